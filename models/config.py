"""Model configuration: one frozen dataclass for every supported family (Llama, Qwen2, Qwen3,
Mistral, Gemma 2/3 as per-family options), the presets, and the compute/memory options
(attention implementation and block sizes, layer scan, remat policy, chunked log-probs).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp

from models import attention
from models.attention import context_parallel

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float64": jnp.float64}
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}
ROPE_SCALING_TYPES = ("linear", "llama3")
REMAT_POLICIES = ("none", "full", "dots", "offload")
LAYER_TYPES = ("full_attention", "linear_attention")  # hybrid: Gated DeltaNet (deltanet.py)


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
      raise ValueError(
        f"model.rope_scaling.type={self.type!r}: unsupported RoPE scaling; "
        f"expected one of {ROPE_SCALING_TYPES}"
      )
    if not self.factor > 0:
      raise ValueError(f"model.rope_scaling.factor={self.factor}: expected > 0")
    if self.type == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor):
      raise ValueError(
        f"model.rope_scaling: low_freq_factor={self.low_freq_factor}, "
        f"high_freq_factor={self.high_freq_factor}: expected 0 < low < high"
      )
    if self.type == "llama3" and not self.original_max_positions > 0:
      raise ValueError(
        f"model.rope_scaling.original_max_positions={self.original_max_positions}: expected > 0"
      )


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
  dtype: str = "float32"  # compute dtype of activations and matmuls
  param_dtype: str = "float32"  # parameters and AdamW state ("master weights")
  # Compute and memory options; both paths (replay and the naive twin) use the same ones.
  remat: Union[bool, str] = "none"  # per layer: none | full | dots (save matmul outputs) |
  #   offload (dots saved to host memory; GPU/TPU only). True/False mean full/none.
  attention: str = "blockwise"  # blockwise (flash-style, custom VJP) | dense (the oracle) |
  #   fused (tokamax's GPU kernel per segment; H100/H200/B200 only, models/attention/fused.py)
  attention_block_q: int = 128  # query rows per score tile (x G query heads per kv head)
  # keys per score tile: 512 (not 64) on the idle 2-core CPU makes a tile's matmuls big enough
  # for both cores: the small replay step's wall time -18% at +8% CPU time
  # (experiments/results/ab_tiles_scan_cpu_2026-12-02.md)
  attention_block_k: int = 512
  context_parallel: str = "all_gather"  # the prefix on a mesh whose `context` axis > 1:
  #   all_gather (shard_map, K/V all-gathered, models/attention/context_parallel.py) | gspmd (the
  #   partitioner splits the kernel from sharding constraints)
  logits_chunk: Optional[int] = 1024  # tokens per [chunk, V] logits block (None: all at once)
  # Chunk over every row's positions together (rows x positions flattened, chunks of
  # logits_chunk tokens) instead of over the positions of all rows at once: with R*T scored
  # tokens and T <= logits_chunk (Llama-3-8B's 16 x 512 tails), the per-position chunks hold
  # all 8,192 rows' [V=128,256] logits (4.2 GB in f32, x ~4 live copies); flattened, one
  # [logits_chunk, V] block. Off by default (the default run's bits stay as frozen).
  logits_chunk_rows: bool = False
  # positions per MLP chunk (None: all at once); chunks run under lax.scan, each
  # rematerialised: at P=131,072 one layer's recomputation otherwise holds several
  # [P, mlp_hidden] hidden states (3.8 GB each in bf16 at Llama-3-8B). Off by default.
  mlp_chunk: Optional[int] = None
  # The projections (q, k, v, o, the MLP's) as one 2-D matmul over the flattened tokens,
  # [tokens, in] @ [in, out] (layers.dense), instead of an einsum over [B, T, ...]: the same
  # products; autodiff's weight gradient is then one [in, tokens] @ [tokens, out] matmul, which
  # XLA's CPU backend runs without writing each output gradient transposed (the einsum's two
  # token axes made it do so: 290 ms of a 1.89 s small-preset step at P=1024 T=512 R=8; this
  # option: -9% step time, docs/performance.md). On one device; under a mesh the einsums
  # (they keep the token axes' shardings). False: the einsums (float32 sums in another
  # order: gradients within ~1e-6 relative of these).
  flat_matmuls: bool = True
  # lax.scan over (periods of) identical layers: true | false | None (auto: scanned when
  # `remat` is on). Unrolled, XLA schedules the layers' recomputation freely and remat saves
  # nothing: the small replay step at P=8192, T=512, R=16, bf16, remat=full compiles to 1,571
  # MB unrolled vs 433 MB scanned (the naive twin at P=8192 T=128 to 13.6 GB unrolled).
  # Without remat, unrolled is the lighter and faster one (1,566 vs 1,989 MB there; the
  # scan's stacked residuals, zero-filled then updated and copied per layer, cost ~5% of a
  # small-preset replay step: experiments/results/ab_tiles_scan_cpu_2026-12-02.md).
  scan_layers: Optional[bool] = None
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
  # --- hybrid (Qwen3.5 / Qwen3-Next): per-layer kinds, Gated DeltaNet options (deltanet.py) ---
  layer_types: Optional[tuple[str, ...]] = None  # per layer, LAYER_TYPES; None: all full
  linear_key_heads: int = 2  # linear layers: query/key heads
  linear_value_heads: int = 4  # linear layers: value heads (a multiple of the key heads)
  linear_key_head_dim: int = 64
  linear_value_head_dim: int = 64
  linear_conv_kernel: int = 4  # the causal depthwise convolution's width
  linear_chunk: int = 64  # positions per chunk of the chunked delta rule (compute only)
  linear_remat: bool = True  # rematerialise each chunk of the linear layers' token mixer in
  #   the backward: the gradient keeps h per token, not the mixer's ~25 temporaries (cost: one
  #   more mixer forward)
  attn_output_gate: bool = False  # Qwen3.5 full attention: output * sigmoid(x W_gate)
  rotary_fraction: float = 1.0  # Qwen3.5: RoPE on the first fraction of each head's dims
  # --- end hybrid ---

  def __post_init__(self):
    if isinstance(self.remat, bool):
      object.__setattr__(self, "remat", "full" if self.remat else "none")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat={self.remat!r}: expected one of {REMAT_POLICIES}")
    if self.attention not in attention.IMPLS:
      raise ValueError(f"model.attention={self.attention!r}: expected one of {attention.IMPLS}")
    if self.context_parallel not in context_parallel.SCHEMES:
      raise ValueError(
        f"model.context_parallel={self.context_parallel!r}: expected one of "
        f"{context_parallel.SCHEMES} (a ring of ppermute steps and zig-zag "
        "load balancing are not built)"
      )
    for name in ("attention_block_q", "attention_block_k"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.{name}={value!r}: expected a positive int")
    if self.logits_chunk is not None and (
      not isinstance(self.logits_chunk, int) or self.logits_chunk < 1
    ):
      raise ValueError(f"model.logits_chunk={self.logits_chunk!r}: expected None or an int >= 1")
    if self.mlp_chunk is not None and (
      not isinstance(self.mlp_chunk, int) or isinstance(self.mlp_chunk, bool) or self.mlp_chunk < 1
    ):
      raise ValueError(f"model.mlp_chunk={self.mlp_chunk!r}: expected None or an int >= 1")
    if not isinstance(self.logits_chunk_rows, bool):
      raise ValueError(f"model.logits_chunk_rows={self.logits_chunk_rows!r}: expected a bool")
    if isinstance(self.local_layers, list):
      object.__setattr__(self, "local_layers", tuple(self.local_layers))
    if isinstance(self.rope_scaling, dict):
      object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
    for name in (
      "vocab_size",
      "d_model",
      "n_layers",
      "n_heads",
      "n_kv_heads",
      "head_dim",
      "mlp_hidden",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"model.{name}: expected a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
        f"model.n_heads={self.n_heads}: expected a multiple of model.n_kv_heads={self.n_kv_heads}"
      )
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim={self.head_dim}: expected an even number (RoPE)")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"model.{name}={getattr(self, name)!r}: expected one of {sorted(DTYPES)}")
    if self.sliding_window is not None and (
      not isinstance(self.sliding_window, int) or self.sliding_window < 1
    ):
      raise ValueError(
        f"model.sliding_window={self.sliding_window!r}: expected None or a positive int"
      )
    if self.local_layers is not None:
      if self.sliding_window is None:
        raise ValueError(
          f"model.local_layers={self.local_layers}: given without model.sliding_window"
        )
      bad = [i for i in self.local_layers if not isinstance(i, int) or not 0 <= i < self.n_layers]
      if bad or len(set(self.local_layers)) != len(self.local_layers):
        raise ValueError(
          f"model.local_layers={self.local_layers}: expected distinct layer "
          f"indices in [0, n_layers={self.n_layers})"
        )
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"model.rope_scaling={self.rope_scaling!r}: expected None or RopeScaling")
    for name in (
      "local_rope_theta",
      "attn_logit_softcap",
      "final_logit_softcap",
      "query_pre_attn_scalar",
    ):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model.{name}={value!r}: expected None or > 0")
    if self.activation not in ACTIVATIONS:
      raise ValueError(
        f"model.activation={self.activation!r}: expected one of {sorted(ACTIVATIONS)}"
      )
    self._check_hybrid()

  def _check_hybrid(self):
    """The hybrid options (layer_types, linear_*, attn_output_gate, rotary_fraction)."""
    if isinstance(self.layer_types, list):
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if not 0 < self.rotary_fraction <= 1 or int(self.head_dim * self.rotary_fraction) % 2:
      raise ValueError(
        f"model.rotary_fraction={self.rotary_fraction!r}: expected in (0, 1] "
        f"with head_dim={self.head_dim} * fraction an even int"
      )
    if self.layer_types is None:
      return
    if len(self.layer_types) != self.n_layers:
      raise ValueError(
        f"model.layer_types: {len(self.layer_types)} entries, expected n_layers={self.n_layers}"
      )
    bad = [t for t in self.layer_types if t not in LAYER_TYPES]
    if bad:
      raise ValueError(
        f"model.layer_types: unsupported layer type {bad[0]!r}; expected one of {LAYER_TYPES}"
      )
    linear = [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]
    if not linear:
      return
    for name in (
      "linear_key_heads",
      "linear_value_heads",
      "linear_key_head_dim",
      "linear_value_head_dim",
      "linear_conv_kernel",
      "linear_chunk",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.{name}={value!r}: expected a positive int")
    if self.linear_conv_kernel < 2:
      raise ValueError(f"model.linear_conv_kernel={self.linear_conv_kernel}: expected >= 2")
    for name in ("linear_key_heads", "linear_value_heads"):
      if self.d_model % getattr(self, name):
        raise ValueError(
          f"model.{name}={getattr(self, name)}: expected a divisor of d_model={self.d_model}"
        )
    if self.linear_value_heads % self.linear_key_heads:
      raise ValueError(
        f"model.linear_value_heads={self.linear_value_heads}: expected a "
        f"multiple of model.linear_key_heads={self.linear_key_heads}"
      )
    windowed = [i for i in linear if self.layer_window(i) is not None]
    if windowed:
      raise ValueError(
        f"model.sliding_window={self.sliding_window} applies to linear layers "
        f"{windowed} (model.local_layers={self.local_layers}): expected no "
        "window on a linear_attention layer"
      )
    if self.attn_logit_softcap is not None:
      raise ValueError(
        f"model.attn_logit_softcap={self.attn_logit_softcap}: a soft-cap on "
        f"linear_attention layers {linear}; expected None in a hybrid model"
      )

  def layer_type(self, layer: int) -> str:
    """'full_attention' or 'linear_attention' (a Gated DeltaNet layer)."""
    return "full_attention" if self.layer_types is None else self.layer_types[layer]

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

  def layer_kind(self, layer: int):
    """What makes two layers computationally different (their window and RoPE)."""
    return self.layer_window(layer), self.layer_rope(layer), self.layer_type(layer)

  def layer_period(self) -> int:
    """The smallest p with kind(i) == kind(i mod p) for every layer: layers are scanned in
    L // p repetitions of a p-layer group (Gemma 2: p=2, Gemma 3: p=6, Llama: p=1); the
    L % p layers left over run unrolled after the scan."""
    L = self.n_layers
    for p in range(1, L + 1):
      if all(self.layer_kind(i) == self.layer_kind(i % p) for i in range(L)):
        return p
    return L

  @property
  def compute_dtype(self):
    return DTYPES[self.dtype]

  @property
  def layers_scanned(self) -> bool:
    """Whether run_layers scans (scan_layers, or with None whether remat is on)."""
    return self.remat != "none" if self.scan_layers is None else bool(self.scan_layers)

  @property
  def weight_dtype(self):
    return DTYPES[self.param_dtype]


PRESETS = {
  "tiny": dict(
    vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=64
  ),
  "small": dict(),  # the defaults above
  "medium": dict(
    d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, head_dim=64, mlp_hidden=1408, vocab_size=4096
  ),
  "large": dict(
    d_model=2048,
    n_layers=16,
    n_heads=16,
    n_kv_heads=8,
    head_dim=128,
    mlp_hidden=5632,
    vocab_size=32000,
    scan_layers=True,
  ),
  # Hybrids (Qwen3.5's layout: 3 Gated DeltaNet layers, then one gated full attention).
  "hybrid_tiny": dict(
    vocab_size=128,
    d_model=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    mlp_hidden=64,
    linear_key_heads=2,
    linear_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_chunk=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    attn_output_gate=True,
    rotary_fraction=0.5,
    qk_norm=True,
    norm_offset=1.0,
  ),
  "hybrid_small": dict(
    linear_key_heads=2,
    linear_value_heads=4,
    layer_types=("linear_attention",) * 3 + ("full_attention",),
    attn_output_gate=True,
    rotary_fraction=0.25,
    qk_norm=True,
    norm_offset=1.0,
  ),
}


def preset(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r}: expected one of {sorted(PRESETS)}")
  return ModelConfig(**{**PRESETS[name], **overrides})
