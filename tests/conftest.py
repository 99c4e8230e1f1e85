"""Fake 8 CPU devices before JAX starts; the test rooms on the path of subprocesses too."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
# pyproject.toml's `pythonpath` (the checkout, tests/ and each room under it: test modules
# import each other by basename, the name pytest imports them by) for the worker processes
# the tests start (`python tests/system/crash_test.py ...`, run.py, notebooks), which
# inherit the environment.
_TESTS = os.path.dirname(os.path.abspath(__file__))
os.environ["PYTHONPATH"] = os.pathsep.join(
  [os.path.dirname(_TESTS), _TESTS]
  + sorted(
    os.path.join(_TESTS, d)
    for d in os.listdir(_TESTS)
    if os.path.isdir(os.path.join(_TESTS, d)) and not d.startswith(("_", "."))
  )
  + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
)

# One persistent compilation cache per test session, shared by the xdist workers and the
# subprocesses the tests start (they inherit the environment): many tests compile the same
# step (each run.py start-up, each trainer run, the grids' shared shapes), and a cache hit
# loads the executable XLA compiled the first time, so results are bitwise the same. A fresh
# directory per session: nothing carries over between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="branch-replay-jax-cache-")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
# XLA's cheap backend pipeline for the tests (LLVM at -O0, no expensive passes; the HLO
# passes, the SPMD partitioner and buffer assignment run as always, so compiled memory, FLOPs and
# collectives read the same): most tests are bound by compiling many small programs, not by
# running them. Code generation differs in the last bits (fused multiply-adds, vector order),
# so tests/core/frozen_flat_test.py, a bitwise guard, compiles with the production pipeline
# (`production_compile` below). Subprocesses inherit it; export
# JAX_DISABLE_MOST_OPTIMIZATIONS=false to test with the production pipeline throughout.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# ... read and written by the subprocesses only, not by the long-lived xdist workers: in them,
# serializing an executable for the cache segfaulted twice in CI (jax 0.10.2,
# compilation_cache.put_executable_and_time, after hundreds of tests in one worker), and
# xdist then hung.
import jax  # noqa: E402  (after the environment above)

jax.config.update("jax_enable_compilation_cache", False)

import pytest  # noqa: E402

# BRANCH_REPLAY_REQUIRE_TEST_PACKAGES=1 (.ci/run sets it): every package a test imports with
# pytest.importorskip is part of the test install (requirements-test.txt), so a missing one
# fails the test by name instead of skipping it; a skip there would hide a check CI never ran.
if os.environ.get("BRANCH_REPLAY_REQUIRE_TEST_PACKAGES") == "1":
  import importlib

  def _require(modname, minversion=None, reason=None, **kwargs):
    del minversion, reason, kwargs
    try:
      return importlib.import_module(modname)
    except ImportError as e:
      raise ImportError(
        f"{modname}: the test install must bring it (requirements-test.txt; "
        f"BRANCH_REPLAY_REQUIRE_TEST_PACKAGES=1 makes this a failure, not a skip): {e}"
      ) from e

  pytest.importorskip = _require


# A long-lived xdist worker compiles thousands of small programs; each XLA CPU executable holds
# memory mappings, and a worker past the kernel's vm.max_map_count (65530 by default) crashes
# inside the next compile (seen once in CI: a segfault in backend_compile after ~30 min in one
# worker, its map count unread; a worker 10 min in held 13,200 maps). After each test module,
# a worker past MAX_MAPS drops JAX's in-memory executables (jax.clear_caches); .ci/run also
# raises the limit where the machine lets it.
MAX_MAPS = int(os.environ.get("BRANCH_REPLAY_TEST_MAX_MAPS", "30000"))


def _maps() -> int:
  try:
    with open("/proc/self/maps") as f:
      return sum(1 for _ in f)
  except OSError:  # not Linux
    return 0


@pytest.fixture(autouse=True, scope="module")
def _bounded_maps():
  yield
  if _maps() > MAX_MAPS:
    jax.clear_caches()


@pytest.fixture
def x64():
  """float64 inside the test (`jax.enable_x64(True)` around it)."""
  import jax

  with jax.enable_x64(True):
    yield


@pytest.fixture
def production_compile():
  """Compile with XLA's full pipeline inside the test (the run.py default), whatever the
  session's JAX_DISABLE_MOST_OPTIMIZATIONS says; jit caches are cleared on both sides so no
  executable crosses over."""
  import jax
  from jax._src import compiler

  before = compiler._DISABLE_MOST_OPTIMIZATIONS.value
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.clear_caches()
    jax.config.update("jax_disable_most_optimizations", before)
