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
  fused      a fused GPU kernel per segment (tokamax, fused.py), merged the same way;
             refused (ValueError) without tokamax and a supported GPU: use blockwise.
A new kernel is a module beside these (segments.py holds the segment type and the merge),
selected by `model.attention`, and equal to `dense` in float64 on awkward shapes
(tests/models/attention_test.py). context_parallel.py splits the tails over a mesh axis.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Sequence

import jax
from jax import lax
import jax.numpy as jnp

from models.attention.segments import IMPLS, KeySegment  # noqa: F401 (attention.KeySegment, .IMPLS)
from models.attention.segments import (
  acc_dtype as _acc_dtype,
  check,
  check_masks,
  merge,
  segment_mask,
)

Array = jax.Array


def attend_dense(
  q_BTNH, q_pos_BT, q_valid_BT, segments, *, scale=None, softcap=None, window=None
) -> Array:
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
    Bk, S = seg.k_BSKH.shape[:2]
    g = Bq // Bk
    # The g query rows of a key row read it in one contraction (no per-row copy of K or V).
    q_BgTKGH = q_BTKGH.reshape(Bk, g, *q_BTKGH.shape[1:])
    s_BKTGS = jnp.einsum(
      "BgTKGH,BSKH->BgKTGS", q_BgTKGH, seg.k_BSKH, preferred_element_type=acc
    ).reshape(Bq, K, T, N // K, S)
    if softcap is not None:
      s_BKTGS = jnp.tanh(s_BKTGS / softcap) * softcap
    allowed_BTS = segment_mask(q_pos_BT, q_valid_BT, seg, window)
    scores.append(jnp.where(allowed_BTS[:, None, :, None, :], s_BKTGS, neg))
    values.append(seg.v_BSKH)
    masks.append(allowed_BTS)
  s_BKTGS = jnp.concatenate(scores, axis=-1)
  p_BKTGS = jax.nn.softmax(s_BKTGS, axis=-1)
  # PV per segment (no concatenated V: a shared segment under vmap is read, never copied).
  out_BTKGH, start = 0.0, 0
  for v_BSKH in values:
    Bk, S = v_BSKH.shape[:2]
    p_seg = p_BKTGS[..., start : start + S].astype(v_BSKH.dtype)
    p_BgKTGS = p_seg.reshape(Bk, Bq // Bk, *p_seg.shape[1:])
    out_BTKGH = out_BTKGH + jnp.einsum(
      "BgKTGS,BSKH->BgTKGH", p_BgKTGS, v_BSKH, preferred_element_type=acc
    ).reshape(Bq, T, K, N // K, H)
    start += S
  any_BT = jnp.any(jnp.concatenate(masks, axis=-1), axis=-1)
  out_BTKGH = jnp.where(any_BT[:, :, None, None, None], out_BTKGH, 0.0)
  return out_BTKGH.reshape(Bq, T, N, H).astype(q_BTNH.dtype)


# ---------------------------------------------------------------------------------------------
# Blockwise attention. Per segment the queries are put in a canonical layout
#   q_BKQH  [Bk, K, Tq*G, H]: rows (t, gi) t-major, Tq = g*T padded to nq*bq query positions,
# keys/values k_BKSH [Bk, K, Sp, H] (Sp = S padded to nk*bk), so one tile's scores are a batched
# matmul [Bk, K, bq*G, H] x [Bk, K, bk, H] -> [Bk, K, bq*G, bk] with the kv-head axis leading
# and the query group folded into the rows (no repeated K/V).


MIN_TILE = 1 << 14  # scores per tile below which key blocks grow (see _prepare)
# A short causal segment's key blocks shrink from block_k to the smallest multiple of the
# query block whose tiles still hold CAUSAL_TILE scores (Bk * N * bq * bk): tiles above the
# diagonal are then skipped and only the diagonal ones masked. It applies where a key block
# longer than the query block wastes much (masked scores are about (bk - bq) / S of those
# computed: above 1/8, i.e. S < 8 (bk - bq)). Tails of 8 x 512 at bq=128, bk=512, 4 query heads:
# key blocks of 128, 10 of 16 tile areas computed (the CPU step -3%, docs/performance.md). A
# lone 1,024-token prefix (Bk=1) keeps block_k: its tiles would be too small to pay the
# loop's per-tile cost. A 128K prefix keeps it too: its masked share is small, and shrinking
# would multiply the loop's iterations.
CAUSAL_TILE = 1 << 18


class _Static(NamedTuple):
  causal: tuple  # per segment
  scale: float
  softcap: Optional[float]
  window: Optional[int]
  block_q: int
  block_k: int
  min_tile: int = 0
  causal_tile: int = 0  # 0: causal segments keep block_k
  # Backward loop order: key blocks outside, so dK/dV are finished one key block at a time
  # and stored in the keys' dtype (not a whole-length accumulator in float32); the
  # context-parallel paths set it, where the keys are the whole gathered sequence.
  key_major_bwd: bool = False


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _blocks(n: int, block: int) -> tuple[int, int]:
  """(number of blocks, block size) covering n with the fewest blocks of at most `block`,
  balanced (sizes rounded up to a multiple of 8 when that stays within `block`)."""
  nb = _cdiv(n, block)
  b = _cdiv(n, nb)
  if b % 8 and _cdiv(b, 8) * 8 <= block:
    b = _cdiv(b, 8) * 8
  return nb, b


def _pad_axis(x, axis: int, to: int, value=0):
  pad = to - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _fold(x_BT_, g: int, K: int, Tp: int):
  """[Bq, T, N, *rest] -> [Bq/g, K, Tp*G, *rest]: g consecutive rows folded into one query
  axis (padded to Tp positions), the kv head leading, the group G folded into the rows."""
  Bq, T, N = x_BT_.shape[:3]
  rest = x_BT_.shape[3:]
  G = N // K
  x = _pad_axis(x_BT_.reshape(Bq // g, g * T, K, G, *rest), 1, Tp)
  x = jnp.moveaxis(x, 2, 1)
  return x.reshape(Bq // g, K, Tp * G, *rest)


def _unfold(x_BKQ_, g: int, T: int, G: int):
  """Inverse of `_fold` (drops the padded positions): -> [Bk*g, T, K*G, *rest]."""
  Bk, K, QG = x_BKQ_.shape[:3]
  rest = x_BKQ_.shape[3:]
  x = x_BKQ_.reshape(Bk, K, QG // G, G, *rest)[:, :, : g * T]
  x = jnp.moveaxis(x, 1, 2)
  return x.reshape(Bk * g, T, K * G, *rest)


class _Seg(NamedTuple):
  """One segment in the canonical layout, with its tile schedule."""

  q_BKQH: Array  # scaled queries
  qpos_BQ: Array
  qvalid_BQ: Array
  k_BKSH: Array
  v_BKSH: Array
  kpos_BS: Array
  kvalid_BS: Array
  lo_I: Array  # key blocks [lo[i], hi[i]) hold every allowed key of query block i
  hi_I: Array
  full_IJ: Array  # tile (i, j) allows every pair: its scores need no mask
  qlo_J: Array  # query blocks [qlo[j], qhi[j]) hold every query that key block j serves
  qhi_J: Array
  g: int
  bq: int
  bk: int
  causal: bool


def _prepare(st: _Static, qs_BTNH, q_pos_BT, q_valid_BT, k, v, kpos, kvalid, causal) -> _Seg:
  Bq, T, N, H = qs_BTNH.shape
  Bk, S, K, _ = k.shape
  g = Bq // Bk
  nq, bq = _blocks(g * T, st.block_q)
  # Few query rows (decoding): longer key blocks, so a tile still holds ~MIN_TILE scores
  # instead of looping over many tiny tiles.
  nk, bk = _blocks(S, max(st.block_k, st.min_tile // (Bk * N * bq)))
  if causal and st.causal_tile and 8 * (bk - bq) > S:
    bk_causal = _cdiv(max(st.causal_tile // (Bk * N * bq), 1), bq) * bq
    if bk_causal < bk:
      nk, bk = _blocks(S, bk_causal)
  Tp, Sp = nq * bq, nk * bk
  q_BKQH = _fold(qs_BTNH, g, K, Tp)
  qpos_BQ = _pad_axis(q_pos_BT.reshape(Bk, g * T), 1, Tp)
  qvalid_BQ = _pad_axis(q_valid_BT.reshape(Bk, g * T), 1, Tp, False)
  k_BKSH = jnp.moveaxis(_pad_axis(k, 1, Sp), 2, 1)
  v_BKSH = jnp.moveaxis(_pad_axis(v, 1, Sp), 2, 1)
  kpos_BS = _pad_axis(kpos, 1, Sp)
  kvalid_BS = _pad_axis(kvalid, 1, Sp, False)
  # The schedule: tile (i, j) is needed when some row has a valid query in block i and a
  # valid key in block j that the window lets it see (exact: the closest pair is the block's
  # smallest query position against the key block's largest key position), and, for the
  # causal segment, when key block j starts at or before query block i ends (static).
  qv_BIq = qvalid_BQ.reshape(Bk, nq, bq)
  kv_BJk = kvalid_BS.reshape(Bk, nk, bk)
  need_BIJ = qv_BIq.any(-1)[:, :, None] & kv_BJk.any(-1)[:, None, :]
  if st.window is not None:
    big = jnp.iinfo(qpos_BQ.dtype).max
    qmin_BI = jnp.where(qv_BIq, qpos_BQ.reshape(Bk, nq, bq), big).min(-1)
    kmax_BJ = jnp.where(kv_BJk, kpos_BS.reshape(Bk, nk, bk), -big).max(-1)
    qmin_BI = jnp.where(qv_BIq.any(-1), qmin_BI, 0)
    kmax_BJ = jnp.where(kv_BJk.any(-1), kmax_BJ, 0)
    need_BIJ &= qmin_BI[:, :, None] - kmax_BJ[:, None, :] < st.window
  need_IJ = need_BIJ.any(0)
  full_BIJ = qv_BIq.all(-1)[:, :, None] & kv_BJk.all(-1)[:, None, :]
  if st.window is not None:
    qmax_BI = qpos_BQ.reshape(Bk, nq, bq).max(-1)
    kmin_BJ = kpos_BS.reshape(Bk, nk, bk).min(-1)
    full_BIJ &= qmax_BI[:, :, None] - kmin_BJ[:, None, :] < st.window
  full_IJ = full_BIJ.all(0)
  if causal:
    i, j = jnp.arange(nq)[:, None], jnp.arange(nk)[None, :]
    need_IJ &= j * bk <= (i + 1) * bq - 1
    full_IJ &= (j + 1) * bk - 1 <= i * bq
  lo_I, hi_I = _ranges(need_IJ)
  qlo_J, qhi_J = _ranges(need_IJ.T)
  return _Seg(
    q_BKQH,
    qpos_BQ,
    qvalid_BQ,
    k_BKSH,
    v_BKSH,
    kpos_BS,
    kvalid_BS,
    lo_I,
    hi_I,
    full_IJ,
    qlo_J,
    qhi_J,
    g,
    bq,
    bk,
    causal,
  )


def _ranges(need_IJ):
  """Per row i: [lo, hi) from its first to its last needed column (0, 0 if none)."""
  n = need_IJ.shape[1]
  any_I = need_IJ.any(1)
  lo_I = jnp.where(any_I, jnp.argmax(need_IJ, axis=1), 0).astype(jnp.int32)
  hi_I = jnp.where(any_I, n - jnp.argmax(need_IJ[:, ::-1], axis=1), 0).astype(jnp.int32)
  return lo_I, hi_I


def _tile(st: _Static, sg: _Seg, i, j, q_BKRH, acc, masked=True, keys_major=False):
  """Scores of query block i (rows q_BKRH) against key block j: (masked, capped) scores in
  acc, [Bk, K, bq*G, bk] (keys_major: [Bk, K, bk, bq*G], so the backward's dK/dV products
  are plain matmuls); masked entries are -inf (masked=False: a full tile, no mask)."""
  bq, bk = sg.bq, sg.bk
  k_BKSH = lax.dynamic_slice_in_dim(sg.k_BKSH, j * bk, bk, axis=2)
  if keys_major:
    s = jnp.einsum("BKSH,BKRH->BKSR", k_BKSH, q_BKRH, preferred_element_type=acc)
  else:
    s = jnp.einsum("BKRH,BKSH->BKRS", q_BKRH, k_BKSH, preferred_element_type=acc)
  if st.softcap is not None:
    s = jnp.tanh(s / st.softcap) * st.softcap
  if not masked:
    return s, s
  qvalid_Bq = lax.dynamic_slice_in_dim(sg.qvalid_BQ, i * bq, bq, axis=1)
  kvalid_Bk = lax.dynamic_slice_in_dim(sg.kvalid_BS, j * bk, bk, axis=1)
  allowed_Bkq = kvalid_Bk[:, :, None] & qvalid_Bq[:, None, :]
  if sg.causal:
    qi = i * bq + jnp.arange(bq)
    kj = j * bk + jnp.arange(bk)
    allowed_Bkq &= (kj[:, None] <= qi[None, :])[None]
  if st.window is not None:
    qpos_Bq = lax.dynamic_slice_in_dim(sg.qpos_BQ, i * bq, bq, axis=1)
    kpos_Bk = lax.dynamic_slice_in_dim(sg.kpos_BS, j * bk, bk, axis=1)
    allowed_Bkq &= qpos_Bq[:, None, :] - kpos_Bk[:, :, None] < st.window
  B, K = s.shape[:2]
  G = q_BKRH.shape[2] // bq
  if keys_major:  # rows (key), columns (query, group)
    out = jnp.where(allowed_Bkq[:, None, :, :, None], s.reshape(B, K, bk, bq, G), -jnp.inf)
  else:  # rows (query, group), columns (key)
    allowed_Bqk = jnp.swapaxes(allowed_Bkq, 1, 2)
    out = jnp.where(allowed_Bqk[:, None, :, None, :], s.reshape(B, K, bq, G, bk), -jnp.inf)
  return out.reshape(s.shape), s


def _mask_if_needed(sg: _Seg, i, j, fn):
  """fn(masked) for tile (i, j), skipping the mask where the tile allows every pair."""
  return lax.cond(sg.full_IJ[i, j], lambda: fn(False), lambda: fn(True))


def _segment_fwd(st: _Static, sg: _Seg, acc):
  """Online softmax over the scheduled key blocks: normalised o [Bk, K, Q, H], lse [Bk, K, Q]
  (rows with no allowed key: o = 0, lse = -inf)."""
  B, K, Q, H = sg.q_BKQH.shape
  G = Q // sg.qvalid_BQ.shape[1]
  R = sg.bq * G  # rows of one query block
  nq = Q // R
  vdt = sg.v_BKSH.dtype

  def q_block(i, carry):
    o_BKQH, lse_BKQ = carry
    q_BKRH = lax.dynamic_slice_in_dim(sg.q_BKQH, i * R, R, axis=2)

    def k_block(j, c):
      return _mask_if_needed(sg, i, j, lambda masked: k_step(j, c, masked))

    def k_step(j, c, masked):
      m_BKR, l_BKR, a_BKRH = c
      s_BKRS, _ = _tile(st, sg, i, j, q_BKRH, acc, masked)
      m_new = jnp.maximum(m_BKR, s_BKRS.max(-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      p_BKRS = jnp.exp(s_BKRS - m_safe[..., None])
      alpha = jnp.exp(m_BKR - m_safe)
      v_BKSH = lax.dynamic_slice_in_dim(sg.v_BKSH, j * sg.bk, sg.bk, axis=2)
      pv_BKRH = jnp.einsum(
        "BKRS,BKSH->BKRH", p_BKRS.astype(vdt), v_BKSH, preferred_element_type=acc
      )
      return m_new, alpha * l_BKR + p_BKRS.sum(-1), alpha[..., None] * a_BKRH + pv_BKRH

    init = (
      jnp.full((B, K, R), -jnp.inf, acc),
      jnp.zeros((B, K, R), acc),
      jnp.zeros((B, K, R, H), acc),
    )
    m_BKR, l_BKR, a_BKRH = lax.fori_loop(sg.lo_I[i], sg.hi_I[i], k_block, init)
    some = l_BKR > 0
    l_safe = jnp.where(some, l_BKR, 1.0)
    o_BKRH = jnp.where(some[..., None], a_BKRH / l_safe[..., None], 0.0)
    lse_BKR = jnp.where(some, m_BKR + jnp.log(l_safe), -jnp.inf)
    return (
      lax.dynamic_update_slice_in_dim(o_BKQH, o_BKRH, i * R, axis=2),
      lax.dynamic_update_slice_in_dim(lse_BKQ, lse_BKR, i * R, axis=2),
    )

  init = (jnp.zeros((B, K, Q, H), acc), jnp.full((B, K, Q), -jnp.inf, acc))
  return lax.fori_loop(0, nq, q_block, init)


def _tile_grads(st: _Static, sg: _Seg, i, j, q_BKRH, do_BKRH, lse_BKR, d_BKR, acc, masked):
  """(dq, dk, dv) of tile (i, j), in acc. Key-major tiles [Bk, K, bk, R]: dV = P^T dO and
  dK = dS^T Q are plain matmuls."""
  bk, qdt = sg.bk, sg.q_BKQH.dtype
  s_BKSR, capped_BKSR = _tile(st, sg, i, j, q_BKRH, acc, masked, keys_major=True)
  p_BKSR = jnp.exp(s_BKSR - lse_BKR[:, :, None, :])
  k_BKsH = lax.dynamic_slice_in_dim(sg.k_BKSH, j * bk, bk, axis=2)
  v_BKsH = lax.dynamic_slice_in_dim(sg.v_BKSH, j * bk, bk, axis=2)
  dv_BKsH = jnp.einsum(
    "BKSR,BKRH->BKSH", p_BKSR.astype(do_BKRH.dtype), do_BKRH, preferred_element_type=acc
  )
  dp_BKSR = jnp.einsum("BKSH,BKRH->BKSR", v_BKsH, do_BKRH, preferred_element_type=acc)
  ds_BKSR = p_BKSR * (dp_BKSR - d_BKR[:, :, None, :])
  if st.softcap is not None:  # through s = cap * tanh(s_raw / cap)
    t_BKSR = capped_BKSR / st.softcap
    ds_BKSR = ds_BKSR * (1.0 - t_BKSR * t_BKSR)
  ds_BKSR = ds_BKSR.astype(qdt)
  dq_BKRH = jnp.einsum("BKSR,BKSH->BKRH", ds_BKSR, k_BKsH, preferred_element_type=acc)
  dk_BKsH = jnp.einsum("BKSR,BKRH->BKSH", ds_BKSR, q_BKRH, preferred_element_type=acc)
  return dq_BKRH, dk_BKsH, dv_BKsH


def _segment_bwd(st: _Static, sg: _Seg, lse_BKQ, do_BKQH, d_BKQ, acc):
  """Flash backward of one segment with the global lse: (dq of the scaled queries, dk, dv),
  canonical layout; dq in acc, dk/dv in acc (or, key_major_bwd, in the keys' dtype: the
  same sums in the same order, each key block's cast once it is complete)."""
  B, K, Q, H = sg.q_BKQH.shape
  G = Q // sg.qvalid_BQ.shape[1]
  R = sg.bq * G
  nq = Q // R
  bk = sg.bk
  lse_BKQ = jnp.where(lse_BKQ == -jnp.inf, 0.0, lse_BKQ)  # such rows have no allowed key

  def rows_of(i):
    """Query block i's rows: (q, do, lse, d)."""
    return tuple(
      lax.dynamic_slice_in_dim(x, i * R, R, axis=2) for x in (sg.q_BKQH, do_BKQH, lse_BKQ, d_BKQ)
    )

  def grads(i, j, rows):
    """Tile (i, j)'s (dq, dk, dv), in acc."""
    return _mask_if_needed(sg, i, j, lambda masked: _tile_grads(st, sg, i, j, *rows, acc, masked))

  def q_block(i, carry):
    dq_BKQH, dk_BKSH, dv_BKSH = carry
    rows = rows_of(i)

    def k_block(j, c):
      dq_BKRH, dk_BKSH, dv_BKSH = c
      dq_tile, dk_BKsH, dv_BKsH = grads(i, j, rows)
      add = lambda buf, x: lax.dynamic_update_slice_in_dim(
        buf, lax.dynamic_slice_in_dim(buf, j * bk, bk, axis=2) + x, j * bk, axis=2
      )
      return dq_BKRH + dq_tile, add(dk_BKSH, dk_BKsH), add(dv_BKSH, dv_BKsH)

    init = (jnp.zeros((B, K, R, H), acc), dk_BKSH, dv_BKSH)
    dq_BKRH, dk_BKSH, dv_BKSH = lax.fori_loop(sg.lo_I[i], sg.hi_I[i], k_block, init)
    return lax.dynamic_update_slice_in_dim(dq_BKQH, dq_BKRH, i * R, axis=2), dk_BKSH, dv_BKSH

  def k_major(j, carry):
    """Key block j over its query blocks (ascending, as q_block's sums run): dK/dV of the
    block finished and stored in the keys' dtype; dQ accumulated (over j ascending)."""
    dq_BKQH, dk_BKSH, dv_BKSH = carry

    def q_step(i, c):
      dq_BKQH, dk_BKsH, dv_BKsH = c
      dq_tile, dk_tile, dv_tile = grads(i, j, rows_of(i))
      dq_BKQH = lax.dynamic_update_slice_in_dim(
        dq_BKQH, lax.dynamic_slice_in_dim(dq_BKQH, i * R, R, axis=2) + dq_tile, i * R, axis=2
      )
      return dq_BKQH, dk_BKsH + dk_tile, dv_BKsH + dv_tile

    zeros = jnp.zeros((B, K, bk, H), acc)
    dq_BKQH, dk_BKsH, dv_BKsH = lax.fori_loop(
      sg.qlo_J[j], sg.qhi_J[j], q_step, (dq_BKQH, zeros, zeros)
    )
    put = lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), j * bk, axis=2)
    return dq_BKQH, put(dk_BKSH, dk_BKsH), put(dv_BKSH, dv_BKsH)

  if st.key_major_bwd:
    nk = sg.k_BKSH.shape[2] // bk
    return lax.fori_loop(
      0,
      nk,
      k_major,
      (
        jnp.zeros((B, K, Q, H), acc),
        jnp.zeros(sg.k_BKSH.shape, sg.k_BKSH.dtype),
        jnp.zeros(sg.v_BKSH.shape, sg.v_BKSH.dtype),
      ),
    )
  zeros_k = jnp.zeros(sg.k_BKSH.shape, acc)
  return lax.fori_loop(0, nq, q_block, (jnp.zeros((B, K, Q, H), acc), zeros_k, zeros_k))


def _scaled(st: _Static, q_BTNH):
  return (q_BTNH * jnp.asarray(st.scale, _acc_dtype(q_BTNH.dtype))).astype(q_BTNH.dtype)


def _prepare_all(st: _Static, q_BTNH, q_pos_BT, q_valid_BT, segs):
  qs_BTNH = _scaled(st, q_BTNH)
  return [
    _prepare(st, qs_BTNH, q_pos_BT, q_valid_BT, *seg, causal)
    for seg, causal in zip(segs, st.causal)
  ]


def _blockwise_fwd(st: _Static, q_BTNH, q_pos_BT, q_valid_BT, segs):
  Bq, T, N, H = q_BTNH.shape
  acc = _acc_dtype(q_BTNH.dtype)
  o_parts, lse_parts = [], []
  for sg in _prepare_all(st, q_BTNH, q_pos_BT, q_valid_BT, segs):
    K = sg.k_BKSH.shape[1]
    o_BKQH, lse_BKQ = _segment_fwd(st, sg, acc)
    o_parts.append(_unfold(o_BKQH, sg.g, T, N // K))
    lse_parts.append(_unfold(lse_BKQ, sg.g, T, N // K))
  o_BTNH, lse_BTN = merge(o_parts, lse_parts)
  return o_BTNH.astype(q_BTNH.dtype), lse_BTN


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise(st: _Static, q_BTNH, q_pos_BT, q_valid_BT, segs):
  return _blockwise_fwd(st, q_BTNH, q_pos_BT, q_valid_BT, segs)[0]


def _blockwise_vjp_fwd(st, q_BTNH, q_pos_BT, q_valid_BT, segs):
  o_BTNH, lse_BTN = _blockwise_fwd(st, q_BTNH, q_pos_BT, q_valid_BT, segs)
  return o_BTNH, (q_BTNH, q_pos_BT, q_valid_BT, segs, o_BTNH, lse_BTN)


def _blockwise_vjp_bwd(st, res, do_BTNH):
  q_BTNH, q_pos_BT, q_valid_BT, segs, o_BTNH, lse_BTN = res
  Bq, T, N, H = q_BTNH.shape
  acc = _acc_dtype(q_BTNH.dtype)
  d_BTN = jnp.sum(do_BTNH.astype(acc) * o_BTNH.astype(acc), axis=-1)
  dq_BTNH = jnp.zeros(q_BTNH.shape, acc)
  dsegs = []
  for sg, (k_BSKH, v_BSKH, _, _) in zip(_prepare_all(st, q_BTNH, q_pos_BT, q_valid_BT, segs), segs):
    K, Tp = k_BSKH.shape[2], sg.qvalid_BQ.shape[1]
    fold = lambda x: _fold(x, sg.g, K, Tp)
    dq_BKQH, dk_BKSH, dv_BKSH = _segment_bwd(
      st, sg, fold(lse_BTN), fold(do_BTNH.astype(q_BTNH.dtype)), fold(d_BTN), acc
    )
    dq_BTNH = dq_BTNH + _unfold(dq_BKQH, sg.g, T, N // K)
    S = k_BSKH.shape[1]
    dsegs.append(
      (
        jnp.moveaxis(dk_BKSH, 1, 2)[:, :S].astype(k_BSKH.dtype),
        jnp.moveaxis(dv_BKSH, 1, 2)[:, :S].astype(v_BSKH.dtype),
        None,
        None,
      )
    )
  dq_BTNH = (dq_BTNH * st.scale).astype(q_BTNH.dtype)
  return dq_BTNH, None, None, tuple(dsegs)


_blockwise.defvjp(_blockwise_vjp_fwd, _blockwise_vjp_bwd)


def _check_blocks(block_q, block_k) -> None:
  for name, b in (("model.attention_block_q", block_q), ("model.attention_block_k", block_k)):
    if isinstance(b, bool) or not isinstance(b, int) or b < 1:
      raise ValueError(
        f"{name}={b!r}: expected a positive integer (query/key positions per attention tile)"
      )


def attend(
  q_BTNH,
  q_pos_BT,
  q_valid_BT,
  segments: Sequence[KeySegment],
  *,
  scale: Optional[float] = None,
  softcap: Optional[float] = None,
  window: Optional[int] = None,
  impl: str = "blockwise",
  block_q: int = 128,
  block_k: int = 64,
  key_major_bwd: bool = False,
) -> Array:
  """Attention of q over the concatenation of `segments` (see the module docstring).
  key_major_bwd: the blockwise backward loops over key blocks outside (see _Static)."""
  check(q_BTNH, segments, impl)
  check_masks(q_BTNH, q_pos_BT, q_valid_BT, segments)
  _check_blocks(block_q, block_k)
  if impl == "dense":
    return attend_dense(
      q_BTNH, q_pos_BT, q_valid_BT, segments, scale=scale, softcap=softcap, window=window
    )
  if impl == "fused":  # refuses (ValueError) without tokamax and a supported GPU
    from models.attention import fused as attention_fused

    attention_fused.check_available()
  segments = [s for s in segments if s.k_BSKH.shape[1]]  # an empty segment adds no key
  if not segments or not q_BTNH.size:
    return jnp.zeros_like(q_BTNH)
  H = q_BTNH.shape[-1]
  if impl == "fused":
    return attention_fused.attend_fused(
      q_BTNH,
      q_pos_BT,
      q_valid_BT,
      segments,
      softcap=softcap,
      window=window,
      scale=1.0 / math.sqrt(H) if scale is None else scale,
    )
  st = _Static(
    causal=tuple(bool(s.causal) for s in segments),
    scale=float(1.0 / math.sqrt(H) if scale is None else scale),
    softcap=None if softcap is None else float(softcap),
    window=None if window is None else int(window),
    block_q=block_q,
    block_k=block_k,
    min_tile=MIN_TILE,
    causal_tile=CAUSAL_TILE,
    key_major_bwd=bool(key_major_bwd),
  )
  segs = tuple((s.k_BSKH, s.v_BSKH, s.pos_BS, s.valid_BS) for s in segments)
  return _blockwise(st, q_BTNH, q_pos_BT, q_valid_BT, segs)
