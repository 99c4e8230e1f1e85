"""Automatic prefix trees: the token trie of a prompt's R responses, laid out as a TreeBatch.

Responses of one prompt often share more than the prompt (a common opening, a tool call).
`build` finds the trie (longest shared openings at any depth; `min_shared`: a shared run
shorter than this is not a node, its tokens stay with its children; `max_depth`: nodes
below it are not split). Two tokens are shared only if their id, scored flag and given
behaviour / reference log-probs are equal, so the tree's objective is the flat one exactly.

The engine's trees are regular (fan-outs R_1..R_d, the same for every prompt), so `layout`
maps each batch's tries onto the cheapest of these regular shapes:
  * the opening all R responses of every prompt share -> the root's scored trunk (W = the
    shortest such opening over the batch's prompts; the rest of a longer one moves down);
  * optionally one level of R/g groups of g responses (g a divisor of R): the responses in
    trie (lexicographic) order, cut into consecutive groups, each group's shared opening a
    level-1 node; the leaves hold the rest.
No padding nodes (a padded path would score its ancestors' tokens again), so the layout
is exact; its cost is the padding of each level to its longest node and the trie structure
below depth 2 that stays inside the leaves. `stats` reports both: `tree_token_ratio` (flat
positions / tree positions as laid out, padding included) and `trie_token_ratio` (the ideal).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax.numpy as jnp
import numpy as np

from branch_replay.core import tree
from branch_replay.core.tree import TreeBatch, TreeLevel


@dataclasses.dataclass
class Node:
  """Tokens [start, stop) of every member response (a leaf: one member, to its end)."""

  start: int
  stop: int
  members: tuple
  children: list

  def positions(self) -> int:
    return self.stop - self.start + sum(c.positions() for c in self.children)

  def depth(self) -> int:
    return 1 + max((c.depth() for c in self.children), default=0) if self.children else 0


def _keys(responses, scored=None, old=None, ref=None):
  """Per response, the per-token record two responses must agree on to share a token."""
  out = []
  for r, ids in enumerate(responses):
    cols = [np.asarray(ids, np.float64)]
    for extra in (scored, old, ref):
      if extra is not None:
        cols.append(np.asarray(extra[r], np.float64))
    out.append(np.stack(cols, -1))
  return out


def _lcp(keys, members, start) -> int:
  """Shared tokens of `members` from `start`, leaving each member >= 1 token of its own."""
  n = min(len(keys[m]) for m in members) - 1 - start
  if n <= 0:
    return 0
  block = np.stack([keys[m][start : start + n] for m in members])
  same = np.all(block == block[:1], axis=(0, 2))
  return int(n if same.all() else np.argmin(same))


def build(keys, max_depth: Optional[int] = None, min_shared: int = 1) -> Node:
  """The trie of one prompt's responses (keys from `_keys`, or the token id lists). The root
  is the opening all responses share (empty if none, or shorter than min_shared); leaves
  are single responses; nodes at depth max_depth are not split further."""
  keys = [k if np.ndim(k) == 2 else np.asarray(k, np.float64)[:, None] for k in keys]
  leaf = lambda m, start: Node(start, len(keys[m]), (m,), [])

  def nodes(members, start, depth) -> list:
    if len(members) == 1:
      return [leaf(members[0], start)]
    if max_depth is not None and depth >= max_depth:
      return [leaf(m, start) for m in members]
    lcp = _lcp(keys, members, start)
    groups = {}
    for m in members:  # where the members diverge
      groups.setdefault(keys[m][start + lcp].tobytes(), []).append(m)
    if len(groups) == 1:  # capped by a member that ends next: its last token is its own
      if lcp and lcp >= min_shared:
        return [Node(start, start + lcp, members, [leaf(m, start + lcp) for m in members])]
      return [leaf(m, start) for m in members]
    if lcp < min_shared:  # too short to be a node: its tokens stay with its children
      return [n for g in groups.values() for n in nodes(tuple(g), start, depth)]
    return [
      Node(
        start,
        start + lcp,
        members,
        [n for g in groups.values() for n in nodes(tuple(g), start + lcp, depth + 1)],
      )
    ]

  everyone = tuple(range(len(keys)))
  kids = nodes(everyone, 0, 0)
  if len(kids) == 1 and kids[0].members == everyone and kids[0].children:
    return kids[0]
  return Node(0, 0, everyone, kids)


def order(root: Node) -> list:
  """Responses in trie (depth-first) order: responses sharing openings are adjacent."""
  if not root.children:
    return list(root.members)
  return [m for c in sorted(root.children, key=lambda c: min(c.members)) for m in order(c)]


# ----------------------------------------------------------------------------- layout


def _pad(rows, width, dtype, fill=0):
  out = np.full((len(rows), width), fill, dtype)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def _layout_cost(prompt_lens, lens_BR, shared_B, group, lcp_BG):
  """Padded positions of a layout: root + level 1 (if grouped) + leaves."""
  B, R = lens_BR.shape
  W = int(shared_B.min())
  cost = B * (max(prompt_lens) + W)
  if group is None:
    return cost + B * R * int((lens_BR - W).max())
  G = R // group
  cost += B * G * int(lcp_BG.max())
  inner = np.repeat(W + lcp_BG, group, axis=1)
  return cost + B * R * int((lens_BR - inner).max())


def layout(
  prompts: Sequence,
  responses: Sequence,
  advantages_BR,
  *,
  scored=None,
  old_logps=None,
  ref_logps=None,
  max_depth: int = 2,
  min_shared: int = 1,
  pad_id: int = 0,
  bucket: int = 1,
):
  """B prompts (id lists) x R responses (id lists; `scored`, `old_logps`, `ref_logps`: per
  response per-token lists, or None) -> (TreeBatch, stats). Leaf r of prompt b is response
  stats['order'][b][r]. max_depth: 1 = the trunk only, 2 = a level of groups below it.
  bucket: pad the root and every level to a multiple of this (fewer distinct shapes, fewer
  compilations across batches)."""
  B, R = len(prompts), len(responses[0])
  if any(len(rs) != R for rs in responses):
    raise ValueError(
      f"trie.layout: responses per prompt {[len(rs) for rs in responses]}: "
      f"expected R={R} for every prompt (a regular tree)"
    )
  if max_depth not in (1, 2):
    raise ValueError(f"trie.layout: max_depth={max_depth}: expected 1 or 2")
  pick = lambda xs, b: None if xs is None else xs[b]
  keys = [
    _keys(responses[b], pick(scored, b), pick(old_logps, b), pick(ref_logps, b)) for b in range(B)
  ]
  tries = [build(k, max_depth=None, min_shared=min_shared) for k in keys]
  orders = [order(t) for t in tries]
  lens_BR = np.array([[len(responses[b][r]) for r in orders[b]] for b in range(B)])
  score_of = lambda b, r: (
    np.ones(len(responses[b][r]), bool) if scored is None else np.asarray(scored[b][r], bool)
  )
  # 1. The trunk: the opening every response shares, scored tokens only.
  shared_B = np.array([t.stop - t.start for t in tries])
  for b in range(B):
    lead = min(int(np.argmin(np.append(score_of(b, r), False))) for r in range(R))
    shared_B[b] = min(shared_B[b], lead)
  if shared_B.min() < min_shared:
    shared_B[:] = 0
  W = int(shared_B.min())
  # 2. Groups: every divisor g of R (1 < g < R) whose groups share >= min_shared tokens.
  best, best_cost = None, _layout_cost([len(p) for p in prompts], lens_BR, shared_B, None, None)
  if max_depth >= 2:
    for g in [g for g in range(2, R) if R % g == 0]:
      lcp_BG = np.array(
        [[_lcp(keys[b], tuple(orders[b][i : i + g]), W) for i in range(0, R, g)] for b in range(B)]
      )
      if lcp_BG.min() < max(min_shared, 1):
        continue
      cost = _layout_cost([len(p) for p in prompts], lens_BR, shared_B, g, lcp_BG)
      if cost < best_cost:
        best, best_cost, best_lcp = g, cost, lcp_BG
  # 3. The arrays.
  P = _round(max(len(p) for p in prompts) + W, bucket)
  root_BP = np.full((B, P), pad_id, np.int32)
  root_valid_BP = np.zeros((B, P), bool)
  for b in range(B):
    ids = list(prompts[b]) + list(responses[b][orders[b][0]][:W])
    root_BP[b, P - len(ids) :], root_valid_BP[b, P - len(ids) :] = ids, True
  trunk = lambda xs: (
    None
    if xs is None or not W
    else jnp.asarray(np.stack([np.asarray(xs[b][orders[b][0]][:W]) for b in range(B)]))
  )
  spans = [[(W, None)] * R for _ in range(B)]  # per leaf (start, stop) of its own tokens
  levels, fanouts = [], (R,)
  if best is not None:
    g = best
    fanouts = (R // g, g)
    inner = [[(W, W + int(best_lcp[b, i])) for i in range(R // g)] for b in range(B)]
    heads = [[orders[b][i * g] for i in range(R // g)] for b in range(B)]
    levels.append(
      _level(responses, heads, inner, scored, old_logps, ref_logps, None, pad_id, bucket)
    )
    spans = [[(inner[b][r // g][1], None) for r in range(R)] for b in range(B)]
  adv = np.asarray(advantages_BR)
  leaf_adv = np.stack([adv[b][orders[b]] for b in range(B)])
  levels.append(
    _level(responses, orders, spans, scored, old_logps, ref_logps, leaf_adv, pad_id, bucket)
  )
  batch = TreeBatch(
    root_BP=jnp.asarray(root_BP),
    root_valid_BP=jnp.asarray(root_valid_BP),
    levels=tuple(levels),
    trunk_old_logp_BW=trunk(old_logps),
    trunk_ref_logp_BW=trunk(ref_logps),
    fanouts=fanouts,
    trunk_len=W,
  )
  flat = B * R * (_round(max(len(p) for p in prompts), bucket) + _round(int(lens_BR.max()), bucket))
  laid = sum(batch.token_counts()[:2])
  ideal = sum(R * len(prompts[b]) + lens_BR[b].sum() for b in range(B)) / sum(
    len(prompts[b]) + tries[b].positions() for b in range(B)
  )
  stats = dict(
    order=orders,
    fanouts=fanouts,
    trunk_len=W,
    tree_positions=laid,
    flat_positions=flat,
    tree_token_ratio=flat / laid,
    trie_token_ratio=float(ideal),
    trie_depth=max(t.depth() for t in tries),
  )
  return batch, stats


def _round(n, bucket):
  return -(-n // bucket) * bucket


def _level(responses, rows, spans, scored, old, ref, adv_BR, pad_id, bucket=1) -> TreeLevel:
  """One level's arrays: node (b, i) is response rows[b][i]'s tokens spans[b][i]."""
  B, R = len(rows), len(rows[0])
  cut = lambda xs, b, i: np.asarray(xs[b][rows[b][i]])[spans[b][i][0] : spans[b][i][1]]
  seg = [[cut(responses, b, i) for i in range(R)] for b in range(B)]
  T = _round(max(len(s) for row in seg for s in row), bucket)
  stack = lambda xs, dtype, fill: np.stack(
    [_pad([cut(xs, b, i) for i in range(R)], T, dtype, fill) for b in range(B)]
  )
  tokens = stack(responses, np.int32, pad_id)
  valid = np.stack([_pad([np.ones(len(s), bool) for s in row], T, bool) for row in seg])
  sc = None if scored is None else stack(scored, bool, False)
  f = lambda xs: None if xs is None else jnp.asarray(stack(xs, np.float64, 0))
  return TreeLevel(
    tokens_BRT=jnp.asarray(tokens),
    valid_BRT=jnp.asarray(valid),
    scored_BRT=None if sc is None else jnp.asarray(sc),
    advantages_BR=None if adv_BR is None else jnp.asarray(adv_BR),
    old_logp_BRT=f(old),
    ref_logp_BRT=f(ref),
  )


def unroll(batch: TreeBatch, order, per_level_BRT, trunk_BW=None) -> list:
  """Per-token values of a laid-out tree (e.g. `engine.forward`) back per response, in
  the original order: out[b][i] is response i's values, trunk + every level's node."""
  B = np.shape(batch.root_BP)[0]
  W, n = batch.trunk_len, batch.n_leaves
  levels = [
    (np.asarray(v), np.asarray(l.valid_BRT, bool)) for v, l in zip(per_level_BRT, batch.levels)
  ]
  out = [[None] * n for _ in range(B)]
  for b in range(B):
    for r in range(n):
      parts = [np.asarray(trunk_BW)[b]] if W else []
      for values, valid in levels:
        node = r // (n // values.shape[1])
        parts.append(values[b, node][valid[b, node]])
      out[b][order[b][r]] = np.concatenate(parts)
  return out


def flat_batch(
  prompts, responses, advantages_BR, *, scored=None, old_logps=None, ref_logps=None, pad_id: int = 0
) -> TreeBatch:
  """The same responses as a flat batch (depth 1: prefix = prompt, tails = responses): the
  twin the trie batch must equal, and the batch of `replay.auto_tree=false`. Unscored tokens
  go through `trie.layout` only (the flat twin scores every valid tail token)."""
  if scored is not None and not all(np.all(s) for rs in scored for s in rs):
    raise ValueError(
      "trie.flat_batch: unscored (tool/observation) tokens need the tree "
      "layout (trie.layout): a flat batch scores every valid tail token"
    )
  B = len(prompts)
  P = max(len(p) for p in prompts)
  T = max(len(r) for rs in responses for r in rs)
  prefix = np.full((B, P), pad_id, np.int32)
  for b, p in enumerate(prompts):
    prefix[b, P - len(p) :] = p
  tails = np.stack([_pad(rs, T, np.int32, pad_id) for rs in responses])
  valid = np.stack([_pad([np.ones(len(r), bool) for r in rs], T, bool) for rs in responses])
  f = lambda xs: None if xs is None else jnp.asarray(np.stack([_pad(x, T, np.float64) for x in xs]))
  lengths_B1 = np.array([len(p) for p in prompts])[:, None]
  return tree.flat(
    jnp.asarray(prefix),
    jnp.asarray(np.arange(P)[None] >= P - lengths_B1),
    jnp.asarray(tails),
    jnp.asarray(valid),
    jnp.asarray(advantages_BR),
    old_logp_BRT=f(old_logps),
    ref_logp_BRT=f(ref_logps),
  )


def auto_tree(batch: TreeBatch, *, max_depth: int = 2, min_shared: int = 1, pad_id: int = 0):
  """The trainer's own sampler output (`replay.auto_tree=true`, a flat batch) as its cheapest
  exact tree: the prompt is the prefix before the trunk; a response is the trunk + the
  branch's tail. Host side (concrete arrays). Returns (TreeBatch, stats) as `layout`."""
  leaves = batch.leaves
  if batch.depth != 1:
    raise ValueError(
      f"tree.fanouts={batch.fanouts}: replay.auto_tree lays out a flat batch: expected depth 1"
    )
  if leaves.advantages_BRT is not None:
    raise ValueError(
      "tree.levels[0].advantages_BRT: per-token advantages (GAE) are not laid "
      "out as a tree yet: expected None with replay.auto_tree=true"
    )
  W, P = batch.trunk_len, batch.root_BP.shape[1]
  host = lambda x: None if x is None else np.asarray(x)
  prefix, pv = host(batch.root_BP), host(batch.root_valid_BP).astype(bool)
  tails, tv = host(leaves.tokens_BRT), host(leaves.valid_BRT).astype(bool)
  B, R, _ = tails.shape
  prompts = [prefix[b, : P - W][pv[b, : P - W]] for b in range(B)]

  def joined(trunk_BW, tail_BRT):
    if tail_BRT is None:
      return None
    head = (lambda b: trunk_BW[b]) if W else (lambda b: tail_BRT[b, 0, :0])
    return [
      [np.concatenate([head(b), tail_BRT[b, r][tv[b, r]]]) for r in range(R)] for b in range(B)
    ]

  responses = joined(prefix[:, P - W :], tails)
  old = joined(host(batch.trunk_old_logp_BW), host(leaves.old_logp_BRT))
  ref = joined(host(batch.trunk_ref_logp_BW), host(leaves.ref_logp_BRT))
  return layout(
    prompts,
    responses,
    host(leaves.advantages_BR),
    old_logps=old,
    ref_logps=ref,
    max_depth=max_depth,
    min_shared=min_shared,
    pad_id=pad_id,
  )
