"""PPO: the policy's GRPO-family step with per-token advantages from a learned critic (GAE),
the critic trained alongside through the same engine. Flat rollouts (R branches per prompt,
optional trunk) and trees alike (rollout.py's batches); selected by `algo.name=ppo`.

What is PPO's alone lives here (a subclass of GRPO): the critic's init at the phase start,
its values of the sampled batch (one replay forward), GAE per path with whitening, the critic
step after each policy step of every minibatch, and the value metrics. Sampling, the policy
step, the warm-up and evaluation are GRPO's.

On a tree the critic's targets and the policy's advantages are per path: a token of an inner
node lies on every path through it, with one value (it depends only on what precedes it) but
one advantage and one return per path (GAE from that path's leaf reward, `critic.gae`); the
engine scores each path with its own, as the naive twin runs every path as its own sequence.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from branch_replay import algorithms, rollout
from branch_replay.algorithms import grpo
from branch_replay.core import critic, tree
from branch_replay.train import state as train_state
from branch_replay.config import Config


@dataclasses.dataclass(frozen=True)
class Options(algorithms.SampledOptions):
  """PPO: GRPO's sampling and epochs; advantages from the critic's values by GAE (the value
  model's own options: the `critic` section)."""

  advantage = "gae"  # not an option: what PPO's advantages are


def check(cfg) -> None:
  if cfg.lora.enabled:
    raise ValueError(
      f"lora.rank={cfg.lora.rank} with algo.name={cfg.algo.name!r}: LoRA is not supported there "
      "(PPO's critic is a full copy of the model, critic.share included); expected lora.rank=0 "
      "or another algo.name"
    )


def critic_body(state: train_state.TrainState, cfg: Config):
  """The transformer a shared critic's head reads (the policy's); None for a separate one."""
  return state.params if cfg.critic.share else None


def make_critic_step(cfg: Config, mesh=None):
  """Pure `critic_step(state, critic_batch) -> (state, metrics)`: one value-model update
  through branch replay (or its naive twin), flat or tree. With critic.share the head alone
  is updated, reading the policy's current transformer (`state.params`, not differentiated).
  mesh: the run's Mesh object (`runtime.Runtime.mesh`; None without cfg.mesh)."""
  train_state.check_mesh(cfg, mesh, "make_critic_step")
  tx = train_state.make_critic_optimizer(cfg)

  def critic_step(state: train_state.TrainState, cb: critic.CriticBatch):
    params, opt_state = state.critic["params"], state.critic["opt_state"]
    loss, aux_BR, grads = critic.loss_and_grad(
      params,
      cb,
      cfg.model,
      cfg.critic,
      mode=cfg.replay.mode,
      body_params=critic_body(state, cfg),
      mesh=mesh,
    )
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    n = jnp.maximum(aux_BR["tokens"].sum(), 1)
    out = {
      "loss/value": loss,
      "value/clip_frac": aux_BR["clip_sum"].sum() / n,
      "value/grad_norm": optax.tree.norm(grads),
    }
    return state.replace(critic=dict(params=params, opt_state=opt_state)), out

  return critic_step


class PPOBatch(NamedTuple):
  """One PPO step's batch: the policy's (per-token GAE advantages) and the critic's (returns,
  old values) over the same prompts; a pytree, so minibatches split both alike."""

  policy: tree.TreeBatch
  critic: critic.CriticBatch


class CriticFns(NamedTuple):
  critic_step: Any
  values: Any


def build_critic_fns(cfg: Config, mesh=None) -> CriticFns:
  """The critic's jitted functions of a config (`steps.compile_key`) on the run's mesh
  (`Runtime.compiled('critic', build_critic_fns)` keeps them across runs)."""
  return CriticFns(
    critic_step=jax.jit(make_critic_step(cfg, mesh), donate_argnums=0),
    values=jax.jit(functools.partial(critic.values, model_cfg=cfg.model)),
  )


def with_token_advantages(batch, adv_BLX):
  """The batch with per-token advantages [B, L, X] (the engine's path layout) in place of
  its per-branch (per-node) ones: the trunk's, each inner level's per path
  (`path_advantages_BLT`) and the leaves' (`advantages_BRT`)."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  W = batch.trunk_len
  trunk = f32(adv_BLX[..., :W]) if W else None
  ends = W + np.cumsum([np.shape(level.tokens_BRT)[2] for level in batch.levels])
  starts = [W, *ends[:-1]]
  levels = [
    level.replace(advantages_BR=None, path_advantages_BLT=f32(adv_BLX[..., a:b]))
    for level, a, b in zip(batch.levels[:-1], starts, ends)
  ]
  leaves = batch.leaves.replace(
    advantages_BR=f32(np.zeros(adv_BLX.shape[:2])), advantages_BRT=f32(adv_BLX[..., starts[-1] :])
  )
  return batch.replace(levels=(*levels, leaves), trunk_advantages_BRW=trunk)


def gae_batch(fns: CriticFns, state, batch, rewards_BR, rt):
  """The critic's values of every path position (one replay forward), GAE per path
  (`critic.gae`), whitened over every path's scored tokens (a shared token once per path):
  (policy batch with per-token advantages, critic batch with returns and old values, stats);
  rt: the run's Runtime (the batch placed on its devices)."""
  cfg = rt.cfg
  c = cfg.critic
  scored_BLX = critic.scored_mask(batch)
  if np.shape(rewards_BR) != scored_BLX.shape[:2]:
    raise ValueError(
      f"rewards_BR: shape {np.shape(rewards_BR)}: expected "
      f"{scored_BLX.shape[:2]} (one reward per branch or leaf)"
    )
  old_values_BLX = np.asarray(
    rt.to_host(
      fns.values(  # on a mesh: gathered to every host
        state.critic["params"],
        batch=rt.put(batch, "batch"),
        body_params=critic_body(state, cfg),
      )
    ),
    np.float64,
  )
  old_values_BLX = np.where(scored_BLX, old_values_BLX, 0.0)
  adv_BLX, returns_BLX = critic.gae(rewards_BR, old_values_BLX, scored_BLX, c.gamma, c.lam)
  ret, v = returns_BLX[scored_BLX], old_values_BLX[scored_BLX]
  stats = {
    "value/explained_variance": critic.explained_variance(old_values_BLX, returns_BLX, scored_BLX),
    "value/mean": float(v.mean()),
    # per-step sums for an explained variance pooled over steps
    # (critic.pooled_explained_variance; the summary's value_ev_before/after)
    "value/sq_err": float(np.mean((ret - v) ** 2)),
    "value/return_var": float(ret.var()),
    "value/return_mean": float(ret.mean()),
    "value/tokens": int(scored_BLX.sum()),
  }
  policy_adv = critic.whiten(adv_BLX, scored_BLX) if c.whiten else adv_BLX
  batch = with_token_advantages(batch, policy_adv)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  cb = critic.CriticBatch(batch, f32(returns_BLX), f32(old_values_BLX))
  critic.validate(cb)
  return batch, cb, stats


class PPO(grpo.GRPO):
  """GRPO's sampling, warm-up, evaluation and policy step; the critic's init, values, GAE and
  step here."""

  uses_critic = True  # the `critic` section is its value model
  auto_tree = False  # its advantages are per token (GAE), its critic has its own batch
  # the critic's explained variance of the old values, pooled over the summary's windows
  summary_metrics = grpo.GRPO.summary_metrics + (
    ("value/explained_variance", critic.pooled_explained_variance),
  )

  def __init__(self, cfg, task, tok, workdir=None, runtime=None):
    super().__init__(cfg, task, tok, workdir, runtime)
    self.progress_keys = self.progress_keys + ("loss/value",)
    self.critic_fns = self.rt.compiled("critic", build_critic_fns)

  def start(self, state):
    state = super().start(state)
    if not self.cfg.critic.share:  # the value model starts from the policy too (a shared
      # critic's body IS the policy)
      state = state.replace(
        critic=dict(
          params={**state.critic["params"], "model": jax.tree.map(jnp.copy, state.params)},
          opt_state=state.critic["opt_state"],
        )
      )
    return state

  def batch(self, state, step):
    batch, rewards_BR, stats = rollout.sampled(self.fns, state, self.task, self.rt, step)
    batch, cb, critic_stats = gae_batch(self.critic_fns, state, batch, rewards_BR, self.rt)
    tree.validate(batch, self.cfg.model.vocab_size, self.cfg.replay.branch_chunk)
    return PPOBatch(batch, cb), {**stats, **critic_stats}

  def update(self, state, batch, step):

    def step_fn(state, mb: PPOBatch):  # the policy's step, then the critic's on the same prompts
      state, out = self.fns.rl_step(state, self.rt.put(mb.policy, "batch"))
      state, critic_out = self.critic_fns.critic_step(state, self.rt.put(mb.critic, "batch"))
      return state, {**out, **critic_out}

    return grpo.rl_update(self.rt, self.fns, state, batch, step, step_fn=step_fn)

  def verify(self, state, batch, tol=None):
    return super().verify(state, batch.policy, tol)

  def token_counts(self, batch, phase):
    return super().token_counts(batch if phase == "sft" else batch.policy, phase)
