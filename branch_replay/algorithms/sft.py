"""Supervised fine-tuning through the engine (`algo.name=sft`, train.sft_steps steps): the
task's long prefix shared by its reference answers (flat: one tail each; trees: the task's
turns), objective -log p. The other algorithms' warm-up (train.sft_steps before their phase) is
this one's batches and step, and their greedy evaluation is this one's."""

from __future__ import annotations

import jax
import numpy as np

from branch_replay import metrics, sharding, tasks, train, tree, tree_train
from branch_replay import state as train_state


def _floats(out) -> dict:
  return {k: float(v) for k, v in jax.device_get(out).items()}


class SFT:
  """Flat warm-up batches (train.sft_batch) or, with tree.fanouts, warm-up trees
  (tree_train.sft_batch); the greedy evaluation of the policy on held-out prompts."""

  phase = "sft"
  progress_keys = ("loss/policy",)
  warmup_steps = 0  # as the run, its steps are the phase (batch/update), not a warm-up

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.is_tree = bool(cfg.tree.fanouts)
    if self.is_tree:
      self.fns = tree_train.compiled(tree_train.compile_key(cfg), task.turn_lengths,
                                     task.stop_tokens(tok))
    else:
      self.fns = train.compiled(train.compile_key(cfg),
                                tuple(getattr(tok, "stop_ids", (tok.eos_id,))))

  @property
  def total_steps(self) -> int:  # as the run itself: its steps; as a warm-up: its owner's
    return self.cfg.train.sft_steps

  def warmup_batch(self, step):
    cfg = self.cfg
    rng = np.random.default_rng([cfg.train.seed, step])
    batch = (tree_train if self.is_tree else train).sft_batch(self.task, rng, cfg, self.tok)
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
    t = self.cfg.train
    if self.is_tree:  # the tree task's held-out draws
      return train_state.sample_examples(self.task, t.seed, 2**31, t.eval_size)
    return self.task.eval_examples(t.seed, t.eval_size)

  def evaluate(self, state, examples):
    """The mean reward of greedy completions (one per prompt; trees: one path)."""
    prompt_BP, valid_BP = tasks.encode_prompts(examples, self.task.max_prompt_len, self.tok)
    s = self.fns.greedy(train_state.weights(state, self.cfg.lora), prompt_BP=prompt_BP,
                        prompt_valid_BP=valid_BP, key=jax.random.key(0))
    if self.is_tree:
      s = sharding.to_host(s)  # numpy; gathered when the mesh spans several processes
      return float(tree_train.rewards_of(self.task, examples, s, (1, 1), self.tok).mean())
    s = sharding.to_host(s) if self.cfg.mesh else s
    return float(train.rewards_of(self.task, examples, train.completions(s, self.tok)).mean())

  def restore_template(self, state, step):
    return train_state.state_dict(state)

  def summarize(self, records):
    rows = [r for r in records if r.get("kind", "train") == "train"]
    k = max(1, min(10, len(rows) // 4))
    evals = {r["step"]: r["eval/greedy_reward"] for r in records if r.get("kind") == "eval"}
    mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
    return {"loss_before": mean([r["loss/policy"] for r in rows[:k]]),
            "loss_after": mean([r["loss/policy"] for r in rows[-k:]]), "loss_window": k,
            "eval_before": evals.get(0), "eval_after": evals.get(self.total_steps),
            "computed_tokens": int(sum(r["replay/computed_tokens"] for r in rows)),
            "naive_equiv_tokens": int(sum(r["replay/naive_equiv_tokens"] for r in rows)),
            "train_time_s": float(sum(r["time/step_s"] for r in rows)), "steps": len(rows)}

  @staticmethod
  def format_summary(s: dict) -> str:
    fmt = lambda x: "n/a" if x is None or x != x else f"{x:.3f}"
    ratio = s["naive_equiv_tokens"] / max(s["computed_tokens"], 1)
    return "\n".join([
        f"loss/policy (-log p, mean of first/last {s['loss_window']} steps): "
        f"{fmt(s['loss_before'])} -> {fmt(s['loss_after'])}",
        f"greedy eval reward before/after SFT: {fmt(s['eval_before'])} -> "
        f"{fmt(s['eval_after'])}",
        f"token positions computed: {s['computed_tokens']:,} vs naive equivalent "
        f"{s['naive_equiv_tokens']:,} ({ratio:.1f}x fewer)",
        f"time: {s['wall_s']:.0f} s wall ({s['train_time_s']:.0f} s in {s['steps']} steps)",
        f"checkpoints: {metrics.shown(s['checkpoint'])}",
        f"metrics: {metrics.shown(s['metrics'])}"])
