"""Supervised fine-tuning through the engine (`algo.name=sft`, train.sft_steps steps): the
task's long prefix shared by its reference answers (flat: one tail each; trees: the task's
turns), objective -log p. The other algorithms' warm-up (train.sft_steps before their phase) is
this one's batches and step, and their greedy evaluation is this one's."""

from __future__ import annotations

import chex
import jax
import numpy as np

from branch_replay.train import metrics, steps
from branch_replay.core import sampler, sharding, tree
from branch_replay.data import tasks, tree_task
from branch_replay.train import state as train_state
from branch_replay.data.tokenizer import TOKENIZER
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


def sft_batch(task, rng: np.random.Generator, cfg, tok=TOKENIZER):
  """A warm-up batch: the task's long prefix shared by its reference answers (one per tail);
  with tree.fanouts, trees of the task's turns (root = haystack, one opening per key `?kK`,
  the question unscored, one second turn `v<eos>` each). Advantage 1 (objective -log p)."""
  items = [task.supervised(rng) for _ in range(cfg.train.sft_batch_size)]
  if cfg.tree.fanouts:
    return tree_task.turn_tree(task, items, lambda b, r, value: [value], tok)
  prefix_BP, prefix_valid_BP = tasks.encode_prompts([p for p, _ in items], task.sft_prompt_len, tok)
  T = task.sft_tail_len  # the task's longest warm-up tail, EOS included
  tails = [tasks.encode_right(t, T, tok) for _, t in items]
  tails_BRT = np.stack([t for t, _ in tails])
  valid_BRT = np.stack([v for _, v in tails])
  B, R = tails_BRT.shape[:2]
  chex.assert_shape([tails_BRT, valid_BRT], (B, R, T))
  chex.assert_shape([prefix_BP, prefix_valid_BP], (B, task.sft_prompt_len))
  return tree.flat(
    prefix_BP=prefix_BP,
    prefix_valid_BP=prefix_valid_BP,
    tails_BRT=tails_BRT,
    tail_valid_BRT=valid_BRT,
    advantages_BR=np.ones(tails_BRT.shape[:2], np.float32),
  )


class SFT:
  """Warm-up batches (`sft_batch`: flat, or with tree.fanouts trees); the greedy evaluation
  of the policy on held-out prompts."""

  phase = "sft"
  progress_keys = ("loss/policy",)
  warmup_steps = 0  # as the run, its steps are the phase (batch/update), not a warm-up

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.is_tree = bool(cfg.tree.fanouts)
    if self.is_tree:
      self.fns = steps.compiled(steps.compile_key(cfg), task.stop_tokens(tok), task.turn_lengths)
    else:
      self.fns = steps.compiled(
        steps.compile_key(cfg), tuple(getattr(tok, "stop_ids", (tok.eos_id,)))
      )

  @property
  def total_steps(self) -> int:  # as the run itself: its steps; as a warm-up: its owner's
    return self.cfg.train.sft_steps

  def warmup_batch(self, step):
    cfg = self.cfg
    rng = np.random.default_rng([cfg.train.seed, step])
    batch = sft_batch(self.task, rng, cfg, self.tok)
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
    if self.cfg.train.eval_batch or self.cfg.train.eval_shared_prefix:
      return float(np.mean(self.evaluate_all(state, examples)))
    prompt_BP, valid_BP = tasks.encode_prompts(examples, self.task.max_prompt_len, self.tok)
    s = self.fns.greedy(
      train_state.weights(state, self.cfg.lora),
      prompt_BP=prompt_BP,
      prompt_valid_BP=valid_BP,
      key=jax.random.key(0),
    )
    if self.is_tree:
      s = sharding.to_host(s)  # numpy; gathered when the mesh spans several processes
      return float(tree_task.rewards_of(self.task, examples, s, (1, 1), self.tok).mean())
    s = sharding.to_host(s) if self.cfg.mesh else s
    return float(self.task.rewards(examples, sampler.completions(s, self.tok)).mean())

  def evaluate_all(self, state, examples) -> np.ndarray:
    """The reward of each prompt's greedy completion (flat), in chunks of train.eval_batch
    prompts (0: all at once; the last chunk padded with its last prompt, so one compiled
    shape); with train.eval_shared_prefix, the ids every prompt starts with (a k-shot
    header) prefilled once per chunk (`sampler.shared_header`)."""
    t = self.cfg.train
    if self.is_tree:
      return np.asarray([self.evaluate(state, examples)])  # (trees: one mean)
    ids = [
      list(e.prompt_ids)
      if getattr(e, "prompt_ids", None) is not None
      else self.tok.encode(e.prompt, bos=True)
      for e in examples
    ]
    header_H = None
    if t.eval_shared_prefix:
      header_H, ids = sampler.shared_header(ids)
      header_H = header_H if len(header_H) else None
    L = max(len(x) for x in ids)
    n = t.eval_batch or len(examples)
    weights = train_state.weights(state, self.cfg.lora)
    out = []
    for i in range(0, len(examples), n):
      chunk = ids[i : i + n]
      chunk = chunk + [chunk[-1]] * (n - len(chunk))
      prompt_BP, valid_BP = tasks.encode_prompts(
        [tasks.Example("", "", prompt_ids=tuple(x)) for x in chunk], L, self.tok
      )
      s = self.fns.greedy(
        weights,
        prompt_BP=prompt_BP,
        prompt_valid_BP=valid_BP,
        key=jax.random.key(0),
        header_H=header_H,
      )
      s = sharding.to_host(s) if self.cfg.mesh else s
      got = examples[i : i + n]
      r = self.task.rewards(got, sampler.completions(s, self.tok)[: len(got)])
      out += list(np.asarray(r, np.float64).reshape(len(got), -1).mean(-1))
    return np.asarray(out, np.float64)

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
