"""experiments/profile_replay.py's op classes on a compiled function whose ops are known: a
matmul inside a while loop, an element-wise op and a reduction outside it."""

import jax
import jax.numpy as jnp

from experiments import profile_replay


def test_op_classes_of_a_known_function():
  def f(x_NN, w_NN):
    y_NN = jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ w_NN), x_NN)
    return jnp.exp(y_NN).sum(0)

  x = jnp.ones((64, 64))
  text = jax.jit(f).lower(x, x).compile().as_text()
  classes = profile_replay.op_classes(text)
  got = set(classes.values())
  assert ("matmul", True) in got  # the dot, inside the loop
  assert ("control", False) in got  # the while itself
  assert not any(cls == "matmul" and not in_loop for cls, in_loop in got)  # no dot outside
  assert ("reduce", False) in got  # exp + sum fused outside the loop
  by = profile_replay.by_class({name: 1000 for name in classes}, classes, reps=1)
  assert abs(sum(r["share"] for r in by) - 1.0) < 0.01


def test_a_fused_transpose_is_its_own_class():
  """Element-wise work written in another layout (a fusion holding a transpose) is `transpose`,
  plain element-wise work is not."""

  def f(x_NM):
    return jnp.tanh(x_NM).T * 2.0, jnp.tanh(x_NM) + 1.0

  text = jax.jit(f).lower(jnp.ones((64, 32))).compile().as_text()
  classes = profile_replay.op_classes(text)
  got = {cls for cls, _ in classes.values()}
  assert "transpose" in got and "elementwise" in got, classes
