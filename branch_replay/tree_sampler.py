"""Tree sampling: prefill the prompt once, decode R_1 openings sharing its K/V, then R_2
continuations of every opening sharing the prompt's and the opening's K/V, and so on.

Each level decodes one parent's children with `choose` (as sampler.py), vmapped over the
parents one fan-out at a time (tree_replay._vmap_nodes' pattern): an ancestor's K/V is an
unbatched input under the vmaps over deeper fan-outs, so every descendant reads it and none
copies it. A node stops at its level's stop tokens (the stop token is kept, as valid); its
children continue from the hidden state of its last valid token. Log-probs are the policy's
own (temperature 1, unfiltered), what the training forward computes for the same tokens.
No `@jax.jit` here; callers jit `sample_tree` with the configs static.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from branch_replay import sampler
from branch_replay.sampler import SamplerConfig
from branch_replay.tree import TreeBatch, TreeLevel
from models import transformer as tfm


def _flat(x, d):
  """[R_1, ..., R_d, B, ...] (vmapped node axes first) -> [B, R_1*...*R_d, ...]."""
  x = jnp.moveaxis(x, d, 0)
  return x.reshape(x.shape[0], -1, *x.shape[d + 1:])


class TreeSamples(NamedTuple):
  tokens: tuple  # per level 1..depth: int32 [B, R_1*...*R_d, T_d], 0 after a stop token
  valid: tuple  # bool: generated up to and including the stop token
  logp: tuple  # float32 policy log-probs (0 where invalid)


def _decode(params, model_cfg, cfg, shared, offset_B, logits_BV, keys_R, n_steps, stop_ids):
  """n_steps tokens for R children (keys_R's axis) of one parent of every prompt.

  shared: [(kv per layer, valid_BS)] of the ancestors, read by every child. Returns
  tokens_RBT, valid_RBT, logp_RBT, own kv per layer [R, B, T, K, H], and logits_RBV: those
  after each child's last *valid* token (what its own children start from)."""
  B = logits_BV.shape[0]
  model = tfm.Transformer(model_cfg)
  K, H, dt = model_cfg.n_kv_heads, model_cfg.head_dim, model_cfg.compute_dtype

  def child_step(carry, key, t):
    logits_BV, kv, gen_valid_BT, done_B = carry
    token_B, logp_B = sampler.choose(jax.random.fold_in(key, t), logits_BV, cfg)
    valid_B = ~done_B
    token_B = jnp.where(valid_B, token_B, 0)
    done_B = done_B | jnp.isin(token_B, stop_ids)
    h_B1D, own = model.apply({"params": params}, token_B[:, None], (offset_B + t)[:, None],
                             valid_B[:, None], context=[*shared, (kv, gen_valid_BT)])
    kv = tuple(tfm.KV(jax.lax.dynamic_update_slice(c.k_BSKH, o.k_BSKH, (0, t, 0, 0)),
                      jax.lax.dynamic_update_slice(c.v_BSKH, o.v_BSKH, (0, t, 0, 0)))
               for c, o in zip(kv, own))
    gen_valid_BT = jax.lax.dynamic_update_slice(gen_valid_BT, valid_B[:, None], (0, t))
    new_BV = model.apply({"params": params}, h_B1D, method=tfm.Transformer.logits)[:, 0]
    logits_BV = jnp.where(valid_B[:, None], new_BV, logits_BV)  # keep the last valid one's
    return (logits_BV, kv, gen_valid_BT, done_B), (token_B, valid_B,
                                                    jnp.where(valid_B, logp_B, 0.0))

  def step(carry, t):
    return jax.vmap(child_step, in_axes=(0, 0, None))(carry, keys_R, t)

  R, T = keys_R.shape[0], n_steps
  empty = jnp.zeros((R, B, T, K, H), dt)
  carry0 = (jnp.broadcast_to(logits_BV, (R, *logits_BV.shape)),
            tuple(tfm.KV(empty, empty) for _ in range(model_cfg.n_layers)),
            jnp.zeros((R, B, T), bool), jnp.zeros((R, B), bool))
  (logits_RBV, kv, _, _), outs = jax.lax.scan(step, carry0, jnp.arange(T))
  tokens_RBT, valid_RBT, logp_RBT = (jnp.moveaxis(x, 0, -1) for x in outs)
  return tokens_RBT, valid_RBT, logp_RBT, kv, logits_RBV


def sample_tree(params, model_cfg: tfm.ModelConfig, cfg: SamplerConfig, prompt_BP,
                prompt_valid_BP, key, fanouts: Sequence[int], lengths: Sequence[int],
                stop_tokens: Sequence[Sequence[int]] = ()) -> TreeSamples:
  """A tree of continuations of every (left-padded) prompt: R_d children of every node of
  level d-1, each up to lengths[d-1] tokens, ending at stop_tokens[d-1] (default none)."""
  if len(lengths) != len(fanouts):
    raise ValueError(f"lengths={tuple(lengths)}: expected one per fan-out {tuple(fanouts)}")
  model = tfm.Transformer(model_cfg)
  # 1. Prefill the prompt once.
  h_BPD, prompt_kv = model.apply({"params": params}, prompt_BP,
                                 tfm.positions_from_valid(prompt_valid_BP), prompt_valid_BP)
  logits_BV = model.apply({"params": params}, h_BPD[:, -1:], method=tfm.Transformer.logits)[:, 0]
  offset_B = jnp.sum(prompt_valid_BP.astype(jnp.int32), axis=1)
  # Per level: the segments (kv, valid) and the parents' logits/offsets/keys, nested [R_1..].
  segments = [(prompt_kv, prompt_valid_BP)]
  out = ([], [], [])
  for d, (R, T) in enumerate(zip(fanouts, lengths), start=1):
    stops = tuple(stop_tokens[d - 1]) if len(stop_tokens) >= d else ()
    stop_ids = jnp.asarray(stops or (-1,), jnp.int32)

    def one_parent(segments, offset_B, logits_BV, key, R=R, T=T, stop_ids=stop_ids):
      return _decode(params, model_cfg, cfg, list(segments), offset_B, logits_BV,
                     jax.random.split(key, R), T, stop_ids)

    # 2. Decode level d: R children of every parent, vmapped over the parents' fan-outs
    #    with each ancestor segment unbatched under the vmaps deeper than its level.
    fn = one_parent
    for j in reversed(range(1, d)):
      seg_axes = tuple(None if i < j else 0 for i in range(d))
      fn = jax.vmap(fn, in_axes=(seg_axes, 0, 0, 0))
    keys = jax.random.split(jax.random.fold_in(key, d), math.prod(fanouts[:d - 1]))
    keys = keys.reshape(*fanouts[:d - 1], *keys.shape[1:]) if d > 1 else keys[0]
    tokens, valid, logp, kv, logits = fn(tuple(segments), offset_B, logits_BV, keys)
    # The children axis (R_d) comes out after the parents': [R_1..R_d, B, ...].
    for acc, x in zip(out, (tokens, valid, logp)):
      acc.append(_flat(x, d))
    segments.append((kv, valid))
    offset_B = jnp.expand_dims(offset_B, d - 1) + jnp.sum(valid.astype(jnp.int32), axis=-1)
    logits_BV = logits
  return TreeSamples(*(tuple(x) for x in out))


def to_tree_batch(prompt_BP, prompt_valid_BP, samples: TreeSamples, fanouts, advantages,
                  scored=None) -> TreeBatch:
  """The training batch: root = prompt, levels = the sampled nodes with the sampler's
  log-probs as old log-probs. advantages: one array per level ([B, nodes]; None for an
  inner level = its leaves' advantages); scored: optional per-level masks."""
  levels = []
  for d, (tokens, valid, logp) in enumerate(zip(*samples)):
    levels.append(TreeLevel(tokens_BRT=tokens, valid_BRT=valid, old_logp_BRT=logp,
                            advantages_BR=advantages[d],
                            scored_BRT=None if scored is None else scored[d]))
  return TreeBatch(root_BP=prompt_BP, root_valid_BP=prompt_valid_BP, levels=tuple(levels),
                   fanouts=tuple(fanouts))
