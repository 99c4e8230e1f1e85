"""Decoder-only transformer in Flax (Llama, Qwen2, Qwen3, Mistral, Gemma 2/3 via per-family
options in ModelConfig; one code path), exposed as pure functions for branch replay.

Shape glossary (used in every variable suffix, einsum string and einops pattern):
  B prompts · R branches · P prefix length · T tail/query length · S key length ·
  W trunk length (scored tokens at the end of the prefix) · D d_model · N query heads ·
  K kv heads · G query heads per kv head (N = K*G) · H head dim · F mlp hidden ·
  V vocab · L layers

The model knows nothing of RL. It exposes:
  prefill(params, cfg, tokens_BP, valid_BP) -> PrefixCache   (K/V per layer + hidden states)
  tail(params, cfg, cache, prefix_valid_BP, tokens_BT, valid_BT) -> h_BTD      (positions P..P+T-1)
  forward(params, cfg, tokens_BS, valid_BS) -> h_BSD           (the naive full sequence)
  token_logps(params, cfg, h_BTD, targets_BT) -> (logp_BT, entropy_BT)
Attention takes a list of K/V *segments* and softmaxes over their concatenated scores, so a
tail (or a decode step) attends to the shared prefix cache without copying it per branch.
The causal mask is built explicitly by index (never `is_causal`, which anchors top-left).
Sliding-window layers mask keys by RoPE position (query position - key position < window)
in every path alike, and the prefix cache of such a layer keeps only its last `window` keys.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
ROPE_SCALING_TYPES = ("linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling: 'linear' (every frequency / factor, Gemma 3) or 'llama3'
  (low frequencies / factor, high ones kept, a smooth ramp between; Llama 3.1+)."""

  type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0  # llama3 only
  high_freq_factor: float = 4.0  # llama3 only
  original_max_positions: int = 8192  # llama3 only

  def __post_init__(self):
    if self.type not in ROPE_SCALING_TYPES:
      raise ValueError(f"model.rope_scaling.type={self.type!r}: unsupported RoPE scaling; "
                       f"expected one of {ROPE_SCALING_TYPES}")
    if not self.factor > 0:
      raise ValueError(f"model.rope_scaling.factor={self.factor}: expected > 0")
    if self.type == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor):
      raise ValueError(f"model.rope_scaling: low_freq_factor={self.low_freq_factor}, "
                       f"high_freq_factor={self.high_freq_factor}: expected 0 < low < high")
    if self.type == "llama3" and not self.original_max_positions > 0:
      raise ValueError(f"model.rope_scaling.original_max_positions="
                       f"{self.original_max_positions}: expected > 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. Defaults are Llama and the 'small' preset (fast on a 2-core
  CPU); the per-family options below switch on Qwen2/Qwen3/Mistral/Gemma behaviour."""

  vocab_size: int = 1024
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 64
  mlp_hidden: int = 704
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  dtype: str = "float32"  # compute dtype of activations
  param_dtype: str = "float32"
  remat: bool = False  # rematerialise each layer in the backward (both paths alike)
  # Per-family options; the defaults are Llama.
  qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections
  qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's q and k, before RoPE
  sliding_window: Optional[int] = None  # local layers see keys with q_pos - k_pos < window
  local_layers: Optional[tuple[int, ...]] = None  # sliding layers; None: all (if a window)
  rope_scaling: Optional[RopeScaling] = None  # scaling of the global layers' RoPE
  local_rope_theta: Optional[float] = None  # Gemma 3: local layers' own base, no scaling
  attn_logit_softcap: Optional[float] = None  # Gemma 2: scores -> cap * tanh(scores / cap)
  final_logit_softcap: Optional[float] = None  # Gemma 2: the same on the output logits
  post_norms: bool = False  # Gemma: RMSNorm of the attention and MLP outputs before the add
  scale_embeddings: bool = False  # Gemma: embeddings * sqrt(d_model)
  norm_offset: float = 0.0  # Gemma: RMSNorm multiplies by (norm_offset + scale)
  activation: str = "silu"  # MLP gate: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
  query_pre_attn_scalar: Optional[float] = None  # Gemma: scores / sqrt(this); None: head_dim

  def __post_init__(self):
    if isinstance(self.local_layers, list):
      object.__setattr__(self, "local_layers", tuple(self.local_layers))
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                 "mlp_hidden"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name}: expected a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads={self.n_heads}: expected a multiple of "
                       f"model.n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim}: expected an even number (RoPE)")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
    if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                            or self.sliding_window < 1):
      raise ValueError(f"model.sliding_window={self.sliding_window!r}: expected None or a "
                       "positive int")
    if self.local_layers is not None:
      if self.sliding_window is None:
        raise ValueError(f"model.local_layers={self.local_layers}: given without "
                         "model.sliding_window")
      bad = [i for i in self.local_layers if not isinstance(i, int) or not 0 <= i < self.n_layers]
      if bad or len(set(self.local_layers)) != len(self.local_layers):
        raise ValueError(f"model.local_layers={self.local_layers}: expected distinct layer "
                         f"indices in [0, n_layers={self.n_layers})")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"model.rope_scaling={self.rope_scaling!r}: expected None or RopeScaling")
    for name in ("local_rope_theta", "attn_logit_softcap", "final_logit_softcap",
                 "query_pre_attn_scalar"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model.{name}={value!r}: expected None or > 0")
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"model.activation={self.activation!r}: expected one of "
                       f"{sorted(ACTIVATIONS)}")

  def layer_window(self, layer: int) -> Optional[int]:
    """The sliding window of layer `layer`, or None for a global (full attention) layer."""
    if self.sliding_window is None:
      return None
    if self.local_layers is None or layer in self.local_layers:
      return self.sliding_window
    return None

  def layer_rope(self, layer: int) -> tuple[float, Optional[RopeScaling]]:
    """(theta, scaling) of layer `layer`'s RoPE."""
    if self.local_rope_theta is not None and self.layer_window(layer) is not None:
      return self.local_rope_theta, None
    return self.rope_theta, self.rope_scaling

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]


PRESETS = {
    "tiny": dict(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                 mlp_hidden=64),
    "small": dict(),  # the defaults above
    "medium": dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64,
                   mlp_hidden=1408, vocab_size=4096),
    "large": dict(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128,
                  mlp_hidden=5632, vocab_size=32000),
}


def preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r}: expected one of {sorted(PRESETS)}")
  return ModelConfig(**{**PRESETS[name], **overrides})


# ----------------------------------------------------------------------------- pieces


class KV(NamedTuple):
  """One layer's keys and values (RoPE already applied to k)."""
  k_BSKH: Array
  v_BSKH: Array


class Segment(NamedTuple):
  """Keys/values a query block may attend to, with the boolean mask allowed_BTS."""
  kv: KV
  allowed_BTS: Array


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


def rope_inv_freq(H: int, theta: float, scaling: Optional[RopeScaling] = None) -> Array:
  """The H/2 rotary frequencies in fp32 (as Hugging Face computes them), optionally scaled."""
  inv_freq_h = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  if scaling is None:
    return inv_freq_h
  if scaling.type == "linear":
    return inv_freq_h / scaling.factor
  # llama3: wavelengths above original/low_freq_factor are divided by factor, those below
  # original/high_freq_factor kept, a linear ramp in between.
  factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
  old_len = scaling.original_max_positions
  wavelen_h = 2 * math.pi / inv_freq_h
  scaled_h = jnp.where(wavelen_h > old_len / low, inv_freq_h / factor, inv_freq_h)
  smooth_h = (old_len / wavelen_h - low) / (high - low)
  smoothed_h = (1 - smooth_h) * scaled_h / factor + smooth_h * scaled_h
  medium_h = ~(wavelen_h < old_len / high) & ~(wavelen_h > old_len / low)
  return jnp.where(medium_h, smoothed_h, scaled_h)


def rope(x_BTNH: Array, positions_BT: Array, theta: float,
         scaling: Optional[RopeScaling] = None) -> Array:
  """Rotary embedding, rotate-half convention (as Hugging Face Llama), computed in fp32."""
  H = x_BTNH.shape[-1]
  inv_freq_h = rope_inv_freq(H, theta, scaling)
  angle_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq_h
  angle_BTH = jnp.concatenate([angle_BTh, angle_BTh], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angle_BTH), jnp.sin(angle_BTH)
  x = x_BTNH.astype(jnp.float32) if x_BTNH.dtype != jnp.float64 else x_BTNH
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTNH.dtype)


def attend(q_BTNH: Array, segments: Sequence[Segment], scale: Optional[float] = None,
           softcap: Optional[float] = None) -> Array:
  """Softmax attention of q over the concatenation of K/V segments, one joint softmax.

  Scores are computed per segment and concatenated along S (they are small), so a segment
  shared across a vmapped branch axis is read, never copied. Rows with no allowed key
  (padding queries) output zeros. fp32 scores and softmax: bf16 loses the tail at long S.
  scale defaults to 1/sqrt(H); softcap (Gemma 2) maps scores to cap * tanh(scores / cap).
  """
  B, T, N, H = q_BTNH.shape
  K = segments[0].kv.k_BSKH.shape[2]
  acc = jnp.float64 if q_BTNH.dtype == jnp.float64 else jnp.float32
  if scale is None:
    scale = 1.0 / jnp.sqrt(jnp.asarray(H, acc))
  # Scale q (T*N*H values), not the scores (T*N*S). Layout BKTGS: XLA:CPU runs these
  # batched dots ~2x faster than BKGTS, and the softmax axis S stays innermost.
  q_BTKGH = (q_BTNH.reshape(B, T, K, N // K, H) * scale).astype(q_BTNH.dtype)
  neg = jnp.finfo(acc).min
  scores = []
  for (k_BSKH, _), allowed_BTS in segments:
    s_BKTGS = jnp.einsum("BTKGH,BSKH->BKTGS", q_BTKGH, k_BSKH, preferred_element_type=acc)
    if softcap is not None:
      s_BKTGS = jnp.tanh(s_BKTGS / softcap) * softcap
    scores.append(jnp.where(allowed_BTS[:, None, :, None, :], s_BKTGS, neg))
  s_BKTGS = jnp.concatenate(scores, axis=-1)
  # Softmax with the normalisation applied after PV (on T*N*H values, not T*N*S); the max
  # is a constant for the gradient (softmax is shift-invariant).
  max_BKTG1 = jax.lax.stop_gradient(jnp.max(s_BKTGS, axis=-1, keepdims=True))
  e_BKTGS = jnp.exp(s_BKTGS - max_BKTG1)
  denom_BTKG = jnp.einsum("BKTGS->BTKG", e_BKTGS)
  out_BTKGH = 0.0
  start = 0
  for (_, v_BSKH), _ in segments:
    S = v_BSKH.shape[1]
    e_seg = e_BKTGS[..., start:start + S].astype(v_BSKH.dtype)
    out_BTKGH = out_BTKGH + jnp.einsum("BKTGS,BSKH->BTKGH", e_seg, v_BSKH,
                                       preferred_element_type=acc)
    start += S
  out_BTKGH = out_BTKGH / denom_BTKG[..., None]
  # Rows with no allowed key are padding queries: they output zeros (and get no gradient).
  any_BT = jnp.any(jnp.concatenate([a for _, a in segments], axis=-1), axis=-1)
  out_BTKGH = jnp.where(any_BT[:, :, None, None, None], out_BTKGH, 0.0)
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def causal_allowed(valid_BT: Array) -> Array:
  """Own-segment mask: key j <= query i (by index), both valid."""
  T = valid_BT.shape[1]
  causal_TT = jnp.tril(jnp.ones((T, T), bool))
  return causal_TT[None] & valid_BT[:, None, :] & valid_BT[:, :, None]


def context_allowed(q_valid_BT: Array, k_valid_BS: Array) -> Array:
  """Mask for keys that all precede the queries (a prefix cache): valid key, valid query."""
  return q_valid_BT[:, :, None] & k_valid_BS[:, None, :]


def window_allowed(q_positions_BT: Array, k_positions_BS: Array, window: int) -> Array:
  """Sliding window by RoPE position: the query and the window-1 positions before it."""
  return q_positions_BT[:, :, None] - k_positions_BS[:, None, :] < window


def keep_window(kv: KV, window: Optional[int]) -> KV:
  """A sliding-window layer's prefix cache: only the last `window` (left-padded) positions.
  A later query reaches at most the last window-1 of them; one more keeps the length the
  configured window. The dropped keys get a zero cotangent through the slice."""
  S = kv.k_BSKH.shape[1]
  if window is None or window >= S:
    return kv
  return KV(kv.k_BSKH[:, S - window:], kv.v_BSKH[:, S - window:])


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
  """x / rms(x) * (offset + scale), in fp32; Gemma stores scale around 0 with offset 1."""
  eps: float
  param_dtype: Any
  offset: float = 0.0
  axes: tuple[str, ...] = ("embed",)

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.ones if self.offset == 0 else nn.initializers.constant(1 - self.offset)
    scale = self.param("scale", nn.with_logical_partitioning(init, self.axes),
                       (x.shape[-1],), self.param_dtype)
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xf = x.astype(acc)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    scale = scale.astype(acc) + self.offset if self.offset else scale.astype(acc)
    return (y * scale).astype(x.dtype)


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
      init = nn.with_logical_partitioning(nn.initializers.normal(fan_in ** -0.5), axes)
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

  def __call__(self, x_BTD, positions_BT, valid_BT, context: Sequence[Segment]):
    """Returns (x_BTD, own KV). `context` are the segments before this block of queries
    (their masks already include this layer's window)."""
    cfg = self.cfg
    dt = x_BTD.dtype
    h_BTD = self.attn_norm(x_BTD)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, self.w_DNH.astype(dt))
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.w_k_DKH.astype(dt))
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.w_v_DKH.astype(dt))
    if cfg.qkv_bias:
      q_BTNH = q_BTNH + self.b_q_NH.astype(dt)
      k_BTKH = k_BTKH + self.b_k_KH.astype(dt)
      v_BTKH = v_BTKH + self.b_v_KH.astype(dt)
    if cfg.qk_norm:
      q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
    theta, scaling = cfg.layer_rope(self.index)
    q_BTNH = rope(q_BTNH, positions_BT, theta, scaling)
    k_BTKH = rope(k_BTKH, positions_BT, theta, scaling)
    own = KV(k_BTKH, v_BTKH)
    allowed_BTT = causal_allowed(valid_BT)
    window = cfg.layer_window(self.index)
    if window is not None:
      allowed_BTT &= window_allowed(positions_BT, positions_BT, window)
    # Context parallelism (sharding.py): q, K, V are computed on this device's sequence
    # shard, then each layer all-gathers its K/V. Logical names only; no-ops unless
    # flax logical_axis_rules are set (the sharded prefix).
    q_BTNH = nn.with_logical_constraint(q_BTNH, ("batch", "seq", "heads", "head_dim"))
    own = KV(*(nn.with_logical_constraint(t_BTKH, ("batch", "seq", "kv_heads", "head_dim"))
               for t_BTKH in own))
    gathered = KV(*(nn.with_logical_constraint(t_BTKH, ("batch", None, "kv_heads", "head_dim"))
                    for t_BTKH in own))
    segments = list(context) + [Segment(gathered, allowed_BTT)]
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    a_BTNH = attend(q_BTNH, segments, scale, cfg.attn_logit_softcap)
    a_BTD = jnp.einsum("BTNH,NHD->BTD", a_BTNH, self.w_o_NHD.astype(dt))
    x_BTD = x_BTD + (self.post_attn_norm(a_BTD) if cfg.post_norms else a_BTD)
    h_BTD = self.mlp_norm(x_BTD)
    gate_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_gate_DF.astype(dt))
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_up_DF.astype(dt))
    m_BTD = jnp.einsum("BTF,FD->BTD", ACTIVATIONS[cfg.activation](gate_BTF) * up_BTF,
                       self.w_down_FD.astype(dt))
    x_BTD = x_BTD + (self.post_mlp_norm(m_BTD) if cfg.post_norms else m_BTD)
    return nn.with_logical_constraint(x_BTD, ("batch", "seq", None)), own


class Transformer(nn.Module):
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, param_dtype=cfg.weight_dtype,
                          embedding_init=nn.with_logical_partitioning(
                              nn.initializers.normal(1.0), ("vocab", "embed")))
    block = nn.remat(Block) if cfg.remat else Block
    self.blocks = [block(cfg, i, name=f"layer_{i}") for i in range(cfg.n_layers)]
    self.final_norm = RMSNorm(cfg.norm_eps, cfg.weight_dtype, cfg.norm_offset)
    if not cfg.tie_embeddings:
      self.lm_head = self.param(
          "lm_head", nn.with_logical_partitioning(nn.initializers.normal(cfg.d_model ** -0.5),
                                                  ("embed", "vocab")),
          (cfg.d_model, cfg.vocab_size), cfg.weight_dtype)

  def __call__(self, tokens_BT, positions_BT, valid_BT, context=()):
    """Final-normed hidden states and each layer's own K/V.

    context: segments that all precede these tokens, each a pair (per-layer tuple of KV,
    valid_BS): e.g. a shared prefix cache, then a branch's generated tokens when decoding.
    Keys are attended where valid; the queries' own keys causally. A context key's position
    is the count of valid context keys before it (the RoPE convention), which is what a
    sliding-window layer masks by. A layer whose K/V is shorter than valid_BS (a sliding
    layer's prefix cache, see `keep_window`) holds the last positions of that segment.
    """
    cfg = self.cfg
    x_BTD = self.embed(tokens_BT)
    if cfg.scale_embeddings:  # in the weight dtype, as Hugging Face (bf16 rounds sqrt(D))
      x_BTD = x_BTD * jnp.asarray(cfg.d_model ** 0.5, x_BTD.dtype)
    x_BTD = x_BTD.astype(cfg.compute_dtype)
    keys, offset_B1 = [], 0
    for kv_L, valid_BS in context:
      keys.append((kv_L, valid_BS, positions_from_valid(valid_BS, offset_B1)))
      offset_B1 = offset_B1 + jnp.sum(valid_BS.astype(jnp.int32), axis=1, keepdims=True)
    own_kv = []
    for i, block in enumerate(self.blocks):
      window = cfg.layer_window(i)
      segments = []
      for kv_L, valid_BS, k_positions_BS in keys:
        start = valid_BS.shape[1] - kv_L[i].k_BSKH.shape[1]
        allowed_BTS = context_allowed(valid_BT, valid_BS[:, start:])
        if window is not None:
          allowed_BTS &= window_allowed(positions_BT, k_positions_BS[:, start:], window)
        segments.append(Segment(kv_L[i], allowed_BTS))
      x_BTD, kv = block(x_BTD, positions_BT, valid_BT, segments)
      own_kv.append(kv)
    return self.final_norm(x_BTD), tuple(own_kv)

  def logits(self, h_BTD):
    w_DV = self.embed.embedding.T if self.cfg.tie_embeddings else self.lm_head
    acc = jnp.float64 if h_BTD.dtype == jnp.float64 else jnp.float32
    logits_BTV = jnp.einsum("BTD,DV->BTV", h_BTD, w_DV.astype(h_BTD.dtype),
                            preferred_element_type=acc)
    cap = self.cfg.final_logit_softcap
    return logits_BTV if cap is None else jnp.tanh(logits_BTV / cap) * cap


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
  h_BSD, _ = Transformer(cfg).apply({"params": params}, tokens_BS,
                                    positions_from_valid(valid_BS), valid_BS)
  return h_BSD


def prefill(params, cfg: ModelConfig, tokens_BP: Array, valid_BP: Array,
            trunk_len: int = 0) -> PrefixCache:
  """Prefix forward. Prefixes are left-padded, so position P-1 is always a real token.

  A sliding-window layer's cache keeps only the last `window` positions (`keep_window`):
  the tails cannot reach further back, and their cotangent for the rest is zero anyway.
  """
  P = tokens_BP.shape[1]
  h_BPD, kv = Transformer(cfg).apply({"params": params}, tokens_BP,
                                     positions_from_valid(valid_BP), valid_BP)
  kv = tuple(keep_window(kv_i, cfg.layer_window(i)) for i, kv_i in enumerate(kv))
  trunk_h_BWD = h_BPD[:, P - 1 - trunk_len:P - 1]
  return PrefixCache(kv, h_BPD[:, -1], trunk_h_BWD)


def tail(params, cfg: ModelConfig, cache: PrefixCache, prefix_valid_BP: Array,
         tokens_BT: Array, valid_BT: Array) -> Array:
  """Tail forward at positions P..P+T-1 against the prefix cache: hidden states h_BTD."""
  offset_B1 = jnp.sum(prefix_valid_BP.astype(jnp.int32), axis=1, keepdims=True)
  positions_BT = positions_from_valid(valid_BT, offset_B1)
  h_BTD, _ = Transformer(cfg).apply({"params": params}, tokens_BT, positions_BT, valid_BT,
                                    [(cache.kv, prefix_valid_BP)])
  return h_BTD


def token_logps(params, cfg: ModelConfig, h_BTD: Array, targets_BT: Array,
                temperature: float = 1.0):
  """log p(target) and the entropy of each predictive distribution, in fp32 (or fp64);
  p = softmax(logits / temperature), the distribution a sampler at that temperature draws from."""
  logits_BTV = Transformer(cfg).apply({"params": params}, h_BTD, method=Transformer.logits)
  if temperature != 1.0:
    logits_BTV = logits_BTV / temperature
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
  return logp_BT, entropy_BT


def logits(params, cfg: ModelConfig, h_BTD: Array) -> Array:
  return Transformer(cfg).apply({"params": params}, h_BTD, method=Transformer.logits)
