"""Tree replay equals every root-to-leaf path run as its own full sequence; a depth-1 tree is
today's batch; the objective matches a hand-written numpy reference; bad trees fail on the
host with errors naming the level and the field."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay import engine, losses, policy, tree
from branch_replay.tree import TreeBatch, TreeLevel
from models import transformer as tfm

from tests.families_test import FAMILIES, TINY
from tests.replay_test import make_batch, max_rel_err
from tests.helpers import cache_per_x64


def make_tree(seed, fanouts, B=2, P=7, T=(4, 3, 3), W=0, ragged=True, logps=False,
              node_advantages=False, holes=False, vocab=128, dtype=jnp.float64):
  """A random tree: left-padded roots, ragged nodes (>= 1 token), optional unscored holes in
  inner nodes (tool text), per-node advantages and off-policy/reference log-probs."""
  rng = np.random.default_rng(seed)
  root_valid = np.ones((B, P), bool)
  if B > 1:
    root_valid[1, :rng.integers(1, P - W - 1)] = False
  levels = []
  depth = len(fanouts)
  for d in range(1, depth + 1):
    R, Td = int(np.prod(fanouts[:d])), T[d - 1]
    lengths = rng.integers(1, Td + 1, size=(B, R)) if ragged else np.full((B, R), Td)
    lengths[0, 0] = Td
    valid = np.arange(Td)[None, None] < lengths[..., None]
    scored = valid.copy()
    if holes and d < depth:
      scored &= rng.random((B, R, Td)) < 0.6
    extra = {}
    if logps:
      extra = dict(old_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, Td)), dtype),
                   ref_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, Td)), dtype))
    adv = None
    if d == depth or node_advantages:
      adv = jnp.asarray(rng.normal(size=(B, R)), dtype)
    levels.append(TreeLevel(tokens_BRT=jnp.asarray(rng.integers(0, vocab, (B, R, Td)), jnp.int32),
                            valid_BRT=jnp.asarray(valid),
                            scored_BRT=jnp.asarray(scored) if holes else None,
                            advantages_BR=adv, **extra))
  trunk = {}
  if logps:
    trunk = dict(trunk_old_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype),
                 trunk_ref_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype))
  return TreeBatch(root_BP=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32),
                   root_valid_BP=jnp.asarray(root_valid), levels=tuple(levels),
                   fanouts=tuple(fanouts), trunk_len=W, **trunk)


@cache_per_x64
def model(family=None, dtype="float64"):
  if family is None:
    cfg = tfm.preset("tiny", dtype=dtype, param_dtype=dtype)
  else:
    cfg = tfm.ModelConfig(**TINY, **FAMILIES[family], dtype=dtype, param_dtype=dtype)
  params = tfm.init_params(cfg, jax.random.key(0))
  # Perturb every leaf (norm scales and biases away from their init).
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return cfg, jax.tree.unflatten(treedef, leaves)


def both(cfg, params, batch, loss_cfg, branch_chunk=None):
  tree.validate(batch, cfg.vocab_size, branch_chunk)
  run = jax.jit(lambda p, b, mode: engine.loss_and_grad(p, b, cfg, loss_cfg, mode,
                                                             branch_chunk), static_argnums=2)
  return run(params, batch, "replay"), run(params, batch, "naive")


def assert_equal(fast, slow, tol=1e-10):
  (l1, aux1, g1), (l2, aux2, g2) = fast, slow
  assert abs(float(l1) - float(l2)) <= tol * max(abs(float(l2)), 1e-3), (l1, l2)
  assert jax.tree.structure(g1) == jax.tree.structure(g2)
  err = max_rel_err(g1, g2)
  assert err < tol, err
  # The tree path reports the per-leaf sums it has; today's policy adds PPO diagnostics
  # (clip_sum, approx_kl_sum, ratio_max, scored_tokens) the tree does not compute yet.
  assert set(aux1) <= set(aux2), (sorted(aux1), sorted(aux2))
  for name in aux1:
    np.testing.assert_allclose(aux1[name], aux2[name], rtol=tol, atol=tol, err_msg=name)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g2)) > 1e-6


# Depths 1, 2, 3; every fan-out 1..4 appears at some level of a depth-2 and a depth-3 tree.
# Depths 1-3 and fan-outs 1-4 in the default suite; two more shapes under -m slow.
FANOUTS = [(3,), (1, 4), (4, 2), pytest.param((2, 3), marks=pytest.mark.slow), (3, 1, 2),
           pytest.param((2, 2, 4), marks=pytest.mark.slow)]


@pytest.mark.parametrize("fanouts", FANOUTS)
def test_tree_replay_equals_naive_float64(fanouts):
  with jax.enable_x64(True):
    cfg, params = model()
    batch = make_tree(sum(fanouts), fanouts, W=1 if len(fanouts) == 2 else 0)
    assert_equal(*both(cfg, params, batch, losses.LossConfig()))


@pytest.mark.parametrize("case", [
    dict(logps=True, kl_coef=0.1, epsilon=0.1, epsilon_high=0.3, W=2),
    dict(node_advantages=True, holes=True, aggregation="seq_mean"),
    dict(holes=True, aggregation="sum", name="pg", W=1),
    dict(branch_chunk=2, W=1, logps=True),
    dict(branch_chunk=1, fanouts=(2, 1, 2), node_advantages=True),
    dict(ragged=False, T=(1, 1, 1)),
])
def test_tree_variants_float64(case):
  case = dict(case)
  shape = {k: case.pop(k) for k in ("W", "logps", "node_advantages", "holes", "ragged", "T")
           if k in case}
  fanouts = case.pop("fanouts", (2, 4))
  chunk = case.pop("branch_chunk", None)
  with jax.enable_x64(True):
    cfg, params = model()
    batch = make_tree(5, fanouts, **shape)
    assert_equal(*both(cfg, params, batch, losses.LossConfig(**case), chunk))


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_tree_with_sliding_windows_float64(family):
  """Window 4 below the path length: the root's windowed cache is sliced, and keys of the
  opening and the root both fall out of the window of later tail tokens."""
  with jax.enable_x64(True):
    cfg, params = model(family)
    batch = make_tree(9, (2, 3), P=8, T=(5, 4), W=1, logps=True, vocab=cfg.vocab_size)
    assert_equal(*both(cfg, params, batch, losses.LossConfig(kl_coef=0.05), branch_chunk=3))


def test_depth_one_tree_is_todays_batch():
  """A depth-1 tree gives policy.loss_and_grad's numbers (replay and naive alike)."""
  with jax.enable_x64(True):
    cfg, params = model()
    batch = make_batch(3, B=2, R=4, P=9, T=5, W=2, logps=True, dtype=jnp.float64)
    loss_cfg = losses.LossConfig(kl_coef=0.1)
    today = jax.jit(lambda p: policy.loss_and_grad(p, batch, cfg, loss_cfg, "replay"))(params)
    t = tree.from_replay_batch(batch)
    tree.validate(t, cfg.vocab_size)
    for mode in ("replay", "naive"):
      got = jax.jit(lambda p: engine.loss_and_grad(p, t, cfg, loss_cfg, mode))(params)
      assert_equal(got, today, tol=1e-12)
    # (Not bit for bit: today's policy runs its tails as folded B*R rows, the tree vmaps
    # its leaves over the fan-out, so float64 sums round in another order: 1e-12 above.)


def test_tree_replay_float32():
  cfg, params = model(dtype="float32")
  batch = make_tree(4, (3, 4), P=16, T=(6, 5), W=2, dtype=jnp.float32)
  (l1, _, g1), (l2, _, g2) = both(cfg, params, batch, losses.LossConfig())
  np.testing.assert_allclose(l1, l2, rtol=1e-5, atol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g2)


def test_objective_matches_numpy_reference():
  """The loss written out by hand: every path assembled token by token in Python, its
  log-probs from one unpadded forward, the clipped-ratio + k3 objective in numpy."""
  with jax.enable_x64(True):
    cfg, params = model()
    batch = make_tree(21, (2, 2), B=2, P=6, T=(3, 3), W=1, logps=True, node_advantages=True,
                      holes=True)
    loss_cfg = losses.LossConfig(kl_coef=0.2, epsilon=0.2, aggregation="token_mean")
    loss, _, _ = jax.jit(lambda p: engine.loss_and_grad(p, batch, cfg, loss_cfg))(params)
    b_ = jax.tree.map(np.asarray, batch)
    R1, R2 = batch.fanouts
    paths = []  # (tokens, scored, advantage, old, ref) per token of each path
    for b in range(2):
      for leaf in range(R1 * R2):
        toks, rows = [], []
        for p in range(6):
          if b_.root_valid_BP[b, p]:
            toks.append(b_.root_BP[b, p])
            trunk = p == 5
            rows.append((trunk, b_.levels[1].advantages_BR[b, leaf],
                         b_.trunk_old_logp_BW[b, 0], b_.trunk_ref_logp_BW[b, 0]))
        for d, node in ((0, leaf // R2), (1, leaf)):
          lv = b_.levels[d]
          for t in range(3):
            if lv.valid_BRT[b, node, t]:
              toks.append(lv.tokens_BRT[b, node, t])
              rows.append((lv.scored()[b, node, t], lv.advantages_BR[b, node],
                           lv.old_logp_BRT[b, node, t], lv.ref_logp_BRT[b, node, t]))
        paths.append((np.array(toks), rows))
    n_scored = sum(sum(r[0] for r in rows) for _, rows in paths)
    total = 0.0
    for toks, rows in paths:
      h = tfm.forward(params, cfg, jnp.asarray(toks[None]), jnp.ones((1, len(toks)), bool))
      logits = np.asarray(tfm.logits(params, cfg, h))[0]
      logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
      for i in range(1, len(toks)):
        scored, adv, old, ref = rows[i]
        if not scored:
          continue
        logp = logits[i - 1, toks[i]] - logz[i - 1]
        ratio = np.exp(logp - old)
        v = -min(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv)
        v += 0.2 * (np.exp(ref - logp) - (ref - logp) - 1)
        total += v / n_scored
    assert abs(float(loss) - total) < 1e-10 * abs(total)


def test_tree_advantages():
  rewards = np.array([[1, 0, 1, 1, 0, 0, 0, 0]], np.float32)  # fan-outs (2, 4)
  a1, a2 = tree.tree_advantages(rewards, (2, 4), use_std=False)
  np.testing.assert_allclose(a1, [[0.375, -0.375]])  # opening values 0.75 and 0
  np.testing.assert_allclose(a2, [[0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0]])
  (a,) = tree.tree_advantages(rewards, (8,))
  np.testing.assert_allclose(a, losses.group_advantages(jnp.asarray(rewards)), rtol=1e-6)


def _bad(batch, message, **kw):
  with pytest.raises(ValueError, match=message):
    tree.validate(batch, 128, **kw)


def test_bad_trees_fail_naming_level_and_field():
  ok = make_tree(0, (2, 3), dtype=jnp.float32)
  tree.validate(ok, 128)
  lv0, lv1 = ok.levels
  _bad(ok.replace(fanouts=(3, 2)), r"levels\[0\] \(level 1, fan-out 3\)\.tokens_BRT: shape "
       r"\(2, 2, 4\): expected \[B=2, R=3")
  _bad(ok.replace(fanouts=(2,)), r"tree.levels: 2 levels, expected one per fan-out")
  empty = lv1.replace(valid_BRT=lv1.valid_BRT.at[1, 4].set(False))
  _bad(ok.replace(levels=(lv0, empty)), r"levels\[1\] \(level 2.*valid_BRT.*node 4 of "
       r"prompt 1 is empty")
  _bad(ok.replace(trunk_len=6), r"root_valid_BP.*a scored token needs a predecessor")
  holes = lv0.replace(scored_BRT=jnp.ones_like(lv0.valid_BRT))
  _bad(ok.replace(levels=(holes, lv1)), r"levels\[0\].*scored_BRT.*only where valid")
  _bad(ok.replace(levels=(lv0, lv1.replace(advantages_BR=None))),
       r"levels\[1\].*advantages_BR: None: expected the leaves'")
  _bad(ok.replace(levels=(lv0, lv1.replace(advantages_BR=jnp.zeros((2, 3))))),
       r"levels\[1\].*advantages_BR: shape \(2, 3\): expected shape \(2, 6\)")
  _bad(ok, r"6 leaves per prompt .* cannot be split over the 4 devices of mesh axis "
       r"context", leaf_shards=4)
  _bad(ok, r"branch_chunk=2: expected a divisor of the last fan-out R_2=3", branch_chunk=2)
  gap = lv1.replace(valid_BRT=lv1.valid_BRT.at[0, 0, 0].set(False))
  _bad(ok.replace(levels=(lv0, gap)), r"levels\[1\].*valid_BRT.*right padding")
  _bad(ok.replace(levels=(lv0.replace(old_logp_BRT=jnp.zeros((2, 2, 4))), lv1)),
       r"old_logp_BRT .* on every level or on none")
  with jax.enable_x64(True):
    cfg, params = model()
    # DPO runs on trees (engine_test), but not without its reference log-probs
    with pytest.raises(ValueError, match=r"levels\[0\]\.ref_logp_BRT: None, but loss.name='dpo'"):
      engine.loss_and_grad(params, make_tree(0, (2,)), cfg, losses.LossConfig(name="dpo"))
