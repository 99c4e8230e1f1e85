"""Supervised fine-tuning through the engine (`algo.name=sft`, train.sft_steps steps): the
task's long prefix shared by its reference answers (flat: one tail each; trees: the task's
turns), objective -log p. The other algorithms' warm-up (train.sft_steps before their phase) is
this one's batches and step, and their greedy evaluation is this one's."""

from __future__ import annotations

import jax
import numpy as np

from branch_replay import rollout
from branch_replay.core import tree
from branch_replay.train import metrics
from branch_replay.train import state as train_state
from branch_replay.sections import NoOptions as Options  # noqa: F401 (SFT has no options)


def check(cfg) -> None:
  if cfg.train.rl_steps or not cfg.train.sft_steps:
    raise ValueError(
      f"algo.name='sft' with train.sft_steps={cfg.train.sft_steps}, "
      f"train.rl_steps={cfg.train.rl_steps}: SFT trains train.sft_steps supervised steps; "
      "expected sft_steps >= 1 and rl_steps=0"
    )


def _floats(out) -> dict:
  return {k: float(v) for k, v in jax.device_get(out).items()}


class SFT:
  """Warm-up batches (`rollout.sft_batch`, flat or trees); the greedy evaluation of the policy
  on held-out prompts."""

  phase = "sft"
  progress_keys = ("loss/policy",)
  warmup_steps = 0  # as the run, its steps are the phase (batch/update), not a warm-up

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.fns = rollout.compiled(cfg, task, tok)

  @property
  def total_steps(self) -> int:  # as the run itself: its steps; as a warm-up: its owner's
    return self.cfg.train.sft_steps

  def warmup_batch(self, step):
    cfg = self.cfg
    rng = np.random.default_rng([cfg.train.seed, step])
    batch = rollout.sft_batch(self.task, rng, cfg, self.tok)
    tree.validate(batch, cfg.model.vocab_size)
    return batch

  def warmup_update(self, state, batch):
    state, out = self.fns.sft_step(state, train_state.place(batch, "batch", self.cfg))
    return state, _floats(out)

  def start(self, state):
    return state

  def batch(self, state, step):
    return self.warmup_batch(step), {}

  def update(self, state, batch, step):
    return self.warmup_update(state, batch)

  def token_counts(self, batch, phase):
    return batch.token_counts()

  def eval_examples(self):
    return rollout.eval_examples(self.task, self.cfg)

  def evaluate(self, state, examples):
    """The mean reward of greedy completions (one per prompt; trees: one path)."""
    if self.cfg.train.eval_batch or self.cfg.train.eval_shared_prefix:
      return float(np.mean(self.evaluate_all(state, examples)))
    params = train_state.weights(state, self.cfg.lora)
    return rollout.greedy_reward(self.fns, params, self.task, examples, self.cfg, self.tok)

  def evaluate_all(self, state, examples) -> np.ndarray:
    """The reward of each prompt's greedy completion (`rollout.greedy_rewards`)."""
    params = train_state.weights(state, self.cfg.lora)
    return rollout.greedy_rewards(self.fns, params, self.task, examples, self.cfg, self.tok)

  def restore_template(self, state, step):
    return train_state.state_dict(state)

  def summarize(self, records):
    rows = [r for r in records if r.get("kind", "train") == "train"]
    k = max(1, min(10, len(rows) // 4))
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
    fmt = lambda x: "n/a" if x is None or x != x else f"{x:.3f}"
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
