"""The one engine's bug guards (issue 16, items 1-3, 7, 8): each failed at 625fa22. A depth-1
tree is checked against the flat oracle (tests/oracles.py); deeper trees against every root-to-leaf path run as
a flat branch of its own (engine.naive_loss)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, tree
from helpers import assert_equal_f64, make_batch, make_tree, max_rel_err, tiny_model
from helpers import slow_where
from oracles import flat_naive_loss_and_grad


def paths_as_flat(batch: tree.TreeBatch) -> tree.TreeBatch:
  """Every root-to-leaf path as one branch of a flat batch (its valid tokens contiguous):
  exact for trees without unscored holes and with the leaves' advantages only."""
  b = jax.tree.map(np.asarray, batch)
  B, n = b.root_BP.shape[0], batch.n_leaves
  T = sum(l.tokens_BRT.shape[2] for l in b.levels)
  out = {
    k: np.zeros((B, n, T), dt)
    for k, dt in (("tokens", np.int32), ("valid", bool), ("old", np.float64), ("ref", np.float64))
  }
  for bi in range(B):
    for leaf in range(n):
      pos = 0
      for d, level in enumerate(b.levels, start=1):
        node = leaf // (n // level.tokens_BRT.shape[1])
        keep = level.valid_BRT[bi, node]
        k = int(keep.sum())
        out["tokens"][bi, leaf, pos : pos + k] = level.tokens_BRT[bi, node][keep]
        out["valid"][bi, leaf, pos : pos + k] = True
        for name, field in (("old", "old_logp_BRT"), ("ref", "ref_logp_BRT")):
          if getattr(level, field) is not None:
            out[name][bi, leaf, pos : pos + k] = getattr(level, field)[bi, node][keep]
        pos += k
  logps = b.leaves.old_logp_BRT is not None
  return tree.flat(
    prefix_BP=batch.root_BP,
    prefix_valid_BP=batch.root_valid_BP,
    tails_BRT=jnp.asarray(out["tokens"]),
    tail_valid_BRT=jnp.asarray(out["valid"]),
    advantages_BR=batch.leaves.advantages_BR,
    trunk_len=batch.trunk_len,
    old_logp_BRT=jnp.asarray(out["old"]) if logps else None,
    ref_logp_BRT=jnp.asarray(out["ref"]) if logps else None,
    trunk_old_logp_BW=batch.trunk_old_logp_BW if logps else None,
    trunk_ref_logp_BW=batch.trunk_ref_logp_BW if logps else None,
  )


def tree_run(cfg, params, batch, loss_cfg, mode="replay", branch_chunk=None):
  tree.validate(batch, cfg.vocab_size, branch_chunk)
  return jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, mode, branch_chunk))(
    params, batch
  )


def flat_naive(cfg, params, flat, loss_cfg):
  return jax.jit(lambda p, b: flat_naive_loss_and_grad(p, b, cfg, loss_cfg))(params, flat)


# Per-path aux (a tree's logp/entropy/tokens sums cover the leaf's own tokens, a flat
# branch's its whole tail).
PATH_KEYS = ("kl_sum", "clip_sum", "approx_kl_sum", "ratio_max", "scored_tokens")


def test_temperature_depth1_equals_flat_and_on_policy_ratio_is_one():
  """Bug 1: the tree scored tokens at temperature 1 whatever loss.temperature said."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    lc = losses.LossConfig(name="ppo", temperature=0.7, kl_coef=0.1)
    batch = make_batch(3, B=2, R=3, P=9, T=5, W=2, logps=True, dtype=jnp.float64)
    want = jax.jit(lambda p: engine.loss_and_grad(p, batch, cfg, lc))(params)
    for mode in engine.MODES:
      assert_equal_f64(tree_run(cfg, params, batch, lc, mode), want)
    # Depth 2: log-probs of the sampling distribution at T=0.7 are on-policy (ratio 1).
    deep = make_tree(4, (2, 3), W=1, logps=True)
    logp, trunk = jax.jit(lambda p: engine.forward(p, deep, cfg, 0.7))(params)
    deep = deep.replace(
      trunk_old_logp_BW=trunk,
      levels=tuple(l.replace(old_logp_BRT=x) for l, x in zip(deep.levels, logp)),
    )
    _, aux, _ = tree_run(cfg, params, deep, lc)
    np.testing.assert_allclose(aux["approx_kl_sum"], 0.0, atol=1e-12)
    np.testing.assert_allclose(aux["ratio_max"], 1.0, atol=1e-12)


# GSPO on trees: depth 1 under -m slow (40 s; depth 2 kept)
@pytest.mark.parametrize("fanouts", slow_where([((3,),), ((2, 3),)], {((3,),)}))
def test_gspo_on_a_tree_equals_every_path_as_a_flat_branch(fanouts):
  """Bug 2: gspo crashed at trace time on trees (token_fn None)."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    lc = losses.LossConfig(name="gspo", epsilon=0.01, kl_coef=0.1, aggregation="seq_mean")
    batch = make_tree(6, fanouts, W=2, logps=True)
    want = flat_naive(cfg, params, paths_as_flat(batch), lc)
    keys = None if len(fanouts) == 1 else PATH_KEYS
    assert_equal_f64(tree_run(cfg, params, batch, lc, "naive"), want, keys=keys)
    assert_equal_f64(tree_run(cfg, params, batch, lc, "replay"), want, keys=keys)


def test_streamed_leaves_accumulate_in_float32():
  """Bug 3: streamed tree leaves summed their cotangents in the compute dtype (bfloat16)."""
  cfg, params = tiny_model(dtype="float32")
  cfg = dataclasses.replace(cfg, dtype="bfloat16")  # bf16 compute, f32 parameters
  batch = make_tree(7, (2, 4), P=8, T=(3, 3), W=1, dtype=jnp.float32)
  lc = losses.LossConfig()
  fn = lambda chunk: lambda p, b: engine.loss_and_grad(p, b, cfg, lc, "replay", chunk)
  jaxpr = jax.make_jaxpr(fn(1))(params, batch).jaxpr
  # The stream is the top-level scan with the most carries (loss, dparams, dcaches).
  stream = max(
    (e for e in jaxpr.eqns if e.primitive.name == "scan"), key=lambda e: e.params["num_carry"]
  )
  start = stream.params["num_consts"]
  carries = [v.aval.dtype for v in stream.invars[start : start + stream.params["num_carry"]]]
  assert len(carries) > len(jax.tree.leaves(params))
  assert carries and all(d == jnp.float32 for d in carries), carries
  # The streamed result equals the unstreamed one (one f32 contraction over the leaves).
  (l1, _, g1), (l2, _, g2) = [jax.jit(fn(c))(params, batch) for c in (1, None)]
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-2)
  assert max_rel_err(g1, g2) < 3e-2


def test_flat_carries_per_token_advantages():
  """Bug 7: the flat -> tree conversion (now tree.flat) dropped advantages_BRT /
  trunk_advantages_BRW silently."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    lc = losses.LossConfig(name="ppo", kl_coef=0.1)
    b = make_batch(8, B=2, R=3, P=9, T=5, W=2, logps=True, dtype=jnp.float64)
    rng, l = np.random.default_rng(9), b.leaves
    t = tree.flat(
      b.root_BP,
      b.root_valid_BP,
      l.tokens_BRT,
      l.valid_BRT,
      l.advantages_BR,
      old_logp_BRT=l.old_logp_BRT,
      trunk_old_logp_BW=b.trunk_old_logp_BW,
      ref_logp_BRT=l.ref_logp_BRT,
      trunk_ref_logp_BW=b.trunk_ref_logp_BW,
      advantages_BRT=jnp.asarray(rng.normal(size=(2, 3, 5))),
      trunk_advantages_BRW=jnp.asarray(rng.normal(size=(2, 3, 2))),
      trunk_len=2,
    )
    assert t.leaves.advantages_BRT is not None and t.trunk_advantages_BRW is not None
    want = flat_naive(cfg, params, t, lc)  # the flat twin reads them as well
    for mode in engine.MODES:
      assert_equal_f64(tree_run(cfg, params, t, lc, mode), want)
    deep = make_tree(1, (2, 2), T=(3, 3))
    deep = deep.replace(
      levels=(deep.levels[0], deep.levels[1].replace(advantages_BRT=jnp.zeros((2, 4, 3))))
    )
    # on a deeper tree the inner levels need theirs per path (ppo_test: PPO on trees)
    with pytest.raises(ValueError, match=r"levels\[0\] \(level 1\)\.path_advantages_BLT: None"):
      tree.validate(deep, cfg.vocab_size)


def test_tree_reports_the_flat_ppo_diagnostics():
  """Bug 8: the tree computed no clip_sum, approx_kl_sum, ratio_max, scored_tokens."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    lc = losses.LossConfig(name="grpo", epsilon=0.1, kl_coef=0.05)
    batch = make_batch(10, B=2, R=4, P=8, T=5, W=1, logps=True, dtype=jnp.float64)
    want = jax.jit(lambda p: engine.loss_and_grad(p, batch, cfg, lc))(params)
    got = tree_run(cfg, params, batch, lc)
    assert set(got[1]) == set(want[1])
    assert float(want[1]["clip_sum"].sum()) > 0  # the diagnostics are not trivially zero
    assert_equal_f64(got, want)
