"""run.py's restart with glibc's huge-page tunable (branch_replay/train/hugepages.py)."""

import os
import platform
import subprocess
import sys

import pytest

from branch_replay.train import hugepages as hp


@pytest.mark.parametrize(
  "environ, system, libc, mode, want",
  [
    ({}, "Linux", "glibc", "madvise", True),
    ({}, "Linux", "glibc", "always", True),
    ({}, "Linux", "glibc", None, True),  # THP mode unreadable: harmless to ask
    ({}, "Linux", "glibc", "never", False),
    ({}, "Darwin", "", "madvise", False),
    ({}, "Linux", "musl", "madvise", False),
    ({"BRANCH_REPLAY_HUGEPAGES": "0"}, "Linux", "glibc", "madvise", False),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "Linux", "glibc", "madvise", False),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "Linux", "glibc", "madvise", True),
  ],
)
def test_wanted(environ, system, libc, mode, want):
  assert hp.wanted(environ, system, libc, mode) is want


def test_environ_with_tunable_keeps_other_tunables():
  assert hp.environ_with_tunable({})["GLIBC_TUNABLES"] == hp.TUNABLE
  env = hp.environ_with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"})
  assert env == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{hp.TUNABLE}", "X": "1"}


def test_thp_mode_parses_the_bracketed_word(tmp_path):
  path = tmp_path / "enabled"
  path.write_text("always [madvise] never\n")
  assert hp.thp_mode(str(path)) == "madvise"
  assert hp.thp_mode(str(tmp_path / "missing")) is None


SCRIPT = """
import os, sys
from branch_replay.train import hugepages
print("start", os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
hugepages.reexec_with_hugepages()
print("run", os.environ.get("GLIBC_TUNABLES", ""), sys.argv[1:], flush=True)
"""


@pytest.mark.skipif(
  platform.system() != "Linux" or platform.libc_ver()[0] != "glibc" or hp.thp_mode() == "never",
  reason="the tunable applies on Linux/glibc with THP available",
)
def test_process_restarts_once_with_the_tunable_and_its_arguments():
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", hp.OPT_OUT)}
  out = subprocess.run(
    [sys.executable, "-c", SCRIPT, "--flag=1", "two"],
    env=env,
    capture_output=True,
    text=True,
    check=True,
  ).stdout.splitlines()
  assert out == [
    "start  ['--flag=1', 'two']",
    f"start {hp.TUNABLE} ['--flag=1', 'two']",
    f"run {hp.TUNABLE} ['--flag=1', 'two']",
  ]
  declined = subprocess.run(
    [sys.executable, "-c", SCRIPT, "x"],
    env=dict(env, BRANCH_REPLAY_HUGEPAGES="0"),
    capture_output=True,
    text=True,
    check=True,
  ).stdout.splitlines()
  assert declined == ["start  ['x']", "run  ['x']"]
