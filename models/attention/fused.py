"""`model.attention=fused`: a fused flash-attention kernel per K/V segment, merged by hand.

The kernel is tokamax's Mosaic GPU flash attention (requirements-gpu.txt; sm90/sm100: H100,
H200, B200), which handles GQA, soft-cap, a boolean mask and a fused backward. It attends one
segment at a time; the segments' partial softmaxes are merged by log-sum-exp exactly as the
blockwise kernel merges them (attention.py). The backward cannot go through the kernel's own
VJP of each segment: that VJP treats its softmax residuals as constants (tokamax drops their
cotangents), so the merge weights' gradient would be lost. Instead, as the blockwise
backward does, every segment's backward runs with the *global* statistics: residuals
(m = global log-sum-exp, l = 1) and the merged output o and its cotangent, which makes the
kernel's p = exp(s - m) / l the joint softmax and its delta = rowsum(do * o) the joint one;
the per-segment dq add up, each segment gets its own dk, dv.

A kernel is a pair of functions with tokamax's contract (shapes as in attention.py):
  fwd(q_BTNH, k_BSKH, v_BSKH, mask_B1TS, scale, softcap) -> (o_BTNH, (m_BNT, l_BNT))
  vjp((m_BNT, l_BNT), o_BTNH, do_BTNH, q, k, v, mask_B1TS, scale, softcap) -> (dq, dk, dv)
with p = exp(scale * q.k (soft-capped) - m) / l over the allowed keys. `kernel()` picks it;
tests on a CPU substitute `reference_kernel()` (the same contract in plain jax).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from models.attention import segments

FALLBACK = "blockwise"
SUPPORTED_DEVICE_KINDS = ("H100", "H200", "H800", "H20", "B200", "GB200")


class Kernel(NamedTuple):
  name: str
  fwd: Callable
  vjp: Callable


def device_found() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform} {dev.device_kind!r}"


def unavailable_reason() -> Optional[str]:
  """Why the fused kernel cannot run here (None: it can)."""
  try:
    import tokamax  # noqa: F401
  except ImportError:
    return "tokamax is not installed (pip install -r requirements-gpu.txt)"
  dev = jax.devices()[0]
  if dev.platform != "gpu" or not any(k in dev.device_kind for k in SUPPORTED_DEVICE_KINDS):
    return f"its Mosaic GPU kernel needs an sm90/sm100 GPU {SUPPORTED_DEVICE_KINDS}"
  return None


def check_available() -> None:
  """ValueError (at trace time, before any compilation) where the kernel cannot run."""
  reason = unavailable_reason()
  if reason is not None:
    raise ValueError(
      f"model.attention='fused': {reason}; device found: {device_found()}; "
      f"expected a supported GPU, or the fallback model.attention='{FALLBACK}'"
    )


def tokamax_kernel() -> Kernel:
  from tokamax._src.ops.attention import base
  from tokamax._src.ops.attention import pallas_mosaic_gpu

  op = pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()

  def fwd(q, k, v, mask, scale, softcap):
    return op(
      q,
      k,
      v,
      mask=mask,
      logits_scale=scale,
      logits_soft_cap=softcap,
      precision=jax.lax.DotAlgorithmPreset.DEFAULT,
      return_residuals=True,
    )

  def vjp(residuals, o, do, q, k, v, mask, scale, softcap):
    preset = jax.lax.DotAlgorithmPreset.DEFAULT
    grads = op.vjp(
      residuals,
      o,
      do,
      q,
      k,
      v,
      precision=(preset, preset),
      logits_dtype=jnp.float32,
      logits_scale=scale,
      bias=None,
      logits_soft_cap=softcap,
      mask=base.Mask(mask),
      dropout_mask=None,
      dropout_rate=0.0,
      paging_info=None,
      q_indices=None,
      k_indices=None,
      normalize_output=True,
    )
    grads = grads[0] if isinstance(grads, tuple) else grads
    return grads["q"], grads["k"], grads["v"]

  return Kernel("tokamax.pallas_mosaic_gpu", fwd, vjp)


def _scores(q, k, mask, scale, softcap):
  """[B, N, T, S] float scores of the contract (GQA: query head n reads kv head n // G)."""
  B, T, N, H = q.shape
  K = k.shape[2]
  acc = jnp.promote_types(q.dtype, jnp.float32)
  s = (
    jnp.einsum(
      "BTKGH,BSKH->BKGTS", q.reshape(B, T, K, N // K, H), k, preferred_element_type=acc
    ).reshape(B, N, T, -1)
    * scale
  )
  capped = s if softcap is None else jnp.tanh(s / softcap) * softcap
  return s, capped, jnp.where(mask, capped, -jnp.inf)


def reference_kernel() -> Kernel:
  """tokamax's contract in plain jax (dense scores): the CPU stand-in of the tests."""

  def fwd(q, k, v, mask, scale, softcap):
    B, T, N, H = q.shape
    K = k.shape[2]
    _, _, s = _scores(q, k, mask, scale, softcap)
    m = jnp.max(s, -1)
    m = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m[..., None])
    l = p.sum(-1)
    o = jnp.einsum("BKGTS,BSKH->BTKGH", p.reshape(B, K, N // K, T, -1), v.astype(p.dtype))
    o = o.reshape(B, T, N, H) / jnp.where(l > 0, l, 1.0).swapaxes(1, 2)[..., None]
    return o.astype(q.dtype), (m, l)

  def vjp(residuals, o, do, q, k, v, mask, scale, softcap):
    B, T, N, H = q.shape
    K = k.shape[2]
    m, l = residuals
    _, capped, s = _scores(q, k, mask, scale, softcap)
    p = jnp.exp(s - m[..., None]) / l[..., None]  # [B, N, T, S]
    acc = p.dtype
    do_BNTH = do.astype(acc).swapaxes(1, 2)
    delta = jnp.sum(do_BNTH * o.astype(acc).swapaxes(1, 2), -1)
    v_BKSH = v.astype(acc).swapaxes(1, 2)
    p_BKGTS = p.reshape(B, K, N // K, T, -1)
    dv = jnp.einsum("BKGTS,BKGTH->BSKH", p_BKGTS, do_BNTH.reshape(B, K, N // K, T, H))
    dp = jnp.einsum("BKGTH,BKSH->BKGTS", do_BNTH.reshape(B, K, N // K, T, H), v_BKSH)
    ds = p * (dp.reshape(p.shape) - delta[..., None])
    if softcap is not None:
      t = capped / softcap
      ds = ds * (1.0 - t * t)
    ds = ds * scale
    ds_BKGTS = ds.reshape(B, K, N // K, T, -1)
    dq = jnp.einsum("BKGTS,BSKH->BTKGH", ds_BKGTS, k.astype(acc)).reshape(B, T, N, H)
    dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds_BKGTS, q.astype(acc).reshape(B, T, K, N // K, H))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

  return Kernel("reference", fwd, vjp)


def kernel() -> Kernel:
  """The kernel `attend(impl='fused')` runs (CPU tests substitute `reference_kernel` and
  `unavailable_reason`)."""
  return tokamax_kernel()


class _Static(NamedTuple):
  causal: tuple
  scale: float
  softcap: Optional[float]
  window: Optional[int]
  kernel: Kernel


def _segment_inputs(st, q_BTNH, q_pos_BT, q_valid_BT, seg, causal):
  """One segment in the kernel's layout: a prompt's g query rows folded into one query axis
  against its key row, and the allowed mask [Bk, 1, g*T, S]."""
  k, v, kpos, kvalid = seg
  Bq, T, N, H = q_BTNH.shape
  Bk, S = k.shape[:2]
  g = Bq // Bk
  mask_BTS = segments.segment_mask(
    q_pos_BT, q_valid_BT, segments.KeySegment(k, v, kpos, kvalid, causal), st.window
  )
  fold = lambda x: x.reshape(Bk, g * T, *x.shape[2:])
  return fold(q_BTNH), k, v, fold(mask_BTS)[:, None]


def _fwd(st: _Static, q_BTNH, q_pos_BT, q_valid_BT, segs):
  Bq, T, N, H = q_BTNH.shape
  o_parts, lse_parts = [], []
  for seg, causal in zip(segs, st.causal):
    q, k, v, mask = _segment_inputs(st, q_BTNH, q_pos_BT, q_valid_BT, seg, causal)
    o, (m, l) = st.kernel.fwd(q, k, v, mask, st.scale, st.softcap)
    some = jnp.any(mask[:, 0], -1)[:, None, :]  # [Bk, 1, gT]: a row with no allowed key
    lse_BNQ = jnp.where(some, m + jnp.log(jnp.where(some, l, 1.0)), -jnp.inf)
    acc = jnp.promote_types(o.dtype, jnp.float32)
    o = jnp.where(some.swapaxes(1, 2)[..., None], o.astype(acc), 0.0)
    o_parts.append(o.reshape(Bq, T, N, H))
    lse_parts.append(lse_BNQ.swapaxes(1, 2).reshape(Bq, T, N))
  o_BTNH, lse_BTN = segments.merge(o_parts, lse_parts)
  return o_BTNH.astype(q_BTNH.dtype), lse_BTN


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fused(st: _Static, q_BTNH, q_pos_BT, q_valid_BT, segs):
  return _fwd(st, q_BTNH, q_pos_BT, q_valid_BT, segs)[0]


def _vjp_fwd(st, q_BTNH, q_pos_BT, q_valid_BT, segs):
  o_BTNH, lse_BTN = _fwd(st, q_BTNH, q_pos_BT, q_valid_BT, segs)
  return o_BTNH, (q_BTNH, q_pos_BT, q_valid_BT, segs, o_BTNH, lse_BTN)


def _vjp_bwd(st, res, do_BTNH):
  q_BTNH, q_pos_BT, q_valid_BT, segs, o_BTNH, lse_BTN = res
  Bq, T, N, H = q_BTNH.shape
  none = lse_BTN == -jnp.inf  # rows with no allowed key anywhere: zero output, no gradient
  m_BTN = jnp.where(none, 0.0, lse_BTN)
  do_BTNH = jnp.where(none[..., None], 0, do_BTNH).astype(q_BTNH.dtype)
  dq_BTNH = jnp.zeros(q_BTNH.shape, jnp.promote_types(q_BTNH.dtype, jnp.float32))
  dsegs = []
  for seg, causal in zip(segs, st.causal):
    q, k, v, mask = _segment_inputs(st, q_BTNH, q_pos_BT, q_valid_BT, seg, causal)
    Bk = k.shape[0]
    fold = lambda x: x.reshape(Bk, (Bq // Bk) * T, *x.shape[2:])
    m_BNQ = fold(m_BTN).swapaxes(1, 2)
    residuals = (m_BNQ, jnp.ones_like(m_BNQ))  # the global statistics: p is the joint softmax
    dq, dk, dv = st.kernel.vjp(
      residuals, fold(o_BTNH), fold(do_BTNH), q, k, v, mask, st.scale, st.softcap
    )
    dq_BTNH = dq_BTNH + dq.reshape(Bq, T, N, H)
    dsegs.append((dk.astype(k.dtype), dv.astype(v.dtype), None, None))
  return dq_BTNH.astype(q_BTNH.dtype), None, None, tuple(dsegs)


fused.defvjp(_vjp_fwd, _vjp_bwd)


def attend_fused(q_BTNH, q_pos_BT, q_valid_BT, key_segments, *, scale, softcap, window):
  """attention.attend(impl='fused') after its checks: the kernel per segment, merged."""
  check_available()
  st = _Static(
    causal=tuple(bool(s.causal) for s in key_segments),
    scale=float(scale),
    softcap=None if softcap is None else float(softcap),
    window=None if window is None else int(window),
    kernel=kernel(),
  )
  segs = tuple((s.k_BSKH, s.v_BSKH, s.pos_BS, s.valid_BS) for s in key_segments)
  return fused(st, q_BTNH, q_pos_BT, q_valid_BT, segs)
