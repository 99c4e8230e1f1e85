"""Where an RL step's time goes: seconds per phase, as metrics `time/<phase>_s`.

  timer = phases.Timer()
  with timer("sample"):
    samples = jax.block_until_ready(sample(...))   # block inside: JAX dispatches async
  rec.update(timer.metrics())   # every phase present (0.0 for one that did not run)
"""

from __future__ import annotations

import contextlib
import time

PHASES = ("sample", "reward", "old_logp", "ref_logp", "update")


class Timer:
  def __init__(self):
    self.seconds = dict.fromkeys(PHASES, 0.0)

  @contextlib.contextmanager
  def __call__(self, phase: str):
    if phase not in self.seconds:
      raise ValueError(f"phases: unknown phase {phase!r}: expected one of {PHASES}")
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self.seconds[phase] += time.perf_counter() - t0

  def metrics(self) -> dict:
    return {f"time/{p}_s": s for p, s in self.seconds.items()}
