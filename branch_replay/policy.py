"""The transformer as a policy: replay's prefill/branch-loss pair and its naive twin.

Both paths score tokens with the same `branch_value` (objective x aggregation weights) and
differ only in how log-probs are computed: replay runs the prefix once and the tails
against its cache; the naive twin runs every branch as its own [P+T] sequence through the
same model, attention and remat setting. A speedup therefore measures replay alone.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from branch_replay import losses, replay
from branch_replay.batch import ReplayBatch
from models import transformer as tfm

MODES = ("replay", "naive")


def _branches(batch: ReplayBatch, loss_cfg: losses.LossConfig):
  """Per-branch inputs with the branch axis first ([R, B, ...]) and shared trunk inputs."""
  tail_w_BRT, w_BR = losses.aggregation_weights(loss_cfg, batch.tail_valid_BRT, batch.trunk_len)
  r_first = lambda x: None if x is None else jnp.swapaxes(x, 0, 1)
  branches_R = dict(tokens_BT=r_first(batch.tails_BRT), valid_BT=r_first(batch.tail_valid_BRT),
                    weight_BT=r_first(tail_w_BRT), trunk_weight_B=r_first(w_BR),
                    advantage_B=r_first(batch.advantages_BR),
                    old_logp_BT=r_first(batch.old_logp_BRT),
                    ref_logp_BT=r_first(batch.ref_logp_BRT))
  P = batch.prefix_BP.shape[1]
  trunk = dict(tokens_BW=batch.prefix_BP[:, P - batch.trunk_len:],
               old_logp_BW=batch.trunk_old_logp_BW, ref_logp_BW=batch.trunk_ref_logp_BW)
  return branches_R, trunk


def _score(logp, old_logp, ref_logp, advantage_B, weight, loss_cfg):
  old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
  ref = jax.lax.stop_gradient(logp) if ref_logp is None else ref_logp
  values = loss_cfg.objective.token_fn(logp, old, ref, advantage_B[:, None], loss_cfg)
  return jnp.sum(values * weight, axis=-1), jnp.sum(losses.k3_kl(logp, ref) * (weight > 0), -1)


def branch_value(tail_logp_BT, tail_entropy_BT, trunk_logp_BW, branch, trunk, loss_cfg):
  """One branch of every prompt: (objective value_B, aux of per-branch sums)."""
  tail_v_B, tail_kl_B = _score(tail_logp_BT, branch["old_logp_BT"], branch["ref_logp_BT"],
                               branch["advantage_B"], branch["weight_BT"], loss_cfg)
  value_B, kl_B = tail_v_B, tail_kl_B
  if trunk_logp_BW.shape[1]:
    w_BW = jnp.broadcast_to(branch["trunk_weight_B"][:, None], trunk_logp_BW.shape)
    trunk_v_B, trunk_kl_B = _score(trunk_logp_BW, trunk["old_logp_BW"], trunk["ref_logp_BW"],
                                   branch["advantage_B"], w_BW, loss_cfg)
    value_B, kl_B = value_B + trunk_v_B, kl_B + trunk_kl_B
  valid = branch["valid_BT"]
  aux = dict(logp_sum=jnp.sum(jnp.where(valid, tail_logp_BT, 0.0), -1),
             entropy_sum=jnp.sum(jnp.where(valid, tail_entropy_BT, 0.0), -1),
             kl_sum=kl_B, tokens=valid.sum(-1))
  return value_B, aux


def combine_fn(loss_cfg):
  """The objective's branch-combining function for `replay.value_and_grad` (None = sum)."""
  fn = loss_cfg.objective.combine
  return None if fn is None else (lambda values_RB: fn(values_RB, loss_cfg))


def replay_fns(model_cfg: tfm.ModelConfig, loss_cfg: losses.LossConfig, batch: ReplayBatch):
  """(prefill_fn, branch_loss_fn, prefix, branches_R) for `replay.value_and_grad(...,
  batched=True)`: branch_loss_fn takes all branches (leaves [R, B, ...]) at once."""
  branches_R, trunk = _branches(batch, loss_cfg)
  prefix_valid_BP = batch.prefix_valid_BP

  def prefill_fn(params, prefix):
    cache = tfm.prefill(params, model_cfg, prefix["tokens_BP"], prefix["valid_BP"],
                        batch.trunk_len)
    trunk_logp_BW, _ = tfm.token_logps(params, model_cfg, cache.trunk_h_BWD, trunk["tokens_BW"])
    # Everything the tails read from the prefix; its cotangent is summed over branches.
    return dict(kv=cache.kv, h_last_BD=cache.h_last_BD, trunk_logp_BW=trunk_logp_BW)

  def branch_loss_fn(params, cache, branches_R):
    """Every branch at once (replay's `batched=True`): the tails run as B*R rows (b, r),
    their attention folding a prompt's R*T queries against its one prefix K/V."""
    tokens_RBT = branches_R["tokens_BT"]
    R, B = tokens_RBT.shape[:2]
    rows = lambda x_RB: jnp.swapaxes(x_RB, 0, 1).reshape(B * R, *x_RB.shape[2:])
    unrows = lambda x_N: jnp.swapaxes(x_N.reshape(B, R, *x_N.shape[1:]), 0, 1)
    kv_cache = tfm.PrefixCache(cache["kv"], cache["h_last_BD"], None)
    tokens_NT = rows(tokens_RBT)
    h_NTD = tfm.tail(params, model_cfg, kv_cache, prefix_valid_BP, tokens_NT,
                     rows(branches_R["valid_BT"]))
    # Tail token t is predicted by the hidden state before it: the prefix's last for t=0.
    h_last_ND = jnp.repeat(cache["h_last_BD"], R, axis=0)
    h_pred_NTD = jnp.concatenate([h_last_ND[:, None], h_NTD[:, :-1]], axis=1)
    logp_NT, entropy_NT = tfm.token_logps(params, model_cfg, h_pred_NTD, tokens_NT)
    value = lambda logp_BT, entropy_BT, branch: branch_value(
        logp_BT, entropy_BT, cache["trunk_logp_BW"], branch, trunk, loss_cfg)
    return jax.vmap(value)(unrows(logp_NT), unrows(entropy_NT), branches_R)

  prefix = dict(tokens_BP=batch.prefix_BP, valid_BP=batch.prefix_valid_BP)
  return prefill_fn, branch_loss_fn, prefix, branches_R


def replay_loss_and_grad(params, batch: ReplayBatch, model_cfg: tfm.ModelConfig,
                         loss_cfg: losses.LossConfig, branch_chunk: Optional[int] = None,
                         cache_constraint=None):
  """Branch replay: (loss, aux_BR, grads)."""
  prefill_fn, branch_loss_fn, prefix, branches_R = replay_fns(model_cfg, loss_cfg, batch)
  loss, aux_R, grads = replay.value_and_grad(
      prefill_fn, branch_loss_fn, params, prefix, branches_R, branch_chunk=branch_chunk,
      combine=combine_fn(loss_cfg), cache_constraint=cache_constraint, batched=True)
  return loss, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), aux_R), grads


def naive_loss(params, batch: ReplayBatch, model_cfg: tfm.ModelConfig,
               loss_cfg: losses.LossConfig):
  """The naive twin: every branch as its own [P+T] sequence. Returns (loss, aux_BR)."""
  B, R, T = batch.tails_BRT.shape
  P, W = batch.prefix_BP.shape[1], batch.trunk_len
  branches_R, trunk = _branches(batch, loss_cfg)
  seq = lambda prefix_BP, tails_BRT: jnp.concatenate(
      [jnp.broadcast_to(prefix_BP[:, None], (B, R, P)), tails_BRT], -1).reshape(B * R, P + T)
  tokens_NS = seq(batch.prefix_BP, batch.tails_BRT)
  valid_NS = seq(batch.prefix_valid_BP, batch.tail_valid_BRT)
  h_NSD = tfm.forward(params, model_cfg, tokens_NS, valid_NS)
  logp_NT, entropy_NT = tfm.token_logps(params, model_cfg, h_NSD[:, P - 1:P + T - 1],
                                        tokens_NS[:, P:])
  trunk_logp_NW, _ = tfm.token_logps(params, model_cfg, h_NSD[:, P - 1 - W:P - 1],
                                     tokens_NS[:, P - W:P])
  r_first = lambda x_N: jnp.swapaxes(x_N.reshape(B, R, *x_N.shape[1:]), 0, 1)

  def one_branch(logp_BT, entropy_BT, trunk_logp_BW, branch):
    return branch_value(logp_BT, entropy_BT, trunk_logp_BW, branch, trunk, loss_cfg)

  values_RB, aux_R = jax.vmap(one_branch)(r_first(logp_NT), r_first(entropy_NT),
                                          r_first(trunk_logp_NW), branches_R)
  combine = combine_fn(loss_cfg)
  loss = values_RB.sum() if combine is None else combine(values_RB)
  return loss, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), aux_R)


def naive_loss_and_grad(params, batch, model_cfg, loss_cfg):
  (loss, aux), grads = jax.value_and_grad(naive_loss, has_aux=True)(params, batch, model_cfg,
                                                                    loss_cfg)
  return loss, aux, grads


def loss_and_grad(params, batch, model_cfg, loss_cfg, mode: str = "replay",
                  branch_chunk: Optional[int] = None, cache_constraint=None):
  if mode == "replay":
    return replay_loss_and_grad(params, batch, model_cfg, loss_cfg, branch_chunk,
                                cache_constraint)
  if mode == "naive":
    return naive_loss_and_grad(params, batch, model_cfg, loss_cfg)
  raise ValueError(f"replay.mode={mode!r}: expected one of {MODES}")
