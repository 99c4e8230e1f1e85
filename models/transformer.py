"""Decoder-only transformer in Flax (Llama, Qwen2, Qwen3, Mistral, Gemma 2/3 via per-family
options in ModelConfig, models/config.py; one code path), exposed as pure functions for branch
replay.

Shape glossary (used in every variable suffix, einsum string and einops pattern):
  B prompts (or rows: a prompt's R branches are rows (b, r), row-major) · R branches ·
  P prefix length · T tail/query length · S key length · W trunk length (scored tokens at the
  end of the prefix) · D d_model · N query heads · K kv heads · G query heads per kv head
  (N = K*G) · H head dim · F mlp hidden · V vocab · L layers

The model knows nothing of RL. It exposes:
  prefill(params, cfg, tokens_BP, valid_BP) -> PrefixCache   (K/V per layer + hidden states)
  tail(params, cfg, cache, prefix_valid_BP, tokens_BT, valid_BT) -> h_BTD  (positions after the
      prefix; tokens may hold g rows per prefix row: a prompt's branches, all in one call)
  forward(params, cfg, tokens_BS, valid_BS) -> h_BSD           (the naive full sequence)
  token_logps(params, cfg, h_BTD, targets_BT) -> (logp_BT, entropy_BT)  (chunked over T)
Attention (models/attention/__init__.py) takes a list of K/V *segments* with one joint softmax, so a
tail (or a decode step) attends to the shared prefix cache without copying it per branch.
The causal mask is built explicitly by index (never `is_causal`, which anchors top-left).
Sliding-window layers mask keys by RoPE position (query position - key position < window)
in every path alike, and the prefix cache of such a layer keeps only its last `window` keys.
Layers run under `lax.scan` over periods of identical layers (`scan_layers`), each under the
configured remat policy; the parameter tree stays per layer (`layer_i`), as Hugging Face's.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import attention
from models.attention import context_parallel
from models import deltanet  # hybrid: Gated DeltaNet layers (layer_types)
from models.layers import RMSNorm, dense, rope, rope_inv_freq  # noqa: F401

# The model's config, re-exported (callers write `tfm.ModelConfig`, `tfm.preset`).
from models.config import (  # noqa: F401
  ACTIVATIONS,  # noqa: F401
  DTYPES,  # noqa: F401
  PRESETS,  # noqa: F401
  REMAT_POLICIES,  # noqa: F401
  ROPE_SCALING_TYPES,  # noqa: F401
  ModelConfig,  # noqa: F401
  RopeScaling,  # noqa: F401
  preset,  # noqa: F401
)

Array = jax.Array


# ----------------------------------------------------------------------------- pieces


class KV(NamedTuple):
  """One layer's keys and values (RoPE already applied to k)."""

  k_BSKH: Array
  v_BSKH: Array


class PrefixCache(NamedTuple):
  """What the tails need from the prefix: every layer's K/V and the prefix hidden states.

  h_last_BD is the final-normed hidden state of the last prefix position (it predicts the
  first tail token); trunk_h_BWD those that predict the W trunk tokens (W may be 0).
  Only float arrays: it is the output of `jax.vjp`, and its cotangent is summed over branches.
  The prefix validity mask travels beside it (`valid_BP` arguments).
  """

  kv: tuple[KV, ...]
  h_last_BD: Array
  trunk_h_BWD: Array


def keep_window(kv: KV, window: Optional[int]) -> KV:
  """A sliding-window layer's prefix cache: only the last `window` (left-padded) positions.
  A later query reaches at most the last window-1 of them; one more keeps the length the
  configured window. The dropped keys get a zero cotangent through the slice."""
  if not isinstance(kv, KV):  # hybrid: a linear layer's state is constant in P
    return kv
  S = kv.k_BSKH.shape[1]
  if window is None or window >= S:
    return kv
  return KV(kv.k_BSKH[:, S - window :], kv.v_BSKH[:, S - window :])


# ----------------------------------------------------------------------------- modules


class Block(nn.Module):
  """Pre-norm decoder layer: GQA attention with RoPE, then a gated MLP (SwiGLU or GeGLU).

  Per-family options (ModelConfig): q/k/v biases, q/k RMSNorm, a sliding window, attention
  soft-capping, post-norms on both sublayer outputs (Gemma).
  """

  cfg: ModelConfig
  index: int = 0  # the layer number: picks its window and RoPE

  def setup(self):
    cfg = self.cfg
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden
    pd = cfg.weight_dtype

    def param(name, shape, axes, fan_in):
      init = nn.with_logical_partitioning(nn.initializers.normal(fan_in**-0.5), axes)
      return self.param(name, init, shape, pd)

    def norm(axes=("embed",)):
      return RMSNorm(cfg.norm_eps, pd, cfg.norm_offset, axes)

    self.w_DNH = param("q", (D, N, H), ("embed", "heads", "head_dim"), D)
    self.w_k_DKH = param("k", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.w_v_DKH = param("v", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.w_o_NHD = param("o", (N, H, D), ("heads", "head_dim", "embed"), N * H)
    self.w_gate_DF = param("gate", (D, F), ("embed", "mlp"), D)
    self.w_up_DF = param("up", (D, F), ("embed", "mlp"), D)
    self.w_down_FD = param("down", (F, D), ("mlp", "embed"), F)
    self.attn_norm = norm()
    self.mlp_norm = norm()
    if cfg.qkv_bias:
      zeros = lambda axes: nn.with_logical_partitioning(nn.initializers.zeros, axes)
      self.b_q_NH = self.param("q_bias", zeros(("heads", "head_dim")), (N, H), pd)
      self.b_k_KH = self.param("k_bias", zeros(("kv_heads", "head_dim")), (K, H), pd)
      self.b_v_KH = self.param("v_bias", zeros(("kv_heads", "head_dim")), (K, H), pd)
    if cfg.qk_norm:
      self.q_norm = norm(("head_dim",))
      self.k_norm = norm(("head_dim",))
    if cfg.post_norms:
      self.post_attn_norm = norm()
      self.post_mlp_norm = norm()
    if cfg.attn_output_gate:  # hybrid (Qwen3.5): the attention output's sigmoid gate
      self.w_gate_DNH = param("q_gate", (D, N, H), ("embed", "heads", "head_dim"), D)

  def __call__(self, x_BTD, positions_BT, valid_BT, context: Sequence[attention.KeySegment]):
    """Returns (x_BTD, own KV). `context` are the key segments before this block of queries
    (a shared prefix cache, a branch's generated tokens, ...)."""
    cfg = self.cfg
    dt = x_BTD.dtype
    h_BTD = self.attn_norm(x_BTD)
    proj = _projection(cfg)
    q_BTNH = proj("BTD,DNH->BTNH", h_BTD, self.w_DNH.astype(dt))
    k_BTKH = proj("BTD,DKH->BTKH", h_BTD, self.w_k_DKH.astype(dt))
    v_BTKH = proj("BTD,DKH->BTKH", h_BTD, self.w_v_DKH.astype(dt))
    if cfg.qkv_bias:
      q_BTNH = q_BTNH + self.b_q_NH.astype(dt)
      k_BTKH = k_BTKH + self.b_k_KH.astype(dt)
      v_BTKH = v_BTKH + self.b_v_KH.astype(dt)
    if cfg.qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    theta, scaling = cfg.layer_rope(self.index)
    if cfg.rotary_fraction == 1.0:
      q_BTNH = rope(q_BTNH, positions_BT, theta, scaling)
      k_BTKH = rope(k_BTKH, positions_BT, theta, scaling)
    else:  # hybrid (Qwen3.5): partial RoPE on each head's first dims
      q_BTNH, k_BTKH = (
        _partial_rope(t, positions_BT, theta, scaling, cfg.rotary_fraction)
        for t in (q_BTNH, k_BTKH)
      )
    own = KV(k_BTKH, v_BTKH)
    # Context parallelism (sharding.py): q, K, V are computed on this device's sequence
    # shard, then each layer all-gathers its K/V. Logical names only; no-ops unless
    # flax logical_axis_rules are set (the sharded prefix).
    q_BTNH = nn.with_logical_constraint(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    own = KV(
      *(
        nn.with_logical_constraint(t_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
        for t_BTKH in own
      )
    )
    segments = [*context, attention.KeySegment(*own, positions_BT, valid_BT, causal=True)]
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar**-0.5
    # The prefix on a mesh: context-parallel (shard_map, K/V all-gathered); else attend.
    a_BTNH = context_parallel.attend(
      q_BTNH,
      positions_BT,
      valid_BT,
      segments,
      scale=scale,
      scheme=cfg.context_parallel,
      softcap=cfg.attn_logit_softcap,
      window=cfg.layer_window(self.index),
      impl=cfg.attention,
      block_q=cfg.attention_block_q,
      block_k=cfg.attention_block_k,
    )
    if cfg.attn_output_gate:  # hybrid (Qwen3.5)
      a_BTNH = a_BTNH * jax.nn.sigmoid(proj("BTD,DNH->BTNH", h_BTD, self.w_gate_DNH.astype(dt)))
    a_BTD = proj("BTNH,NHD->BTD", a_BTNH, self.w_o_NHD.astype(dt))
    x_BTD = x_BTD + (self.post_attn_norm(a_BTD) if cfg.post_norms else a_BTD)
    m_BTD = mlp(cfg, (self.w_gate_DF, self.w_up_DF, self.w_down_FD), self.mlp_norm(x_BTD))
    x_BTD = x_BTD + (self.post_mlp_norm(m_BTD) if cfg.post_norms else m_BTD)
    return nn.with_logical_constraint(x_BTD, ("batch", "seq", None)), own


def _projection(cfg: ModelConfig):
  """proj(spec, x, w): a weight projection written as its einsum; with model.flat_matmuls
  (the default) one 2-D matmul over the flattened tokens (layers.dense: the spec's inputs are
  x's trailing axes that w leads with), on one device: under a mesh's logical rules the
  einsum keeps [B, T] apart (merging a replicated B with a sequence-sharded T is no tiling the
  partitioner can keep: it would all-gather the activations)."""
  if not cfg.flat_matmuls or nn.get_logical_axis_rules():
    return jnp.einsum

  def proj(spec, x, w):
    x_axes, w_axes = spec.split("->")[0].split(",")
    return dense(x, w, n_in=len(set(x_axes) & set(w_axes)))

  return proj


def mlp(cfg: ModelConfig, weights, h_BTD):
  """The gated MLP on h (weights: gate [D, F], up [D, F], down [F, D], any param dtype).

  With `model.mlp_chunk` = C < T, the T positions run in chunks of C under `lax.scan`, each
  chunk rematerialised in the backward: one chunk's [B, C, F] hidden states are alive instead
  of [B, T, F] (per position the same arithmetic). The weights enter the scan in at least
  float32, so their cotangents accumulate over the chunks in float32 (and reach a bf16
  weight rounded once, as the unchunked matmul's do)."""
  dt = h_BTD.dtype
  act = ACTIVATIONS[cfg.activation]
  proj = _projection(cfg)

  def block(w_gate_DF, w_up_DF, w_down_FD, h_BCD):
    gate_BCF = proj("BTD,DF->BTF", h_BCD, w_gate_DF.astype(dt))
    up_BCF = proj("BTD,DF->BTF", h_BCD, w_up_DF.astype(dt))
    return proj("BTF,FD->BTD", act(gate_BCF) * up_BCF, w_down_FD.astype(dt))

  B, T, D = h_BTD.shape
  C = cfg.mlp_chunk
  if C is None or T <= C:
    return block(*weights, h_BTD)
  acc = jnp.promote_types(weights[0].dtype, jnp.float32)
  weights = tuple(w.astype(acc) for w in weights)
  n = -(-T // C)
  h_nBCD = jnp.pad(h_BTD, ((0, 0), (0, n * C - T), (0, 0))).reshape(B, n, C, D).swapaxes(0, 1)
  chunk_fn = jax.checkpoint(lambda h_BCD: block(*weights, h_BCD))
  _, m_nBCD = jax.lax.scan(lambda c, h_BCD: (c, chunk_fn(h_BCD)), None, h_nBCD)
  return m_nBCD.swapaxes(0, 1).reshape(B, n * C, D)[:, :T]


class Transformer(nn.Module):
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(
      cfg.vocab_size,
      cfg.d_model,
      param_dtype=cfg.weight_dtype,
      embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed")),
    )
    self.blocks = [_block_class(cfg, i)(cfg, i, name=f"layer_{i}") for i in range(cfg.n_layers)]
    self.final_norm = RMSNorm(cfg.norm_eps, cfg.weight_dtype, cfg.norm_offset)
    if not cfg.tie_embeddings:
      self.lm_head = self.param(
        "lm_head",
        nn.with_logical_partitioning(nn.initializers.normal(cfg.d_model**-0.5), ("embed", "vocab")),
        (cfg.d_model, cfg.vocab_size),
        cfg.weight_dtype,
      )

  def __call__(self, tokens_BT, positions_BT, valid_BT, context=()):
    """Final-normed hidden states and each layer's own K/V.

    context: segments that all precede these tokens, each a pair (per-layer tuple of KV,
    valid_BS): e.g. a shared prefix cache, then a branch's generated tokens when decoding.
    A segment may hold fewer rows than the tokens (rows divide): token rows [i*g, (i+1)*g)
    read its row i (a prompt's g branches read the prompt's one cache). Keys are attended
    where valid; the queries' own keys causally. A context key's position is the count of
    valid context keys before it (the RoPE convention), which is what a sliding-window
    layer masks by. A layer whose K/V is shorter than valid_BS (a sliding layer's prefix
    cache, see `keep_window`) holds the last positions of that segment.
    """
    cfg = self.cfg
    x_BTD = self.embed(tokens_BT)
    if cfg.scale_embeddings:  # in the weight dtype, as Hugging Face (bf16 rounds sqrt(D))
      x_BTD = x_BTD * jnp.asarray(cfg.d_model**0.5, x_BTD.dtype)
    x_BTD = x_BTD.astype(cfg.compute_dtype)
    if self.is_initializing():  # creates the per-layer parameters
      own_kv = []
      for i, block in enumerate(self.blocks):
        x_BTD, kv = block(x_BTD, positions_BT, valid_BT, _layer_context(cfg, i, context))
        own_kv.append(kv)
      own_kv = tuple(own_kv)
    else:
      x_BTD, own_kv = run_layers(
        self.variables["params"], cfg, x_BTD, positions_BT, valid_BT, context
      )
    return self.final_norm(x_BTD), own_kv

  def logits(self, h_BTD):
    w_DV = self.embed.embedding.T if self.cfg.tie_embeddings else self.lm_head
    acc = jnp.float64 if h_BTD.dtype == jnp.float64 else jnp.float32
    logits_BTV = jnp.einsum(
      "BTD,DV->BTV", h_BTD, w_DV.astype(h_BTD.dtype), preferred_element_type=acc
    )
    cap = self.cfg.final_logit_softcap
    return logits_BTV if cap is None else jnp.tanh(logits_BTV / cap) * cap


# ----------------------------------------------------------------------------- layers


def _rows(x_B, rows: int):
  """x repeated along axis 0 to `rows` rows (each row g = rows / len(x) times, in order)."""
  return x_B if x_B.shape[0] == rows else jnp.repeat(x_B, rows // x_B.shape[0], axis=0)


def context_keys(context):
  """[(kv per layer, valid_BS, positions_BS)]: each context segment's key positions count the
  valid keys of the segments before it (rows of later segments may be finer)."""
  keys, offset_B1 = [], jnp.zeros((1, 1), jnp.int32)
  for kv_L, valid_BS in context:
    offset_B1 = _rows(offset_B1, valid_BS.shape[0]) if offset_B1.shape[0] > 1 else offset_B1
    keys.append((kv_L, valid_BS, positions_from_valid(valid_BS, offset_B1)))
    offset_B1 = offset_B1 + jnp.sum(valid_BS.astype(jnp.int32), axis=1, keepdims=True)
  return keys


def _layer_segments(cfg: ModelConfig, i: int, context, kv_of=None):
  """Layer i's context key segments; `kv_of(segment index)` overrides the K/V (scan)."""
  out = []
  for c, (kv_L, valid_BS, positions_BS) in enumerate(context_keys(context)):
    kv = kv_L[i] if kv_of is None else kv_of(c)
    start = valid_BS.shape[1] - kv.k_BSKH.shape[1]
    out.append(
      attention.KeySegment(kv.k_BSKH, kv.v_BSKH, positions_BS[:, start:], valid_BS[:, start:])
    )
  return out


# --- hybrid: per-layer kinds (a linear layer's context is the last segment's LinearState) ---


def _block_class(cfg: ModelConfig, i: int):
  return deltanet.GatedDeltaNetBlock if cfg.layer_type(i) == "linear_attention" else Block


def _layer_context(cfg: ModelConfig, i: int, context, kv_of=None):
  """Layer i's context: key segments (attention), or the state after the last context
  segment (a linear layer: every segment's state was computed from those before it)."""
  if cfg.layer_type(i) != "linear_attention":
    return _layer_segments(cfg, i, context, kv_of)
  if not context:
    return None
  return context[-1][0][i] if kv_of is None else kv_of(len(context) - 1)


def _partial_rope(x_BTNH, positions_BT, theta, scaling, fraction: float):
  rd = int(x_BTNH.shape[-1] * fraction)
  return jnp.concatenate(
    [rope(x_BTNH[..., :rd], positions_BT, theta, scaling), x_BTNH[..., rd:]], axis=-1
  )


# --- end hybrid ---


def _remat(fn, cfg: ModelConfig):
  if cfg.remat == "none":
    return fn
  if cfg.remat == "full":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)
  if cfg.remat == "dots":
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  if jax.default_backend() == "cpu":
    raise ValueError(
      "model.remat='offload': host offload of saved residuals needs a GPU or "
      f"TPU backend (this one is cpu); expected one of {REMAT_POLICIES[:3]}"
    )
  return jax.checkpoint(
    fn, policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host")
  )


ADAPTERS = "lora"  # a layer's LoRA adapters beside its weights (models/lora.py: attach)


def merge_adapters(layer_params, compute_dtype):
  """A layer's weights with its attached adapters merged: W + scale * A @ B in W's layout, the
  sum in the adapters' precision, stored in the wider of W's dtype and the compute dtype (a
  bf16 base with float32 adapters: one rounding to bf16 under bf16 compute, none under
  float32, whose weight cotangents then stay float32); the same arithmetic as lora.merge
  with its `dtype` (lora.add_delta); unchanged without adapters."""
  if ADAPTERS not in layer_params:
    return layer_params
  out = {k: v for k, v in layer_params.items() if k != ADAPTERS}
  for t, ab in layer_params[ADAPTERS].items():
    w = out[t]
    d = (ab["scale"] * (ab["a"] @ ab["b"])).reshape(w.shape)
    out[t] = (w + d).astype(jnp.promote_types(w.dtype, compute_dtype))
  return out


def run_layers(params, cfg: ModelConfig, x_BTD, positions_BT, valid_BT, context=()):
  """Every decoder layer on x: (x_BTD, own K/V per layer).

  With `cfg.layers_scanned` (scan_layers, auto: when remat is on), layers run under `lax.scan`
  over L // p repetitions of a p-layer group (p = cfg.layer_period(): layers of one period
  position share window and RoPE), their
  parameters and context K/V stacked on the fly; leftover layers run unrolled. Each layer
  runs under the remat policy.
  """
  L = cfg.n_layers

  def layer_fn(index):
    if cfg.layer_type(index) == "linear_attention":  # hybrid: context is a LinearState
      return _remat(
        lambda layer_params, x_BTD, state: deltanet.GatedDeltaNetBlock(
          cfg, index, parent=None
        ).apply(
          {"params": merge_adapters(layer_params, cfg.compute_dtype)},
          x_BTD,
          positions_BT,
          valid_BT,
          state,
        ),
        cfg,
      )

    def fn(layer_params, x_BTD, key_arrays):  # only arrays cross jax.checkpoint
      segments = [attention.KeySegment(*arrays) for arrays in key_arrays]
      return Block(cfg, index, parent=None).apply(
        {"params": merge_adapters(layer_params, cfg.compute_dtype)},
        x_BTD,
        positions_BT,
        valid_BT,
        segments,
      )

    remat_fn = _remat(fn, cfg)
    return lambda layer_params, x_BTD, segments: remat_fn(
      layer_params, x_BTD, [tuple(seg[:4]) for seg in segments]
    )

  p = cfg.layer_period()
  reps = L // p if cfg.layers_scanned else 0
  own_kv: list[Any] = [None] * L
  if reps > 1:
    stack = lambda *xs: jnp.stack(xs)
    xs = [
      (
        jax.tree.map(stack, *[params[f"layer_{j * p + r}"] for j in range(reps)]),
        [jax.tree.map(stack, *[kv_L[j * p + r] for j in range(reps)]) for kv_L, _ in context],
      )
      for r in range(p)
    ]
    fns = [layer_fn(r) for r in range(p)]

    def body(x_BTD, xs_group):
      kvs = []
      for r, (layer_params, ctx_kv) in enumerate(xs_group):
        segments = _layer_context(cfg, r, context, kv_of=lambda c: ctx_kv[c])
        x_BTD, kv = fns[r](layer_params, x_BTD, segments)
        kvs.append(kv)
      return x_BTD, kvs

    x_BTD, kvs = jax.lax.scan(body, x_BTD, xs)
    for j in range(reps):
      for r in range(p):
        own_kv[j * p + r] = jax.tree.map(lambda y: y[j], kvs[r])
  else:
    reps = 0
  for i in range(reps * p, L):
    x_BTD, own_kv[i] = layer_fn(i)(params[f"layer_{i}"], x_BTD, _layer_context(cfg, i, context))
  return x_BTD, tuple(own_kv)


# ----------------------------------------------------------------------------- pure functions


def init_params(cfg: ModelConfig, key: Array):
  """Parameters as plain arrays (logical axis names stripped; see `param_axes`)."""
  return nn.unbox(_init_boxed(cfg, key))


def _init_boxed(cfg, key):
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Transformer(cfg).init(key, tokens, tokens, tokens.astype(bool))["params"]


def param_axes(cfg: ModelConfig):
  """Logical axis names of every parameter leaf (a pytree of PartitionSpecs)."""
  boxed = jax.eval_shape(lambda: _init_boxed(cfg, jax.random.key(0)))
  return nn.get_partition_spec(boxed)


def positions_from_valid(valid_BT: Array, offset_B1: Array | int = 0) -> Array:
  """RoPE positions: the count of valid tokens before each one (padding does not advance)."""
  return offset_B1 + jnp.maximum(jnp.cumsum(valid_BT.astype(jnp.int32), axis=1) - 1, 0)


def forward(params, cfg: ModelConfig, tokens_BS: Array, valid_BS: Array) -> Array:
  """Full-sequence forward (the naive path): final-normed hidden states h_BSD."""
  h_BSD, _ = Transformer(cfg).apply(
    {"params": params}, tokens_BS, positions_from_valid(valid_BS), valid_BS
  )
  return h_BSD


def prefill(
  params, cfg: ModelConfig, tokens_BP: Array, valid_BP: Array, trunk_len: int = 0
) -> PrefixCache:
  """Prefix forward. Prefixes are left-padded, so position P-1 is always a real token.

  A sliding-window layer's cache keeps only the last `window` positions (`keep_window`):
  the tails cannot reach further back, and their cotangent for the rest is zero anyway.
  """
  P = tokens_BP.shape[1]
  h_BPD, kv = Transformer(cfg).apply(
    {"params": params}, tokens_BP, positions_from_valid(valid_BP), valid_BP
  )
  kv = tuple(keep_window(kv_i, cfg.layer_window(i)) for i, kv_i in enumerate(kv))
  trunk_h_BWD = h_BPD[:, P - 1 - trunk_len : P - 1]
  return PrefixCache(kv, h_BPD[:, -1], trunk_h_BWD)


def tail(
  params,
  cfg: ModelConfig,
  cache: PrefixCache,
  prefix_valid_BP: Array,
  tokens_BT: Array,
  valid_BT: Array,
) -> Array:
  """Tail forward against the prefix cache: hidden states h_BTD at the positions after the
  prefix. tokens_BT may hold g rows per prefix row (rows (b, r), row-major): all branches of
  a prompt in one call, their queries folded against the one prefix K/V in attention."""
  offset_B1 = jnp.sum(prefix_valid_BP.astype(jnp.int32), axis=1, keepdims=True)
  positions_BT = positions_from_valid(valid_BT, _rows(offset_B1, tokens_BT.shape[0]))
  h_BTD, _ = Transformer(cfg).apply(
    {"params": params}, tokens_BT, positions_BT, valid_BT, [(cache.kv, prefix_valid_BP)]
  )
  return h_BTD


def _token_logps(
  params, cfg: ModelConfig, h_BTD: Array, targets_BT: Array, temperature: float = 1.0
):
  logits_BTV = Transformer(cfg).apply({"params": params}, h_BTD, method=Transformer.logits)
  if temperature != 1.0:
    logits_BTV = logits_BTV / temperature
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
  return logp_BT, entropy_BT


def token_logps(
  params, cfg: ModelConfig, h_BTD: Array, targets_BT: Array, temperature: float = 1.0
):
  """log p(target) and the entropy of each predictive distribution, in fp32 (or fp64);
  p = softmax(logits / temperature), the distribution a sampler at that temperature draws from.

  With `model.logits_chunk` = C, the T positions run in chunks of C under `lax.scan`, each
  chunk rematerialised in the backward: at most one [B, C, V] logits block is ever alive.
  With `model.logits_chunk_rows` (and T <= C < B*T), the B rows' positions run as one
  sequence of B*T tokens in chunks of C: one [C, V] block.
  """
  B, T, D = h_BTD.shape
  C = cfg.logits_chunk
  if C is not None and cfg.logits_chunk_rows and T <= C < B * T:
    # rows x positions as one axis of B*T tokens, chunked below as one row
    logp_1N, entropy_1N = token_logps(
      params,
      dataclasses.replace(cfg, logits_chunk_rows=False),
      h_BTD.reshape(1, B * T, D),
      targets_BT.reshape(1, B * T),
      temperature,
    )
    return logp_1N.reshape(B, T), entropy_1N.reshape(B, T)
  if C is None or T <= C:
    return _token_logps(params, cfg, h_BTD, targets_BT, temperature)
  n = -(-T // C)
  pad = n * C - T
  h_nBCD = jnp.pad(h_BTD, ((0, 0), (0, pad), (0, 0))).reshape(B, n, C, D).swapaxes(0, 1)
  t_nBC = jnp.pad(targets_BT, ((0, 0), (0, pad))).reshape(B, n, C).swapaxes(0, 1)
  chunk_fn = jax.checkpoint(lambda h_BCD, t_BC: _token_logps(params, cfg, h_BCD, t_BC, temperature))
  _, (logp_nBC, entropy_nBC) = jax.lax.scan(lambda c, xs: (c, chunk_fn(*xs)), None, (h_nBCD, t_nBC))
  unchunk = lambda x_nBC: x_nBC.swapaxes(0, 1).reshape(B, n * C)[:, :T]
  return unchunk(logp_nBC), unchunk(entropy_nBC)


def logits(params, cfg: ModelConfig, h_BTD: Array) -> Array:
  return Transformer(cfg).apply({"params": params}, h_BTD, method=Transformer.logits)
