"""The test install is complete under CI: with BRANCH_REPLAY_REQUIRE_TEST_PACKAGES=1 (.ci/run sets
it) a test whose package is missing fails by name instead of skipping, so no check of the peers
(PrefixGrouper, TRL) or the reference implementations silently drops out of CI."""

import os
import pathlib
import subprocess
import sys

TESTS = pathlib.Path(__file__).resolve().parents[1]


def _run(tmp_path, require):
  (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
  (tmp_path / "needs_test.py").write_text(
    "import pytest\n\n\ndef test_needs():\n  pytest.importorskip('no_such_package_br')\n"
  )
  env = {k: v for k, v in os.environ.items() if k != "BRANCH_REPLAY_REQUIRE_TEST_PACKAGES"}
  if require:
    env["BRANCH_REPLAY_REQUIRE_TEST_PACKAGES"] = "1"
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:xdist",
      "-p",
      "no:cacheprovider",
      "-o",
      "addopts=",
      "-o",
      "python_files=*_test.py",
      "--rootdir",
      str(tmp_path),
      str(tmp_path),
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    timeout=300,
  )


def test_missing_package_fails_by_name_under_ci(tmp_path):
  out = _run(tmp_path, require=True)
  assert out.returncode == 1, out.stdout + out.stderr
  assert "1 failed" in out.stdout and "no_such_package_br" in out.stdout


def test_missing_package_skips_outside_ci(tmp_path):
  out = _run(tmp_path, require=False)
  assert out.returncode == 0, out.stdout + out.stderr
  assert "1 skipped" in out.stdout


def test_ci_sets_the_requirement():
  ci = (TESTS.parent / ".ci" / "run").read_text()
  assert "BRANCH_REPLAY_REQUIRE_TEST_PACKAGES=1" in ci
