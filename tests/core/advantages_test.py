"""core/advantages.py: the group estimators against hand-written references."""

import numpy as np

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
