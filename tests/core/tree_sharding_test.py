"""Sharded tree replay equals one device (8 fake CPU devices, depth 2, float64); a leaf count
the mesh cannot split fails naming the level and both numbers."""

import jax
import numpy as np
import pytest

from branch_replay.core import engine, losses, sharding, tree
from helpers import make_tree, max_rel_err, tiny_model

LOSS = losses.LossConfig(kl_coef=0.05, epsilon=0.1)


@pytest.mark.parametrize(
  "spec, fanouts, branch_chunk",
  [
    pytest.param(
      "context:8",
      (2, 4),
      None,  # 8 leaves over 8 devices, context-parallel
      marks=pytest.mark.slow,
    ),  # prompt (the mixed mesh below runs by default)
    ("data:2,fsdp:2,context:2", (3, 2), 1),  # prompts x leaves, FSDP, streamed leaves
  ],
)
def test_sharded_tree_equals_single_device(spec, fanouts, branch_chunk):
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    batch = make_tree(1, fanouts, B=4, P=16, T=(3, 3), W=1, logps=True, node_advantages=True)
    mesh = sharding.make_mesh(spec)
    tree.validate(batch, cfg.vocab_size, branch_chunk, leaf_shards=mesh.shape["context"])
    ref = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, LOSS))(params, batch)
    placed_params = sharding.put(params, sharding.param_shardings(mesh, cfg))
    placed = sharding.put(batch, sharding.batch_shardings(mesh, batch))
    got = jax.jit(
      lambda p, b: engine.loss_and_grad(p, b, cfg, LOSS, "replay", branch_chunk, mesh=mesh)
    )(placed_params, placed)
    assert abs(float(got[0]) - float(ref[0])) <= 1e-10 * abs(float(ref[0]))
    assert max_rel_err(got[2], ref[2]) < 1e-10
    for name in ref[1]:
      np.testing.assert_allclose(got[1][name], ref[1][name], rtol=1e-10, atol=1e-10)
    leaf = batch.levels[-1].tokens_BRT
    assert placed.levels[-1].tokens_BRT.sharding.spec[1] == "context", leaf.shape


def test_leaves_the_mesh_cannot_split():
  batch = make_tree(0, (3, 2), B=4, P=16, T=(3, 3))
  with pytest.raises(
    ValueError,
    match=r"tree.levels\[1\] \(level 2\).tokens_BRT: dimension "
    r"1 has size 6, not divisible by the 4 devices of mesh axes context",
  ):
    sharding.batch_shardings(sharding.make_mesh("data:2,context:4"), batch)
