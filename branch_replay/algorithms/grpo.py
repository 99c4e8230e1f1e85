"""GRPO-family RL on sampled groups: every group advantage estimator (`algo.advantage`; GAE
is PPO's, algorithms/ppo.py, which builds on these), the KL reference, epochs x minibatches.
Its batches, flat groups or trees, DAPO included, are rollout.py's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay import algorithms, rollout
from branch_replay.algorithms import base
from branch_replay.config import Config


@dataclasses.dataclass(frozen=True)
class Options(algorithms.SampledOptions):
  """GRPO and its family on sampled groups or trees."""

  advantage: str = "grpo"  # a group estimator (advantages.py): grpo | dr_grpo | rloo | yours

  def __post_init__(self):
    super().__post_init__()
    algorithms.check_estimator(self.advantage)


def minibatches(tree, cfg: Config, step: int, epoch: int):
  """The sampled batch split by prompt into algo.minibatches parts, in a per-epoch order
  (a device batch split on its device)."""
  B = cfg.train.batch_size
  M = cfg.algo.minibatches
  if M == 1 and epoch == 0:
    return [tree]
  order = np.random.default_rng([cfg.train.seed, step, epoch, 7]).permutation(B)
  parts = np.split(order, M)
  return [rollout.take_rows(tree, np.sort(idx)) for idx in parts]


def rl_update(rt, fns, state, batch, step: int, step_fn=None):
  """algo.ppo_epochs passes of algo.minibatches replay steps over one sampled batch (any
  pytree of prompt-major arrays: PPO's is (policy batch, critic batch)); metrics averaged
  over the steps, the ratio's maximum over all of them. step_fn(state, minibatch) ->
  (state, metrics): default the policy's step on the minibatch placed by the run's Runtime."""
  cfg = rt.cfg
  if step_fn is None:
    step_fn = lambda state, mb: fns.rl_step(state, rt.put(mb, "batch"))
  outs = []
  for epoch in range(cfg.algo.ppo_epochs):
    for mb in minibatches(batch, cfg, step, epoch):
      state, out = step_fn(state, mb)
      outs.append(base.floats(out))
  avg = {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}
  avg["ratio/max"] = max(o["ratio/max"] for o in outs)
  avg["clip_frac/last"] = outs[-1]["clip_frac"]
  return state, avg


class GRPO(base.Algorithm):
  """Sampled groups (`rollout.sampled`: flat or trees, one batch type) and their update:
  epochs x minibatches of the replay step, against the KL reference; the base's warm-up,
  evaluation and self-check."""

  auto_tree = True  # flat groups laid out as their trie (rollout.auto_tree)
  summary_metrics = ("reward/mean",)  # sampled, before shaping

  def __init__(self, cfg, task, tok, workdir=None, runtime=None):
    super().__init__(cfg, task, tok, workdir, runtime)
    self.progress_keys = rollout.reward_keys(task) + ("loss/policy",)

  def start(self, state):
    if state.ref_params is not None:  # the reference policy: the policy as RL begins
      state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    return state

  def batch(self, state, step):
    batch, _, stats = rollout.sampled(self.fns, state, self.task, self.rt, step)
    return batch, stats

  def update(self, state, batch, step):
    return rl_update(self.rt, self.fns, state, batch, step)

  def token_counts(self, batch, phase):
    if phase == "sft":
      return batch.token_counts()
    return tuple(self.cfg.algo.ppo_epochs * n for n in batch.token_counts())  # per pass
