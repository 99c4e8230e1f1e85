"""The algorithms' base: every member of the protocol (algorithms/__init__.py) with its default,
so an algorithm overrides only what it does differently and the loop asks nothing optional."""

from __future__ import annotations

import functools

import jax
import numpy as np

from branch_replay import rollout
from branch_replay.core import tree
from branch_replay.data import supervised
from branch_replay.train import evaluate, steps, verify
from branch_replay.train import runtime as runtime_lib
from branch_replay.train import state as train_state


def floats(out) -> dict:
  """A jitted step's metrics on the host, as floats."""
  return {k: float(v) for k, v in jax.device_get(out).items()}


class Algorithm:
  """Built once per run, `Algorithm(cfg, task, tokenizer, workdir=..., runtime=...)` (the
  trainer's Runtime: the mesh, placement and compiled functions; built here when not given,
  e.g. in a notebook). The defaults: the
  supervised warm-up of train.sft_steps (data/supervised.py through the policy's sft_step),
  then train.rl_steps of the phase (`batch` and `update`: every algorithm's own), the greedy
  evaluation on held-out prompts, the first-batch self-check, the checkpoint's state; its
  summary is train/summary.py's over `phase` and `summary_metrics`."""

  phase = "rl"  # the name of its phase in metrics
  progress_keys = ("loss/policy",)  # metrics shown beside the progress bar
  # What its summary shows first/last of its phase's steps (train/summary.py: one schema for
  # every algorithm, rendered once): record keys, or (key, pool(records) -> float).
  summary_metrics = ("loss/policy",)
  # What it needs of the other sections, declared (algorithms.check reads them when a config
  # is made, before any compute):
  objectives = None  # the loss.name values it trains; None: those of sampled groups
  uses_critic = False  # trains a value model (the `critic` section: PPO's)
  auto_tree = False  # its sampled flat groups may be laid out as their trie (replay.auto_tree)

  def __init__(self, cfg, task, tok, workdir=None, runtime=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.rt = runtime_lib.Runtime(cfg, tok) if runtime is None else runtime

  @functools.cached_property
  def fns(self) -> steps.Fns:
    """The policy's jitted functions for this run's rollouts (compiled once per config)."""
    return rollout.compiled(self.rt, self.task)

  @property
  def total_steps(self) -> int:  # a rollouts file's epochs may end a run sooner
    return self.cfg.train.total_steps

  @property
  def warmup_steps(self) -> int:  # supervised steps before the phase
    return self.cfg.train.sft_steps

  def warmup_batch(self, step: int) -> tree.TreeBatch:
    rng = np.random.default_rng([self.cfg.train.seed, step])
    batch = supervised.warmup_batch(self.task, rng, self.cfg.train.sft_batch_size, self.tok)
    tree.validate(batch, self.cfg.model.vocab_size)
    return batch

  def warmup_update(self, state, batch):
    state, out = self.fns.sft_step(state, self.rt.put(batch, "batch"))
    return state, floats(out)

  def start(self, state):
    """The phase boundary (the reference copy, a critic's init); default: nothing."""
    return state

  def batch(self, state, step: int):
    """(batch, stats) of phase step `step` (sampled batches stay on the device)."""
    raise NotImplementedError(f"{type(self).__name__}.batch")

  def update(self, state, batch, step: int):
    """(state, metrics): its jitted steps on `batch`."""
    raise NotImplementedError(f"{type(self).__name__}.update")

  def verify(self, state, batch, tol: float | None = None) -> dict:
    """replay.verify: the first phase batch through replay and the naive twin at the RL
    objective, differentiating what the train step differentiates (with LoRA the adapters
    over the frozen base); raises on a gap beyond `tol` (default `verify.tolerance`); its
    metrics."""
    return verify.check(
      state.params,  # with LoRA the adapters, attached to the frozen base as the step does
      batch,
      self.cfg.model,
      steps.rl_loss_config(self.cfg),
      branch_chunk=self.cfg.replay.branch_chunk,
      tol=tol,
      base=state.base,
      lora=None if state.base is None else self.cfg.lora,
    )

  def token_counts(self, batch, phase: str) -> tuple:
    """(prefix, tails, naive-equivalent) positions computed by one step on `batch`."""
    return batch.token_counts()

  def eval_examples(self) -> list:
    return evaluate.eval_examples(self.task, self.cfg)

  def evaluate(self, state, examples) -> np.ndarray:
    """The reward of each prompt's greedy completion (`train/evaluate.py`; trees: one path);
    the trainer logs their mean, and with train.eval_batch their count and interval."""
    params = train_state.weights(state, self.cfg.lora, self.cfg.model.compute_dtype)
    return evaluate.greedy_rewards(self.fns, params, self.task, examples, self.cfg, self.tok)

  def restore_template(self, state, step: int) -> dict:
    """The checkpoint's tree at `step` (resume)."""
    return train_state.state_dict(state)
