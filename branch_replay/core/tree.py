"""The tree batch: B prompts, each the root of a tree with a fixed fan-out per level.

Level 0 is the root (the prompt, left-padded as prefixes are, with an optional scored trunk
of W tokens at its end). Level d >= 1 has R_1 * ... * R_d nodes per prompt, stored flat and
row-major ([B, R, T]: node r's parent is r // R_d at level d-1); each node is a segment of
right-padded tokens (>= 1 valid), some of them scored (response tokens: `scored_BRT`, default
all valid ones; tool/environment text inside a turn is valid but unscored). The last level
holds the leaves; a root-to-leaf path is one sampled sequence.

The objective is that of every path as its own sequence: a path scores its tokens at every
level with the leaf's weight (aggregation mode) and an advantage: the leaf's own, or, where
a level gives `advantages_BR`, its node's (tree-aware advantages, `advantages.levels`); or,
for PPO's GAE, per token and per path (the leaves' `advantages_BRT`, the inner levels'
`path_advantages_BLT`, the trunk's `trunk_advantages_BRW`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import losses


@flax.struct.dataclass
class TreeLevel:
  """The nodes of one level below the root: R = product of the fan-outs down to it."""

  tokens_BRT: jax.Array  # int32, right-padded
  valid_BRT: jax.Array  # bool, >= 1 valid token per node
  scored_BRT: Optional[jax.Array] = None  # bool, a subset of valid; None = every valid token
  advantages_BR: Optional[jax.Array] = None  # per node; required on the leaves; None on an
  # inner level = every leaf scores this level's tokens with its own advantage
  old_logp_BRT: Optional[jax.Array] = None  # sampling log-probs (None: on-policy, ratio 1)
  ref_logp_BRT: Optional[jax.Array] = None  # reference log-probs (KL)
  # Per-token advantages (PPO's GAE), leaves only: they replace advantages_BR token by token.
  advantages_BRT: Optional[jax.Array] = None
  # Per-token advantages of an inner level's tokens on every root-to-leaf path through the
  # node ([B, L, T], L = leaves per prompt): GAE on a tree gives a shared token one advantage
  # per path (its returns differ by the leaf). Inner levels only, with the leaves' advantages_BRT.
  path_advantages_BLT: Optional[jax.Array] = None

  def scored(self):
    return self.valid_BRT if self.scored_BRT is None else self.scored_BRT


@flax.struct.dataclass
class TreeBatch:
  root_BP: jax.Array  # int32 prompt (+ trunk) tokens, left-padded
  root_valid_BP: jax.Array  # bool
  levels: tuple  # TreeLevel per level 1..depth; levels[-1] are the leaves
  trunk_old_logp_BW: Optional[jax.Array] = None
  trunk_ref_logp_BW: Optional[jax.Array] = None
  # Per-path advantages of the trunk tokens [B, leaves, W] (with the leaves' advantages_BRT).
  trunk_advantages_BRW: Optional[jax.Array] = None
  fanouts: tuple = flax.struct.field(pytree_node=False, default=())  # (R_1, ..., R_depth)
  trunk_len: int = flax.struct.field(pytree_node=False, default=0)  # W scored root tokens

  @property
  def depth(self) -> int:
    return len(self.fanouts)

  @property
  def leaves(self) -> TreeLevel:
    return self.levels[-1]

  @property
  def n_leaves(self) -> int:
    return math.prod(self.fanouts)

  def with_leaves(self, **fields) -> "TreeBatch":
    """The batch with these fields of the leaf level replaced."""
    return self.replace(levels=self.levels[:-1] + (self.leaves.replace(**fields),))

  def with_reference(self, ref_levels, trunk_ref_BW) -> "TreeBatch":
    """The batch with the reference policy's log-probs (`engine.forward`'s output: one
    [B, R, T] per level, the trunk's [B, W]) in place."""
    return self.replace(
      levels=tuple(level.replace(ref_logp_BRT=ref) for level, ref in zip(self.levels, ref_levels)),
      trunk_ref_logp_BW=trunk_ref_BW if self.trunk_len else None,
    )

  def token_counts(self):
    """(root positions, positions below the root, naive-equivalent positions): padding
    included; the naive equivalent runs every root-to-leaf path as its own sequence."""
    B, P = np.shape(self.root_BP)
    below = sum(math.prod(np.shape(l.tokens_BRT)) for l in self.levels)
    path_len = P + sum(np.shape(l.tokens_BRT)[2] for l in self.levels)
    return B * P, below, B * self.n_leaves * path_len


def nodes(fanouts: Sequence[int], d: int) -> int:
  """Nodes per prompt at level d (level 0: the root)."""
  return math.prod(fanouts[:d])


def flat(
  prefix_BP,
  prefix_valid_BP,
  tails_BRT,
  tail_valid_BRT,
  advantages_BR,
  *,
  old_logp_BRT=None,
  trunk_old_logp_BW=None,
  ref_logp_BRT=None,
  trunk_ref_logp_BW=None,
  advantages_BRT=None,
  trunk_advantages_BRW=None,
  trunk_len: int = 0,
) -> TreeBatch:
  """A flat batch (B prompts x R branches) as the depth-1 tree it is: the prefix (prompt +
  trunk, left-padded) is the root, the tails (right-padded) the leaves."""
  leaves = TreeLevel(
    tokens_BRT=tails_BRT,
    valid_BRT=tail_valid_BRT,
    advantages_BR=advantages_BR,
    old_logp_BRT=old_logp_BRT,
    ref_logp_BRT=ref_logp_BRT,
    advantages_BRT=advantages_BRT,
  )
  return TreeBatch(
    root_BP=prefix_BP,
    root_valid_BP=prefix_valid_BP,
    levels=(leaves,),
    trunk_old_logp_BW=trunk_old_logp_BW,
    trunk_ref_logp_BW=trunk_ref_logp_BW,
    trunk_advantages_BRW=trunk_advantages_BRW,
    fanouts=tuple(np.shape(tails_BRT)[1:2]),
    trunk_len=trunk_len,
  )


# ----------------------------------------------------------------------------- validation


def _fail(where, arr, expected):
  raise ValueError(
    f"tree.{where}: shape {getattr(arr, 'shape', np.shape(arr))}: expected {expected}"
  )


def validate(
  batch: TreeBatch, vocab_size: int, branch_chunk: Optional[int] = None, leaf_shards: int = 1
) -> None:
  """Raise ValueError naming the level, the field, its shape and what was expected. Host
  side, before any compilation (call it on concrete arrays). leaf_shards: the number of
  devices the leaves are split over (the mesh's `context` size)."""
  fanouts = batch.fanouts
  if not fanouts or any(not isinstance(r, int) or r < 1 for r in fanouts):
    leaf = (
      f" (leaf tokens_BRT shape {np.shape(batch.levels[-1].tokens_BRT)})" if batch.levels else ""
    )
    raise ValueError(f"tree.fanouts={fanouts!r}: expected a non-empty tuple of ints >= 1{leaf}")
  if len(batch.levels) != len(fanouts):
    raise ValueError(
      f"tree.levels: {len(batch.levels)} levels, expected one per fan-out "
      f"(fanouts={fanouts}, depth {len(fanouts)})"
    )
  root = np.asarray(batch.root_BP)
  if root.ndim != 2 or 0 in root.shape:
    _fail("root_BP", root, "[B >= 1, P >= 1] (left-padded prompt tokens)")
  B, P = root.shape
  if np.shape(batch.root_valid_BP) != (B, P):
    _fail("root_valid_BP", batch.root_valid_BP, f"shape {(B, P)}")
  _check_ids("root_BP", root, vocab_size)
  rv = np.asarray(batch.root_valid_BP, bool)
  if not rv[:, -1].all() or np.any(rv[:, 1:] < rv[:, :-1]):
    _fail(
      "root_valid_BP",
      rv,
      "left padding (every position after a valid one valid, the last one valid)",
    )
  W = batch.trunk_len
  if not 0 <= W < P:
    raise ValueError(f"tree.trunk_len={W}: expected 0 <= trunk_len < P={P}")
  if W and (rv.sum(1) <= W).any():
    _fail(
      "root_valid_BP",
      rv,
      f"every prompt longer than trunk_len={W}: a scored token "
      "needs a predecessor (the first token of a prompt has none)",
    )
  for name in ("trunk_old_logp_BW", "trunk_ref_logp_BW"):
    _check_logp(name, getattr(batch, name), (B, W))
  for d, (level, R_d) in enumerate(zip(batch.levels, fanouts), start=1):
    at = f"levels[{d - 1}] (level {d}, fan-out {R_d})"
    R = nodes(fanouts, d)
    tokens = np.asarray(level.tokens_BRT)
    if tokens.ndim != 3 or tokens.shape[:2] != (B, R) or tokens.shape[2] == 0:
      _fail(
        f"{at}.tokens_BRT", tokens, f"[B={B}, R={R} (= product of fanouts {fanouts[:d]}), T >= 1]"
      )
    T = tokens.shape[2]
    _check_ids(f"{at}.tokens_BRT", tokens, vocab_size)
    for name in ("valid_BRT", "scored_BRT"):
      arr = getattr(level, name)
      if arr is not None and np.shape(arr) != (B, R, T):
        _fail(f"{at}.{name}", arr, f"shape {(B, R, T)}")
    valid = np.asarray(level.valid_BRT, bool)
    if np.any(valid[..., 1:] > valid[..., :-1]):
      _fail(f"{at}.valid_BRT", valid, "right padding (once invalid, every later position invalid)")
    if not valid[..., 0].all():
      b, r = np.argwhere(~valid[..., 0])[0]
      _fail(
        f"{at}.valid_BRT", valid, f"every node to hold >= 1 token (node {r} of prompt {b} is empty)"
      )
    if level.scored_BRT is not None and np.any(np.asarray(level.scored_BRT, bool) & ~valid):
      _fail(f"{at}.scored_BRT", level.scored_BRT, "scored tokens only where valid_BRT")
    adv = level.advantages_BR
    if d == len(fanouts) and adv is None:
      raise ValueError(
        f"tree.{at}.advantages_BR: None: expected the leaves' advantages, shape {(B, R)}"
      )
    if adv is not None:
      if np.shape(adv) != (B, R):
        _fail(f"{at}.advantages_BR", adv, f"shape {(B, R)}")
      if not np.all(np.isfinite(np.asarray(adv))):
        _fail(f"{at}.advantages_BR", adv, "finite values (found NaN or inf)")
    for name in ("old_logp_BRT", "ref_logp_BRT", "advantages_BRT"):
      _check_logp(f"{at}.{name}", getattr(level, name), (B, R, T))
    if d < len(fanouts) and level.advantages_BRT is not None:
      raise ValueError(
        f"tree.{at}.advantages_BRT: shape {np.shape(level.advantages_BRT)}: "
        "expected None (an inner node's per-token advantages differ by path: "
        "path_advantages_BLT)"
      )
    if d == len(fanouts) and level.path_advantages_BLT is not None:
      raise ValueError(
        f"tree.{at}.path_advantages_BLT: shape "
        f"{np.shape(level.path_advantages_BLT)}: expected None on the leaves "
        "(their per-token advantages are advantages_BRT)"
      )
    _check_logp(
      f"{at}.path_advantages_BLT", level.path_advantages_BLT, (B, nodes(fanouts, len(fanouts)), T)
    )
  for name, trunk in (("old_logp_BRT", "trunk_old_logp_BW"), ("ref_logp_BRT", "trunk_ref_logp_BW")):
    given = {getattr(l, name) is not None for l in batch.levels}
    if W:
      given.add(getattr(batch, trunk) is not None)
    if len(given) > 1:
      raise ValueError(
        f"tree: {name} (and {trunk} with a trunk) must be given on every "
        "level or on none: a path needs them on all its tokens"
      )
  n_leaves = nodes(fanouts, len(fanouts))
  per_token = batch.leaves.advantages_BRT is not None
  if W and per_token != (batch.trunk_advantages_BRW is not None):
    raise ValueError(
      f"tree.trunk_advantages_BRW: give it exactly when the leaves' "
      f"advantages_BRT are given (trunk_len={W})"
    )
  for d, level in enumerate(batch.levels[:-1], start=1):
    if per_token != (level.path_advantages_BLT is not None):
      raise ValueError(
        f"tree.levels[{d - 1}] (level {d}).path_advantages_BLT: "
        f"{'None' if per_token else 'given'}: expected it exactly when the "
        "leaves' advantages_BRT are given (per-token advantages on every token "
        f"of a path), shape {(B, n_leaves, np.shape(level.tokens_BRT)[2])}"
      )
  _check_logp("trunk_advantages_BRW", batch.trunk_advantages_BRW, (B, n_leaves, W))
  if branch_chunk is not None and (branch_chunk < 1 or fanouts[-1] % branch_chunk):
    raise ValueError(
      f"replay.branch_chunk={branch_chunk}: expected a divisor of the last "
      f"fan-out R_{len(fanouts)}={fanouts[-1]} (fanouts {fanouts})"
    )
  if leaf_shards > 1 and n_leaves % leaf_shards:
    raise ValueError(
      f"tree.levels[{len(fanouts) - 1}].tokens_BRT: shape {tokens.shape}: "
      f"{n_leaves} leaves per prompt (fanouts {fanouts}) cannot be split over "
      f"the {leaf_shards} devices of mesh axis context: expected a multiple"
    )


def _check_ids(where, arr, vocab_size):
  if not np.issubdtype(arr.dtype, np.integer):
    _fail(where, arr, f"integer token ids, got dtype {arr.dtype}")
  if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
    _fail(where, arr, f"token ids in [0, {vocab_size}) (found {arr.min()}..{arr.max()})")


def _check_logp(where, arr, shape):
  if arr is None:
    return
  if np.shape(arr) != shape:
    _fail(where, arr, f"shape {shape}")
  if not np.all(np.isfinite(np.asarray(arr))):
    _fail(where, arr, "finite values (found NaN or inf)")


# ----------------------------------------------------------------------------- weights


def leaf_weights(loss_cfg: losses.LossConfig, batch: TreeBatch):
  """Per-path token weight w_BR ([B, leaves]) for the aggregation mode, as
  `losses.aggregation_weights` weighs a branch: a path's length counts its scored tokens at
  every level (an inner node's tokens once per path through it) and the trunk.
  token_mean: 1 / (scored tokens of all paths); seq_mean: 1 / (B * leaves * len(path));
  sum: 1. Depends only on masks: replay and naive share it exactly."""
  mode = loss_cfg.objective.fixed_aggregation or loss_cfg.aggregation
  ft = jnp.result_type(float)  # f64 under x64
  n_leaves = batch.n_leaves
  len_BR = batch.trunk_len
  for level in batch.levels:
    count_BR = level.scored().astype(ft).sum(-1)
    len_BR = len_BR + jnp.repeat(count_BR, n_leaves // count_BR.shape[1], axis=1)
  B = batch.root_BP.shape[0]
  if mode == "token_mean":
    return jnp.full((B, n_leaves), 1.0) / jnp.maximum(len_BR.sum(), 1.0)
  if mode == "seq_mean":
    return 1.0 / (B * n_leaves * jnp.maximum(len_BR, 1.0))
  return jnp.ones((B, n_leaves))


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Trees in the trainer (`--set=tree.fanouts=4x4`): R_1 openings per prompt, R_2
  continuations of each, ...; "" = no tree (the flat trainer)."""

  fanouts: str = ""
  node_advantages: bool = True  # tree-aware: an inner node's tokens get its own advantage
  # (its leaves' mean reward, normalised among siblings); False: every path its leaf's

  def __post_init__(self):
    if self.fanouts and not re.fullmatch(r"[1-9]\d*(x[1-9]\d*)*", self.fanouts):
      raise ValueError(f"tree.fanouts={self.fanouts!r}: expected '' or fan-outs such as '4x4'")

  @property
  def fanout_tuple(self) -> tuple[int, ...]:
    return tuple(int(r) for r in self.fanouts.split("x")) if self.fanouts else ()
