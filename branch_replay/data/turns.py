"""Tasks of several turns, sampled as trees: the base a new multi-turn task subclasses.

A `TurnsTask` states `turns` (n) and, per instance, `turn_lengths` (tokens per turn) and
`stop_tokens(tok)` (one tuple per turn); the run's `tree.fanouts` gives one fan-out per turn
(R_1 first turns per prompt, R_2 second turns of each, ...). It scores a leaf by its path:
`reward(example, turns) -> float`, the turns decoded up to their stop token; `leaf_rewards`
gathers every leaf's path ([B, leaves], under train.reward_timeout_s). A supervised warm-up
or DPO's preference trees are the task's own (`warmup_tree`, tree_task.py's for its lookup).
A new multi-turn task is one file: a subclass registered with `@tasks.register`.
"""

from __future__ import annotations

import numpy as np

from branch_replay.data import rewards, tasks
from branch_replay.data.tokenizer import TOKENIZER


def texts(tokens_BRT, tok):
  """[B][nodes] decoded node texts (up to EOS) of one level's tokens [B, nodes, T]."""
  return [[tok.decode(row, strict=False) for row in rows] for rows in np.asarray(tokens_BRT)]


def paths(samples, tok):
  """[B][leaves] each leaf's path as its turns' texts, root to leaf (a node of level d is the
  ancestor of leaves // nodes_d consecutive leaves)."""
  levels = [texts(t, tok) for t in samples.tokens]
  leaves = len(levels[-1][0])
  return [
    [
      tuple(level[b][leaf // (leaves // len(level[b]))] for level in levels)
      for leaf in range(leaves)
    ]
    for b in range(len(levels[-1]))
  ]


class TurnsTask(tasks.Task):
  """A task whose rollouts are trees of its `turns` turns (one tree.fanouts level each)."""

  turns = 2
  turn_lengths: tuple = ()  # tokens per turn, set by the instance (its options)

  def stop_tokens(self, tok=TOKENIZER) -> tuple:
    """One tuple of stop ids per turn (default: EOS ends every turn)."""
    return tuple((tok.eos_id,) for _ in range(self.turns))

  def reward(self, example, turns: tuple) -> float:
    """A leaf's reward from its path's turns (texts, root to leaf)."""
    raise NotImplementedError(f"{type(self).__name__}.reward")

  def leaf_rewards(self, examples, samples, tok=TOKENIZER) -> np.ndarray:
    """[B, leaves]: each leaf's reward from its path's turns, within train.reward_timeout_s
    (`rewards.limited`: past it, the run stops naming the first leaf that hangs alone)."""
    path_BL = paths(samples, tok)
    leaves = [(b, leaf) for b in range(len(examples)) for leaf in range(len(path_BL[0]))]
    one = lambda b, leaf: self.reward(examples[b], path_BL[b][leaf])
    probes = (  # read only when the call hangs
      (
        f"example {b} leaf {leaf} (prompt {examples[b].prompt[-60:]!r}, turns "
        f"{' / '.join(repr(t[:30]) for t in path_BL[b][leaf])})",
        lambda b=b, leaf=leaf: one(b, leaf),
      )
      for b, leaf in leaves
    )
    values = rewards.limited(
      f"task {type(self).__name__}'s reward on {len(leaves)} leaves",
      lambda: [one(b, leaf) for b, leaf in leaves],
      probes,
    )
    return np.asarray(values, np.float32).reshape(len(examples), len(path_BL[0]))

  def warmup_tree(self, rng: np.random.Generator, n: int, tok=TOKENIZER):
    """A supervised warm-up batch of `n` trees (train.sft_steps); a task without one refuses
    train.sft_steps in `check`."""
    raise NotImplementedError(f"{type(self).__name__}.warmup_tree")

  def preference_trees(self, rng: np.random.Generator, n: int, tok=TOKENIZER):
    """DPO on trees (algo.name=dpo): `n` trees whose last level pairs (chosen, rejected)
    siblings; a task without them refuses DPO when the run starts (dpo.Pairs)."""
    raise NotImplementedError(f"{type(self).__name__}.preference_trees")

  def check(self, cfg) -> None:
    if cfg.train.sft_steps and type(self).warmup_tree is TurnsTask.warmup_tree:
      raise ValueError(
        f"train.sft_steps={cfg.train.sft_steps}: task {cfg.task.name!r} has no supervised "
        "warm-up trees (warmup_tree); expected train.sft_steps=0"
      )
