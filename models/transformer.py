"""Llama-family decoder in Flax, exposed as pure functions for branch replay.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama-family decoder. Defaults are the 'small' preset (fast on a 2-core CPU)."""

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

  def __post_init__(self):
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


def rope(x_BTNH: Array, positions_BT: Array, theta: float) -> Array:
  """Rotary embedding, rotate-half convention (as Hugging Face Llama), computed in fp32."""
  H = x_BTNH.shape[-1]
  inv_freq_h = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  angle_BTh = positions_BT.astype(jnp.float32)[..., None] * inv_freq_h
  angle_BTH = jnp.concatenate([angle_BTh, angle_BTh], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angle_BTH), jnp.sin(angle_BTH)
  x = x_BTNH.astype(jnp.float32) if x_BTNH.dtype != jnp.float64 else x_BTNH
  x1, x2 = jnp.split(x, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTNH.dtype)


def attend(q_BTNH: Array, segments: Sequence[Segment]) -> Array:
  """Softmax attention of q over the concatenation of K/V segments, one joint softmax.

  Scores are computed per segment and concatenated along S (they are small), so a segment
  shared across a vmapped branch axis is read, never copied. Rows with no allowed key
  (padding queries) output zeros. fp32 scores and softmax: bf16 loses the tail at long S.
  """
  B, T, N, H = q_BTNH.shape
  K = segments[0].kv.k_BSKH.shape[2]
  q_BTKGH = q_BTNH.reshape(B, T, K, N // K, H)
  acc = jnp.float64 if q_BTNH.dtype == jnp.float64 else jnp.float32
  scale = 1.0 / jnp.sqrt(jnp.asarray(H, acc))
  neg = jnp.finfo(acc).min
  scores, masks = [], []
  for (k_BSKH, _), allowed_BTS in segments:
    s_BKGTS = jnp.einsum("BTKGH,BSKH->BKGTS", q_BTKGH, k_BSKH,
                         preferred_element_type=acc) * scale
    mask_BKGTS = allowed_BTS[:, None, None, :, :]
    scores.append(jnp.where(mask_BKGTS, s_BKGTS, neg))
    masks.append(allowed_BTS)
  s_BKGTS = jnp.concatenate(scores, axis=-1)
  any_BT = jnp.any(jnp.concatenate(masks, axis=-1), axis=-1)
  p_BKGTS = jax.nn.softmax(s_BKGTS, axis=-1)
  p_BKGTS = jnp.where(any_BT[:, None, None, :, None], p_BKGTS, 0.0)
  out_BTKGH = 0.0
  start = 0
  for (_, v_BSKH), _ in segments:
    S = v_BSKH.shape[1]
    p_seg = p_BKGTS[..., start:start + S].astype(v_BSKH.dtype)
    out_BTKGH = out_BTKGH + jnp.einsum("BKGTS,BSKH->BTKGH", p_seg, v_BSKH,
                                       preferred_element_type=acc)
    start += S
  return out_BTKGH.reshape(B, T, N, H).astype(q_BTNH.dtype)


def causal_allowed(valid_BT: Array) -> Array:
  """Own-segment mask: key j <= query i (by index), both valid."""
  T = valid_BT.shape[1]
  causal_TT = jnp.tril(jnp.ones((T, T), bool))
  return causal_TT[None] & valid_BT[:, None, :] & valid_BT[:, :, None]


def context_allowed(q_valid_BT: Array, k_valid_BS: Array) -> Array:
  """Mask for keys that all precede the queries (a prefix cache): valid key, valid query."""
  return q_valid_BT[:, :, None] & k_valid_BS[:, None, :]


# ----------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
  eps: float
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
                       (x.shape[-1],), self.param_dtype)
    acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
    xf = x.astype(acc)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    return (y * scale.astype(acc)).astype(x.dtype)


class Block(nn.Module):
  """Pre-norm decoder layer: GQA attention with RoPE, then SwiGLU."""
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden
    pd = cfg.weight_dtype

    def param(name, shape, axes, fan_in):
      init = nn.with_logical_partitioning(nn.initializers.normal(fan_in ** -0.5), axes)
      return self.param(name, init, shape, pd)

    self.w_DNH = param("q", (D, N, H), ("embed", "heads", "head_dim"), D)
    self.w_k_DKH = param("k", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.w_v_DKH = param("v", (D, K, H), ("embed", "kv_heads", "head_dim"), D)
    self.w_o_NHD = param("o", (N, H, D), ("heads", "head_dim", "embed"), N * H)
    self.w_gate_DF = param("gate", (D, F), ("embed", "mlp"), D)
    self.w_up_DF = param("up", (D, F), ("embed", "mlp"), D)
    self.w_down_FD = param("down", (F, D), ("mlp", "embed"), F)
    self.attn_norm = RMSNorm(cfg.norm_eps, pd)
    self.mlp_norm = RMSNorm(cfg.norm_eps, pd)

  def __call__(self, x_BTD, positions_BT, valid_BT, context: Sequence[Segment]):
    """Returns (x_BTD, own KV). `context` are the segments before this block of queries."""
    cfg = self.cfg
    dt = x_BTD.dtype
    h_BTD = self.attn_norm(x_BTD)
    q_BTNH = jnp.einsum("BTD,DNH->BTNH", h_BTD, self.w_DNH.astype(dt))
    k_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.w_k_DKH.astype(dt))
    v_BTKH = jnp.einsum("BTD,DKH->BTKH", h_BTD, self.w_v_DKH.astype(dt))
    q_BTNH = rope(q_BTNH, positions_BT, cfg.rope_theta)
    k_BTKH = rope(k_BTKH, positions_BT, cfg.rope_theta)
    own = KV(k_BTKH, v_BTKH)
    segments = list(context) + [Segment(own, causal_allowed(valid_BT))]
    a_BTNH = attend(q_BTNH, segments)
    x_BTD = x_BTD + jnp.einsum("BTNH,NHD->BTD", a_BTNH, self.w_o_NHD.astype(dt))
    h_BTD = self.mlp_norm(x_BTD)
    gate_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_gate_DF.astype(dt))
    up_BTF = jnp.einsum("BTD,DF->BTF", h_BTD, self.w_up_DF.astype(dt))
    x_BTD = x_BTD + jnp.einsum("BTF,FD->BTD", jax.nn.silu(gate_BTF) * up_BTF,
                               self.w_down_FD.astype(dt))
    return x_BTD, own


class Transformer(nn.Module):
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = nn.Embed(cfg.vocab_size, cfg.d_model, param_dtype=cfg.weight_dtype,
                          embedding_init=nn.with_logical_partitioning(
                              nn.initializers.normal(1.0), ("vocab", "embed")))
    block = nn.remat(Block) if cfg.remat else Block
    self.blocks = [block(cfg, name=f"layer_{i}") for i in range(cfg.n_layers)]
    self.final_norm = RMSNorm(cfg.norm_eps, cfg.weight_dtype)
    if not cfg.tie_embeddings:
      self.lm_head = self.param(
          "lm_head", nn.with_logical_partitioning(nn.initializers.normal(cfg.d_model ** -0.5),
                                                  ("embed", "vocab")),
          (cfg.d_model, cfg.vocab_size), cfg.weight_dtype)

  def __call__(self, tokens_BT, positions_BT, valid_BT, context=()):
    """Final-normed hidden states and each layer's own K/V.

    context: segments that all precede these tokens, each a pair (per-layer tuple of KV,
    valid_BS): e.g. a shared prefix cache, then a branch's generated tokens when decoding.
    Keys are attended where valid; the queries' own keys causally.
    """
    x_BTD = self.embed(tokens_BT).astype(self.cfg.compute_dtype)
    own_kv = []
    for i, block in enumerate(self.blocks):
      segments = [Segment(kv_L[i], context_allowed(valid_BT, valid_BS))
                  for kv_L, valid_BS in context]
      x_BTD, kv = block(x_BTD, positions_BT, valid_BT, segments)
      own_kv.append(kv)
    return self.final_norm(x_BTD), tuple(own_kv)

  def logits(self, h_BTD):
    w_DV = self.embed.embedding.T if self.cfg.tie_embeddings else self.lm_head
    acc = jnp.float64 if h_BTD.dtype == jnp.float64 else jnp.float32
    return jnp.einsum("BTD,DV->BTV", h_BTD, w_DV.astype(h_BTD.dtype),
                      preferred_element_type=acc)


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
  """Prefix forward. Prefixes are left-padded, so position P-1 is always a real token."""
  P = tokens_BP.shape[1]
  h_BPD, kv = Transformer(cfg).apply({"params": params}, tokens_BP,
                                     positions_from_valid(valid_BP), valid_BP)
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


def token_logps(params, cfg: ModelConfig, h_BTD: Array, targets_BT: Array):
  """log p(target) and the entropy of each predictive distribution, in fp32 (or fp64)."""
  logits_BTV = Transformer(cfg).apply({"params": params}, h_BTD, method=Transformer.logits)
  logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
  logp_BT = jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]
  entropy_BT = -jnp.sum(jnp.exp(logp_BTV) * logp_BTV, axis=-1)
  return logp_BT, entropy_BT


def logits(params, cfg: ModelConfig, h_BTD: Array) -> Array:
  return Transformer(cfg).apply({"params": params}, h_BTD, method=Transformer.logits)
