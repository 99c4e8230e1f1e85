"""Tree replay on a mesh: sharding.py's layout applied to trees.

  root    prompts over (data, fsdp), sequence over `context` (the context-parallel prefill);
  levels  inner nodes split by prompt only (each device of a `context` group runs every
          opening: they are few and short); leaves split by prompt and over `context`
          (as branches are), so the leaf count per prompt must divide the `context` size;
  params  FSDP/tensor as sharding.param_shardings.

The root cache crosses to the levels below under sharding.cache_constraint (K/V kept in
their sequence shards; each layer below gathers its own); the partitioner sums the leaves' cotangents across `context` before the
inner levels' and the root's VJPs.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
from jax.sharding import Mesh

from branch_replay import losses, sharding
from branch_replay.tree import TreeBatch
from models import transformer as tfm


def tree_batch_shardings(mesh: Mesh, batch: TreeBatch) -> TreeBatch:
  """A TreeBatch of NamedShardings (None fields stay None); a dimension its mesh axes do not
  divide is a ValueError naming the level, the field and both numbers."""
  def spec(where, x, names):
    return None if x is None else sharding.named_sharding(mesh, f"tree.{where}", np.shape(x), names)

  levels = []
  for d, level in enumerate(batch.levels, start=1):
    node_axis = "branch" if d == batch.depth else None  # leaves over `context`
    at = f"levels[{d - 1}] (level {d})"
    three = ("batch", node_axis, None)
    levels.append(level.replace(**{
        name: spec(f"{at}.{name}", getattr(level, name), three[:2] if name.endswith("_BR")
                   else three)
        for name in ("tokens_BRT", "valid_BRT", "scored_BRT", "advantages_BR", "old_logp_BRT",
                     "ref_logp_BRT", "advantages_BRT")},
        # per path: split like the leaves
        path_advantages_BLT=spec(f"{at}.path_advantages_BLT", level.path_advantages_BLT,
                                 ("batch", "branch", None))))
  return batch.replace(
      root_BP=spec("root_BP", batch.root_BP, ("batch", "seq")),
      root_valid_BP=spec("root_valid_BP", batch.root_valid_BP, ("batch", "seq")),
      trunk_old_logp_BW=spec("trunk_old_logp_BW", batch.trunk_old_logp_BW, ("batch", None)),
      trunk_ref_logp_BW=spec("trunk_ref_logp_BW", batch.trunk_ref_logp_BW, ("batch", None)),
      trunk_advantages_BRW=spec("trunk_advantages_BRW", batch.trunk_advantages_BRW,
                                ("batch", "branch", None)),
      levels=tuple(levels))


def tree_loss_and_grad(mesh: Mesh, params, batch: TreeBatch, model_cfg: tfm.ModelConfig,
                       loss_cfg: losses.LossConfig, branch_chunk: Optional[int] = None,
                       params_fn=None):
  """Tree replay on `mesh` (call it inside one jit): (loss, aux_BR, grads), equal to
  `tree_replay.loss_and_grad(..., mode='replay')` on one device."""
  return sharding.engine_loss_and_grad(
      mesh, params, sharding.constrain(batch, tree_batch_shardings(mesh, batch)), model_cfg,
      loss_cfg, branch_chunk, params_fn)
