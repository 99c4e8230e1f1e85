"""The transformer on a tree, and the library's one entry: `loss_and_grad(params, batch,
model_cfg, loss_cfg, mode, branch_chunk, *, mesh, params_fn, head)`.

Replay: every level runs as folded rows (B*N_d rows, row-major (b, node)) against its
ancestors' K/V segments, so each ancestor's dK/dV comes out of the attention contraction
already summed; the objective scores every root-to-leaf path over its X scored positions
(trunk, then each level's tokens). A flat batch is the depth-1 tree (`tree.flat`). The naive
twin (`naive_loss`, mode 'naive') runs every path as its own sequence through the same model
and the same head. What is scored is a `Head`: the policy's objective (`policy_head`, the
default) or PPO's value model (critic.head); a mesh (`sharding.make_mesh`) runs the same
replay context-parallel; params_fn runs it over LoRA adapters. The flat twin that shares no
tree code is a test oracle (tests/oracles.py).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from branch_replay.core import losses, replay, sharding
from branch_replay.core.tree import TreeBatch, leaf_weights
from models import transformer as tfm
from models.attention import context_parallel

MODES = ("replay", "naive")


def _rows(x_M, rows: int):
  """x repeated along axis 0 to `rows` rows (a node's row read by each of its descendants)."""
  return x_M if x_M.shape[0] == rows else jnp.repeat(x_M, rows // x_M.shape[0], axis=0)


def _fold(x_BNT):
  return None if x_BNT is None else x_BNT.reshape(-1, *x_BNT.shape[2:])


# ----------------------------------------------------------------------------- path inputs


def path_inputs(batch: TreeBatch, loss_cfg: losses.LossConfig):
  """Per root-to-leaf path (rows (b, leaf), [B*leaves, X] with X = W + T_1 + ... + T_D):
  old/ref log-probs (None when not given), advantage, scored mask and weight of every
  scored position, and the leaf's own valid mask [B*leaves, T_D]."""
  B = batch.root_BP.shape[0]
  n, W = batch.n_leaves, batch.trunk_len
  per_path = lambda x_BN: jnp.repeat(x_BN, n // x_BN.shape[1], axis=1)
  w_Bn = leaf_weights(loss_cfg, batch)
  leaf = batch.leaves
  leaf_adv_Bn = leaf.advantages_BR

  def along(x_BnT, T):
    return jnp.broadcast_to(x_BnT[..., None], (B, n, T)) if x_BnT.ndim == 2 else x_BnT

  trunk_adv = (
    leaf_adv_Bn[..., None] if batch.trunk_advantages_BRW is None else batch.trunk_advantages_BRW
  )
  adv = [jnp.broadcast_to(trunk_adv, (B, n, W))]
  scored = [jnp.ones((B, n, W), bool)]
  for d, level in enumerate(batch.levels, start=1):
    T = level.tokens_BRT.shape[2]
    scored.append(per_path(level.scored()))
    if d == batch.depth and level.advantages_BRT is not None:
      adv.append(level.advantages_BRT)
    elif level.path_advantages_BLT is not None:  # per token and per path (GAE on a tree)
      adv.append(level.path_advantages_BLT)
    else:
      adv.append(
        along(per_path(level.advantages_BR) if level.advantages_BR is not None else leaf_adv_Bn, T)
      )

  def logps(name, trunk):
    if getattr(leaf, name) is None:
      return None
    trunk_BW = (
      jnp.zeros((B, 0), w_Bn.dtype) if getattr(batch, trunk) is None else getattr(batch, trunk)
    )
    parts = [jnp.broadcast_to(trunk_BW[:, None], (B, n, W))]
    return jnp.concatenate(parts + [per_path(getattr(l, name)) for l in batch.levels], -1)

  scored_BnX = jnp.concatenate(scored, -1)
  out = dict(
    old=logps("old_logp_BRT", "trunk_old_logp_BW"),
    ref=logps("ref_logp_BRT", "trunk_ref_logp_BW"),
    adv=jnp.concatenate(adv, -1).astype(w_Bn.dtype),
    scored=scored_BnX,
    weight=w_Bn[..., None] * scored_BnX.astype(w_Bn.dtype),
    leaf_valid=leaf.valid_BRT,
  )
  return {k: _fold(v) for k, v in out.items()}


def path_value(logp_MX, entropy_MT, path, loss_cfg: losses.LossConfig):
  """(value_M, aux of per-path sums) of every path (tests/oracles.py scores a flat branch
  independently)."""
  sg = jax.lax.stop_gradient(logp_MX)
  old_MX = sg if path["old"] is None else path["old"]
  ref_MX = sg if path["ref"] is None else path["ref"]
  adv_MX, scored_MX, weight_MX = path["adv"], path["scored"], path["weight"]
  value_M = losses.branch_value(logp_MX, old_MX, ref_MX, adv_MX, scored_MX, weight_MX, loss_cfg)
  valid = path["leaf_valid"]
  logp_MT = logp_MX[:, logp_MX.shape[1] - valid.shape[1] :]
  log_ratio_MX = jnp.where(scored_MX, sg - old_MX, 0.0)
  ratio_MX = jnp.exp(log_ratio_MX)
  clipped_MX = jnp.clip(ratio_MX, 1.0 - loss_cfg.epsilon, 1.0 + loss_cfg.eps_high)
  binds_MX = scored_MX & (-clipped_MX * adv_MX > -ratio_MX * adv_MX)
  aux = dict(
    logp_sum=jnp.sum(jnp.where(valid, logp_MT, 0.0), -1),
    entropy_sum=jnp.sum(jnp.where(valid, entropy_MT, 0.0), -1),
    kl_sum=jnp.sum(jnp.where(weight_MX > 0, losses.k3_kl(sg, ref_MX), 0.0), -1),
    tokens=valid.sum(-1),
    scored_tokens=scored_MX.sum(-1),
    clip_sum=binds_MX.sum(-1),
    approx_kl_sum=jnp.sum(jnp.where(scored_MX, ratio_MX - 1.0 - log_ratio_MX, 0.0), -1),
    ratio_max=jnp.max(jnp.where(scored_MX, ratio_MX, 0.0), -1),
  )
  return value_M, aux


def check(batch: TreeBatch, loss_cfg: losses.LossConfig, branch_chunk=None) -> None:
  """Shape-level checks of the objective against the tree (static: before any compilation).
  An objective (or KL penalty) that needs reference log-probs gets them, or a ValueError: a
  missing reference must not silently read as the policy itself (KL 0, DPO margin 0)."""
  n = loss_cfg.objective.n_branches
  if n is not None and batch.fanouts[-1] != n:
    raise ValueError(
      f"tree.levels[{batch.depth - 1}].tokens_BRT: shape "
      f"{tuple(batch.leaves.tokens_BRT.shape)}: loss.name={loss_cfg.name!r} "
      f"expects a last fan-out of {n} (fanouts {batch.fanouts})"
    )
  if loss_cfg.needs_ref and (
    batch.leaves.ref_logp_BRT is None or (batch.trunk_len and batch.trunk_ref_logp_BW is None)
  ):
    why = "kl_coef > 0" if loss_cfg.kl_coef else f"objective {loss_cfg.name!r}"
    raise ValueError(
      f"tree.levels[{batch.depth - 1}].ref_logp_BRT: None, but loss.name="
      f"{loss_cfg.name!r} needs reference log-probs ({why}); score the batch "
      "with the reference policy (sampler.score) first"
    )
  if branch_chunk is not None and (branch_chunk < 1 or batch.fanouts[-1] % branch_chunk):
    raise ValueError(
      f"replay.branch_chunk={branch_chunk}: expected a divisor of the last "
      f"fan-out R_{batch.depth}={batch.fanouts[-1]} (fanouts {batch.fanouts})"
    )


def combine_fn(loss_cfg):
  """The objective's combining of the last fan-out's values ([R, M] -> loss; None = sum)."""
  fn = loss_cfg.objective.combine
  return None if fn is None else (lambda values_RM: fn(values_RM, loss_cfg))


# ----------------------------------------------------------------------------- replay


class Head(NamedTuple):
  """What a level's hidden states become and what a path's scores are worth. The policy's
  (`policy_head`): log-probs and the RL/DPO objective; the critic's (critic.py): values and
  the clipped value loss. The engine's folding, VJPs and cotangent sums are the same."""

  body: Callable  # params -> the transformer's params
  score: Callable  # (params, h_pred_MTD, tokens_MT) -> (score_MT, entropy_MT or None)
  value: Callable  # (score_MX, entropy_MT, path) -> (value_M, aux of per-path sums)
  path: Optional[dict] = None  # per-path inputs [B*leaves, ...] (path_inputs for the policy)
  combine: Optional[Callable] = None  # [R, M] values -> loss (None: their sum)


def policy_head(
  batch: TreeBatch, model_cfg: tfm.ModelConfig, loss_cfg: losses.LossConfig, with_path: bool = True
) -> Head:
  """Log-probs at loss.temperature, scored by the objective over every root-to-leaf path."""
  score = lambda params, h_MTD, tokens_MT: tfm.token_logps(
    params, model_cfg, h_MTD, tokens_MT, temperature=loss_cfg.temperature
  )
  return Head(
    body=lambda params: params,
    score=score,
    value=lambda logp_MX, entropy_MT, path: path_value(logp_MX, entropy_MT, path, loss_cfg),
    path=path_inputs(batch, loss_cfg) if with_path else None,
    combine=combine_fn(loss_cfg),
  )


def _node_rows(params, head: Head, model_cfg, caches, context_valid, tokens_MT, valid_MT):
  """Rows of one level against the caches of its ancestors (each with fewer rows, dividing):
  (h_MTD, kv, score_MT, entropy_MT); a row's first token is predicted by its parent's last
  hidden state."""
  M = tokens_MT.shape[0]
  context = [(c["kv"], v) for c, v in zip(caches, context_valid)]
  offset_M1 = sum(
    _rows(jnp.sum(v.astype(jnp.int32), axis=1, keepdims=True), M) for v in context_valid
  )
  positions_MT = tfm.positions_from_valid(valid_MT, offset_M1)
  h_MTD, kv = tfm.Transformer(model_cfg).apply(
    {"params": head.body(params)}, tokens_MT, positions_MT, valid_MT, context
  )
  h_last_MD = _rows(caches[-1]["h_last_BD"], M)
  h_pred_MTD = jnp.concatenate([h_last_MD[:, None], h_MTD[:, :-1]], axis=1)
  score_MT, entropy_MT = head.score(params, h_pred_MTD, tokens_MT)
  return h_MTD, kv, score_MT, entropy_MT


def replay_fns(batch: TreeBatch, model_cfg: tfm.ModelConfig, head: Head):
  """(root_fn, level_fns, leaf_loss_fn, leaves_R) for `replay.tree_value_and_grad`. The
  caches carry each level's scores (`score_BT`; the root's trunk: `trunk_score_BW`)."""
  B, P = batch.root_BP.shape
  W = batch.trunk_len
  valid = [batch.root_valid_BP] + [_fold(l.valid_BRT) for l in batch.levels]

  def root_fn(params):
    cache = tfm.prefill(head.body(params), model_cfg, batch.root_BP, batch.root_valid_BP, W)
    trunk_score_BW, _ = head.score(params, cache.trunk_h_BWD, batch.root_BP[:, P - W :])
    return dict(kv=cache.kv, h_last_BD=cache.h_last_BD, trunk_score_BW=trunk_score_BW)

  def level_fn(d):
    def fn(params, caches):
      tokens_MT, valid_MT = _fold(batch.levels[d - 1].tokens_BRT), valid[d]
      h_MTD, kv, score_MT, _ = _node_rows(
        params, head, model_cfg, caches, valid[:d], tokens_MT, valid_MT
      )
      last_M = jnp.sum(valid_MT.astype(jnp.int32), axis=1) - 1
      h_last_MD = jnp.take_along_axis(h_MTD, last_M[:, None, None], axis=1)[:, 0]
      return dict(kv=kv, h_last_BD=h_last_MD, score_BT=score_MT)

    return fn

  leaf = batch.leaves
  R = batch.fanouts[-1]
  r_first = lambda x_M: (
    None if x_M is None else jnp.swapaxes(x_M.reshape(-1, R, *x_M.shape[1:]), 0, 1)
  )
  leaves_R = dict(
    tokens=r_first(_fold(leaf.tokens_BRT)),
    valid=r_first(_fold(leaf.valid_BRT)),
    path={k: r_first(v) for k, v in (head.path or {}).items()},
  )

  def leaf_loss_fn(params, caches, leaves_R):
    """Every leaf at once: [R, M'] -> rows (parent, r), folded against the ancestors."""
    R_, Mp = leaves_R["tokens"].shape[:2]
    rows = lambda x: None if x is None else jnp.swapaxes(x, 0, 1).reshape(Mp * R_, *x.shape[2:])
    unrows = lambda x_M: jnp.swapaxes(x_M.reshape(Mp, R_, *x_M.shape[1:]), 0, 1)
    tokens_MT = rows(leaves_R["tokens"])
    M = tokens_MT.shape[0]
    _, _, score_MT, entropy_MT = _node_rows(
      params, head, model_cfg, caches, valid[:-1], tokens_MT, rows(leaves_R["valid"])
    )
    cached = [caches[0]["trunk_score_BW"]] + [c["score_BT"] for c in caches[1:]]
    score_MX = jnp.concatenate([_rows(x, M) for x in cached] + [score_MT], axis=1)
    value_M, aux = head.value(score_MX, entropy_MT, jax.tree.map(rows, leaves_R["path"]))
    return unrows(value_M), jax.tree.map(unrows, aux)

  level_fns = [level_fn(d) for d in range(1, batch.depth)]
  return root_fn, level_fns, leaf_loss_fn, leaves_R


def _per_leaf(x_RM, B):
  """[R_D, B*N_{D-1}] -> [B, leaves]."""
  return jnp.swapaxes(x_RM, 0, 1).reshape(B, -1)


def _replay(
  params,
  batch: TreeBatch,
  model_cfg: tfm.ModelConfig,
  head: Head,
  branch_chunk: Optional[int] = None,
  *,
  root_wrap: Optional[Callable] = None,
  cache_constraint: Optional[Callable] = None,
  params_fn: Optional[Callable] = None,
):
  """Tree replay: (loss, aux_BR per leaf, grads), grads equal to the naive gradient.
  root_wrap(root_fn) -> root_fn (the context-parallel prefill); cache_constraint(level, cache)
  -> cache where each level's cache crosses to the levels below; params_fn(params) -> the
  model's params, inside every differentiated function (LoRA: `params` are the adapters,
  merged into the frozen base; grads are the adapters')."""
  root_fn, level_fns, leaf_loss_fn, leaves_R = replay_fns(batch, model_cfg, head)
  if params_fn is not None:
    root_fn = (lambda fn: lambda p: fn(params_fn(p)))(root_fn)
    level_fns = [(lambda fn: lambda p, caches: fn(params_fn(p), caches))(fn) for fn in level_fns]
    leaf_loss_fn = (lambda fn: lambda p, caches, leaves: fn(params_fn(p), caches, leaves))(
      leaf_loss_fn
    )
  if root_wrap is not None:
    root_fn = root_wrap(root_fn)
  loss, aux_R, grads = replay.tree_value_and_grad(
    root_fn,
    level_fns,
    leaf_loss_fn,
    params,
    leaves_R,
    branch_chunk=branch_chunk,
    combine=head.combine,
    cache_constraint=cache_constraint,
  )
  B = batch.root_BP.shape[0]
  return loss, jax.tree.map(lambda x: _per_leaf(x, B), aux_R), grads


def _replay_on_mesh(
  mesh, params, batch: TreeBatch, model_cfg, head: Head, branch_chunk, params_fn, p_shardings
):
  """Replay on `mesh` (call it inside one jit): the batch placed by sharding.batch_shardings,
  the root prefill context-parallel under the model's logical rules, its cache kept in its
  sequence shards where it crosses to the levels below, each tail layer gathering its K/V
  once; params and grads sharded like the parameters (p_shardings: the head's params tree,
  default the policy's). With params_fn (LoRA: params are the adapters, replicated) the
  weights it returns are sharded like the parameters instead. The leaves' cache cotangent is
  summed across the branch shards by the partitioner (an all-reduce / reduce-scatter over
  `context`) before the single prefix VJP. branch_chunk's chunks are strided over R, so each
  chunk's branches stay split over `context` (a multiple of the `context` size)."""
  batch = sharding.constrain(batch, sharding.batch_shardings(mesh, batch))
  if p_shardings is None:
    p_shardings = sharding.param_shardings(mesh, model_cfg)
  if params_fn is None:
    params = sharding.constrain(params, p_shardings)
  else:
    params_fn = (lambda fn: lambda p: sharding.constrain_weights(fn(p), p_shardings))(params_fn)
  root_constraint = sharding.cache_constraint(mesh)

  def root_wrap(root_fn):
    prefill = sharding.sharded_prefill(mesh, lambda p, _: root_fn(p))
    return lambda p: prefill(p, None)

  with context_parallel.sharded_tails(mesh, sharding.RULES):
    loss, aux_BR, grads = _replay(
      params,
      batch,
      model_cfg,
      head,
      branch_chunk,
      root_wrap=root_wrap,
      cache_constraint=lambda level, cache: root_constraint(cache) if level == 0 else cache,
      params_fn=params_fn,
    )
  aux_BR = sharding.constrain(
    aux_BR,
    jax.tree.map(  # per leaf, split like the leaves
      lambda x: sharding.named_sharding(mesh, "aux", x.shape, ("batch", "branch")), aux_BR
    ),
  )
  return loss, aux_BR, (grads if params_fn is not None else sharding.constrain(grads, p_shardings))


def prefix_residuals(mesh, params, batch: TreeBatch, model_cfg, loss_cfg: losses.LossConfig):
  """Replay's step 1 alone, on the mesh: (cache, prefix_vjp). prefix_vjp's leaves are the
  residuals the prefix backward keeps alive; jit this to inspect their shardings."""
  params = sharding.constrain(params, sharding.param_shardings(mesh, model_cfg))
  batch = sharding.constrain(batch, sharding.batch_shardings(mesh, batch))
  root_fn, _, _, _ = replay_fns(batch, model_cfg, policy_head(batch, model_cfg, loss_cfg))
  prefill = sharding.sharded_prefill(mesh, lambda p, _: root_fn(p))
  return replay.prefix_forward(prefill, params, None)


def forward(
  params,
  batch: TreeBatch,
  model_cfg: tfm.ModelConfig,
  temperature: float = 1.0,
  head: Optional[Head] = None,
):
  """Scores of every node's tokens (no grad): (per level [B, R, T], 0 where invalid; the
  trunk's [B, W]). Default head: log-probs at `temperature` (the reference or sampling
  policy's); critic.values passes the value head."""
  if head is None:
    head = policy_head(
      batch, model_cfg, losses.LossConfig(temperature=temperature), with_path=False
    )
  root_fn, level_fns, _, _ = replay_fns(batch, model_cfg, head)
  caches = [root_fn(params)]
  for fn in level_fns:
    caches.append(fn(params, tuple(caches)))
  valid = [_fold(l.valid_BRT) for l in batch.levels]
  leaf = batch.leaves
  _, _, score_MT, _ = _node_rows(
    params,
    head,
    model_cfg,
    caches,
    [batch.root_valid_BP] + valid[:-1],
    _fold(leaf.tokens_BRT),
    valid[-1],
  )
  scores = [c["score_BT"] for c in caches[1:]] + [score_MT]
  out = tuple(
    jnp.where(l.valid_BRT, x.reshape(l.valid_BRT.shape), 0.0) for l, x in zip(batch.levels, scores)
  )
  return out, caches[0]["trunk_score_BW"]


# ----------------------------------------------------------------------------- naive twin


def path_sequences(batch: TreeBatch):
  """Every root-to-leaf path as its own sequence: (tokens_MS, valid_MS, back), rows (b, leaf),
  S = P + T_1 + ... + T_D: the left-padded prompt, then the path's tokens contiguous (each
  node's valid tokens behind its ancestors', padding at the end). back(x_MS') maps scores of
  positions P - W .. S - 1 (predicted by the hidden state before each) to the engine's path
  layout [M, X] (trunk, then each level's T_d positions)."""
  B, P = batch.root_BP.shape
  n, W = batch.n_leaves, batch.trunk_len
  per_path = lambda x_BN: jnp.repeat(x_BN, n // x_BN.shape[1], axis=1)
  below = lambda f: jnp.concatenate([per_path(f(l)) for l in batch.levels], -1)
  tokens_BnY, valid_BnY = below(lambda l: l.tokens_BRT), below(lambda l: l.valid_BRT)
  order_BnY = jnp.argsort(~valid_BnY, axis=-1, stable=True)  # valid tokens first, in order
  seq = lambda root_BP, x_BnY: jnp.concatenate(
    [jnp.broadcast_to(root_BP[:, None], (B, n, P)), jnp.take_along_axis(x_BnY, order_BnY, -1)], -1
  ).reshape(B * n, -1)
  unsort = jnp.argsort(order_BnY, axis=-1).reshape(B * n, -1)  # back to the level layout
  back = lambda x_MS: jnp.concatenate(
    [x_MS[:, :W], jnp.take_along_axis(x_MS[:, W:], unsort, -1)], -1
  )
  return seq(batch.root_BP, tokens_BnY), seq(batch.root_valid_BP, valid_BnY), back


def naive_loss(
  params,
  batch: TreeBatch,
  model_cfg: tfm.ModelConfig,
  loss_cfg: Optional[losses.LossConfig],
  head: Optional[Head] = None,
):
  """The naive twin: every root-to-leaf path as its own sequence through tfm.forward (the
  left-padded prompt, then the path's tokens contiguous: each node's valid tokens behind its
  ancestors', padding at the end), scored by the same head. Returns (loss, aux_BR per leaf)."""
  if head is None:
    check(batch, loss_cfg)
    head = policy_head(batch, model_cfg, loss_cfg)
  tokens_MS, valid_MS, back = path_sequences(batch)
  h_MSD = tfm.forward(head.body(params), model_cfg, tokens_MS, valid_MS)
  first = batch.root_BP.shape[1] - batch.trunk_len  # the first position that may be scored
  score_MS, entropy_MS = head.score(params, h_MSD[:, first - 1 : -1], tokens_MS[:, first:])
  T_D = batch.leaves.tokens_BRT.shape[2]
  entropy_MT = None if entropy_MS is None else back(entropy_MS)[:, -T_D:]
  value_M, aux = head.value(back(score_MS), entropy_MT, head.path)
  B, n, R = batch.root_BP.shape[0], batch.n_leaves, batch.fanouts[-1]
  loss = value_M.sum() if head.combine is None else head.combine(value_M.reshape(-1, R).T)
  return loss, jax.tree.map(lambda x: x.reshape(B, n), aux)


# ----------------------------------------------------------------------------- the entry


def loss_and_grad(
  params,
  batch: TreeBatch,
  model_cfg: tfm.ModelConfig,
  loss_cfg: Optional[losses.LossConfig],
  mode: str = "replay",
  branch_chunk: Optional[int] = None,
  *,
  mesh=None,
  params_fn: Optional[Callable] = None,
  head: Optional[Head] = None,
  p_shardings=None,
):
  """(loss, aux_BR per leaf, grads) of a tree (a flat batch is the depth-1 tree) by branch
  replay (mode 'replay') or by its naive twin ('naive'): the one entry of the library.

  mesh: a jax Mesh (sharding.make_mesh; call inside one jit): replay runs context-parallel
  with the branches over `context`; the naive twin runs under the partitioner's defaults from
  the inputs' shardings. params_fn(params) -> the model's params inside every differentiated
  function (LoRA: params are the adapters, `lora.attach`ed to the frozen base; grads are the
  adapters'). head: what is scored (default the policy's objective `loss_cfg`; critic.head
  for PPO's value model, loss_cfg None, p_shardings its params' shardings on a mesh).
  branch_chunk streams the last level's branches in chunks (replay only)."""
  if mode not in MODES:
    raise ValueError(f"replay.mode={mode!r}: expected one of {MODES}")
  if head is None:
    check(batch, loss_cfg, branch_chunk if mode == "replay" else None)
    head = policy_head(batch, model_cfg, loss_cfg)
  if mode == "naive":
    fn = lambda p: naive_loss(
      p if params_fn is None else params_fn(p), batch, model_cfg, loss_cfg, head
    )
    (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(params)
    return loss, aux, grads
  if mesh is None:
    return _replay(params, batch, model_cfg, head, branch_chunk, params_fn=params_fn)
  return _replay_on_mesh(mesh, params, batch, model_cfg, head, branch_chunk, params_fn, p_shardings)
