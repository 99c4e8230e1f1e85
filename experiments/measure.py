"""Measuring helpers shared by the benchmarks (flag-free, importable anywhere): the machine's
matmul rate and a thread sampling this process's peak RSS."""

from __future__ import annotations

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
  return 2 * n ** 3 / sorted(times)[len(times) // 2] / 1e9


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
