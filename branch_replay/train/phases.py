"""Where an RL step's time goes: seconds per phase, as metrics `time/<phase>_s`.

  timer = phases.Timer()
  with timer("sample"):
    samples = jax.block_until_ready(sample(...))   # block inside: JAX dispatches async
  rec.update(timer.metrics())   # every phase present (0.0 for one that did not run)

Every RL path writes all five per step (flat and sampled-tree GRPO, a rollouts file); where
the sampler returns the behaviour log-probs with its tokens, old_logp_s is 0 (part of
sample_s). `totals(rows)` sums them over the steps given (train/summary.py: the phase's).
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


def totals(rows) -> dict:
  """Seconds per phase summed over the given steps' records (every phase present; the
  summary passes its phase's steps, so a warm-up is left out)."""
  return {p: float(sum(r.get(f"time/{p}_s") or 0.0 for r in rows)) for p in PHASES}


def format_totals(seconds: dict, phase: str = "RL") -> str:
  return f"time by phase ({phase} steps): " + ", ".join(
    f"{p} {s:.2f} s" for p, s in seconds.items()
  )
