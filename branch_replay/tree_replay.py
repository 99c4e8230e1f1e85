"""Tree replay: branch replay applied level by level, and its naive twin.

A tree (tree.TreeBatch) shares text at several depths: the prompt, then R_1 openings, each
continued by R_2 tails (and so on). Every inner node is a prefix for its children:

  1. the root runs forward once under `jax.vjp` (its K/V cache, last hidden state and trunk
     log-probs are the cache the level below reads);
  2. each inner level runs forward once per node against its ancestors' caches, under
     `jax.vjp` (the residuals are kept), producing its own cache (K/V, last hidden state,
     the log-probs of its tokens, computed once);
  3. the leaves run forward+backward, vmapped inside the grad, each scoring its own tokens
     and every ancestor's scored tokens with its weight; the cotangent of every ancestor
     cache arrives summed over the leaves below it;
  4. the backward climbs the tree: each inner level runs its VJP once with its children's
     summed cotangent, which yields its parameters' share and its ancestors' cotangents;
     the root's VJP runs last, once.

Nodes are vmapped one fan-out at a time (`_vmap_nodes`): an ancestor's cache is an
unbatched input under the vmaps over deeper fan-outs, so every descendant reads it and none
copies it, and its cotangent comes out summed. The gradient equals `naive_loss_and_grad`,
which runs every root-to-leaf path as its own full sequence.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from branch_replay import losses
from branch_replay.tree import TreeBatch, leaf_weights
from models import transformer as tfm

MODES = ("replay", "naive")


# ----------------------------------------------------------------------------- layout


def _nested(x, fanouts):
  """[B, R_1*...*R_d, ...] -> [R_1, ..., R_d, B, ...] (fan-out axes first, for vmap)."""
  if x is None:
    return None
  d = len(fanouts)
  x = x.reshape(x.shape[0], *fanouts, *x.shape[2:])
  return jnp.moveaxis(x, 0, d)


def _flat(x, d):
  """[R_1, ..., R_d, B, ...] -> [B, R_1*...*R_d, ...]."""
  x = jnp.moveaxis(x, d, 0)
  return x.reshape(x.shape[0], -1, *x.shape[d + 1:])


def _vmap_nodes(fn, d):
  """fn(params, caches, inputs, node) for one node of every prompt at level d -> fn over all
  nodes of level d. node's leaves carry the axes R_1..R_d; caches[i] and inputs[i] (ancestor
  level i < d) carry R_1..R_i. Under the vmap over R_j the ancestors above level j are
  unbatched (None): every descendant reads them, none copies them, and their cotangents
  come out summed over the descendants."""
  for j in reversed(range(1, d + 1)):
    anc_axes = tuple(None if i < j else 0 for i in range(d))
    fn = jax.vmap(fn, in_axes=(None, anc_axes, anc_axes, 0))
  return fn


def _inputs(batch: TreeBatch, loss_cfg: losses.LossConfig):
  """Non-differentiable inputs per level: [root, level 1, ..., leaves], levels nested."""
  W, P = batch.trunk_len, batch.root_BP.shape[1]
  root = dict(tokens_BP=batch.root_BP, valid_BP=batch.root_valid_BP,
              trunk_BW=batch.root_BP[:, P - W:], old_logp_BW=batch.trunk_old_logp_BW,
              ref_logp_BW=batch.trunk_ref_logp_BW)
  levels = [root]
  for d, level in enumerate(batch.levels, start=1):
    nest = functools.partial(_nested, fanouts=batch.fanouts[:d])
    levels.append(dict(tokens_BT=nest(level.tokens_BRT), valid_BT=nest(level.valid_BRT),
                       scored_BT=nest(level.scored()), advantage_B=nest(level.advantages_BR),
                       old_logp_BT=nest(level.old_logp_BRT),
                       ref_logp_BT=nest(level.ref_logp_BRT)))
  levels[-1]["weight_B"] = _nested(leaf_weights(loss_cfg, batch), batch.fanouts)
  return levels


# ----------------------------------------------------------------------------- one node


def _root_cache(params, model_cfg, root):
  """Step 1's function: the root's cache (what every level below reads from it)."""
  W = root["trunk_BW"].shape[1]
  cache = tfm.prefill(params, model_cfg, root["tokens_BP"], root["valid_BP"], W)
  trunk_logp_BW, _ = tfm.token_logps(params, model_cfg, cache.trunk_h_BWD, root["trunk_BW"])
  return dict(kv=cache.kv, h_last_BD=cache.h_last_BD, trunk_logp_BW=trunk_logp_BW)


def _node_forward(params, model_cfg, caches, inputs, node):
  """One node of every prompt against its ancestors' caches: (h_BTD, kv, logp_BT, entropy_BT).
  Its first token is predicted by the parent's last hidden state."""
  context = [(caches[0]["kv"], inputs[0]["valid_BP"])]
  context += [(c["kv"], x["valid_BT"]) for c, x in zip(caches[1:], inputs[1:])]
  offset_B1 = sum(jnp.sum(valid.astype(jnp.int32), axis=1, keepdims=True)
                  for _, valid in context)
  positions_BT = tfm.positions_from_valid(node["valid_BT"], offset_B1)
  h_BTD, kv = tfm.Transformer(model_cfg).apply({"params": params}, node["tokens_BT"],
                                               positions_BT, node["valid_BT"], context)
  h_pred_BTD = jnp.concatenate([caches[-1]["h_last_BD"][:, None], h_BTD[:, :-1]], axis=1)
  logp_BT, entropy_BT = tfm.token_logps(params, model_cfg, h_pred_BTD, node["tokens_BT"])
  return h_BTD, kv, logp_BT, entropy_BT


def _inner_cache(params, caches, inputs, node, model_cfg):
  """Step 2's function for one node: its cache (K/V, last valid hidden state, log-probs)."""
  h_BTD, kv, logp_BT, _ = _node_forward(params, model_cfg, caches, inputs, node)
  last_B = jnp.sum(node["valid_BT"].astype(jnp.int32), axis=1) - 1
  h_last_BD = jnp.take_along_axis(h_BTD, last_B[:, None, None], axis=1)[:, 0]
  return dict(kv=kv, h_last_BD=h_last_BD, logp_BT=logp_BT)


def _score(logp, old_logp, ref_logp, advantage_B, weight, loss_cfg):
  """(objective value_B, k3-KL sum_B) of one segment's tokens, as policy.branch_value."""
  old = jax.lax.stop_gradient(logp) if old_logp is None else old_logp
  ref = jax.lax.stop_gradient(logp) if ref_logp is None else ref_logp
  values = loss_cfg.objective.token_fn(logp, old, ref, advantage_B[:, None], loss_cfg)
  return jnp.sum(values * weight, axis=-1), jnp.sum(losses.k3_kl(logp, ref) * (weight > 0), -1)


def _leaf_value(params, caches, inputs, leaf, model_cfg, loss_cfg):
  """Step 3's function for one leaf of every prompt: its path's objective value_B (its own
  tokens, the trunk and every inner ancestor's scored tokens, from their cached log-probs,
  with this leaf's weight) and per-leaf aux sums."""
  _, _, logp_BT, entropy_BT = _node_forward(params, model_cfg, caches, inputs, leaf)
  w_B, advantage_B = leaf["weight_B"], leaf["advantage_B"]
  weight_BT = w_B[:, None] * leaf["scored_BT"].astype(w_B.dtype)
  value_B, kl_B = _score(logp_BT, leaf["old_logp_BT"], leaf["ref_logp_BT"], advantage_B,
                         weight_BT, loss_cfg)
  trunk_logp_BW = caches[0]["trunk_logp_BW"]
  if trunk_logp_BW.shape[1]:
    w_BW = jnp.broadcast_to(w_B[:, None], trunk_logp_BW.shape)
    v_B, k_B = _score(trunk_logp_BW, inputs[0]["old_logp_BW"], inputs[0]["ref_logp_BW"],
                      advantage_B, w_BW, loss_cfg)
    value_B, kl_B = value_B + v_B, kl_B + k_B
  for cache, node in zip(caches[1:], inputs[1:]):
    adv_B = advantage_B if node["advantage_B"] is None else node["advantage_B"]
    v_B, k_B = _score(cache["logp_BT"], node["old_logp_BT"], node["ref_logp_BT"], adv_B,
                      w_B[:, None] * node["scored_BT"].astype(w_B.dtype), loss_cfg)
    value_B, kl_B = value_B + v_B, kl_B + k_B
  valid = leaf["valid_BT"]
  aux = dict(logp_sum=jnp.sum(jnp.where(valid, logp_BT, 0.0), -1),
             entropy_sum=jnp.sum(jnp.where(valid, entropy_BT, 0.0), -1),
             kl_sum=kl_B, tokens=valid.sum(-1))
  return value_B, aux


# ----------------------------------------------------------------------------- replay


def _leaves_value_and_grad(leaf_fn, params, caches, inputs, depth, branch_chunk):
  """Step 3: (loss, aux, dparams, dcaches) of every leaf, vmapped inside the grad.
  branch_chunk=C streams the leaves under lax.scan, C tails of every parent at a time
  (chunk k holds tails k, k + R_depth/C, ...), accumulating the cotangents."""
  fn = _vmap_nodes(leaf_fn, depth)
  ancestors = tuple(inputs[:depth])

  def loss_of_leaves(params, caches, leaves):
    values, aux = fn(params, caches, ancestors, leaves)
    return values.sum(), aux

  grad_fn = jax.value_and_grad(loss_of_leaves, argnums=(0, 1), has_aux=True)
  leaves = inputs[depth]
  R = leaves["tokens_BT"].shape[depth - 1]
  if branch_chunk is None or branch_chunk == R:
    (loss, aux), (dparams, dcaches) = grad_fn(params, caches, leaves)
    return loss, aux, dparams, dcaches
  if R % branch_chunk:
    raise ValueError(f"replay.branch_chunk={branch_chunk}: expected a divisor of the last "
                     f"fan-out {R}")
  n = R // branch_chunk
  a = depth - 1  # the last fan-out's axis
  chunks = jax.tree.map(
      lambda x: jnp.moveaxis(x.reshape(*x.shape[:a], branch_chunk, n, *x.shape[a + 1:]),
                             a + 1, 0), leaves)

  def body(carry, chunk):
    loss_sum, dparams_sum, dcaches_sum = carry
    (loss, aux), (dparams, dcaches) = grad_fn(params, caches, chunk)
    carry = (loss_sum + loss, jax.tree.map(jnp.add, dparams_sum, dparams),
             jax.tree.map(jnp.add, dcaches_sum, dcaches))
    return carry, aux

  zeros = lambda tree: jax.tree.map(jnp.zeros_like, tree)
  dtype = jnp.float64 if jax.tree.leaves(params)[0].dtype == jnp.float64 else jnp.float32
  init = (jnp.zeros((), dtype), zeros(params), zeros(caches))
  (loss, dparams, dcaches), aux = jax.lax.scan(body, init, chunks)
  aux = jax.tree.map(
      lambda x: jnp.moveaxis(x, 0, a + 1).reshape(*x.shape[1:a + 1], R, *x.shape[a + 2:]), aux)
  return loss, aux, dparams, dcaches


def replay_loss_and_grad(params, batch: TreeBatch, model_cfg: tfm.ModelConfig,
                         loss_cfg: losses.LossConfig, branch_chunk: Optional[int] = None, *,
                         root_wrap: Optional[Callable] = None,
                         cache_constraint: Optional[Callable] = None):
  """Tree replay: (loss, aux_BR per leaf, grads), grads equal to the naive gradient.

  root_wrap(root_fn) -> root_fn (e.g. the context-parallel prefill of sharding.py);
  cache_constraint(level, cache) -> cache is applied where each level's cache crosses to
  the levels below (a sharding constraint)."""
  if not loss_cfg.objective.additive:
    raise ValueError(f"loss.name={loss_cfg.name!r}: tree replay needs an additive objective "
                     "(a sum over root-to-leaf paths); this one combines branches")
  depth = batch.depth
  inputs = _inputs(batch, loss_cfg)
  constrain = cache_constraint or (lambda level, cache: cache)
  root_fn = lambda p: _root_cache(p, model_cfg, inputs[0])
  if root_wrap is not None:
    root_fn = root_wrap(root_fn)
  # 1. The root forward, once; its vjp keeps the residuals alive.
  cache, root_vjp = jax.vjp(root_fn, params)
  caches, vjps = [constrain(0, cache)], [root_vjp]
  # 2. Each inner level forward once per node against its ancestors' caches, under vjp.
  for d in range(1, depth):
    level_fn = _vmap_nodes(functools.partial(_inner_cache, model_cfg=model_cfg), d)
    anc_inputs, node = tuple(inputs[:d]), inputs[d]
    cache, level_vjp = jax.vjp(lambda p, anc, f=level_fn, x=anc_inputs, n=node: f(p, anc, x, n),
                               params, tuple(caches))
    caches.append(constrain(d, cache))
    vjps.append(level_vjp)
  # 3. The leaves: forward+backward, vmapped inside the grad; each ancestor's cotangent
  #    arrives summed over the leaves below it.
  leaf_fn = functools.partial(_leaf_value, model_cfg=model_cfg, loss_cfg=loss_cfg)
  loss, aux, grads, dcaches = _leaves_value_and_grad(leaf_fn, params, tuple(caches), inputs,
                                                     depth, branch_chunk)
  dcaches = list(dcaches)
  # 4. Climb: each inner level's VJP once with its children's summed cotangent, handing its
  #    ancestors' share upward; the root's VJP last.
  for d in reversed(range(1, depth)):
    dparams, danc = vjps[d](dcaches[d])
    grads = jax.tree.map(jnp.add, grads, dparams)
    dcaches[:d] = [jax.tree.map(jnp.add, a, b) for a, b in zip(dcaches[:d], danc)]
  (dparams,) = vjps[0](dcaches[0])
  grads = jax.tree.map(jnp.add, grads, dparams)
  return loss, jax.tree.map(lambda x: _flat(x, depth), aux), grads


def logps(params, batch: TreeBatch, model_cfg: tfm.ModelConfig):
  """Log-probs of every node's tokens, one forward per node (the tree's forward, no grad):
  (per level [B, R, T] with 0 where invalid, trunk_logp_BW). E.g. the reference policy's."""
  inputs = _inputs(batch, losses.LossConfig())
  caches, out = [_root_cache(params, model_cfg, inputs[0])], []
  for d, level in enumerate(batch.levels, start=1):
    fn = _vmap_nodes(functools.partial(_inner_cache, model_cfg=model_cfg), d)
    caches.append(fn(params, tuple(caches), tuple(inputs[:d]), inputs[d]))
    out.append(jnp.where(level.valid_BRT, _flat(caches[-1]["logp_BT"], d), 0.0))
  return tuple(out), caches[0]["trunk_logp_BW"]


# ----------------------------------------------------------------------------- naive twin


def paths(batch: TreeBatch, loss_cfg: losses.LossConfig):
  """Every root-to-leaf path as its own sequence, as a trainer without trees holds it: the
  left-padded prompt, then the path's response tokens contiguous (each node's valid tokens
  moved up behind its ancestors', padding at the end). A dict of [B*leaves, S] arrays
  (S = P + sum of T_d); scored tokens lie in the last S - (P - W) positions."""
  B, P = batch.root_BP.shape
  n, W = batch.n_leaves, batch.trunk_len
  w_BR = leaf_weights(loss_cfg, batch)
  leaf_adv_BR = batch.leaves.advantages_BR
  per_path = lambda x_BR: jnp.repeat(x_BR, n // x_BR.shape[1], axis=1)
  ft = w_BR.dtype

  def segment(tokens, valid, scored, adv_BR, old, ref, is_leaf):
    T = tokens.shape[-1]
    adv = jnp.broadcast_to(per_path(adv_BR)[..., None], (B, n, T))
    fill = lambda x: jnp.zeros((B, n, T), ft) if x is None else per_path(x)
    return dict(tokens=per_path(tokens), valid=per_path(valid), scored=per_path(scored),
                advantage=adv, old=fill(old), ref=fill(ref),
                leaf=jnp.full((B, n, T), is_leaf))

  trunk = lambda x: None if x is None else jnp.concatenate(
      [jnp.zeros((B, P - W), x.dtype), x], 1)[:, None]
  root_scored = jnp.broadcast_to(jnp.arange(P) >= P - W, (B, P)) & batch.root_valid_BP
  root = segment(batch.root_BP[:, None], batch.root_valid_BP[:, None], root_scored[:, None],
                 leaf_adv_BR, trunk(batch.trunk_old_logp_BW), trunk(batch.trunk_ref_logp_BW),
                 False)
  below = []
  for d, level in enumerate(batch.levels, start=1):
    adv = leaf_adv_BR if level.advantages_BR is None else level.advantages_BR
    below.append(segment(level.tokens_BRT, level.valid_BRT, level.scored(), adv,
                         level.old_logp_BRT, level.ref_logp_BRT, d == batch.depth))
  below = {k: jnp.concatenate([s[k] for s in below], axis=-1) for k in root}
  order = jnp.argsort(~below["valid"], axis=-1, stable=True)  # valid tokens first, in order
  seq = {k: jnp.concatenate([root[k], jnp.take_along_axis(below[k], order, axis=-1)], -1)
         for k in root}
  seq = {k: v.reshape(B * n, -1) for k, v in seq.items()}
  seq["weight"] = w_BR.reshape(B * n)
  return seq


def naive_loss(params, batch: TreeBatch, model_cfg: tfm.ModelConfig,
               loss_cfg: losses.LossConfig):
  """The naive twin: every root-to-leaf path as its own full sequence through tfm.forward.
  Returns (loss, aux_BR per leaf)."""
  B, n = batch.root_BP.shape[0], batch.n_leaves
  first = batch.root_BP.shape[1] - batch.trunk_len  # the first position that may be scored
  s = paths(batch, loss_cfg)
  h_NSD = tfm.forward(params, model_cfg, s["tokens"], s["valid"])
  # Token i is predicted by the hidden state at i-1 (the prompt's last token for the first
  # response token: response tokens are contiguous behind it).
  logp_NS, entropy_NS = tfm.token_logps(params, model_cfg, h_NSD[:, first - 1:-1],
                                        s["tokens"][:, first:])
  cut = lambda x: x[:, first:]
  scored, leaf, valid = cut(s["scored"]), cut(s["leaf"]), cut(s["valid"])
  sg = jax.lax.stop_gradient(logp_NS)
  given = lambda name: getattr(batch.leaves, name) is not None
  old = jnp.where(scored, cut(s["old"]), sg) if given("old_logp_BRT") else sg
  ref = jnp.where(scored, cut(s["ref"]), sg) if given("ref_logp_BRT") else sg
  weight_NS = s["weight"][:, None] * scored.astype(s["weight"].dtype)
  values_NS = loss_cfg.objective.token_fn(logp_NS, old, ref, cut(s["advantage"]), loss_cfg)
  value_N = jnp.sum(values_NS * weight_NS, axis=-1)
  leaf = leaf & valid
  aux = dict(logp_sum=jnp.sum(jnp.where(leaf, logp_NS, 0.0), -1),
             entropy_sum=jnp.sum(jnp.where(leaf, entropy_NS, 0.0), -1),
             kl_sum=jnp.sum(losses.k3_kl(logp_NS, ref) * (weight_NS > 0), -1),
             tokens=leaf.sum(-1))
  return value_N.sum(), jax.tree.map(lambda x: x.reshape(B, n), aux)


def naive_loss_and_grad(params, batch, model_cfg, loss_cfg):
  (loss, aux), grads = jax.value_and_grad(naive_loss, has_aux=True)(params, batch, model_cfg,
                                                                    loss_cfg)
  return loss, aux, grads


def loss_and_grad(params, batch: TreeBatch, model_cfg, loss_cfg, mode: str = "replay",
                  branch_chunk: Optional[int] = None):
  if mode == "replay":
    return replay_loss_and_grad(params, batch, model_cfg, loss_cfg, branch_chunk)
  if mode == "naive":
    return naive_loss_and_grad(params, batch, model_cfg, loss_cfg)
  raise ValueError(f"replay.mode={mode!r}: expected one of {MODES}")
