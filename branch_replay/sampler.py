"""Shared-prefix sampling: prefill the prompt once, fork R branches from its one K/V cache.

Each branch keeps K/V buffers only for the tokens it generates; every decode step is the
model applied to one token per branch with a list of context segments
  [(prompt K/V, prompt_valid_BP), (trunk K/V, all valid), (this branch's K/V, written so far)],
vmapped over branches with the shared segments closed over (unbatched), so the prompt K/V is
read by every branch and copied by none. An optional trunk (`trunk_len` = W tokens) is decoded
once per prompt and then shared by all R branches; for training it becomes the prefix's end.

Log-probs returned are those of the distribution the tokens were drawn from,
softmax(logits / temperature) (temperature 1 when greedy), i.e. what the training forward
computes with `loss.temperature` equal to the sampler's (the trainer sets it): the ratio's
denominator. Top-k / top-p filtered distributions are not trained against: the trainer
refuses them for RL (`config.Config`).
No `@jax.jit` here; callers jit `sample` with the configs static.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from branch_replay.batch import ReplayBatch
from models import transformer as tfm


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  max_new_tokens: int = 4  # T: tail tokens per branch (stop tokens included)
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off
  trunk_len: int = 0  # W: response tokens decoded once per prompt, shared by the R branches

  def __post_init__(self):
    if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
      raise ValueError(f"sampler.max_new_tokens={self.max_new_tokens!r}: expected an int >= 1")
    if not self.temperature >= 0:
      raise ValueError(f"sampler.temperature={self.temperature!r}: expected >= 0")
    if not isinstance(self.top_k, int) or self.top_k < 0:
      raise ValueError(f"sampler.top_k={self.top_k!r}: expected an int >= 0 (0 = off)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"sampler.top_p={self.top_p!r}: expected 0 < top_p <= 1")
    if not isinstance(self.trunk_len, int) or self.trunk_len < 0:
      raise ValueError(f"sampler.trunk_len={self.trunk_len!r}: expected an int >= 0")


class Samples(NamedTuple):
  tokens_BRT: jax.Array  # int32, right-padded with 0 after a stop token
  valid_BRT: jax.Array  # bool: generated and not after a stop token (the stop token is valid)
  logp_BRT: jax.Array  # float32 policy log-probs of the tokens (0 where invalid)
  trunk_BW: jax.Array  # int32 shared trunk tokens ([B, 0] without a trunk)
  trunk_logp_BW: jax.Array  # float32


def filter_logits(logits_BV: jax.Array, cfg: SamplerConfig) -> jax.Array:
  """Temperature, then top-k, then top-p (nucleus) masking to -inf."""
  logits_BV = logits_BV / cfg.temperature
  neg = jnp.asarray(-jnp.inf, logits_BV.dtype)
  if cfg.top_k and cfg.top_k < logits_BV.shape[-1]:
    kth_B1 = jax.lax.top_k(logits_BV, cfg.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV < kth_B1, neg, logits_BV)
  if cfg.top_p < 1.0:
    sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV  # mass strictly above each token
    keep_BV = before_BV < cfg.top_p  # the smallest set whose mass reaches top_p
    cutoff_B1 = jnp.min(jnp.where(keep_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
    logits_BV = jnp.where(logits_BV < cutoff_B1, neg, logits_BV)
  return logits_BV


def choose(key, logits_BV, cfg: SamplerConfig):
  """Next token and its log-prob under softmax(logits / temperature) (unfiltered; greedy:
  temperature 1)."""
  logits_BV = logits_BV.astype(jnp.float32)
  if cfg.temperature == 0:
    token_B = jnp.argmax(logits_BV, axis=-1)
  else:
    token_B = jax.random.categorical(key, filter_logits(logits_BV, cfg), axis=-1)
    logits_BV = logits_BV / cfg.temperature if cfg.temperature != 1.0 else logits_BV
  logp_B = jnp.take_along_axis(jax.nn.log_softmax(logits_BV, -1), token_B[:, None], -1)[:, 0]
  return token_B.astype(jnp.int32), logp_B


def _decode(params, model_cfg, cfg, shared, offset_B, logits_BV, keys_R, n_steps, stop_ids):
  """Decode `n_steps` tokens for R branches (the leading axis of keys_R) from shared context.

  shared: segments [(kv per layer, valid_BS)] read by every branch (never copied per branch).
  Returns tokens_RBT, valid_RBT, logp_RBT, own kv per layer ([R, B, T, K, H]) and the
  logits after the last token, logits_RBV.
  """
  B = logits_BV.shape[0]
  model = tfm.Transformer(model_cfg)
  K, H, dt = model_cfg.n_kv_heads, model_cfg.head_dim, model_cfg.compute_dtype
  T = n_steps

  def branch_step(carry, key, t):
    logits_BV, kv, gen_valid_BT, done_B = carry
    # 1. Sample this branch's token t from the logits its previous token produced.
    token_B, logp_B = choose(jax.random.fold_in(key, t), logits_BV, cfg)
    valid_B = ~done_B
    token_B = jnp.where(valid_B, token_B, 0)
    done_B = done_B | jnp.isin(token_B, stop_ids)
    # 2. One token forward against [shared segments..., own generated K/V so far].
    position_B1 = (offset_B + t)[:, None]
    h_B1D, own = model.apply({"params": params}, token_B[:, None], position_B1,
                             jnp.ones((B, 1), bool), context=[*shared, (kv, gen_valid_BT)])
    kv = tuple(o if not isinstance(o, tfm.KV) else  # hybrid: a linear layer's new state
               tfm.KV(jax.lax.dynamic_update_slice(c.k_BSKH, o.k_BSKH, (0, t, 0, 0)),
                      jax.lax.dynamic_update_slice(c.v_BSKH, o.v_BSKH, (0, t, 0, 0)))
               for c, o in zip(kv, own))
    gen_valid_BT = jax.lax.dynamic_update_slice(gen_valid_BT, jnp.ones((B, 1), bool), (0, t))
    logits_BV = model.apply({"params": params}, h_B1D, method=tfm.Transformer.logits)[:, 0]
    out = (token_B, valid_B, jnp.where(valid_B, logp_B, 0.0))
    return (logits_BV, kv, gen_valid_BT, done_B), out

  def step(carry, t):
    carry, out = jax.vmap(branch_step, in_axes=(0, 0, None))(carry, keys_R, t)
    return carry, out

  R = keys_R.shape[0]
  empty = jnp.zeros((R, B, T, K, H), dt)
  kv0 = tuple(tfm.KV(empty, empty) if model_cfg.layer_type(i) != "linear_attention" else
              # hybrid: a linear layer carries the state after the shared context (recurrent form)
              jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), shared[-1][0][i])
              for i in range(model_cfg.n_layers))
  carry0 = (jnp.broadcast_to(logits_BV, (R, *logits_BV.shape)), kv0,
            jnp.zeros((R, B, T), bool), jnp.zeros((R, B), bool))
  (logits_RBV, kv, _, _), (tokens_TRB, valid_TRB, logp_TRB) = jax.lax.scan(
      step, carry0, jnp.arange(T))
  to_RBT = lambda x: jnp.moveaxis(x, 0, -1)
  return to_RBT(tokens_TRB), to_RBT(valid_TRB), to_RBT(logp_TRB), kv, logits_RBV


def sample(params, model_cfg: tfm.ModelConfig, cfg: SamplerConfig, prompt_BP, prompt_valid_BP,
           key, n_branches: int, stop_tokens: Sequence[int] = ()) -> Samples:
  """R = n_branches continuations of every (left-padded) prompt, prefix K/V computed once."""
  B, P = prompt_BP.shape
  stop_ids = jnp.asarray(tuple(stop_tokens) or (-1,), jnp.int32)
  model = tfm.Transformer(model_cfg)
  # 1. Prefill the prompt once.
  h_BPD, prompt_kv = model.apply({"params": params}, prompt_BP,
                                 tfm.positions_from_valid(prompt_valid_BP), prompt_valid_BP)
  logits_BV = model.apply({"params": params}, h_BPD[:, -1:], method=tfm.Transformer.logits)[:, 0]
  offset_B = jnp.sum(prompt_valid_BP.astype(jnp.int32), axis=1)
  shared = [(prompt_kv, prompt_valid_BP)]
  trunk_key, branch_key = jax.random.split(key)
  W = cfg.trunk_len
  # 2. Optional trunk: W tokens decoded once per prompt (stop tokens do not end a trunk).
  trunk_BW = jnp.zeros((B, 0), jnp.int32)
  trunk_logp_BW = jnp.zeros((B, 0), jnp.float32)
  if W:
    tokens, _, logp, trunk_kv, logits_RBV = _decode(
        params, model_cfg, cfg, shared, offset_B, logits_BV, trunk_key[None], W,
        jnp.asarray((-1,), jnp.int32))
    trunk_BW, trunk_logp_BW, logits_BV = tokens[0], logp[0], logits_RBV[0]
    shared.append((jax.tree.map(lambda x: x[0], trunk_kv), jnp.ones((B, W), bool)))
    offset_B = offset_B + W
  # 3. Fork R branches from the shared context.
  keys_R = jax.random.split(branch_key, n_branches)
  tokens_RBT, valid_RBT, logp_RBT, _, _ = _decode(
      params, model_cfg, cfg, shared, offset_B, logits_BV, keys_R, cfg.max_new_tokens, stop_ids)
  to_BRT = lambda x: jnp.swapaxes(x, 0, 1)
  return Samples(to_BRT(tokens_RBT), to_BRT(valid_RBT), to_BRT(logp_RBT), trunk_BW,
                 trunk_logp_BW)


def score(params, model_cfg: tfm.ModelConfig, batch: ReplayBatch, temperature: float = 1.0):
  """Policy log-probs of every tail (and trunk) token from ONE shared-prefix forward:
  (logp_BRT, trunk_logp_BW), of softmax(logits / temperature). Used for the frozen
  reference policy's log-probs (RL, DPO)."""
  W = batch.trunk_len
  P = batch.prefix_BP.shape[1]
  cache = tfm.prefill(params, model_cfg, batch.prefix_BP, batch.prefix_valid_BP, W)
  trunk_logp_BW, _ = tfm.token_logps(params, model_cfg, cache.trunk_h_BWD,
                                     batch.prefix_BP[:, P - W:], temperature=temperature)

  B, R, T = batch.tails_BRT.shape
  tokens_NT = batch.tails_BRT.reshape(B * R, T)  # rows (b, r): all branches in one call
  valid_NT = batch.tail_valid_BRT.reshape(B * R, T)
  h_NTD = tfm.tail(params, model_cfg, cache, batch.prefix_valid_BP, tokens_NT, valid_NT)
  h_last_ND = jnp.repeat(cache.h_last_BD, R, axis=0)
  h_pred_NTD = jnp.concatenate([h_last_ND[:, None], h_NTD[:, :-1]], axis=1)
  logp_NT, _ = tfm.token_logps(params, model_cfg, h_pred_NTD, tokens_NT, temperature=temperature)
  return jnp.where(valid_NT, logp_NT, 0.0).reshape(B, R, T), trunk_logp_BW


def to_batch(prompt_BP, prompt_valid_BP, samples: Samples, advantages_BR,
             ref: tuple | None = None) -> ReplayBatch:
  """The training batch: prefix = prompt + trunk, tails = branches, old log-probs = sampling's."""
  B, W = samples.trunk_BW.shape
  prefix_BP = jnp.concatenate([prompt_BP, samples.trunk_BW], axis=1)
  prefix_valid_BP = jnp.concatenate([prompt_valid_BP, jnp.ones((B, W), bool)], axis=1)
  return ReplayBatch(prefix_BP=prefix_BP, prefix_valid_BP=prefix_valid_BP,
                     tails_BRT=samples.tokens_BRT, tail_valid_BRT=samples.valid_BRT,
                     advantages_BR=advantages_BR, old_logp_BRT=samples.logp_BRT,
                     trunk_old_logp_BW=samples.trunk_logp_BW if W else None,
                     trunk_len=W)
