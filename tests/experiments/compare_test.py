"""experiments/compare.py: a leaf's error relative to the reference leaf's scale."""

import jax.numpy as jnp
import numpy as np
import pytest

from experiments import compare


def test_rel_err_by_hand_npz_and_pytrees(tmp_path):
  assert compare.rel_err([1.0, 2.0, 3.0], [1.0, 2.0, 3.3]) == pytest.approx(0.3 / 3.3, rel=1e-12)
  assert compare.rel_err(np.zeros(0), np.zeros(0)) == 0.0
  np.savez(tmp_path / "a.npz", w=np.array([1.0, 2.0]), b=np.array([0.5]))
  np.savez(tmp_path / "b.npz", w=np.array([1.0, 2.5]), b=np.array([0.4]))
  errs = compare.npz_rel_errs(tmp_path / "a.npz", tmp_path / "b.npz")
  assert errs == pytest.approx({"w": 0.5 / 2.5, "b": 0.1 / 0.4}, rel=1e-12)
  assert compare.npz_max_rel_err(tmp_path / "a.npz", tmp_path / "b.npz") == max(errs.values())
  a, b = {"x": jnp.ones(3), "y": jnp.array([2.0])}, {"x": jnp.ones(3), "y": jnp.array([4.0])}
  assert compare.tree_rel_errs(a, b) == {"['x']": 0.0, "['y']": 0.5}
  assert compare.tree_max_rel_err(a, b) == 0.5


def test_mismatched_gradients_are_refused(tmp_path):
  with pytest.raises(ValueError, match=r"leaf shapes \(2,\) and \(3,\)"):
    compare.rel_err(np.ones(2), np.ones(3))
  np.savez(tmp_path / "a.npz", w=np.ones(2))
  np.savez(tmp_path / "b.npz", v=np.ones(2))
  with pytest.raises(ValueError, match=r"gradient leaves differ: \['v', 'w'\]"):
    compare.npz_rel_errs(tmp_path / "a.npz", tmp_path / "b.npz")
