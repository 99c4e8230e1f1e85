"""Supervised fine-tuning through the engine (`algo.name=sft`, train.sft_steps steps): the
task's long prefix shared by its reference answers (flat: one tail each; trees: the task's
turns), objective -log p: the base's warm-up (algorithms/base.py), which every algorithm runs
for train.sft_steps before its phase, run as the phase."""

from __future__ import annotations

import numpy as np

from branch_replay.algorithms import base
from branch_replay.train import metrics
from branch_replay.sections import NoOptions as Options  # noqa: F401 (SFT has no options)


def check(cfg) -> None:
  if cfg.train.rl_steps or not cfg.train.sft_steps:
    raise ValueError(
      f"algo.name='sft' with train.sft_steps={cfg.train.sft_steps}, "
      f"train.rl_steps={cfg.train.rl_steps}: SFT trains train.sft_steps supervised steps; "
      "expected sft_steps >= 1 and rl_steps=0"
    )


class SFT(base.Algorithm):
  """The base's warm-up batches (`supervised.warmup_batch`, flat or trees) and step as the phase;
  the greedy evaluation of the policy on held-out prompts."""

  phase = "sft"
  warmup_steps = 0  # as the run, its steps are the phase (batch/update), not a warm-up

  @property
  def total_steps(self) -> int:  # as the run itself: its steps; as a warm-up: its owner's
    return self.cfg.train.sft_steps

  def batch(self, state, step):
    return self.warmup_batch(step), {}

  def update(self, state, batch, step):
    return self.warmup_update(state, batch)

  def verify(self, state, batch, tol=None):
    return {}  # supervised batches: the self-check is the RL objective's

  def summarize(self, records):
    rows = [r for r in records if r.get("kind", "train") == "train"]
    k = base.window(rows)
    evals = {r["step"]: r["eval/greedy_reward"] for r in records if r.get("kind") == "eval"}
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
    return {
      "loss_before": mean([r["loss/policy"] for r in rows[:k]]),
      "loss_after": mean([r["loss/policy"] for r in rows[-k:]]),
      "loss_window": k,
      "eval_before": evals.get(0),
      "eval_after": evals.get(self.total_steps),
      "computed_tokens": int(sum(r["replay/computed_tokens"] for r in rows)),
      "naive_equiv_tokens": int(sum(r["replay/naive_equiv_tokens"] for r in rows)),
      "train_time_s": float(sum(r["time/step_s"] for r in rows)),
      "steps": len(rows),
    }

  @staticmethod
  def format_summary(s: dict) -> str:
    fmt = base.fmt
    ratio = s["naive_equiv_tokens"] / max(s["computed_tokens"], 1)
    return "\n".join(
      [
        f"loss/policy (-log p, mean of first/last {s['loss_window']} steps): "
        f"{fmt(s['loss_before'])} -> {fmt(s['loss_after'])}",
        f"greedy eval reward before/after SFT: {fmt(s['eval_before'])} -> {fmt(s['eval_after'])}",
        f"token positions computed: {s['computed_tokens']:,} vs naive equivalent "
        f"{s['naive_equiv_tokens']:,} ({ratio:.1f}x fewer)",
        f"time: {s['wall_s']:.0f} s wall ({s['train_time_s']:.0f} s in {s['steps']} steps)",
        f"checkpoints: {metrics.shown(s['checkpoint'])}",
        f"metrics: {metrics.shown(s['metrics'])}",
      ]
    )
