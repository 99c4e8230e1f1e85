"""Training on a rollouts file (task.name=rollouts): epochs over the file, B lines a step,
each step's lines one TreeBatch (their shared openings found by trie.py), GRPO/PPO-style
clipped updates (`algo.ppo_epochs` passes over each batch); the loop (trainer.py) owns
checkpoints, resume mid-file, metrics, the first-step self-check and the NaN stop. Each step's
time is split by phase (phases.py).

Lines without `logprobs` are scored by the policy before their first update (ratio 1 on the
first pass); those log-probs are recorded in workdir/recorded_logprobs.jsonl (process 0) and
are the behaviour policy of every later epoch (and of a resumed run).
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import numpy as np

from branch_replay import algorithms
from branch_replay.core import advantages, engine, tree
from branch_replay.data import rollouts
from branch_replay.rollout import Recorded, old_logps
from branch_replay.train import phases, steps, verify
from branch_replay.train import state as train_state


@dataclasses.dataclass(frozen=True)
class Options:
  """Completions from a file (task.name=rollouts): group advantages, passes over each batch."""

  advantage: str = "grpo"
  advantage_std: bool = True
  ppo_epochs: int = 1

  def __post_init__(self):
    algorithms.int_at_least(self, ("ppo_epochs",), 1)
    algorithms.check_estimator(self.advantage)


class Rollouts:
  """Completions sampled elsewhere (vLLM, SGLang, a log): no sampling, no warm-up, no greedy
  evaluation; `train.rl_steps` caps the steps at `task.epochs` passes over the file."""

  phase = "rl"
  progress_keys = ("reward/mean", "loss/policy")

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    t = cfg.train
    self.total_steps = min(t.rl_steps, task.cfg.epochs * task.steps_per_epoch(t.batch_size))
    chief = jax.process_index() == 0
    self.recorded = Recorded(
      os.path.join(workdir, "recorded_logprobs.jsonl") if workdir and chief else None
    )
    self.step_fn = jax.jit(steps.make_train_step(cfg, "rl", cfg.loss), donate_argnums=0)
    self.score_fn = jax.jit(functools.partial(engine.forward, model_cfg=cfg.model))

  def warmup_batch(self, step):  # unreachable: task.check refuses train.sft_steps > 0
    raise ValueError("task.name=rollouts: no supervised warm-up (train.sft_steps=0)")

  def start(self, state):
    if state.ref_params is None and self.cfg.loss.needs_ref:
      raise ValueError(f"loss.kl_coef={self.cfg.loss.kl_coef}: the reference policy is missing")
    return state

  def batch(self, state, step):
    cfg, t, timer = self.cfg, self.cfg.train, phases.Timer()
    lines = self.task.batch_lines(step, t.batch_size)
    rewards_BR = np.stack([l.rewards for l in lines])
    adv_BR = advantages.compute(cfg.algo.advantage, rewards_BR, cfg.algo)
    with timer("old_logp"):
      old = old_logps(
        lines, self.recorded, self.score_fn, state.params, cfg, adv_BR, self.tok.pad_id
      )
    batch, stats = rollouts.make_batch(
      lines, adv_BR, self.task.cfg, old_logps=old, pad_id=self.tok.pad_id
    )
    tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
    if state.ref_params is not None:
      with timer("ref_logp"):
        ref_levels, ref_trunk = jax.block_until_ready(self.score_fn(state.ref_params, batch))
      batch = batch.replace(
        levels=tuple(l.replace(ref_logp_BRT=r) for l, r in zip(batch.levels, ref_levels)),
        trunk_ref_logp_BW=ref_trunk if batch.trunk_len else None,
      )
    self.flat_positions = stats["flat_positions"]
    return batch, {
      "epoch": step // self.task.steps_per_epoch(t.batch_size),
      "reward/mean": float(rewards_BR.mean()),
      "reward/std": float(rewards_BR.std()),
      "replay/tree_token_ratio": stats["tree_token_ratio"],
      "replay/trie_token_ratio": stats["trie_token_ratio"],
      "replay/trunk_len": stats["trunk_len"],
      "replay/fanouts": "x".join(map(str, stats["fanouts"])),
      **timer.metrics(),
    }

  def update(self, state, batch, step):
    outs = []
    for _ in range(self.cfg.algo.ppo_epochs):
      state, out = self.step_fn(state, batch)
      outs.append(jax.device_get(out))
    return state, {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}

  def verify(self, state, batch):
    return verify.check(
      state.params, batch, self.cfg.model, self.cfg.loss, branch_chunk=self.cfg.replay.branch_chunk
    )

  def token_counts(self, batch, phase):
    prefix, below, _ = batch.token_counts()
    return prefix, below, self.flat_positions

  def eval_examples(self):
    return []

  def restore_template(self, state, step):
    return train_state.state_dict(state)

  def summarize(self, records):
    train = [r for r in records if r.get("kind") == "train"]
    k = max(1, min(10, len(train) // 4))
    mean = lambda rs: float(np.mean([r["reward/mean"] for r in rs])) if rs else float("nan")
    return {
      "steps": len(train),
      "records": records,
      "reward_first": mean(train[:k]),
      "reward_last": mean(train[-k:]),
      "window": k,
      "time_by_phase": phases.totals(records),
    }

  @staticmethod
  def format_summary(summary) -> str:
    return (
      f"rollouts: {summary['steps']} steps, reward (file) first {summary['window']} "
      f"{summary['reward_first']:.3f}, last {summary['reward_last']:.3f}"
      + (
        f"\n{phases.format_totals(summary['time_by_phase'])}"
        if summary.get("time_by_phase")
        else ""
      )
    )
