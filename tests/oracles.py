"""Test oracles: statements of what the engine computes that share none of its tree code.

`flat_naive_loss` is the flat naive twin: every branch of a flat batch (a depth-1 tree with
every valid leaf token scored, `is_flat`) as its own [P+T] sequence through the same model,
attention and remat setting, scored by its own `branch_value` (per branch, trunk then tail),
not by the engine's path layout. Replay agreeing with it checks the engine's path scoring
against an independent statement of the objective; the engine's own naive twin
(engine.naive_loss, mode 'naive') shares the path layout with replay and cannot.
Import by basename (`from oracles import ...`), as tests/helpers.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from branch_replay.core import engine, losses, tree
from models import transformer as tfm


def is_flat(batch: tree.TreeBatch) -> bool:
  """Whether the flat twin serves `batch`: depth 1, every valid leaf token scored."""
  return batch.depth == 1 and batch.leaves.scored_BRT is None


def _branches(batch: tree.TreeBatch, loss_cfg: losses.LossConfig):
  """Per-branch inputs with the branch axis first ([R, B, ...]) and shared trunk inputs."""
  engine.check(batch, loss_cfg)
  leaves = batch.leaves
  tail_w_BRT, w_BR = losses.aggregation_weights(loss_cfg, leaves.valid_BRT, batch.trunk_len)
  r_first = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
  branches_R = dict(
    tokens_BT=r_first(leaves.tokens_BRT),
    valid_BT=r_first(leaves.valid_BRT),
    weight_BT=r_first(tail_w_BRT),
    trunk_weight_B=r_first(w_BR),
    advantage_B=r_first(leaves.advantages_BR),
    advantage_BT=r_first(leaves.advantages_BRT),
    trunk_advantage_BW=r_first(batch.trunk_advantages_BRW),
    old_logp_BT=r_first(leaves.old_logp_BRT),
    ref_logp_BT=r_first(leaves.ref_logp_BRT),
  )
  P = batch.root_BP.shape[1]
  trunk = dict(
    tokens_BW=batch.root_BP[:, P - batch.trunk_len :],
    old_logp_BW=batch.trunk_old_logp_BW,
    ref_logp_BW=batch.trunk_ref_logp_BW,
  )
  return branches_R, trunk


def branch_value(tail_logp_BT, tail_entropy_BT, trunk_logp_BW, branch, trunk, loss_cfg):
  """One branch of every prompt: (objective value_B, aux of per-branch sums).

  The branch's scored tokens are X = W trunk tokens (shared, scored by every branch with
  its own advantage) followed by its T tail tokens."""
  B, W = trunk_logp_BW.shape
  cat = lambda trunk_BW, tail_BT: (
    tail_BT
    if W == 0  # (trunk inputs may be None then)
    else jnp.concatenate([trunk_BW, tail_BT], axis=1)
  )
  logp_BX = cat(trunk_logp_BW, tail_logp_BT)
  sg = jax.lax.stop_gradient(logp_BX)
  old_BX = sg if branch["old_logp_BT"] is None else cat(trunk["old_logp_BW"], branch["old_logp_BT"])
  ref_BX = sg if branch["ref_logp_BT"] is None else cat(trunk["ref_logp_BW"], branch["ref_logp_BT"])
  if branch["advantage_BT"] is None:
    adv_BX = jnp.broadcast_to(branch["advantage_B"][:, None], logp_BX.shape)
  else:
    adv_BX = cat(branch["trunk_advantage_BW"], branch["advantage_BT"])
  valid_BX = cat(jnp.ones((B, W), bool), branch["valid_BT"])
  weight_BX = cat(jnp.broadcast_to(branch["trunk_weight_B"][:, None], (B, W)), branch["weight_BT"])
  value_B = losses.branch_value(logp_BX, old_BX, ref_BX, adv_BX, valid_BX, weight_BX, loss_cfg)
  # Diagnostics over scored tokens (stop-gradient: they never reach the loss).
  valid = branch["valid_BT"]
  log_ratio_BX = jnp.where(valid_BX, sg - old_BX, 0.0)
  ratio_BX = jnp.exp(log_ratio_BX)
  clipped_BX = jnp.clip(ratio_BX, 1.0 - loss_cfg.epsilon, 1.0 + loss_cfg.eps_high)
  binds_BX = valid_BX & (-clipped_BX * adv_BX > -ratio_BX * adv_BX)
  scored = weight_BX > 0
  aux = dict(
    logp_sum=jnp.sum(jnp.where(valid, tail_logp_BT, 0.0), -1),
    entropy_sum=jnp.sum(jnp.where(valid, tail_entropy_BT, 0.0), -1),
    kl_sum=jnp.sum(jnp.where(scored, losses.k3_kl(sg, ref_BX), 0.0), -1),
    tokens=valid.sum(-1),
    scored_tokens=valid_BX.sum(-1),
    clip_sum=binds_BX.sum(-1),
    # approx KL(old || new) by k3 on the sampled tokens
    approx_kl_sum=jnp.sum(jnp.where(valid_BX, ratio_BX - 1.0 - log_ratio_BX, 0.0), -1),
    ratio_max=jnp.max(jnp.where(valid_BX, ratio_BX, 0.0), -1),
  )
  return value_B, aux


def flat_naive_loss(
  params, batch: tree.TreeBatch, model_cfg: tfm.ModelConfig, loss_cfg: losses.LossConfig
):
  """The naive twin of a flat batch (`is_flat`): every branch as its own [P+T] sequence.
  Returns (loss, aux_BR)."""
  if not is_flat(batch):
    raise ValueError(
      f"tree.fanouts={batch.fanouts}: the flat naive twin expects a depth-1 "
      "tree with every valid leaf token scored (levels[0].scored_BRT None); "
      "deeper trees: engine.naive_loss"
    )
  leaves = batch.leaves
  B, R, T = leaves.tokens_BRT.shape
  P, W = batch.root_BP.shape[1], batch.trunk_len
  branches_R, trunk = _branches(batch, loss_cfg)
  seq = lambda root_BP, leaves_BRT: jnp.concatenate(
    [jnp.broadcast_to(root_BP[:, None], (B, R, P)), leaves_BRT], -1
  ).reshape(B * R, P + T)
  tokens_NS = seq(batch.root_BP, leaves.tokens_BRT)
  valid_NS = seq(batch.root_valid_BP, leaves.valid_BRT)
  h_NSD = tfm.forward(params, model_cfg, tokens_NS, valid_NS)
  logp_NT, entropy_NT = tfm.token_logps(
    params,
    model_cfg,
    h_NSD[:, P - 1 : P + T - 1],
    tokens_NS[:, P:],
    temperature=loss_cfg.temperature,
  )
  trunk_logp_NW, _ = tfm.token_logps(
    params,
    model_cfg,
    h_NSD[:, P - 1 - W : P - 1],
    tokens_NS[:, P - W : P],
    temperature=loss_cfg.temperature,
  )
  r_first = lambda x_N: jnp.swapaxes(x_N.reshape(B, R, *x_N.shape[1:]), 0, 1)

  def one_branch(logp_BT, entropy_BT, trunk_logp_BW, branch):
    return branch_value(logp_BT, entropy_BT, trunk_logp_BW, branch, trunk, loss_cfg)

  values_RB, aux_R = jax.vmap(one_branch)(
    r_first(logp_NT), r_first(entropy_NT), r_first(trunk_logp_NW), branches_R
  )
  combine = engine.combine_fn(loss_cfg)
  loss = values_RB.sum() if combine is None else combine(values_RB)
  return loss, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), aux_R)


def flat_naive_loss_and_grad(params, batch, model_cfg, loss_cfg, params_fn=None):
  fn = lambda p: flat_naive_loss(
    p if params_fn is None else params_fn(p), batch, model_cfg, loss_cfg
  )
  (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params)
  return loss, aux, grads
