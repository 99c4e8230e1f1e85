"""How far one gradient is from another (flag-free, importable anywhere): the benchmarks'
agreement checks. A leaf's error is max|a - b| / max|b|, relative to the reference leaf's
scale, in float64."""

from __future__ import annotations


def rel_err(a, b) -> float:
  """max|a - b| / max|b| of one leaf (0 for an empty leaf)."""
  import numpy as np

  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  if a.shape != b.shape:
    raise ValueError(f"leaf shapes {a.shape} and {b.shape}: expected equal shapes")
  return float(np.max(np.abs(a - b)) / (np.max(np.abs(b)) + 1e-30)) if b.size else 0.0


def npz_rel_errs(path_a, path_b) -> dict:
  """{leaf name: rel_err} of two .npz gradients saved with the same leaf names."""
  import numpy as np

  a, b = np.load(path_a), np.load(path_b)
  if set(a.files) != set(b.files):
    raise ValueError(
      f"{path_a} vs {path_b}: gradient leaves differ: {sorted(set(a.files) ^ set(b.files))[:5]}"
    )
  return {k: rel_err(a[k], b[k]) for k in b.files}


def npz_max_rel_err(path_a, path_b) -> float:
  return max(npz_rel_errs(path_a, path_b).values())


def tree_rel_errs(a_tree, b_tree, names=None) -> dict:
  """{name: rel_err} over the leaves of two pytrees of one structure (names: one per leaf;
  default: their key paths)."""
  import jax

  a_leaves, b_paths = jax.tree.leaves(a_tree), jax.tree_util.tree_leaves_with_path(b_tree)
  if names is None:
    names = [jax.tree_util.keystr(k) for k, _ in b_paths]
  return {name: rel_err(a, b) for name, a, (_, b) in zip(names, a_leaves, b_paths, strict=True)}


def tree_max_rel_err(a_tree, b_tree) -> float:
  return max(tree_rel_errs(a_tree, b_tree).values())
