"""Shared-prefix sampling over trees; a flat group is a depth-1 tree, a shared trunk a
fan-out-1 level before it.

Prefill the prompt once; decode R_1 children of it, then R_2 children of every child, and so
on. Every decode step is the model applied to one token per child with a list of context
segments [(prompt K/V, prompt_valid_BP), (each ancestor's K/V, its valid mask), (this child's
K/V, written so far)], vmapped over the children with the ancestors' segments closed over
(unbatched under the vmaps deeper than their level), so an ancestor's K/V is read by every
descendant and copied by none. A node ends at its level's stop tokens (the stop token is kept,
as valid); its children continue from the logits after its last valid token.

Log-probs returned are those of the distribution the tokens were drawn from,
softmax(logits / temperature) (temperature 1 when greedy), i.e. what the training forward
computes with `loss.temperature` equal to the sampler's (the trainer sets it): the ratio's
denominator. Top-k / top-p filtered distributions are not trained against: the trainer
refuses them for RL (`config.Config`).
No `@jax.jit` here; callers jit `sample` / `sample_tree` with the configs static.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import engine, tree
from branch_replay.core.tree import TreeBatch, TreeLevel
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
  """A flat group: R branches of every prompt after an optional trunk decoded once (`sample`).
  Shares its two methods with TreeSamples, so the rollout code never asks which it holds."""

  tokens_BRT: jax.Array  # int32, right-padded with 0 after a stop token
  valid_BRT: jax.Array  # bool: generated and not after a stop token (the stop token is valid)
  logp_BRT: jax.Array  # float32 policy log-probs of the tokens (0 where invalid)
  trunk_BW: jax.Array  # int32 shared trunk tokens ([B, 0] without a trunk)
  trunk_logp_BW: jax.Array  # float32

  def path_valid(self) -> list:
    """The valid masks below the prompt, one per level ([B, nodes, T_d], host numpy): the
    trunk as a level of one node (all valid: stop tokens do not end it), then the branches."""
    trunk_BW = np.asarray(self.trunk_BW)
    trunk = np.ones((trunk_BW.shape[0], 1, trunk_BW.shape[1]), bool)
    return [trunk, np.asarray(self.valid_BRT)]

  def batch(self, prompt_BP, prompt_valid_BP, advantages) -> TreeBatch:
    """The training batch (`to_batch`); advantages: one array per level, a flat group's one
    ([B, R])."""
    (advantages_BR,) = advantages
    return to_batch(prompt_BP, prompt_valid_BP, self, advantages_BR)


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
  """Decode `n_steps` tokens for R children (keys_R's leading axis) of one parent of every
  prompt.

  shared: the ancestors' segments [(kv per layer, valid_BS)], read by every child (never
  copied per child). Returns tokens_RBT, valid_RBT, logp_RBT, own kv per layer ([R, B, T, K,
  H]; a linear-attention layer's: its recurrent state) and logits_RBV, those after each
  child's last *valid* token (what its own children start from)."""
  B = logits_BV.shape[0]
  model = tfm.Transformer(model_cfg)
  K, H, dt = model_cfg.n_kv_heads, model_cfg.head_dim, model_cfg.compute_dtype

  def child_step(carry, key, t):
    logits_BV, kv, gen_valid_BT, done_B = carry
    # 1. Sample this child's token t from the logits its previous token produced.
    token_B, logp_B = choose(jax.random.fold_in(key, t), logits_BV, cfg)
    valid_B = ~done_B
    token_B = jnp.where(valid_B, token_B, 0)
    done_B = done_B | jnp.isin(token_B, stop_ids)
    # 2. One token forward against [ancestors' segments..., own generated K/V so far].
    h_B1D, own = model.apply(
      {"params": params},
      token_B[:, None],
      (offset_B + t)[:, None],
      valid_B[:, None],
      context=[*shared, (kv, gen_valid_BT)],
    )
    kv = tuple(
      o
      if not isinstance(o, tfm.KV)
      # hybrid: a linear layer's new state
      else tfm.KV(
        jax.lax.dynamic_update_slice(c.k_BSKH, o.k_BSKH, (0, t, 0, 0)),
        jax.lax.dynamic_update_slice(c.v_BSKH, o.v_BSKH, (0, t, 0, 0)),
      )
      for c, o in zip(kv, own)
    )
    gen_valid_BT = jax.lax.dynamic_update_slice(gen_valid_BT, valid_B[:, None], (0, t))
    new_BV = model.apply({"params": params}, h_B1D, method=tfm.Transformer.logits)[:, 0]
    logits_BV = jnp.where(valid_B[:, None], new_BV, logits_BV)  # keep the last valid one's
    return (logits_BV, kv, gen_valid_BT, done_B), (
      token_B,
      valid_B,
      jnp.where(valid_B, logp_B, 0.0),
    )

  def step(carry, t):
    return jax.vmap(child_step, in_axes=(0, 0, None))(carry, keys_R, t)

  R, T = keys_R.shape[0], n_steps
  empty = jnp.zeros((R, B, T, K, H), dt)
  kv0 = tuple(
    tfm.KV(empty, empty)
    if model_cfg.layer_type(i) != "linear_attention"
    # hybrid: a linear layer carries the state after the parent's context
    else jax.tree.map(lambda x: jnp.broadcast_to(x, (R, *x.shape)), shared[-1][0][i])
    for i in range(model_cfg.n_layers)
  )
  carry0 = (
    jnp.broadcast_to(logits_BV, (R, *logits_BV.shape)),
    kv0,
    jnp.zeros((R, B, T), bool),
    jnp.zeros((R, B), bool),
  )
  (logits_RBV, kv, _, _), outs = jax.lax.scan(step, carry0, jnp.arange(T))
  tokens_RBT, valid_RBT, logp_RBT = (jnp.moveaxis(x, 0, -1) for x in outs)
  return tokens_RBT, valid_RBT, logp_RBT, kv, logits_RBV


def _flat(x, d):
  """[R_1, ..., R_d, B, ...] (vmapped node axes first) -> [B, R_1*...*R_d, ...]."""
  x = jnp.moveaxis(x, d, 0)
  return x.reshape(x.shape[0], -1, *x.shape[d + 1 :])


class TreeSamples(NamedTuple):
  """A tree of turns: R_d children of every node of level d-1 (`sample_tree`)."""

  tokens: tuple  # per level 1..depth: int32 [B, R_1*...*R_d, T_d], 0 after a stop token
  valid: tuple  # bool: generated up to and including the stop token
  logp: tuple  # float32 log-probs at the sampler's temperature (0 where invalid)

  @property
  def fanouts(self) -> tuple[int, ...]:
    """R_1, ..., R_depth, read from the levels' node counts (static shapes)."""
    nodes = [1] + [t.shape[1] for t in self.tokens]
    return tuple(child // parent for parent, child in zip(nodes, nodes[1:]))

  def path_valid(self) -> list:
    """The valid masks below the prompt, one per level ([B, nodes, T_d], host numpy)."""
    return [np.asarray(v) for v in self.valid]

  def batch(self, prompt_BP, prompt_valid_BP, advantages) -> TreeBatch:
    """The training batch (`to_tree_batch`); advantages: one array per level (None for an
    inner level that takes its leaves')."""
    return to_tree_batch(prompt_BP, prompt_valid_BP, self, self.fanouts, advantages)


def _prefill(model, params, prompt_BP, prompt_valid_BP, header_H=None):
  """The prompt's K/V segments, the logits after its last token and its length. With a
  header (ids every prompt starts with, unpadded [H]), its K/V is computed once ([1, H])
  and read by every prompt's rest (prompt_BP is then the part after the header), so B
  prompts sharing a k-shot header prefill H + B*P tokens instead of B*(H + P)."""
  n_B = jnp.sum(prompt_valid_BP.astype(jnp.int32), axis=1)
  if header_H is None:
    h_BPD, prompt_kv = model.apply(
      {"params": params}, prompt_BP, tfm.positions_from_valid(prompt_valid_BP), prompt_valid_BP
    )
    segments = [(prompt_kv, prompt_valid_BP)]
  else:
    B, H = prompt_BP.shape[0], header_H.shape[0]
    valid_1H = jnp.ones((1, H), bool)
    _, header_kv = model.apply({"params": params}, header_H[None], jnp.arange(H)[None], valid_1H)
    header = (
      jax.tree.map(lambda x: jnp.broadcast_to(x, (B, *x.shape[1:])), header_kv),
      jnp.ones((B, H), bool),
    )
    h_BPD, prompt_kv = model.apply(
      {"params": params},
      prompt_BP,
      tfm.positions_from_valid(prompt_valid_BP, H),
      prompt_valid_BP,
      context=[header],
    )
    segments, n_B = [header, (prompt_kv, prompt_valid_BP)], n_B + H
  logits_BV = model.apply({"params": params}, h_BPD[:, -1:], method=tfm.Transformer.logits)[:, 0]
  return segments, logits_BV, n_B


def _levels(
  params,
  model_cfg,
  cfg,
  prompt_BP,
  prompt_valid_BP,
  child_keys,
  lengths,
  stop_tokens,
  header_H=None,
) -> TreeSamples:
  """The one decoder: child_keys[d-1] holds one key per node of level d, shaped [R_1, ...,
  R_d] (its parent's axes first); level d decodes lengths[d-1] tokens ending at
  stop_tokens[d-1]. header_H: a shared header before every prompt (`_prefill`)."""
  model = tfm.Transformer(model_cfg)
  # 1. Prefill the prompt once.
  segments, logits_BV, offset_B = _prefill(model, params, prompt_BP, prompt_valid_BP, header_H)
  out = ([], [], [])
  roots = len(segments) - 1  # the prompt's segments beyond one (a shared header's)
  for d, (keys, T, stops) in enumerate(zip(child_keys, lengths, stop_tokens), start=1):
    stop_ids = jnp.asarray(tuple(stops) or (-1,), jnp.int32)

    def one_parent(segments, offset_B, logits_BV, keys_R, T=T, stop_ids=stop_ids):
      return _decode(
        params, model_cfg, cfg, list(segments), offset_B, logits_BV, keys_R, T, stop_ids
      )

    # 2. Decode level d: the children of every parent, vmapped over the parents' fan-outs
    #    with each ancestor segment unbatched under the vmaps deeper than its level.
    fn = one_parent
    for j in reversed(range(1, d)):
      seg_axes = tuple(None if i < j + roots else 0 for i in range(d + roots))
      fn = jax.vmap(fn, in_axes=(seg_axes, 0, 0, 0))
    tokens, valid, logp, kv, logits_BV = fn(tuple(segments), offset_B, logits_BV, keys)
    # The children axis (R_d) comes out after the parents': [R_1..R_d, B, ...].
    for acc, x in zip(out, (tokens, valid, logp)):
      acc.append(_flat(x, d))
    segments.append((kv, valid))
    offset_B = jnp.expand_dims(offset_B, d - 1) + jnp.sum(valid.astype(jnp.int32), axis=-1)
  return TreeSamples(*(tuple(x) for x in out))


def sample_tree(
  params,
  model_cfg: tfm.ModelConfig,
  cfg: SamplerConfig,
  prompt_BP,
  prompt_valid_BP,
  key,
  fanouts: Sequence[int],
  lengths: Sequence[int],
  stop_tokens: Sequence[Sequence[int]] = (),
  header_H=None,
) -> TreeSamples:
  """A tree of continuations of every (left-padded) prompt: R_d children of every node of
  level d-1, each up to lengths[d-1] tokens, ending at stop_tokens[d-1] (default none).
  header_H: ids that precede every prompt, prefilled once for all (as `sample`'s)."""
  if len(lengths) != len(fanouts):
    raise ValueError(f"lengths={tuple(lengths)}: expected one per fan-out {tuple(fanouts)}")
  _check_header(header_H, model_cfg, 0)
  child_keys = []
  for d, R in enumerate(fanouts, start=1):
    parents = jax.random.split(jax.random.fold_in(key, d), math.prod(fanouts[: d - 1]))
    children = jax.vmap(lambda k, R=R: jax.random.split(k, R))(parents)
    child_keys.append(children.reshape(*fanouts[:d], *children.shape[2:]))
  stops = [tuple(stop_tokens[d]) if len(stop_tokens) > d else () for d in range(len(fanouts))]
  return _levels(
    params, model_cfg, cfg, prompt_BP, prompt_valid_BP, child_keys, lengths, stops, header_H
  )


def _check_header(header_H, model_cfg: tfm.ModelConfig, trunk_len: int) -> None:
  """A shared header is read as attention context: no trunk, attention layers only."""
  if header_H is not None and (
    trunk_len
    or any(model_cfg.layer_type(i) == "linear_attention" for i in range(model_cfg.n_layers))
  ):
    raise ValueError(
      f"sampler header_H: shape {tuple(header_H.shape)}: a shared header needs "
      f"sampler.trunk_len=0 (got {trunk_len}) and attention layers only"
    )


def sample(
  params,
  model_cfg: tfm.ModelConfig,
  cfg: SamplerConfig,
  prompt_BP,
  prompt_valid_BP,
  key,
  n_branches: int,
  stop_tokens: Sequence[int] = (),
  header_H=None,
) -> Samples:
  """R = n_branches continuations of every (left-padded) prompt, prefix K/V computed once:
  the tree of fan-outs (R,), or (1, R) with a trunk of sampler.trunk_len tokens decoded once
  per prompt (stop tokens do not end a trunk). header_H: ids that precede every prompt
  (unpadded; prompt_BP is then each prompt's rest), prefilled once for all of them
  (`shared_header` splits prompts; attention only, no trunk)."""
  B, W = prompt_BP.shape[0], cfg.trunk_len
  _check_header(header_H, model_cfg, W)
  trunk_key, branch_key = jax.random.split(key)
  keys_R = jax.random.split(branch_key, n_branches)
  if not W:
    s = _levels(
      params,
      model_cfg,
      cfg,
      prompt_BP,
      prompt_valid_BP,
      [keys_R],
      [cfg.max_new_tokens],
      [stop_tokens],
      header_H,
    )
    return Samples(
      s.tokens[0],
      s.valid[0],
      s.logp[0],
      jnp.zeros((B, 0), jnp.int32),
      jnp.zeros((B, 0), jnp.float32),
    )
  s = _levels(
    params,
    model_cfg,
    cfg,
    prompt_BP,
    prompt_valid_BP,
    [trunk_key[None], keys_R[None]],
    [W, cfg.max_new_tokens],
    [(), stop_tokens],
  )
  return Samples(s.tokens[1], s.valid[1], s.logp[1], s.tokens[0][:, 0], s.logp[0][:, 0])


def shared_header(ids_list, keep: int = 1):
  """The longest prefix of token ids every prompt starts with, each prompt keeping at least
  `keep` ids of its own: (header ids [H], rests). H = 0 when they share nothing."""
  n = min(len(ids) for ids in ids_list) - keep
  H = 0
  while H < n and all(ids[H] == ids_list[0][H] for ids in ids_list):
    H += 1
  return np.asarray(ids_list[0][:H], np.int32), [list(ids[H:]) for ids in ids_list]


def score(params, model_cfg: tfm.ModelConfig, batch: TreeBatch, temperature: float = 1.0):
  """Policy log-probs of every tail (and trunk) token from ONE shared-prefix forward (the
  engine's): (logp_BRT, trunk_logp_BW), of softmax(logits / temperature). Used for the
  frozen reference policy's log-probs (RL, DPO)."""
  (logp_BRT,), trunk_logp_BW = engine.forward(params, batch, model_cfg, temperature)
  return logp_BRT, trunk_logp_BW


def completions(samples: Samples, tok) -> list[list[str]]:
  """Decoded trunk + branch text (up to EOS) for every prompt and branch."""
  trunk_BW = np.asarray(samples.trunk_BW)
  tokens_BRT = np.asarray(samples.tokens_BRT)
  return [
    [tok.decode(np.concatenate([trunk_BW[b], row]), strict=False) for row in tokens_BRT[b]]
    for b in range(tokens_BRT.shape[0])
  ]


def to_batch(prompt_BP, prompt_valid_BP, samples: Samples, advantages_BR) -> TreeBatch:
  """The flat training batch (depth 1): prefix = prompt + trunk, tails = branches, old
  log-probs = sampling's."""
  B, W = samples.trunk_BW.shape
  prefix_BP = jnp.concatenate([prompt_BP, samples.trunk_BW], axis=1)
  prefix_valid_BP = jnp.concatenate([prompt_valid_BP, jnp.ones((B, W), bool)], axis=1)
  return tree.flat(
    prefix_BP,
    prefix_valid_BP,
    samples.tokens_BRT,
    samples.valid_BRT,
    advantages_BR,
    old_logp_BRT=samples.logp_BRT,
    trunk_old_logp_BW=samples.trunk_logp_BW if W else None,
    trunk_len=W,
  )


def to_tree_batch(
  prompt_BP, prompt_valid_BP, samples: TreeSamples, fanouts, advantages, scored=None
) -> TreeBatch:
  """The training batch: root = prompt, levels = the sampled nodes with the sampler's
  log-probs as old log-probs. advantages: one array per level ([B, nodes]; None for an
  inner level = its leaves' advantages); scored: optional per-level masks."""
  levels = []
  for d, (tokens, valid, logp) in enumerate(zip(*samples)):
    levels.append(
      TreeLevel(
        tokens_BRT=tokens,
        valid_BRT=valid,
        old_logp_BRT=logp,
        advantages_BR=advantages[d],
        scored_BRT=None if scored is None else scored[d],
      )
    )
  return TreeBatch(
    root_BP=prompt_BP, root_valid_BP=prompt_valid_BP, levels=tuple(levels), fanouts=tuple(fanouts)
  )
