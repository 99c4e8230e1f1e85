"""A run's summary: one schema for every algorithm, computed from its metrics records alone and
rendered once.

  s = summary.summarize(records, phase="rl", metrics=("reward/mean",))
  print(summary.render(s))

An algorithm declares what its summary shows (`phase`, `summary_metrics`); the trainer, run.py
and experiments/provenance.py (a finished workdir's results file) call these two functions, so a
summary written by any of them has the same keys. Every key is present; None where the run
has no such thing (no evaluation, no accuracy counts, no phase steps):

  phase                              the phase's name in metrics ("rl", "sft", "dpo")
  steps, phase_steps                 train records of the run; of its phase (warm-up excluded)
  window                             how many first/last phase steps `first`/`last` cover (1-10)
  first, last                        {metric: value} over the first/last `window` phase steps:
                                     the mean of each record's value, or a metric's own pooling
  eval_before, eval_after            greedy mean reward at the phase's first step, after its last
  eval_before_n, _correct, _ci95     an accuracy evaluation's count, correct and Wilson 95%
  eval_after_n, _correct, _ci95      (train.eval_batch / eval_shared_prefix); None otherwise
  eval_after_interval_above_before   the after interval's low end above the before's high end
  computed_tokens, naive_equiv_tokens              token positions over every step
  phase_computed_tokens, phase_naive_equiv_tokens  ... over the phase's steps
  train_time_s, median_phase_step_s  seconds in steps; the median phase step
  time_by_phase                      seconds per phases.PHASES summed over the phase's steps

The trainer adds where the run's files are (workdir, checkpoint, metrics, plot, adapter) and
wall_s; `render` shows them when present. Results files written before this schema (the
GRPO summary's `reward_before`, `rl_steps`, ...) keep their keys: tables read them as written.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from branch_replay.train import metrics as metrics_lib
from branch_replay.train import phases

# A summary metric: a record key whose first/last values are averaged, or (key, pool) where
# pool(records) -> float pools the window's records itself (PPO's explained variance).
Metric = str | tuple[str, Callable[[list], float]]


def window(rows) -> int:
  """How many first and last steps a summary averages: a quarter of the run, 1 to 10."""
  return max(1, min(10, len(rows) // 4))


def fmt(x) -> str:
  """A summary number: 3 decimals, 'n/a' for None or NaN."""
  return "n/a" if x is None or x != x else f"{x:.3f}"


def _reduce(metric: Metric, rows: list) -> float:
  if isinstance(metric, tuple):
    return float(metric[1](rows))
  values = [r[metric] for r in rows if r.get(metric) is not None]
  return float(np.mean(values)) if values else float("nan")


def _name(metric: Metric) -> str:
  return metric[0] if isinstance(metric, tuple) else metric


def _eval_at(records, step) -> dict | None:
  if step is None:
    return None
  return next((r for r in records if r.get("kind") == "eval" and r["step"] == step), None)


def summarize(records, phase: str, metrics: tuple[Metric, ...] = ()) -> dict:
  """The summary of a run's metrics records (trainer order; a resumed run's earlier steps
  included): `phase` selects the phase's train records, `metrics` what `first`/`last` hold.
  The evaluations are those at the phase's first step (before it) and one past its last."""
  for m in metrics:
    if not (isinstance(m, str) or (isinstance(m, tuple) and len(m) == 2 and callable(m[1]))):
      raise ValueError(f"summary metrics: {m!r}: expected a record key or (key, pool)")
  train = [r for r in records if r.get("kind", "train") == "train"]
  rows = [r for r in train if r.get("phase", phase) == phase]
  k = window(rows)
  first_step = rows[0]["step"] if rows else None
  last_step = rows[-1]["step"] + 1 if rows else None
  out = {
    "phase": phase,
    "steps": len(train),
    "phase_steps": len(rows),
    "window": k,
    "first": {_name(m): _reduce(m, rows[:k]) for m in metrics},
    "last": {_name(m): _reduce(m, rows[-k:]) for m in metrics},
  }
  for when, step in (("before", first_step), ("after", last_step)):
    rec = _eval_at(records, step)
    out[f"eval_{when}"] = None if rec is None else rec["eval/greedy_reward"]
    counted = rec is not None and "eval/ci95_low" in rec
    out[f"eval_{when}_n"] = rec["eval/n"] if counted else None
    out[f"eval_{when}_correct"] = rec["eval/correct"] if counted else None
    out[f"eval_{when}_ci95"] = [rec["eval/ci95_low"], rec["eval/ci95_high"]] if counted else None
  both = out["eval_before_ci95"] is not None and out["eval_after_ci95"] is not None
  out["eval_after_interval_above_before"] = (
    out["eval_after_ci95"][0] > out["eval_before_ci95"][1] if both else None
  )
  tokens = lambda rs, key: int(sum(r.get(key, 0) for r in rs))
  step_s = [r["time/step_s"] for r in rows if "time/step_s" in r]
  out.update(
    computed_tokens=tokens(train, "replay/computed_tokens"),
    naive_equiv_tokens=tokens(train, "replay/naive_equiv_tokens"),
    phase_computed_tokens=tokens(rows, "replay/computed_tokens"),
    phase_naive_equiv_tokens=tokens(rows, "replay/naive_equiv_tokens"),
    train_time_s=float(sum(r.get("time/step_s", 0.0) for r in train)),
    median_phase_step_s=float(np.median(step_s)) if step_s else None,
    time_by_phase=phases.totals(rows),
  )
  return out


def _eval_text(s: dict, when: str) -> str:
  text = fmt(s[f"eval_{when}"])
  if s[f"eval_{when}_n"] is not None:
    low, high = s[f"eval_{when}_ci95"]
    text += f" ({s[f'eval_{when}_correct']}/{s[f'eval_{when}_n']}, 95% [{low:.3f}, {high:.3f}])"
  return text


def render(s: dict) -> str:
  """The summary as the lines run.py prints (any algorithm's; the run's files when present)."""
  name = s["phase"].upper()
  ratio = lambda a, b: b / max(a, 1)
  lines = [
    f"{metric} (first/last {s['window']} {name} steps): {fmt(s['first'][metric])} -> "
    f"{fmt(s['last'][metric])}"
    for metric in s["first"]
  ]
  lines += [
    f"greedy eval reward before/after {name}: {_eval_text(s, 'before')} -> "
    f"{_eval_text(s, 'after')}",
    f"token positions computed: {s['computed_tokens']:,} vs naive equivalent "
    f"{s['naive_equiv_tokens']:,} "
    f"({ratio(s['computed_tokens'], s['naive_equiv_tokens']):.1f}x fewer; {name} steps alone "
    f"{s['phase_computed_tokens']:,} vs {s['phase_naive_equiv_tokens']:,}, "
    f"{ratio(s['phase_computed_tokens'], s['phase_naive_equiv_tokens']):.1f}x)",
  ]
  wall = f"{s['wall_s']:.0f} s wall, " if s.get("wall_s") is not None else ""
  lines.append(
    f"time: {wall}{s['train_time_s']:.0f} s in {s['steps']} steps ({s['phase_steps']} {name})"
  )
  if any(s["time_by_phase"].values()):
    lines.append(phases.format_totals(s["time_by_phase"], name))
  for key, label in (("checkpoint", "checkpoints"), ("metrics", "metrics"), ("plot", "plot")):
    if key in s:
      lines.append(f"{label}: {metrics_lib.shown(s[key])}")
  return "\n".join(lines)
