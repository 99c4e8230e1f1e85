"""Helpers shared by the test modules."""

import functools

import jax
import jax.numpy as jnp


def x64_enabled() -> bool:
  """Whether float64 arrays are float64 here (inside `jax.enable_x64(True)`), without a warning."""
  return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


def cache_per_x64(fn):
  """functools.lru_cache keyed on the call AND on whether x64 is on: a model built with
  dtype='float64' outside `jax.enable_x64` has float32 arrays, and a plain cache would hand
  those to a later float64 test in the same worker (its 1e-10 checks then fail at ~1e-7, as
  they did when the test files' distribution over workers changed)."""
  cached = functools.lru_cache(maxsize=None)(lambda x64, *args, **kwargs: fn(*args, **kwargs))

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return cached(x64_enabled(), *args, **kwargs)
  return wrapper
