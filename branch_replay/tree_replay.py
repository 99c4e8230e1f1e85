"""Tree replay (tree.TreeBatch): the entry points the trainer calls, now thin wrappers over
the one engine (`engine.py`: every level as folded rows against its ancestors' K/V)."""

from __future__ import annotations

from typing import Optional

from branch_replay import engine
from branch_replay.tree import TreeBatch

MODES = engine.MODES
replay_loss_and_grad = engine.replay_loss_and_grad
naive_loss = engine.naive_loss
naive_loss_and_grad = engine.naive_loss_and_grad


def logps(params, batch: TreeBatch, model_cfg, temperature: float = 1.0):
  """Log-probs of every node's tokens: (per level [B, R, T], 0 where invalid; trunk_logp_BW)."""
  return engine.forward(params, batch, model_cfg, temperature)


def loss_and_grad(params, batch: TreeBatch, model_cfg, loss_cfg, mode: str = "replay",
                  branch_chunk: Optional[int] = None):
  return engine.loss_and_grad(params, batch, model_cfg, loss_cfg, mode, branch_chunk)
