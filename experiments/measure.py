"""Measuring helpers shared by the benchmarks (flag-free, importable anywhere): the machine's
matmul rate, a thread sampling this process's peak RSS, waiting for a quiet machine and the
cores other processes use (a step's FLOPs: experiments/flops.py)."""

from __future__ import annotations

import os
import threading
import time


def matmul_gflops(n=2048, reps=5):
  import jax
  import jax.numpy as jnp

  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def release_freed_heap() -> bool:
  """Hand the heap that freed allocations left in glibc's arenas back to the OS
  (malloc_trim(0)); True if it ran. After compiling and warming up, that is mostly the
  compiler's (~300 MB for the small preset's replay step): memory the process holds but no
  step uses. The benchmarks call it for every side alike before their timed steps."""
  import ctypes
  import ctypes.util

  name = ctypes.util.find_library("c")
  if not name:
    return False
  try:
    ctypes.CDLL(name).malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    return False
  return True


class PeakRSS:
  """Samples this process's RSS in a thread; .peak is the maximum seen."""

  def __init__(self, interval=0.002):
    import psutil

    self._proc, self._interval, self.peak, self._stop = psutil.Process(), interval, 0, False

  def __enter__(self):
    self.peak = self._proc.memory_info().rss
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop:
      self.peak = max(self.peak, self._proc.memory_info().rss)
      time.sleep(self._interval)

  def __exit__(self, *exc):
    self._stop = True
    self._thread.join()


def wait_for_quiet(
  max_load: float, timeout_s: float, poll_s: float, load_fn=None, sleep=None, clock=None
) -> dict:
  """Poll the 1-minute load average until it is below max_load (max_load <= 0: no wait).
  Returns dict(quiet, waited_s, load_at_start, loads: the readings); quiet=False when
  timeout_s passed first. load_fn, sleep and clock are injectable (tests)."""
  load_fn = load_fn or (lambda: os.getloadavg()[0])
  sleep, clock = sleep or time.sleep, clock or time.monotonic
  t0 = clock()
  loads = [round(load_fn(), 2)]
  if max_load <= 0:
    return dict(quiet=True, waited_s=0.0, load_at_start=loads[-1], loads=loads, max_load=max_load)
  while loads[-1] >= max_load and clock() - t0 < timeout_s:
    sleep(min(poll_s, max(timeout_s - (clock() - t0), 0.0)))
    loads.append(round(load_fn(), 2))
  return dict(
    quiet=loads[-1] < max_load,
    waited_s=round(clock() - t0, 1),
    load_at_start=loads[-1],
    loads=loads[-20:],
    max_load=max_load,
  )


def busy_cpu_seconds() -> float:
  """The machine's non-idle CPU seconds so far, summed over cores (psutil)."""
  import psutil

  t = psutil.cpu_times()
  return sum(t) - t.idle - getattr(t, "iowait", 0.0)


PAGE_REPORTING = "/sys/module/page_reporting/parameters"


def page_reporting(folder: str = PAGE_REPORTING):
  """The guest kernel's free page reporting, where this is a VM whose balloon device has it
  (virtio-balloon): free blocks of 2^order pages that stay free are handed to the host, which
  takes the memory back; touching it again costs a host fault and zeroing. Returns
  dict(order=..., reported_kib=...) read now, or None where the kernel has no such module."""
  try:
    with open(os.path.join(folder, "page_reporting_order")) as f:
      order = int(f.read())
    with open(os.path.join(folder, "reported_kib")) as f:
      kib = int(f.read())
  except (OSError, ValueError):
    return None
  return dict(order=order, reported_kib=kib)


def reported_mb(before, after) -> "float | None":
  """MB the guest reported free to the host between two `page_reporting` readings (machine
  wide: any process's freed memory), None where there is no page reporting."""
  if before is None or after is None:
    return None
  return round((after["reported_kib"] - before["reported_kib"]) / 1024, 1)


def other_cores(busy_before: float, busy_after: float, own_cpu_s: float, wall_s: float) -> float:
  """Cores that processes other than the stepping worker kept busy during a step: the
  machine's busy CPU seconds over it, less the worker's own, per wall second (>= 0)."""
  return max(busy_after - busy_before - own_cpu_s, 0.0) / max(wall_s, 1e-9)


def compile_replay_step(cfg, mesh, B: int, P: int, R: int, T: int):
  """The replay train step (GRPO loss + gradient + clipped AdamW, the trainer's moments) on
  `mesh`, compiled from abstract arguments only (no weights allocated, no step run). Returns
  (compiled, (param shapes, optimizer-state shapes) placed with their shardings), for
  `sharding.memory_report(compiled)` and `sharding.per_device_bytes(...)`."""
  import jax
  import jax.numpy as jnp
  import optax
  from branch_replay.core import losses, sharding, tree
  from models import transformer as tfm

  sds = jax.ShapeDtypeStruct
  batch = tree.flat(
    prefix_BP=sds((B, P), jnp.int32),
    prefix_valid_BP=sds((B, P), bool),
    tails_BRT=sds((B, R, T), jnp.int32),
    tail_valid_BRT=sds((B, R, T), bool),
    advantages_BR=sds((B, R), jnp.float32),
  )
  loss_cfg = losses.LossConfig(name="grpo")
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6))
  params = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  opt_state = jax.eval_shape(tx.init, params)
  p_sh = sharding.param_shardings(mesh, cfg)
  o_sh = sharding.opt_state_shardings(mesh, tx, opt_state, p_sh)
  place = lambda tree, sh: jax.tree.map(lambda x, s: sds(x.shape, x.dtype, sharding=s), tree, sh)
  params, opt_state = place(params, p_sh), place(opt_state, o_sh)
  batch = place(batch, sharding.batch_shardings(mesh, batch))

  from branch_replay.core import engine

  def step(params, opt_state, batch):
    loss, _, grads = engine.loss_and_grad(params, batch, cfg, loss_cfg, "replay", mesh=mesh)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  compiled = (
    jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_sh, o_sh, None))
    .lower(params, opt_state, batch)
    .compile()
  )
  return compiled, (params, opt_state)
