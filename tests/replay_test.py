"""The central test: branch replay equals every branch run as its own full sequence."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay import engine, losses, policy, replay, tree
from branch_replay.batch import ReplayBatch, validate
from models import transformer as tfm
from tests.helpers import cache_per_x64


def make_batch(seed, B, R, P, T, W=0, ragged=True, vocab=128, pad_prefix=True, logps=False,
               dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  prefix_valid = np.ones((B, P), bool)
  if pad_prefix and B > 1 and P > W + 2:
    prefix_valid[1, :rng.integers(1, P - W - 1)] = False  # left padding on prompt 1
  tail_valid = np.ones((B, R, T), bool)
  if ragged and T > 1:
    lengths = rng.integers(1, T + 1, size=(B, R))
    tail_valid = np.arange(T)[None, None] < lengths[..., None]
  extra = {}
  if logps:  # off-policy data and a reference policy: exercises ratio clipping and KL
    extra = dict(old_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, T)), dtype),
                 ref_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, T)), dtype),
                 trunk_old_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype),
                 trunk_ref_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype))
  return ReplayBatch(
      prefix_BP=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32),
      prefix_valid_BP=jnp.asarray(prefix_valid),
      tails_BRT=jnp.asarray(rng.integers(0, vocab, (B, R, T)), jnp.int32),
      tail_valid_BRT=jnp.asarray(tail_valid),
      advantages_BR=jnp.asarray(rng.normal(size=(B, R)), dtype), trunk_len=W, **extra)


@cache_per_x64
def model(dtype="float64", **overrides):
  cfg = tfm.preset("tiny", dtype=dtype, param_dtype=dtype, **overrides)
  return cfg, tfm.init_params(cfg, jax.random.key(0))


def both_paths(cfg, params, batch, loss_cfg, branch_chunk=None):
  validate(batch, cfg.vocab_size, branch_chunk)
  fast = jax.jit(lambda p, b: policy.loss_and_grad(p, b, cfg, loss_cfg, "replay", branch_chunk))
  slow = jax.jit(lambda p, b: policy.loss_and_grad(p, b, cfg, loss_cfg, "naive"))
  return fast(params, batch), slow(params, batch)


def max_rel_err(a, b):
  """Largest relative error over leaves, relative to each leaf's scale."""
  errs = jax.tree.map(lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)),
                      a, b)
  return max(jax.tree.leaves(errs))


def assert_equal_f64(fast, slow, tol=1e-10):
  (l1, aux1, g1), (l2, aux2, g2) = fast, slow
  assert abs(float(l1) - float(l2)) <= tol * max(abs(float(l2)), 1e-3)
  assert jax.tree.structure(g1) == jax.tree.structure(g2)
  assert max_rel_err(g1, g2) < tol
  for name in aux1:
    np.testing.assert_allclose(aux1[name], aux2[name], rtol=tol, atol=tol)
  # The test can fail: the gradient is not trivially zero.
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g2)) > 1e-6


# Every (R, P) pair, each B value with every R and every P: 9 compiles instead of 18.
GRID = [(1 + (i + j) % 2, R, P) for i, R in enumerate([1, 3, 16]) for j, P in enumerate([1, 7, 64])]


@pytest.mark.parametrize("B, R, P", GRID)
def test_replay_equals_naive_float64(B, R, P):
  with jax.enable_x64(True):
    cfg, params = model("float64")
    batch = make_batch(B * 100 + R * 10 + P, B, R, P, T=5, dtype=jnp.float64)
    assert_equal_f64(*both_paths(cfg, params, batch, losses.LossConfig()))


@pytest.mark.parametrize("case", [
    dict(T=1, ragged=False),
    dict(W=3, aggregation="token_mean"),
    dict(W=3, aggregation="seq_mean"),
    dict(W=2, logps=True, kl_coef=0.1, epsilon=0.1, epsilon_high=0.3),
    dict(W=2, branch_chunk=4),
    dict(W=0, branch_chunk=1, aggregation="seq_mean"),
    dict(W=2, name="pg"),
    dict(W=2, logps=True, name="gspo", epsilon=0.01, kl_coef=0.1, aggregation="seq_mean"),
    dict(W=2, logps=True, name="ppo", token_adv=True, temperature=0.7, kl_coef=0.1),
])
def test_replay_variants_float64(case):
  case = dict(case)
  shape = dict(B=2, R=case.pop("R", 8), P=case.pop("P", 12), T=case.pop("T", 6),
               W=case.pop("W", 0), ragged=case.pop("ragged", True), logps=case.pop("logps", False))
  chunk = case.pop("branch_chunk", None)
  token_adv = case.pop("token_adv", False)
  with jax.enable_x64(True):
    cfg, params = model("float64")
    batch = make_batch(7, **shape, dtype=jnp.float64)
    if token_adv:  # PPO's per-token (GAE) advantages, a trunk token's differing per branch
      rng = np.random.default_rng(8)
      B, R, T, W = shape["B"], shape["R"], shape["T"], shape["W"]
      batch = batch.replace(advantages_BRT=jnp.asarray(rng.normal(size=(B, R, T))),
                            trunk_advantages_BRW=jnp.asarray(rng.normal(size=(B, R, W))))
    fast, slow = both_paths(cfg, params, batch, losses.LossConfig(**case), branch_chunk=chunk)
    assert_equal_f64(fast, slow)


def test_dpo_replay_equals_naive_float64():
  with jax.enable_x64(True):
    cfg, params = model("float64")
    batch = make_batch(3, B=2, R=2, P=9, T=5, W=2, logps=True, dtype=jnp.float64)
    assert_equal_f64(*both_paths(cfg, params, batch, losses.LossConfig(name="dpo")))
    with pytest.raises(ValueError, match="branch_chunk"):
      jax.eval_shape(lambda p: policy.loss_and_grad(p, batch, cfg, losses.LossConfig(name="dpo"),
                                                    "replay", branch_chunk=1), params)


def test_replay_equals_naive_float32():
  cfg, params = model("float32")
  batch = make_batch(11, B=2, R=16, P=64, T=8, W=4)
  (l1, _, g1), (l2, _, g2) = both_paths(cfg, params, batch, losses.LossConfig())
  np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g2)


def test_replay_bfloat16_close_to_naive():
  cfg, params = model("bfloat16")
  batch = make_batch(12, B=1, R=4, P=16, T=6)
  (l1, _, g1), (l2, _, g2) = both_paths(cfg, params, batch, losses.LossConfig())
  # bf16 activations round differently on the two paths; this bounds, not equates.
  np.testing.assert_allclose(np.float32(l1), np.float32(l2), rtol=5e-2, atol=5e-3)
  assert max_rel_err(g1, g2) < 0.1


def test_remat_equals_no_remat():
  with jax.enable_x64(True):
    cfg, params = model("float64")
    cfg_remat, _ = model("float64", remat=True)
    batch = make_batch(5, B=2, R=3, P=10, T=4, W=2, dtype=jnp.float64)
    lc = losses.LossConfig()
    a = jax.jit(lambda p: policy.loss_and_grad(p, batch, cfg, lc))(params)
    b = jax.jit(lambda p: policy.loss_and_grad(p, batch, cfg_remat, lc))(params)
    assert_equal_f64(a, b, tol=1e-12)


def test_staged_jits_equal_fused_and_prefix_compiles_once():
  """The prefix stage is jitted once; its vjp function is a pytree held across jit calls."""
  with jax.enable_x64(True):
    cfg, params = model("float64")
    lc = losses.LossConfig()
    traces = []

    def stages(batch):  # the engine's depth-1 functions: root, (no inner levels), leaves
      flat = tree.from_replay_batch(batch)
      root_fn, _, leaf_loss_fn, leaves_R = engine.replay_fns(flat, cfg,
                                                             engine.policy_head(flat, cfg, lc))
      return root_fn, leaf_loss_fn, leaves_R

    @jax.jit
    def prefix_stage(params, batch):
      traces.append(1)
      root_fn, _, _ = stages(batch)
      return replay.prefix_forward(lambda p, _: root_fn(p), params, None)

    @jax.jit
    def tail_stage(params, cache, batch):
      _, leaf_loss_fn, leaves_R = stages(batch)
      return replay.tails_value_and_grad(leaf_loss_fn, params, (cache,), leaves_R, batched=True)

    @jax.jit
    def prefix_backward(prefix_vjp, dcache):
      return prefix_vjp(dcache)[0]

    for seed in (1, 2):
      batch = make_batch(seed, B=2, R=3, P=8, T=4, W=1, dtype=jnp.float64)
      cache, prefix_vjp = prefix_stage(params, batch)
      loss, _, dparams_tail, dcache = tail_stage(params, cache, batch)
      grads = jax.tree.map(jnp.add, dparams_tail, prefix_backward(prefix_vjp, dcache[0]))
      fused_loss, _, fused = jax.jit(lambda p, b: policy.loss_and_grad(p, b, cfg, lc))(params,
                                                                                     batch)
      assert abs(float(loss - fused_loss)) < 1e-12
      assert max_rel_err(grads, fused) < 1e-12
    assert len(traces) == 1  # same shapes: one trace, one compile of the prefix


def test_prefill_plus_tail_equals_full_forward():
  with jax.enable_x64(True):
    cfg, params = model("float64")
    batch = make_batch(4, B=2, R=1, P=9, T=5, ragged=False, dtype=jnp.float64)
    tails_BT = batch.tails_BRT[:, 0]
    tail_valid_BT = batch.tail_valid_BRT[:, 0]

    @jax.jit
    def split_and_full(params):
      cache = tfm.prefill(params, cfg, batch.prefix_BP, batch.prefix_valid_BP)
      h_tail = tfm.tail(params, cfg, cache, batch.prefix_valid_BP, tails_BT, tail_valid_BT)
      h_full = tfm.forward(params, cfg, jnp.concatenate([batch.prefix_BP, tails_BT], 1),
                           jnp.concatenate([batch.prefix_valid_BP, tail_valid_BT], 1))
      return tfm.logits(params, cfg, h_tail), tfm.logits(params, cfg, h_full[:, 9:])

    split, full = split_and_full(params)
    np.testing.assert_allclose(split, full, rtol=1e-12, atol=1e-12)


def test_causality_by_gradient():
  """A position's logits have zero gradient w.r.t. the embeddings of later and padded tokens."""
  with jax.enable_x64(True):
    cfg, params = model("float64")
    # Tokens 0..9 come first, 50..59 later, 100.. are padding: disjoint embedding rows.
    tokens = jnp.asarray([[100, 101, 0, 1, 2, 3, 4, 50, 51, 52]], jnp.int32)
    valid = jnp.asarray([[False, False] + [True] * 8])
    t = 6  # last of the early tokens

    def logit_sum(embedding, params):
      params = {**params, "embed": {"embedding": embedding}}
      h = tfm.forward(params, cfg, tokens, valid)
      return jnp.sum(tfm.logits(params, cfg, h)[:, t] ** 2)

    g = jax.jit(jax.grad(logit_sum))(params["embed"]["embedding"], params)
    assert float(jnp.abs(g[:5]).max()) > 0  # earlier tokens matter
    assert float(jnp.abs(g[50:53]).max()) == 0.0  # later tokens never do
    assert float(jnp.abs(g[100:102]).max()) == 0.0  # padding is never attended


def test_tail_padding_does_not_change_loss():
  """Whatever sits in a padded tail slot, the loss and gradients are the same."""
  with jax.enable_x64(True):
    cfg, params = model("float64")
    batch = make_batch(8, B=2, R=3, P=6, T=5, dtype=jnp.float64)
    other = batch.replace(tails_BRT=jnp.where(batch.tail_valid_BRT, batch.tails_BRT,
                                              (batch.tails_BRT + 17) % cfg.vocab_size))
    f = jax.jit(lambda b: policy.loss_and_grad(params, b, cfg, losses.LossConfig()))
    assert_equal_f64(f(other), f(batch), tol=1e-13)


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b.replace(tails_BRT=b.tails_BRT[:, :, :0], tail_valid_BRT=b.tail_valid_BRT[..., :0]),
     r"tails_BRT: shape \(2, 3, 0\): expected T >= 1"),
    (lambda b: b.replace(prefix_BP=b.prefix_BP[:, :0], prefix_valid_BP=b.prefix_valid_BP[:, :0]),
     r"prefix_BP: shape \(2, 0\): expected P >= 1"),
    (lambda b: b.replace(tails_BRT=b.tails_BRT.at[0, 0, 0].set(128)),
     r"tails_BRT: shape \(2, 3, 4\): expected token ids in \[0, 128\)"),
    (lambda b: b.replace(prefix_BP=b.prefix_BP.at[0, 0].set(-1)), r"prefix_BP.*\[0, 128\)"),
    (lambda b: b.replace(advantages_BR=b.advantages_BR.at[1, 2].set(jnp.nan)),
     r"advantages_BR: shape \(2, 3\): expected finite"),
    (lambda b: b.replace(advantages_BR=b.advantages_BR.at[0, 0].set(jnp.inf)), "finite"),
    (lambda b: b.replace(advantages_BR=b.advantages_BR[:, :2]),
     r"advantages_BR: shape \(2, 2\): expected shape \(2, 3\)"),
    (lambda b: b.replace(tails_BRT=b.tails_BRT[:1]), r"tails_BRT: shape \(1, 3, 4\): expected \[B=2"),
    (lambda b: b.replace(tail_valid_BRT=b.tail_valid_BRT.at[0, 1, :].set(False)), "empty tail"),
    (lambda b: b.replace(prefix_valid_BP=b.prefix_valid_BP.at[0, -1].set(False)), "left padding"),
    (lambda b: b.replace(trunk_len=9), r"trunk_len=9: expected 0 <= trunk_len < P=9"),
])
def test_bad_input_raises_before_compilation(mutate, match):
  batch = make_batch(0, B=2, R=3, P=9, T=4, ragged=False)
  with pytest.raises(ValueError, match=match):
    validate(mutate(batch), vocab_size=128)


def test_chunk_must_divide_branches():
  batch = make_batch(0, B=2, R=3, P=9, T=4)
  with pytest.raises(ValueError, match=r"branch_chunk=2: expected a divisor of R=3"):
    validate(batch, vocab_size=128, branch_chunk=2)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="model.n_heads=3"):
    tfm.ModelConfig(n_heads=3, n_kv_heads=2)
  with pytest.raises(ValueError, match="loss.aggregation='mean'"):
    losses.LossConfig(aggregation="mean")
  with pytest.raises(ValueError, match="loss.name='sft'"):
    losses.LossConfig(name="sft")
