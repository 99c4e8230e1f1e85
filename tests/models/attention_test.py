"""Blockwise attention (models/attention/__init__.py) against the dense oracle.

Cases: prefix self-attention (one causal segment, left padding) and the tail merge (a shared
prefix folded over g branch rows + the branch's own causal keys, right padding), with windows
smaller and larger than a block, soft-cap, GQA groups 1/2/4, T=1, lengths the blocks do not
divide and rows with no allowed key. Gradients of q and of every segment's k, v.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import attention
from attention_cases import (
  PREFIX_CASES,
  TAIL_CASES,
  assert_match,
  prefix_case,
  tail_case,
  value_and_grads,
)

KS = attention.KeySegment


@pytest.fixture(autouse=True)
def exact_block_sizes(monkeypatch):
  """Tiny test shapes would otherwise get one long key block (attention.MIN_TILE)."""
  monkeypatch.setattr(attention, "MIN_TILE", 0)


@pytest.mark.parametrize("name", list(PREFIX_CASES))
def test_prefix_matches_dense_float64(name):
  case_kw, kw = PREFIX_CASES[name]
  with jax.enable_x64(True):
    assert_match(prefix_case(np.random.default_rng(0), jnp.float64, **case_kw), 1e-10, **kw)


@pytest.mark.parametrize("name", list(TAIL_CASES))
def test_tail_merge_matches_dense_float64(name):
  case_kw, kw = TAIL_CASES[name]
  with jax.enable_x64(True):
    assert_match(tail_case(np.random.default_rng(1), jnp.float64, **case_kw), 1e-10, **kw)


def test_no_allowed_key_outputs_zero_float64():
  """A non-causal segment alone, one key row all invalid: its queries output 0, no NaN."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    q, q_pos, q_valid, segments = tail_case(rng, jnp.float64, pad_left=(19, 2))
    case = (q, q_pos, q_valid, segments[:1])
    assert_match(case, 1e-10, block_q=4, block_k=8)
    o = attention.attend(q, q_pos, q_valid, segments[:1], block_q=4, block_k=8)
    assert np.all(np.asarray(o[:3]) == 0.0)


@pytest.mark.parametrize("which", ["prefix", "tail"])
def test_matches_dense_float32(which):
  rng = np.random.default_rng(3)
  if which == "prefix":
    case = prefix_case(rng, jnp.float32, P=45, K=1)
  else:
    case = tail_case(rng, jnp.float32, T=9, tail_len=[9, 3, 1, 0, 9, 5])
  assert_match(case, 1e-5, 1e-6, softcap=3.0, window=13, block_q=8, block_k=16)


def test_bfloat16_close_to_dense():
  """bfloat16 inputs: float32 scores and accumulation, output in bfloat16."""
  case = tail_case(np.random.default_rng(4), jnp.bfloat16, T=9)
  dense, _ = value_and_grads("dense", case)
  block, grads = value_and_grads("blockwise", case, block_q=8, block_k=8)
  assert block.dtype == jnp.bfloat16 and grads[0].dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(block, np.float32), np.asarray(dense, np.float32), atol=2e-2
  )


@pytest.mark.parametrize("min_tile", [0, 1 << 14])
def test_vmap_over_branches_with_shared_prefix_unbatched(min_tile, monkeypatch):
  """The sampler's decode step: vmapped over branches, the prefix segment unbatched
  (min_tile > 0: the key blocks grow to one tile, as they do by default when decoding)."""
  monkeypatch.setattr(attention, "MIN_TILE", min_tile)
  q, q_pos, q_valid, segs = tail_case(
    np.random.default_rng(5), jnp.float32, B=1, R=4, T=1, pad_left=(4,)
  )
  prefix, own = segs
  own_R = jax.tree.map(lambda x: x[:, None], own._replace(causal=None))

  def step(impl, q, q_pos, q_valid, k, v, pos, valid):
    own = KS(k, v, pos, valid, causal=True)
    return attention.attend(
      q, q_pos, q_valid, [prefix, own], impl=impl, window=5, block_q=4, block_k=8
    )

  outs = {
    impl: jax.jit(jax.vmap(lambda *a: step(impl, *a)))(
      q[:, None],
      q_pos[:, None],
      q_valid[:, None],
      own_R.k_BSKH,
      own_R.v_BSKH,
      own_R.pos_BS,
      own_R.valid_BS,
    )
    for impl in ("dense", "blockwise")
  }
  np.testing.assert_allclose(outs["blockwise"], outs["dense"], rtol=1e-5, atol=1e-6)


def test_schedule_skips_masked_tiles():
  """Causal: key blocks after the query block are skipped; windows skip blocks before it."""
  P, bq = 64, 8
  q, q_pos, q_valid, (seg,) = prefix_case(
    np.random.default_rng(6), jnp.float32, P=P, pad_left=(0, 0)
  )
  st = lambda window: attention._Static((True,), 1.0, None, window, bq, bq)
  sg = attention._prepare(st(None), q, q_pos, q_valid, *seg[:4], True)
  np.testing.assert_array_equal(sg.lo_I, np.zeros(P // bq))
  np.testing.assert_array_equal(sg.hi_I, np.arange(1, P // bq + 1))
  sg = attention._prepare(st(9), q, q_pos, q_valid, *seg[:4], True)
  # query block i (positions 8i..8i+7) needs keys >= 8i - 8: blocks i-1 and i.
  np.testing.assert_array_equal(sg.lo_I, np.maximum(np.arange(P // bq) - 1, 0))
  # left padding: all-padding key blocks are skipped too.
  q, q_pos, q_valid, (seg,) = prefix_case(
    np.random.default_rng(6), jnp.float32, P=P, pad_left=(20, 17)
  )
  sg = attention._prepare(st(None), q, q_pos, q_valid, *seg[:4], True)
  np.testing.assert_array_equal(sg.lo_I, [0, 0, 2, 2, 2, 2, 2, 2])
  np.testing.assert_array_equal(sg.hi_I, [0, 0, 3, 4, 5, 6, 7, 8])


CAUSAL_SHRINK_CASES = {  # causal key blocks shrunk to the query block (attention.CAUSAL_TILE)
  "prefix_pad": ("prefix", dict(P=37, pad_left=(5, 0)), dict(block_q=8, block_k=32)),
  "prefix_window_softcap": (
    "prefix",
    dict(P=45, K=1),
    dict(block_q=8, block_k=32, window=13, softcap=2.0),
  ),
  "prefix_odd": ("prefix", dict(P=29, pad_left=(3, 11)), dict(block_q=7, block_k=16)),
  "tail_right_pad": (
    "tail",
    dict(T=20, tail_len=[20, 3, 1, 0, 17, 9]),
    dict(block_q=4, block_k=16),
  ),
  "tail_three_segments": ("tail", dict(T=13, generated=7), dict(block_q=4, block_k=16)),
}


@pytest.mark.parametrize("name", list(CAUSAL_SHRINK_CASES))
def test_causal_key_blocks_shrunk_match_dense_float64(name, monkeypatch):
  """A short causal segment's key blocks shrink to the query block's multiple (every tile
  qualifies at CAUSAL_TILE=1): the same result as dense, and the schedule is the triangle."""
  monkeypatch.setattr(attention, "CAUSAL_TILE", 1)
  which, case_kw, kw = CAUSAL_SHRINK_CASES[name]
  make = prefix_case if which == "prefix" else tail_case
  with jax.enable_x64(True):
    case = make(np.random.default_rng(8), jnp.float64, **case_kw)
    assert_match(case, 1e-10, **kw)
    q, q_pos, q_valid, segs = case
    st = attention._Static((True,), 1.0, None, None, kw["block_q"], kw["block_k"], causal_tile=1)
    sg = attention._prepare(st, q, q_pos, q_valid, *segs[-1][:4], True)
    assert sg.bk == sg.bq < kw["block_k"]


def test_causal_key_blocks_shrink_only_where_it_pays():
  """The rule's two limits: tiles keep CAUSAL_TILE scores (a lone prefix row of 1,024 keys
  keeps block_k) and the segment is short (S < 8 (block_k - block_q): a long one keeps it);
  8 tail rows of 512 shrink to 128, computing 10 of 16 tile areas instead of 4 whole blocks."""
  N, K, H, bq, bk = 4, 2, 8, 128, 512

  def key_block(rows, S):
    q = jnp.zeros((rows, S, N, H))
    pos = jnp.broadcast_to(jnp.arange(S), (rows, S))
    valid = jnp.ones((rows, S), bool)
    kv = jnp.zeros((rows, S, K, H))
    st = attention._Static((True,), 1.0, None, None, bq, bk, causal_tile=attention.CAUSAL_TILE)
    sg = attention._prepare(st, q, pos, valid, kv, kv, pos, valid, True)
    return sg.bk, int(np.sum(np.asarray(sg.hi_I) - np.asarray(sg.lo_I)))

  assert key_block(8, 512) == (128, 10)
  assert key_block(1, 1024) == (512, 12)  # Bk * N * bq * 128 = 2^16 scores: too small a tile
  assert key_block(8, 1536) == (128, 12 * 13 // 2)  # the naive twin's rows of P + T
  # S = 8 (bk - bq): query block i of 24 needs key blocks 0..i // 4
  assert key_block(8, 3072) == (512, sum(i // 4 + 1 for i in range(24)))


def _tail_temp_bytes(g, vmapped=False):
  """Compiled temporary memory of d(tail loss)/d(q, prefix k, v) at g branches x T = 96/g.
  vmapped: the trap, the kernel vmapped over branches with the prefix K/V unbatched."""
  B, P, N, K, H = 1, 1024, 4, 2, 64
  T = 96 // g
  q, q_pos, q_valid, segs = tail_case(
    np.random.default_rng(7), jnp.float32, B=B, R=g, T=T, P=P, N=N, K=K, H=H, pad_left=(0,)
  )
  kw = dict(block_q=32, block_k=128)

  def loss(q, k, v):
    prefix, own = segs[0]._replace(k_BSKH=k, v_BSKH=v), segs[1]
    if not vmapped:
      return attention.attend(q, q_pos, q_valid, [prefix, own], **kw).sum()
    one = lambda q, pos, valid, k, v: attention.attend(
      q[None],
      pos[None],
      valid[None],
      [prefix, KS(k[None], v[None], pos[None], valid[None], causal=True)],
      **kw,
    ).sum()
    return jax.vmap(one)(q, q_pos, q_valid, own.k_BSKH, own.v_BSKH).sum()

  compiled = (
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, segs[0].k_BSKH, segs[0].v_BSKH).compile()
  )
  return compiled.memory_analysis().temp_size_in_bytes


def test_tail_temp_memory_flat_in_branches():
  """No per-branch prefix cotangent: at fixed g*T the tail's temporaries do not grow with g
  (vmapping the kernel over branches, the trap, does: a [g, P, K, H] cotangent)."""
  block = {g: _tail_temp_bytes(g) for g in (1, 8)}
  trap = _tail_temp_bytes(8, vmapped=True)
  assert trap > block[1] + 4 * 1024 * 2 * 64 * 4, (trap, block)  # sees >= g/2 prefix copies
  assert block[8] <= 1.1 * block[1], block


@pytest.mark.parametrize(
  "field,kw",
  [
    ("model.attention_block_q", dict(block_q=0)),
    ("model.attention_block_k", dict(block_k=-4)),
    ("model.attention", dict(impl="flash")),
    ("q_valid_BT", dict(q_valid=np.ones((2, 36), bool))),
    ("segment 0 pos_BS", dict(pos=np.zeros((1, 37), np.int32))),
  ],
)
def test_bad_input(field, kw):
  q, q_pos, q_valid, segs = prefix_case(np.random.default_rng(8), jnp.float32)
  q_valid = kw.pop("q_valid", q_valid)
  if "pos" in kw:
    segs = [segs[0]._replace(pos_BS=kw.pop("pos"))]
  with pytest.raises(ValueError, match=field):
    attention.attend(q, q_pos, q_valid, segs, **kw)


def test_empty_segment_adds_no_key():
  """A zero-length segment (e.g. no generated tokens yet) changes nothing; its K/V get 0."""
  with jax.enable_x64(True):
    q, q_pos, q_valid, segs = tail_case(np.random.default_rng(9), jnp.float64, T=4)
    B, _, K, H = segs[1].k_BSKH.shape
    empty = KS(
      jnp.zeros((B, 0, K, H)),
      jnp.zeros((B, 0, K, H)),
      jnp.zeros((B, 0), int),
      jnp.zeros((B, 0), bool),
    )
    assert_match((q, q_pos, q_valid, [segs[0], empty, segs[1]]), 1e-10, block_q=4, block_k=8)
