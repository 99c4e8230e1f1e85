"""Hybrid models (Gated DeltaNet beside full attention): the chunked delta rule equals the
recurrent one (values and gradients), padding leaves the state untouched, prefill + tail and
token-by-token decoding equal a full forward, and branch replay equals the naive twin on flat
and depth-2 tree batches (float64)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses
from models import deltanet as dn
from models import transformer as tfm
from helpers import assert_equal_f64, both_paths, cache_per_x64, make_batch, make_tree, max_rel_err
from helpers import slow_where


@cache_per_x64
def hybrid(dtype="float64", **overrides):
  cfg = tfm.preset("hybrid_tiny", dtype=dtype, param_dtype=dtype, **overrides)
  params = tfm.init_params(cfg, jax.random.key(0))
  # Perturb every leaf (norm scales, dt_bias, A_log away from their init).
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return cfg, jax.tree.unflatten(treedef, leaves)


def rule_inputs(seed, B=2, T=11, N=4, H=8, J=6):
  rng = np.random.default_rng(seed)
  q = dn.l2norm(jnp.asarray(rng.normal(size=(B, T, N, H)))) * H**-0.5
  k = dn.l2norm(jnp.asarray(rng.normal(size=(B, T, N, H))))
  v = jnp.asarray(rng.normal(size=(B, T, N, J)))
  g = -jnp.asarray(rng.uniform(0, 2, (B, T, N)))
  beta = jnp.asarray(rng.uniform(0, 1, (B, T, N)))
  return q, k, v, g, beta, jnp.asarray(rng.normal(size=(B, N, H, J)))


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunked_equals_recurrent_float64(chunk):
  with jax.enable_x64(True):
    args = rule_inputs(chunk)
    w_o = jnp.asarray(np.random.default_rng(0).normal(size=args[2].shape))
    w_s = jnp.asarray(np.random.default_rng(1).normal(size=args[5].shape))

    def loss(fn, *a):
      o, s = fn(*a)
      return jnp.sum(o * w_o) + jnp.sum(s * w_s)

    chunked = functools.partial(dn.chunked_delta_rule, chunk=chunk)
    l1, g1 = jax.value_and_grad(functools.partial(loss, chunked), range(6))(*args)
    l2, g2 = jax.value_and_grad(functools.partial(loss, dn.recurrent_delta_rule), range(6))(*args)
    assert abs(float(l1 - l2)) <= 1e-10 * abs(float(l2))
    assert max_rel_err(g1, g2) < 1e-10
    assert min(float(jnp.max(jnp.abs(g))) for g in g2) > 1e-3


@pytest.mark.parametrize("c", [1, 3, 4, 13, 64])
def test_unit_lower_inverse_float64(c):
  """The blocked inverse the chunked rule uses (no LAPACK call) against numpy's inverse, on
  matrices like the rule's: unit diagonal, strictly lower entries (beta k_i.k_j decay) in
  (-1, 1)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(c)
    L = np.tril(rng.uniform(-1, 1, (2, 3, c, c)) * 0.5, -1) + np.eye(c)
    ours = np.asarray(dn.unit_lower_inverse(jnp.asarray(L)))
    np.testing.assert_allclose(ours, np.linalg.inv(L), rtol=1e-10, atol=1e-12)
    assert np.all(np.triu(ours, 1) == 0)


@pytest.mark.slow  # 89 s (hybrid_test's flat shape, tree, decoding and chunked recurrence stay)
def test_padding_leaves_state_untouched():
  """Left padding of a prefix and right padding of a tail give the unpadded states."""
  with jax.enable_x64(True):
    cfg, params = hybrid()
    rng = np.random.default_rng(0)
    tok = jnp.asarray(rng.integers(0, 128, (1, 6)))
    ones = jnp.ones((1, 6), bool)
    ref = tfm.prefill(params, cfg, tok, ones).kv
    pad = lambda x, left, right: jnp.pad(x, ((0, 0), (left, right)))
    left = tfm.prefill(params, cfg, pad(tok, 3, 0), pad(ones, 3, 0)).kv
    tail_tok = jnp.asarray(rng.integers(0, 128, (1, 4)))
    t_ones = jnp.ones((1, 4), bool)
    run = lambda t, v: tfm.Transformer(cfg).apply(
      {"params": params}, t, tfm.positions_from_valid(v, 6), v, [(ref, ones)]
    )[1]
    tail = run(tail_tok, t_ones)
    right = run(pad(tail_tok, 0, 3), pad(t_ones, 0, 3))
    for i in range(3):  # the linear layers
      for a, b in ((left[i], ref[i]), (right[i], tail[i])):
        assert isinstance(a, dn.LinearState)
        np.testing.assert_allclose(a.state_BNHJ, b.state_BNHJ, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(a.conv_BWC, b.conv_BWC, rtol=1e-12, atol=1e-13)
      assert float(jnp.max(jnp.abs(tail[i].state_BNHJ - ref[i].state_BNHJ))) > 1e-3


def test_prefill_tail_and_decode_equal_forward():
  """prefill + tail (chunked) and one token at a time (the recurrent form) equal forward."""
  with jax.enable_x64(True):
    cfg, params = hybrid()
    rng = np.random.default_rng(1)
    tok = jnp.asarray(rng.integers(0, 128, (2, 13)))
    valid = jnp.ones((2, 13), bool).at[1, :3].set(False)
    h = tfm.forward(params, cfg, tok, valid)
    P = 8
    cache = tfm.prefill(params, cfg, tok[:, :P], valid[:, :P])
    h_tail = tfm.tail(params, cfg, cache, valid[:, :P], tok[:, P:], valid[:, P:])
    np.testing.assert_allclose(h_tail, h[:, P:], rtol=1e-10, atol=1e-10)
    # Decode: every step's context is the prefix and the tokens so far (the linear layers
    # read the last segment's state).
    model = tfm.Transformer(cfg)
    context, offset = [(cache.kv, valid[:, :P])], jnp.sum(valid[:, :P], 1, keepdims=True)
    for t in range(P, 13):
      h_t, own = model.apply(
        {"params": params}, tok[:, t : t + 1], offset + (t - P), valid[:, t : t + 1], context
      )
      np.testing.assert_allclose(h_t[:, 0], h[:, t], rtol=1e-10, atol=1e-10)
      # Attention layers append their own K/V segment; linear ones carry the new state.
      context = context + [(own, jnp.ones((2, 1), bool))]


@pytest.mark.parametrize(
  "overrides", [dict(linear_remat=False), dict(linear_chunk=1), dict(linear_chunk=13)], ids=str
)
def test_mixer_chunks_and_remat_leave_values_and_gradients(overrides):
  """The token mixer's chunking (4 positions, one, the whole sequence) and its per-chunk
  remat change what is stored, not the function: forward and gradient equal in float64."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    tok = jnp.asarray(rng.integers(0, 128, (2, 13)))
    valid = jnp.ones((2, 13), bool).at[1, :5].set(False)  # left padding across a chunk
    w = jnp.asarray(rng.normal(size=(2, 13, 32)))
    results = []
    for cfg_over in ({}, overrides):
      cfg, params = hybrid(**cfg_over)
      loss = lambda p: jnp.sum(tfm.forward(p, cfg, tok, valid) * w * valid[..., None])
      results.append(jax.value_and_grad(loss)(params))
    (l1, g1), (l2, g2) = results
    assert abs(float(l1 - l2)) <= 1e-12 * abs(float(l1))
    assert max_rel_err(g2, g1) < 1e-10


CASES = [
  dict(B=2, R=3, P=9, T=6),
  dict(B=2, R=4, P=6, T=5, W=2),
  dict(B=1, R=4, P=10, T=7, W=2, branch_chunk=2),
]


# the first and last cases under -m slow (46-50 s each; the trunk case W=2 kept)
@pytest.mark.parametrize(
  "case", slow_where(CASES, {str(CASES[0]), str(CASES[2])}, key=str), ids=str
)
def test_hybrid_replay_equals_naive_float64(case):
  case = dict(case)
  chunk = case.pop("branch_chunk", None)
  with jax.enable_x64(True):
    cfg, params = hybrid()
    batch = make_batch(7, **case, dtype=jnp.float64)
    assert_equal_f64(*both_paths(cfg, params, batch, losses.LossConfig(), branch_chunk=chunk))


def test_hybrid_tree_replay_equals_naive_float64():
  with jax.enable_x64(True):
    cfg, params = hybrid()
    tree = make_tree(5, (2, 3), B=2, P=7, T=(5, 4), W=2)
    loss_cfg = losses.LossConfig()
    fast = jax.jit(lambda p: engine.loss_and_grad(p, tree, cfg, loss_cfg, "replay"))(params)
    slow = jax.jit(lambda p: engine.loss_and_grad(p, tree, cfg, loss_cfg, "naive"))(params)
    assert_equal_f64(fast, slow)


@pytest.mark.slow  # the float64 cases cover the path; this one checks float32 tolerances
def test_hybrid_replay_float32():
  cfg, params = hybrid("float32")
  batch = make_batch(3, B=2, R=4, P=12, T=6, W=2)
  (l1, _, g1), (l2, _, g2) = both_paths(cfg, params, batch, losses.LossConfig())
  np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
  assert max_rel_err(g1, g2) < 1e-4


@pytest.mark.parametrize(
  "overrides, field",
  [
    (
      dict(layer_types=("linear_attention", "mamba", "full_attention", "full_attention")),
      "layer_types",
    ),
    (dict(layer_types=("linear_attention",)), "layer_types"),
    (dict(linear_key_heads=3, linear_value_heads=6), "linear_key_heads"),
    (dict(linear_value_heads=6), "linear_value_heads"),
    (dict(linear_key_heads=4, linear_value_heads=2), "linear_value_heads"),
    (dict(sliding_window=4), "sliding_window"),
    (dict(sliding_window=4, local_layers=(1,)), "sliding_window"),
    (dict(attn_logit_softcap=20.0), "attn_logit_softcap"),
    (dict(rotary_fraction=0.375), "rotary_fraction"),  # 3 of 8 dims: odd
    (dict(rotary_fraction=1.5), "rotary_fraction"),
  ],
)
def test_bad_hybrid_configs_name_the_field(overrides, field):
  with pytest.raises(ValueError, match=field):
    tfm.preset("hybrid_tiny", **overrides)


@pytest.mark.parametrize("trunk_len", [2])  # a trunk, then R branches forked from its state
def test_hybrid_sampler_decodes_with_the_recurrent_state(trunk_len):
  """Greedy decoding (prefill once, then one token at a time through the linear layers'
  recurrent form) equals an argmax loop over the full forward."""
  from branch_replay.core import sampler

  cfg, params = hybrid("float32")
  rng = np.random.default_rng(2)
  prompt = jnp.asarray(rng.integers(3, 128, (2, 7)), jnp.int32)
  valid = jnp.ones((2, 7), bool).at[0, :3].set(False)
  prompt = jnp.where(valid, prompt, 0)
  n = trunk_len + 4
  s = jax.jit(
    lambda p: sampler.sample(
      p,
      cfg,
      sampler.SamplerConfig(max_new_tokens=4, temperature=0.0, trunk_len=trunk_len),
      prompt,
      valid,
      jax.random.key(0),
      2,
    )
  )(params)
  tokens = np.concatenate([np.asarray(prompt), np.zeros((2, n), np.int32)], 1)
  mask = np.concatenate([np.asarray(valid), np.zeros((2, n), bool)], 1)
  fwd = jax.jit(lambda t, v: tfm.logits(params, cfg, tfm.forward(params, cfg, t, v)))
  for i in range(n):
    tokens[:, 7 + i] = np.asarray(
      jnp.argmax(fwd(jnp.asarray(tokens), jnp.asarray(mask))[:, 6 + i], -1)
    )
    mask[:, 7 + i] = True
  np.testing.assert_array_equal(np.asarray(s.trunk_BW), tokens[:, 7 : 7 + trunk_len])
  for r in range(2):
    np.testing.assert_array_equal(np.asarray(s.tokens_BRT[:, r]), tokens[:, 7 + trunk_len :])
