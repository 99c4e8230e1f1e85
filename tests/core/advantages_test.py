"""core/advantages.py: the group estimators against hand-written references."""

import numpy as np
import pytest

from branch_replay.core import advantages
from branch_replay.config import Config


def test_rloo_equals_leave_one_out():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(3, 5))
  expected = np.asarray(
    [[r[b, i] - np.mean(np.delete(r[b], i)) for i in range(5)] for b in range(3)]
  )
  np.testing.assert_allclose(advantages.compute("rloo", r, Config().train), expected, rtol=1e-6)
  dr = advantages.compute("dr_grpo", r, Config().train)
  np.testing.assert_allclose(dr, r - r.mean(1, keepdims=True), rtol=1e-6)
  g = advantages.compute("grpo", r, Config().train)
  np.testing.assert_allclose(
    g, (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6), rtol=1e-5
  )


def _grpo_by_hand(values):
  """One group's GRPO advantages in plain Python floats (population std, eps 1e-6)."""
  n = len(values)
  mean = sum(values) / n
  std = (sum((v - mean) ** 2 for v in values) / n) ** 0.5
  return [(v - mean) / (std + 1e-6) for v in values]


def test_flat_levels_are_the_estimator_on_each_group():
  """Fan-outs (R,): one level, the estimator over each prompt's R rewards (a hand loop), as
  float32 from float64 arithmetic."""
  rng = np.random.default_rng(3)
  r = rng.integers(0, 2, size=(4, 6)).astype(np.float64) + rng.normal(size=(4, 6)) * 0.1
  (got,) = advantages.levels("grpo", r, (6,))
  assert got.dtype == np.float32 and got.shape == (4, 6)
  want = np.asarray([_grpo_by_hand(list(row)) for row in r], np.float32)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, advantages.compute("grpo", r, None))
  (dr,) = advantages.levels("dr_grpo", r, (6,))
  np.testing.assert_array_equal(dr, (r - r.mean(1, keepdims=True)).astype(np.float32))


def test_tree_levels_judge_each_node_among_its_siblings():
  """Fan-outs (2, 4): an opening's value is its leaves' mean; Dr. GRPO centres it among the
  openings, a leaf among its parent's children (hand values)."""
  rewards = np.array([[1, 0, 1, 1, 0, 0, 0, 0]], np.float32)
  a1, a2 = advantages.levels("dr_grpo", rewards, (2, 4))
  np.testing.assert_allclose(a1, [[0.375, -0.375]])  # opening values 0.75 and 0
  np.testing.assert_allclose(a2, [[0.25, -0.75, 0.25, 0.25, 0, 0, 0, 0]])
  g1, g2 = advantages.levels("grpo", rewards, (2, 4))
  np.testing.assert_allclose(g1, [_grpo_by_hand([0.75, 0.0])], rtol=1e-6)
  np.testing.assert_allclose(g2[0, :4], _grpo_by_hand([1, 0, 1, 1]), rtol=1e-6)
  np.testing.assert_array_equal(g2[0, 4:], 0)  # all equal: centred to 0, std 0 + eps


def test_tree_rloo_is_leave_one_out_among_siblings():
  """algo.advantage=rloo on a tree: every node's value (its leaves' mean reward) minus the
  mean of its siblings' values, each sibling left out of its own baseline (a hand loop)."""
  rng = np.random.default_rng(1)
  B, fanouts = 2, (3, 2)
  rewards_BR = rng.normal(size=(B, 6))
  got = advantages.levels("rloo", rewards_BR, fanouts)
  for b in range(B):
    first = [rewards_BR[b, 2 * i : 2 * i + 2].mean() for i in range(3)]
    for i in range(3):
      others = [first[j] for j in range(3) if j != i]
      assert got[0][b, i] == pytest.approx(first[i] - np.mean(others), rel=1e-6)
    for leaf in range(6):
      sibling = leaf ^ 1
      assert got[1][b, leaf] == pytest.approx(
        rewards_BR[b, leaf] - rewards_BR[b, sibling], rel=1e-6
      )


def test_levels_refuse_a_wrong_shape_and_gae():
  with pytest.raises(ValueError, match=r"rewards shape \(2, 5\); expected \[B, leaves\]"):
    advantages.levels("grpo", np.zeros((2, 5)), (2, 2))
  with pytest.raises(ValueError, match=r"algo.advantage='gae' is per token"):
    advantages.levels("gae", np.zeros((2, 4)), (4,))
  with pytest.raises(ValueError, match=r"unknown advantage estimator"):
    advantages.levels("nope", np.zeros((2, 4)), (4,))
