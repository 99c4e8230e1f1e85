"""Transparent huge pages for the host buffers XLA's CPU backend allocates every step.

XLA:CPU takes a step's temporaries from malloc. glibc serves requests above its mmap threshold
(32 MB at most) as fresh mmaps and returns them to the kernel when they are freed, so every step
faults its large buffers back in, 4 KiB at a time: about 160,000 minor faults per step for the
small preset at P=1024, T=512, R=8 (~650 MB). With glibc's tunable `glibc.malloc.hugetlb=1`
(glibc >= 2.35) malloc advises the kernel to back its memory with transparent huge pages
(`madvise`, the THP mode most distributions ship): 650-4,000 faults per step, and the step
1.50 -> 1.36 s on this project's 2-core CPU (docs/performance.md, "Page faults").

GLIBC_TUNABLES is read once, when a process starts, so `run.py` restarts itself (execve, same
pid, same arguments) with the tunable added. It does nothing where it cannot help or was
declined: not Linux/glibc, the kernel's THP mode `never`, the tunable already present, or
BRANCH_REPLAY_HUGEPAGES=0. Numerics are untouched (only where the memory comes from).
"""

from __future__ import annotations

import os
import platform
import sys
from typing import Mapping, Optional

TUNABLE = "glibc.malloc.hugetlb=1"
OPT_OUT = "BRANCH_REPLAY_HUGEPAGES"  # "0": leave malloc as it is
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode(path: str = THP_MODE) -> Optional[str]:
  """The kernel's transparent-huge-page mode (always | madvise | never), None if unknown."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return None
  for word in text.split():
    if word.startswith("[") and word.endswith("]"):
      return word[1:-1]
  return None


def wanted(environ: Mapping[str, str], system: str, libc: str, mode: Optional[str]) -> bool:
  """Whether to add the tunable: Linux with glibc, THP not `never`, not already set, not
  declined with BRANCH_REPLAY_HUGEPAGES=0."""
  if environ.get(OPT_OUT, "1") == "0":
    return False
  if system != "Linux" or libc != "glibc" or mode == "never":
    return False
  return "glibc.malloc.hugetlb" not in environ.get("GLIBC_TUNABLES", "")


def environ_with_tunable(environ: Mapping[str, str]) -> dict:
  """A copy of environ with TUNABLE appended to GLIBC_TUNABLES (colon-separated)."""
  env = dict(environ)
  old = env.get("GLIBC_TUNABLES", "")
  env["GLIBC_TUNABLES"] = f"{old}:{TUNABLE}" if old else TUNABLE
  return env


def reexec_with_hugepages() -> None:
  """Restart this process with the tunable when `wanted` (does not return then); a no-op
  otherwise. Call it first thing in a script's __main__, before anything heavy runs."""
  system, libc = platform.system(), platform.libc_ver()[0]
  if not wanted(os.environ, system, libc, thp_mode()):
    return
  env = environ_with_tunable(os.environ)  # present now: the restarted process does not restart
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
