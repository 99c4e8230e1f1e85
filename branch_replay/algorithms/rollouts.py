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
from typing import NamedTuple

import jax
import numpy as np

from branch_replay import algorithms
from branch_replay.algorithms import base
from branch_replay.config import Config
from branch_replay.core import advantages, engine, tree
from branch_replay.core.tree import TreeBatch
from branch_replay.data import rollouts
from branch_replay.train import phases, steps, verify


@dataclasses.dataclass(frozen=True)
class Options:
  """Completions from a file (task.name=rollouts): group advantages, passes over each batch."""

  advantage: str = "grpo"
  ppo_epochs: int = 1

  def __post_init__(self):
    algorithms.int_at_least(self, ("ppo_epochs",), 1)
    algorithms.check_estimator(self.advantage)


def check(cfg) -> None:
  """A rollouts file's lines (task.name=rollouts, whose lines it alone trains; laid out by the
  file's own switch, task.auto_tree, as the config's task check says), scored with full
  weights."""
  refused = [  # (field, value, expected, why)
    ("task.name", cfg.task.name, "'rollouts'", cfg.task.name != "rollouts", "the completions file"),
    (
      "lora.rank",
      cfg.lora.rank,
      "0",
      cfg.lora.enabled,
      "LoRA is not supported there: the rollouts trainer scores with full weights",
    ),
  ]
  for field, value, expected, bad, why in refused:
    if bad:
      raise ValueError(
        f"algo.name={cfg.algo.name!r} with {field}={value!r}: expected {field}={expected} ({why})"
      )


class FileBatch(NamedTuple):
  """One step's lines as their tree, with the positions the same lines take flat (what the
  naive twin computes: token_counts reads it from the batch, no state kept between calls)."""

  tree: TreeBatch
  flat_positions: int


def file_fns(cfg, mesh=None) -> tuple:
  """(the train step at the file's objective `loss` itself, the scorer of behaviour and
  reference log-probs at temperature 1), jitted (`Runtime.compiled` keeps them)."""
  return (
    jax.jit(steps.make_train_step(cfg, "rl", cfg.loss, mesh), donate_argnums=0),
    jax.jit(functools.partial(engine.forward, model_cfg=cfg.model)),
  )


def from_file(task, recorded: rollouts.Recorded, score_fn, state, cfg: Config, step: int, tok):
  """Step `step`'s train.batch_size lines of the rollouts file as one TreeBatch (their shared
  openings found by trie.py with task.auto_tree, else flat): group advantages of the file's
  rewards, behaviour log-probs (`old_logps`), reference log-probs with a reference. Returns
  (batch, its flat positions (the naive equivalent), stats)."""
  t, timer = cfg.train, phases.Timer()
  lines = task.batch_lines(step, t.batch_size)
  rewards_BR = np.stack([l.rewards for l in lines])
  adv_BR = advantages.compute(cfg.algo.advantage, rewards_BR, cfg.algo)
  with timer("old_logp"):
    old = rollouts.old_logps(lines, recorded, score_fn, state.params, task.cfg, adv_BR, tok.pad_id)
  batch, stats = rollouts.make_batch(lines, adv_BR, task.cfg, old_logps=old, pad_id=tok.pad_id)
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  if state.ref_params is not None:
    with timer("ref_logp"):
      ref_levels, ref_trunk = jax.block_until_ready(score_fn(state.ref_params, batch))
    batch = batch.replace(
      levels=tuple(l.replace(ref_logp_BRT=r) for l, r in zip(batch.levels, ref_levels)),
      trunk_ref_logp_BW=ref_trunk if batch.trunk_len else None,
    )
  return (
    batch,
    stats["flat_positions"],
    {
      "epoch": step // task.steps_per_epoch(t.batch_size),
      "reward/mean": float(rewards_BR.mean()),
      "reward/std": float(rewards_BR.std()),
      "replay/tree_token_ratio": stats["tree_token_ratio"],
      "replay/trie_token_ratio": stats["trie_token_ratio"],
      "replay/trunk_len": stats["trunk_len"],
      "replay/fanouts": "x".join(map(str, stats["fanouts"])),
      **timer.metrics(),
    },
  )


class Rollouts(base.Algorithm):
  """Completions sampled elsewhere (vLLM, SGLang, a log; `from_file`): no sampling,
  no warm-up, no greedy evaluation; `train.rl_steps` caps the steps at `task.epochs` passes
  over the file."""

  progress_keys = ("reward/mean", "loss/policy")
  summary_metrics = ("reward/mean",)  # the file's rewards

  def __init__(self, cfg, task, tok, workdir=None, runtime=None):
    super().__init__(cfg, task, tok, workdir, runtime)
    chief = jax.process_index() == 0
    self.recorded = rollouts.Recorded(
      os.path.join(workdir, "recorded_logprobs.jsonl") if workdir and chief else None
    )
    self.step_fn, self.score_fn = self.rt.compiled("rollouts_file", file_fns)

  @property
  def total_steps(self) -> int:
    t = self.cfg.train
    return min(t.rl_steps, self.task.cfg.epochs * self.task.steps_per_epoch(t.batch_size))

  def warmup_batch(self, step):  # unreachable: task.check refuses train.sft_steps > 0
    raise ValueError("task.name=rollouts: no supervised warm-up (train.sft_steps=0)")

  def start(self, state):
    if state.ref_params is None and self.cfg.loss.needs_ref:
      raise ValueError(f"loss.kl_coef={self.cfg.loss.kl_coef}: the reference policy is missing")
    return state

  def batch(self, state, step):
    batch, flat_positions, stats = from_file(
      self.task, self.recorded, self.score_fn, state, self.cfg, step, self.tok
    )
    return FileBatch(batch, flat_positions), stats

  def update(self, state, batch, step):
    outs = []
    for _ in range(self.cfg.algo.ppo_epochs):
      state, out = self.step_fn(state, batch.tree)
      outs.append(jax.device_get(out))
    return state, {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}

  def verify(self, state, batch, tol=None):
    return verify.check(
      state.params,
      batch.tree,
      self.cfg.model,
      self.cfg.loss,
      branch_chunk=self.cfg.replay.branch_chunk,
      tol=tol,
    )

  def token_counts(self, batch, phase):
    prefix, below, _ = batch.tree.token_counts()
    return prefix, below, batch.flat_positions

  def eval_examples(self):
    return []
