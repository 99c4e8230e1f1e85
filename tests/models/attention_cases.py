"""The attention test cases shared by tests/models/attention_test.py, attention_fused_test.py
and context_parallel_test.py: random prefix self-attention and tail-merge inputs (a shared prefix
folded over g branch rows + the branch's own causal keys), the named grids of shapes and block
sizes, and the loss-and-gradients probe run through `attention.attend`."""

import jax
import jax.numpy as jnp
import numpy as np

from models import attention

KS = attention.KeySegment


def positions(valid_BS, start_B=None):
  """RoPE convention: a key's position is the count of valid keys before it (+ start)."""
  pos_BS = np.cumsum(valid_BS, axis=1) - valid_BS
  return pos_BS + (0 if start_B is None else np.asarray(start_B)[:, None])


def prefix_case(rng, dtype, *, B=2, P=37, N=4, K=2, H=8, pad_left=(5, 0)):
  """Prefix self-attention: queries are the prefix tokens, one causal segment."""
  valid_BP = np.arange(P)[None] >= np.asarray(pad_left)[:, None]
  pos_BP = positions(valid_BP)
  q = jnp.asarray(rng.normal(size=(B, P, N, H)), dtype)
  k, v = (jnp.asarray(rng.normal(size=(B, P, K, H)), dtype) for _ in range(2))
  return (
    q,
    jnp.asarray(pos_BP),
    jnp.asarray(valid_BP),
    [KS(k, v, jnp.asarray(pos_BP), jnp.asarray(valid_BP), causal=True)],
  )


def tail_case(
  rng, dtype, *, B=2, R=3, T=5, P=19, N=4, K=2, H=8, pad_left=(4, 0), tail_len=None, generated=0
):
  """Tails: R branch rows per prompt read the prompt's prefix (folded, g=R), optionally a
  non-causal segment of `generated` earlier branch tokens, then their own keys causally."""
  valid_BP = np.arange(P)[None] >= np.asarray(pad_left)[:, None]
  pos_BP = positions(valid_BP)
  n_prefix_B = np.repeat(valid_BP.sum(1), R)
  rows = B * R
  lens = np.full(rows, T) if tail_len is None else np.asarray(tail_len)
  tvalid_BT = np.arange(T)[None] < lens[:, None]  # right padding
  new = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  segments = [KS(new(B, P, K, H), new(B, P, K, H), jnp.asarray(pos_BP), jnp.asarray(valid_BP))]
  start = n_prefix_B
  if generated:
    gvalid_BS = np.ones((rows, generated), bool)
    gvalid_BS[0, -2:] = False
    segments.append(
      KS(
        new(rows, generated, K, H),
        new(rows, generated, K, H),
        jnp.asarray(positions(gvalid_BS, start)),
        jnp.asarray(gvalid_BS),
      )
    )
    start = start + gvalid_BS.sum(1)
  tpos_BT = positions(tvalid_BT, start)
  segments.append(
    KS(
      new(rows, T, K, H),
      new(rows, T, K, H),
      jnp.asarray(tpos_BT),
      jnp.asarray(tvalid_BT),
      causal=True,
    )
  )
  return new(rows, T, N, H), jnp.asarray(tpos_BT), jnp.asarray(tvalid_BT), segments


def value_and_grads(impl, case, **kw):
  q, q_pos, q_valid, segments = case

  def loss(q, kvs):
    segs = [s._replace(k_BSKH=k, v_BSKH=v) for s, (k, v) in zip(segments, kvs)]
    o_BTNH = attention.attend(q, q_pos, q_valid, segs, impl=impl, **kw)
    w = jnp.cos(jnp.arange(o_BTNH.size, dtype=jnp.float32).reshape(o_BTNH.shape))
    return jnp.sum(
      o_BTNH.astype(w.dtype if o_BTNH.dtype != jnp.float64 else o_BTNH.dtype) * w
    ), o_BTNH

  kvs = [(s.k_BSKH, s.v_BSKH) for s in segments]
  (_, o), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(q, kvs)
  return o, grads


def assert_match(case, rtol, atol=0.0, **kw):
  dense = value_and_grads("dense", case, window=kw.get("window"), softcap=kw.get("softcap"))
  block = value_and_grads("blockwise", case, **kw)
  names = ["out", "dq"] + [f"d{kv}[{i}]" for i in range(len(case[3])) for kv in "kv"]
  for name, a, b in zip(names, jax.tree.leaves(dense), jax.tree.leaves(block)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(b)), name
    err = np.max(np.abs(a - b)) if a.size else 0.0
    scale = np.max(np.abs(a)) if a.size else 0.0
    assert err <= rtol * scale + atol, f"{name}: max err {err:.3g}, max |dense| {scale:.3g}"


PREFIX_CASES = {  # name: (case kwargs, attend kwargs)
  "gqa1_blocks8": (dict(N=4, K=4), dict(block_q=8, block_k=8)),
  "gqa2_blocks16x8": (dict(N=4, K=2), dict(block_q=16, block_k=8)),
  "gqa4_blocks8x16": (dict(N=4, K=1), dict(block_q=8, block_k=16)),
  "one_block": (dict(), dict(block_q=64, block_k=64)),
  "odd_blocks": (dict(P=29, pad_left=(3, 11)), dict(block_q=7, block_k=5)),
  "window_below_block": (dict(), dict(window=4, block_q=8, block_k=8)),
  "window_above_block": (dict(), dict(window=20, block_q=8, block_k=8)),
  "softcap": (dict(), dict(softcap=2.0, block_q=16, block_k=8)),
  "softcap_window_gqa4": (dict(K=1), dict(softcap=2.0, window=11, block_q=8, block_k=16)),
}

TAIL_CASES = {
  "merge_g3": (dict(), dict(block_q=8, block_k=8)),
  "merge_right_pad": (dict(T=9, tail_len=[9, 3, 1, 0, 9, 5]), dict(block_q=4, block_k=8)),
  "merge_window": (dict(T=9, P=30), dict(window=6, block_q=8, block_k=4)),
  "merge_window_large": (dict(T=9, P=30), dict(window=25, block_q=8, block_k=4)),
  "merge_softcap_gqa4": (dict(K=1), dict(softcap=2.0, block_q=4, block_k=4)),
  "merge_gqa1": (dict(K=4, T=7), dict(block_q=16, block_k=16)),
  "decode_t1": (dict(T=1), dict(block_q=2, block_k=8)),
  "decode_t1_window": (dict(T=1, P=30), dict(window=7, block_q=8, block_k=8)),
  "three_segments": (dict(T=6, generated=7), dict(window=9, block_q=8, block_k=4)),
  # Prompt 0's prefix is all padding and tail row 3 holds no valid query: rows with no
  # allowed key in a segment, and rows with no allowed key at all.
  "empty_rows": (dict(pad_left=(19, 0), tail_len=[5, 5, 5, 0, 2, 5]), dict(block_q=8, block_k=8)),
}
