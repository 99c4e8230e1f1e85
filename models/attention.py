"""Attention over K/V segments: one joint softmax over several key segments.

Shape glossary as in transformer.py (B rows, T queries, S keys, N query heads, K kv heads,
G = N/K query heads per kv head, H head dim).

A query block attends to a list of `KeySegment`s and softmaxes over their concatenated keys.
A segment may hold fewer rows than the queries: with Bq query rows and Bk key rows
(Bk divides Bq), query rows [i*g, (i+1)*g) (g = Bq/Bk) all read key row i. That is how R
branch tails (rows (b, r), row-major) read one shared prefix cache: the segment's g*T queries
are folded into one query axis against the single prefix K/V, so its dK/dV come out of the
contraction already summed over branches and no per-branch copy of the prefix exists.

Mask of query i against key j of a segment:
  q_valid[i] & k_valid[j] & (not causal or j <= i) & (window is None or q_pos[i] - k_pos[j] < window)
`causal` segments are the queries' own keys (same rows, S == T); index-causal, never
`is_causal` (which anchors top-left). Rows with no allowed key output zeros and get no
gradient. Scores and softmax run in float32 (float64 under x64 inputs).

Two implementations behind one signature (`impl`):
  dense      materialises the [B, K, T, G, S] scores: the test oracle.
  blockwise  flash-style online softmax under one jax.custom_vjp, saving only the output and
             the log-sum-exp; the backward recomputes score tiles with the global LSE.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp

Array = jax.Array
IMPLS = ("blockwise", "dense")


class KeySegment(NamedTuple):
  """Keys a block of queries may attend to. Rows Bk divide the queries' rows Bq."""
  k_BSKH: Array
  v_BSKH: Array
  pos_BS: Array  # int RoPE positions (for sliding windows)
  valid_BS: Array  # bool
  causal: bool = False  # the queries' own keys: Bk == Bq, S == T, key j <= query i


def _acc_dtype(dtype):
  return jnp.float64 if dtype == jnp.float64 else jnp.float32


def check(q_BTNH: Array, segments: Sequence[KeySegment], impl: str) -> None:
  """Static shape checks (trace time): rows divide, causal segments match the queries."""
  if impl not in IMPLS:
    raise ValueError(f"model.attention={impl!r}: expected one of {IMPLS}")
  Bq, T, N, H = q_BTNH.shape
  for i, seg in enumerate(segments):
    Bk, S, K, Hk = seg.k_BSKH.shape
    if Hk != H or N % K or Bq % Bk or seg.v_BSKH.shape != seg.k_BSKH.shape:
      raise ValueError(f"attention segment {i}: k {seg.k_BSKH.shape}, v {seg.v_BSKH.shape} "
                       f"against queries {q_BTNH.shape}: expected [Bk, S, K, {H}] with Bk "
                       f"dividing {Bq} and K dividing {N}")
    if seg.causal and (Bk != Bq or S != T):
      raise ValueError(f"attention segment {i}: causal keys {seg.k_BSKH.shape} must match "
                       f"the queries' rows and length {(Bq, T)}")


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


def attend_dense(q_BTNH, q_pos_BT, q_valid_BT, segments, *, scale=None, softcap=None,
                 window=None) -> Array:
  """The oracle: materialised scores, one joint softmax over every segment's keys."""
  Bq, T, N, H = q_BTNH.shape
  K = segments[0].k_BSKH.shape[2]
  acc = _acc_dtype(q_BTNH.dtype)
  if scale is None:
    scale = 1.0 / jnp.sqrt(jnp.asarray(H, acc))
  q_BTKGH = (q_BTNH.reshape(Bq, T, K, N // K, H) * scale).astype(q_BTNH.dtype)
  neg = jnp.finfo(acc).min
  scores, values, masks = [], [], []
  for seg in segments:
    g = Bq // seg.k_BSKH.shape[0]
    k_BSKH = jnp.repeat(seg.k_BSKH, g, axis=0)
    s_BKTGS = jnp.einsum("BTKGH,BSKH->BKTGS", q_BTKGH, k_BSKH, preferred_element_type=acc)
    if softcap is not None:
      s_BKTGS = jnp.tanh(s_BKTGS / softcap) * softcap
    allowed_BTS = segment_mask(q_pos_BT, q_valid_BT, seg, window)
    scores.append(jnp.where(allowed_BTS[:, None, :, None, :], s_BKTGS, neg))
    values.append(jnp.repeat(seg.v_BSKH, g, axis=0))
    masks.append(allowed_BTS)
  s_BKTGS = jnp.concatenate(scores, axis=-1)
  p_BKTGS = jax.nn.softmax(s_BKTGS, axis=-1)
  v_BSKH = jnp.concatenate(values, axis=1)
  out_BTKGH = jnp.einsum("BKTGS,BSKH->BTKGH", p_BKTGS.astype(v_BSKH.dtype), v_BSKH,
                         preferred_element_type=acc)
  any_BT = jnp.any(jnp.concatenate(masks, axis=-1), axis=-1)
  out_BTKGH = jnp.where(any_BT[:, :, None, None, None], out_BTKGH, 0.0)
  return out_BTKGH.reshape(Bq, T, N, H).astype(q_BTNH.dtype)


def attend(q_BTNH, q_pos_BT, q_valid_BT, segments: Sequence[KeySegment], *,
           scale: Optional[float] = None, softcap: Optional[float] = None,
           window: Optional[int] = None, impl: str = "dense", block_q: int = 512,
           block_k: int = 512) -> Array:
  """Attention of q over the concatenation of `segments` (see the module docstring)."""
  check(q_BTNH, segments, impl)
  if impl == "dense":
    return attend_dense(q_BTNH, q_pos_BT, q_valid_BT, segments, scale=scale, softcap=softcap,
                        window=window)
  raise NotImplementedError("blockwise attention: in progress")
