"""Small pieces of the decoder: rotary embeddings (with Llama-3 / linear scaling) and RMSNorm.
Shape letters as in transformer.py."""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.config import RopeScaling

Array = jax.Array


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


def rope(
  x_BTNH: Array, positions_BT: Array, theta: float, scaling: Optional[RopeScaling] = None
) -> Array:
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


class RMSNorm(nn.Module):
  """x / rms(x) * (offset + scale), in fp32; Gemma stores scale around 0 with offset 1."""

  eps: float
  param_dtype: Any
  offset: float = 0.0
  axes: tuple[str, ...] = ("embed",)

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.ones if self.offset == 0 else nn.initializers.constant(1 - self.offset)
    scale = self.param(
      "scale", nn.with_logical_partitioning(init, self.axes), (x.shape[-1],), self.param_dtype
    )
    return rms_norm(x, scale, self.eps, self.offset)


def dense(x, w, n_in: int = 1):
  """x's last n_in axes contracted with w's first n_in, as one 2-D matmul over the flattened
  leading (token) axes: [tokens, in] @ [in, out], reshaped back to [..., *w.shape[n_in:]]."""
  lead, k = x.shape[: x.ndim - n_in], math.prod(x.shape[x.ndim - n_in :])
  if w.shape[:n_in] != x.shape[x.ndim - n_in :]:
    raise ValueError(f"dense: x {x.shape} and w {w.shape} do not share {n_in} axes")
  return (x.reshape(-1, k) @ w.reshape(k, -1)).reshape(*lead, *w.shape[n_in:])


def rms_norm(x, scale, eps: float, offset: float = 0.0):
  """RMSNorm's computation on its scale parameter (for code outside a flax module)."""
  acc = jnp.float64 if x.dtype == jnp.float64 else jnp.float32
  xf = x.astype(acc)
  y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  scale = scale.astype(acc) + offset if offset else scale.astype(acc)
  return (y * scale).astype(x.dtype)
