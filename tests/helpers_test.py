"""The shared test helpers: a cached float64 model is float64 inside enable_x64 whatever came first."""

import jax
import jax.numpy as jnp

from helpers import tiny_model


def test_cached_model_follows_x64():
  _, outside = tiny_model()  # built without x64: float32 arrays
  assert jax.tree.leaves(outside)[0].dtype == jnp.float32
  with jax.enable_x64(True):
    _, inside = tiny_model()
    assert {x.dtype for x in jax.tree.leaves(inside)} == {jnp.dtype("float64")}
