"""Trees: replay equals the naive twin under sliding windows; the objective matches a
hand-written numpy reference; tree advantages; bad trees fail on the host with errors naming
the level and the field. Replay == naive over shapes and objectives is
tests/core/equivalence_test.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, tree
from helpers import assert_equal_f64, make_tree, tiny_model, tree_both
from helpers import slow_where
from models import transformer as tfm


# a tree under sliding windows: gemma2 under -m slow (49 s; mistral kept)
@pytest.mark.parametrize("family", slow_where(["mistral", "gemma2"], {"gemma2"}))
def test_tree_with_sliding_windows_float64(family):
  """Window 4 below the path length: the root's windowed cache is sliced, and keys of the
  opening and the root both fall out of the window of later tail tokens."""
  with jax.enable_x64(True):
    cfg, params = tiny_model(family)
    batch = make_tree(9, (2, 3), P=8, T=(5, 4), W=1, logps=True, vocab=cfg.vocab_size)
    assert_equal_f64(*tree_both(cfg, params, batch, losses.LossConfig(kl_coef=0.05), 3))


def test_objective_matches_numpy_reference():
  """The loss written out by hand: every path assembled token by token in Python, its
  log-probs from one unpadded forward, the clipped-ratio + k3 objective in numpy."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    batch = make_tree(
      21, (2, 2), B=2, P=6, T=(3, 3), W=1, logps=True, node_advantages=True, holes=True
    )
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
            rows.append(
              (
                trunk,
                b_.levels[1].advantages_BR[b, leaf],
                b_.trunk_old_logp_BW[b, 0],
                b_.trunk_ref_logp_BW[b, 0],
              )
            )
        for d, node in ((0, leaf // R2), (1, leaf)):
          lv = b_.levels[d]
          for t in range(3):
            if lv.valid_BRT[b, node, t]:
              toks.append(lv.tokens_BRT[b, node, t])
              rows.append(
                (
                  lv.scored()[b, node, t],
                  lv.advantages_BR[b, node],
                  lv.old_logp_BRT[b, node, t],
                  lv.ref_logp_BRT[b, node, t],
                )
              )
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


def _bad(batch, message, **kw):
  with pytest.raises(ValueError, match=message):
    tree.validate(batch, 128, **kw)


def test_bad_trees_fail_naming_level_and_field():
  ok = make_tree(0, (2, 3), dtype=jnp.float32)
  tree.validate(ok, 128)
  lv0, lv1 = ok.levels
  _bad(
    ok.replace(fanouts=(3, 2)),
    r"levels\[0\] \(level 1, fan-out 3\)\.tokens_BRT: shape "
    r"\(2, 2, 4\): expected \[B=2, R=3",
  )
  _bad(ok.replace(fanouts=(2,)), r"tree.levels: 2 levels, expected one per fan-out")
  empty = lv1.replace(valid_BRT=lv1.valid_BRT.at[1, 4].set(False))
  _bad(
    ok.replace(levels=(lv0, empty)),
    r"levels\[1\] \(level 2.*valid_BRT.*node 4 of "
    r"prompt 1 is empty",
  )
  _bad(ok.replace(trunk_len=6), r"root_valid_BP.*a scored token needs a predecessor")
  holes = lv0.replace(scored_BRT=jnp.ones_like(lv0.valid_BRT))
  _bad(ok.replace(levels=(holes, lv1)), r"levels\[0\].*scored_BRT.*only where valid")
  _bad(
    ok.replace(levels=(lv0, lv1.replace(advantages_BR=None))),
    r"levels\[1\].*advantages_BR: None: expected the leaves'",
  )
  _bad(
    ok.replace(levels=(lv0, lv1.replace(advantages_BR=jnp.zeros((2, 3))))),
    r"levels\[1\].*advantages_BR: shape \(2, 3\): expected shape \(2, 6\)",
  )
  _bad(
    ok,
    r"6 leaves per prompt .* cannot be split over the 4 devices of mesh axis "
    r"context",
    leaf_shards=4,
  )
  _bad(ok, r"branch_chunk=2: expected a divisor of the last fan-out R_2=3", branch_chunk=2)
  gap = lv1.replace(valid_BRT=lv1.valid_BRT.at[0, 0, 0].set(False))
  _bad(ok.replace(levels=(lv0, gap)), r"levels\[1\].*valid_BRT.*right padding")
  _bad(
    ok.replace(levels=(lv0.replace(old_logp_BRT=jnp.zeros((2, 2, 4))), lv1)),
    r"old_logp_BRT .* on every level or on none",
  )
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    # DPO runs on trees (engine_test), but not without its reference log-probs
    with pytest.raises(ValueError, match=r"levels\[0\]\.ref_logp_BRT: None, but loss.name='dpo'"):
      engine.loss_and_grad(params, make_tree(0, (2,)), cfg, losses.LossConfig(name="dpo"))
