"""What every attention implementation shares: key segments, their masks, the checks, and the
log-sum-exp merge of per-segment partial softmaxes (attention.py's blockwise kernel and
attention_fused.py's fused one both attend segment by segment and merge here)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
IMPLS = ("blockwise", "dense", "fused")  # fused: attention_fused.py (tokamax, GPU)


class KeySegment(NamedTuple):
  """Keys a block of queries may attend to. Rows Bk divide the queries' rows Bq."""

  k_BSKH: Array
  v_BSKH: Array
  pos_BS: Array  # int RoPE positions (for sliding windows)
  valid_BS: Array  # bool
  causal: bool = False  # the queries' own keys: Bk == Bq, S == T, key j <= query i


def acc_dtype(dtype):
  """The softmax accumulator dtype: float64 under x64 inputs, else float32."""
  return jnp.float64 if dtype == jnp.float64 else jnp.float32


def check(q_BTNH: Array, segments: Sequence[KeySegment], impl: str) -> None:
  """Static shape checks (trace time): rows divide, causal segments match the queries."""
  if impl not in IMPLS:
    raise ValueError(f"model.attention={impl!r}: expected one of {IMPLS}")
  Bq, T, N, H = q_BTNH.shape
  for i, seg in enumerate(segments):
    Bk, S, K, Hk = seg.k_BSKH.shape
    if Hk != H or N % K or Bq % Bk or seg.v_BSKH.shape != seg.k_BSKH.shape:
      raise ValueError(
        f"attention segment {i}: k {seg.k_BSKH.shape}, v {seg.v_BSKH.shape} "
        f"against queries {q_BTNH.shape}: expected [Bk, S, K, {H}] with Bk "
        f"dividing {Bq} and K dividing {N}"
      )
    if seg.causal and (Bk != Bq or S != T):
      raise ValueError(
        f"attention segment {i}: causal keys {seg.k_BSKH.shape} must match "
        f"the queries' rows and length {(Bq, T)}"
      )


def segment_mask(q_pos_BT, q_valid_BT, seg: KeySegment, window: Optional[int]) -> Array:
  """allowed_BTS for one segment, with the queries' rows (key rows repeated g times)."""
  Bq, T = q_valid_BT.shape
  g = Bq // seg.valid_BS.shape[0]
  k_valid_BS = jnp.repeat(seg.valid_BS, g, axis=0)
  allowed_BTS = q_valid_BT[:, :, None] & k_valid_BS[:, None, :]
  if seg.causal:
    allowed_BTS &= jnp.tril(jnp.ones((T, T), bool))[None]
  if window is not None:
    k_pos_BS = jnp.repeat(seg.pos_BS, g, axis=0)
    allowed_BTS &= q_pos_BT[:, :, None] - k_pos_BS[:, None, :] < window
  return allowed_BTS


def check_masks(q_BTNH, q_pos_BT, q_valid_BT, segments) -> None:
  """Positions and validity match the rows and lengths of their queries / keys."""
  want = q_BTNH.shape[:2]
  for name, x in (("q_pos_BT", q_pos_BT), ("q_valid_BT", q_valid_BT)):
    if tuple(x.shape) != tuple(want):
      raise ValueError(
        f"attention {name}: shape {x.shape}, expected {want} (queries {q_BTNH.shape})"
      )
  for i, seg in enumerate(segments):
    want = seg.k_BSKH.shape[:2]
    for name, x in (("pos_BS", seg.pos_BS), ("valid_BS", seg.valid_BS)):
      if tuple(x.shape) != tuple(want):
        raise ValueError(
          f"attention segment {i} {name}: shape {x.shape}, expected {want} "
          f"(keys {seg.k_BSKH.shape})"
        )


def merge(o_parts, lse_parts):
  """(o_BTNH, lse_BTN) of the joint softmax from each segment's normalised output o_BTNH and
  log-sum-exp lse_BTN (-inf where a row has no allowed key; such rows come out zero)."""
  lse_LBTN = jnp.stack(lse_parts)
  m_BTN = lse_LBTN.max(0)
  m_safe = jnp.where(m_BTN == -jnp.inf, 0.0, m_BTN)
  w_LBTN = jnp.exp(lse_LBTN - m_safe)
  total_BTN = w_LBTN.sum(0)
  some = total_BTN > 0
  lse_BTN = jnp.where(some, m_safe + jnp.log(jnp.where(some, total_BTN, 1.0)), -jnp.inf)
  w_LBTN = w_LBTN / jnp.where(some, total_BTN, 1.0)
  return sum(w_BTN[..., None] * o for w_BTN, o in zip(w_LBTN, o_parts)), lse_BTN
