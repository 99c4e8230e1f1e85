"""model.flat_matmuls: the projections as 2-D matmuls over the flattened tokens (layers.dense)
compute what the einsums compute: dense == einsum for every projection's shape, and the whole
replay step's loss and every gradient leaf agree with the einsum model (float64 near 1e-12,
float32 within rounding), on a family with q/k norms, biases and an attention output gate's
absence alike."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses
from helpers import make_batch, tiny_model
from models.layers import dense


@pytest.mark.parametrize(
  "spec, x_shape, w_shape, n_in",
  [
    ("BTD,DNH->BTNH", (2, 5, 8), (8, 4, 3), 1),
    ("BTD,DF->BTF", (3, 1, 8), (8, 6), 1),
    ("BTNH,NHD->BTD", (2, 5, 4, 3), (4, 3, 8), 2),
  ],
)
def test_dense_is_the_einsum(spec, x_shape, w_shape, n_in):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=x_shape))
    w = jnp.asarray(rng.normal(size=w_shape))
    np.testing.assert_allclose(dense(x, w, n_in), jnp.einsum(spec, x, w), rtol=1e-13, atol=1e-13)
    g = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), (0, 1))(x, w)
    for a, b in zip(g(lambda x, w: dense(x, w, n_in)), g(lambda x, w: jnp.einsum(spec, x, w))):
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_dense_names_mismatched_axes():
  with pytest.raises(ValueError, match=r"dense: x \(2, 5, 8\) and w \(7, 3\) do not share 1 axes"):
    dense(jnp.ones((2, 5, 8)), jnp.ones((7, 3)))


@pytest.mark.parametrize(
  "family, dtype", [(None, "float64"), ("qwen2", "float64"), (None, "float32")]
)
def test_flat_matmuls_step_equals_the_einsum_step(family, dtype):
  x64 = dtype == "float64"
  with jax.enable_x64(x64):
    cfg, params = tiny_model(family, dtype=dtype)
    einsum_cfg = dataclasses.replace(cfg, flat_matmuls=False)
    assert cfg.flat_matmuls  # the default
    batch = make_batch(
      3, B=2, R=3, P=9, T=5, vocab=cfg.vocab_size, dtype=jnp.float64 if x64 else jnp.float32
    )
    loss_cfg = losses.LossConfig("grpo")
    got = engine.loss_and_grad(params, batch, cfg, loss_cfg, "replay")
    want = engine.loss_and_grad(params, batch, einsum_cfg, loss_cfg, "replay")
    tol = dict(rtol=1e-12, atol=1e-12) if x64 else dict(rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got[0], want[0], **tol)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[2]), jax.tree.leaves(want[2])):
      scale = float(np.max(np.abs(b))) or 1.0
      np.testing.assert_allclose(a / scale, b / scale, err_msg=jax.tree_util.keystr(path), **tol)
