"""PPO's critic through branch replay: a value model of the policy's family (its transformer
plus a linear value head), trained exactly like the policy on the one engine (engine.Head):
the prefix forward once per prompt, every node against its ancestors' cache, one backward
per level. Flat batches (the depth-1 tree) and trees alike. Also GAE per path.

Token x of a path (its W trunk tokens, then each level's tokens) gets the value V_x of the
state that predicts it (the hidden state before it, as for log-probs). A value depends only
on the tokens before it, so a trunk token's or an inner node's token's value is one, shared
by every path through it; its targets (GAE's return) are the path's own. GAE runs per path
over its scored tokens with the reward at the path's last one (`gae`), so the last trunk
token bootstraps from the value of the branch's first tail token, a node's last token from
its child's first. The value loss is every path's own (the naive twin: every root-to-leaf
path as its own sequence with its own targets), so a shared token counts once per path.

Two critics (`critic.share`):
  share=false  a separate value model: params {'model': transformer, 'head': value head},
               both trained (the prefix backward runs through the critic's own body).
  share=true   a value head on the policy with a detached trunk: params {'head'} only; the
               values are the head applied to the POLICY's hidden states (`body_params`, the
               policy's transformer params, closed over as constants: not differentiated).
               The critic step is still a replay step (the prefix forward once per prompt,
               the tails batched against it) but its gradient is the head's alone, so no
               backward runs through the body and no second transformer is kept in memory.
               The policy's own update is unchanged (the value loss never reaches the body).
Every function below takes `body_params=None` (separate model) or the policy's params (shared).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import engine, losses, sharding, tree
from models import transformer as tfm


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  # PPO's value model (algo.name=ppo).
  # true: a value head on the policy with a detached trunk (only the head is the critic's);
  # false: a separate value model (a copy of the policy's transformer + a value head)
  share: bool = False
  learning_rate: float = 1e-3
  # AdamW's decoupled decay of the critic (the policy's: train.weight_decay): 1e-4, the decay
  # it has always had (optax.adamw's default, implicit before this field); 0 turns it off
  weight_decay: float = 1e-4
  value_clip: float = 0.2  # clip of V - V_old in the clipped value loss
  gamma: float = 1.0
  lam: float = 0.95  # GAE lambda
  whiten: bool = True  # normalise the policy's advantages over the batch's scored tokens

  def __post_init__(self):
    if not isinstance(self.share, bool):
      raise ValueError(f"critic.share={self.share!r}: expected true or false")
    if not (0 < self.learning_rate < float("inf")):
      raise ValueError(f"critic.learning_rate={self.learning_rate!r}: expected > 0")
    if not (0 <= self.weight_decay < float("inf")):
      raise ValueError(f"critic.weight_decay={self.weight_decay!r}: expected >= 0")
    if not self.value_clip > 0:
      raise ValueError(f"critic.value_clip={self.value_clip!r}: expected > 0")
    for name in ("gamma", "lam"):
      if not 0 <= getattr(self, name) <= 1:
        raise ValueError(f"critic.{name}={getattr(self, name)!r}: expected in [0, 1]")


@flax.struct.dataclass
class CriticBatch:
  """A tree (a flat batch: depth 1; tokens and masks) with per-token regression targets on
  every path ([B, L, X]: L branches or leaves per prompt, X = W + T_1 + ... + T_D scored
  positions in the engine's path layout, `scored_mask`; the trunk's and an inner node's
  targets repeated on every path through it, each with that path's return)."""

  batch: tree.TreeBatch
  returns_BRX: jax.Array
  old_values_BRX: jax.Array


def _scored_BLX(t: tree.TreeBatch):
  """[B, L, X] bool: the trunk, then each level's scored tokens on every path through it."""
  B, L = t.root_BP.shape[0], t.n_leaves
  per_path = lambda x_BN: jnp.repeat(x_BN, L // x_BN.shape[1], axis=1)
  return jnp.concatenate(
    [jnp.ones((B, L, t.trunk_len), bool)] + [per_path(level.scored()) for level in t.levels], -1
  )


def scored_mask(batch) -> np.ndarray:
  """[B, L, X] bool (host): the positions with a value target (`CriticBatch`); flat: the
  trunk tokens, then the branch's valid tail tokens."""
  return np.asarray(_scored_BLX(batch), bool)


def _weights_BRX(batch):
  """token_mean over every path's scored tokens (an inner node's once per path through it),
  as the policy's tree.leaf_weights weighs them."""
  w_BL = tree.leaf_weights(losses.LossConfig(aggregation="token_mean"), batch)
  return w_BL[..., None] * _scored_BLX(batch).astype(w_BL.dtype)


def validate(cb: CriticBatch) -> None:
  """Host checks of a CriticBatch, before any compilation: ValueError naming the field."""
  t = cb.batch
  mask = scored_mask(t)
  for name in ("returns_BRX", "old_values_BRX"):
    x = getattr(cb, name)
    if np.shape(x) != mask.shape:
      raise ValueError(
        f"critic_batch.{name}: shape {np.shape(x)}: expected {mask.shape} "
        f"([B, leaves={t.n_leaves}, X = trunk_len {t.trunk_len} + level "
        f"lengths {[np.shape(l.tokens_BRT)[2] for l in t.levels]}])"
      )
    if not np.all(np.isfinite(np.asarray(x))):
      raise ValueError(f"critic_batch.{name}: expected finite values (found NaN or inf)")
  _check_paths(t, mask)


def _check_paths(t: tree.TreeBatch, mask) -> None:
  """GAE puts a path's reward on its last scored token: a path with none cannot be served."""
  empty = ~mask.any(-1)
  if empty.any():
    b, leaf = np.argwhere(empty)[0]
    raise ValueError(
      f"tree.levels[{t.depth - 1}].scored_BRT: path to leaf {leaf} of prompt "
      f"{b} has no scored token: expected >= 1 scored token on every "
      "root-to-leaf path (GAE puts the reward on the path's last one)"
    )


def init_head(model_cfg: tfm.ModelConfig):
  """A zero value head {'w_D': [D], 'b': []}."""
  dt = model_cfg.weight_dtype
  return {"w_D": jnp.zeros((model_cfg.d_model,), dt), "b": jnp.zeros((), dt)}


def init_params(model_cfg: tfm.ModelConfig, key, model_params=None, share: bool = False):
  """{'model': transformer params (a copy of model_params if given), 'head': zero value head};
  with share=True only {'head'} (the body is the policy's, passed as `body_params`)."""
  if share:
    return {"head": init_head(model_cfg)}
  model = (
    tfm.init_params(model_cfg, key)
    if model_params is None
    else jax.tree.map(jnp.copy, model_params)
  )
  return {"model": model, "head": init_head(model_cfg)}


def _body(params, body_params):
  """The transformer params the values are read from: the critic's own ('model') or, for a
  shared critic, the policy's (`body_params`, a constant of the critic's gradient)."""
  if body_params is None:
    if "model" not in params:
      raise ValueError(
        f"critic params have keys {sorted(params)} and body_params=None: a "
        "shared critic (critic.share=true, {'head'} only) needs body_params="
        "the policy's params"
      )
    return params["model"]
  if "model" in params:
    raise ValueError(
      "critic params hold a 'model' and body_params was given: expected "
      "{'head'} only with body_params (critic.share=true), or body_params=None"
    )
  return jax.lax.stop_gradient(body_params)


def value_head(head, h_BTD):
  acc = jnp.float64 if h_BTD.dtype == jnp.float64 else jnp.float32
  return jnp.einsum(
    "BTD,D->BT", h_BTD, head["w_D"].astype(h_BTD.dtype), preferred_element_type=acc
  ) + head["b"].astype(acc)


def value_loss(values_BX, old_values_BX, returns_BX, weight_BX, clip: float):
  """PPO's clipped value loss per branch: sum_x w_x 0.5 max((V-R)^2, (V_old + clip(V-V_old,
  -c, c) - R)^2)."""
  clipped = old_values_BX + jnp.clip(values_BX - old_values_BX, -clip, clip)
  per_token = 0.5 * jnp.maximum((values_BX - returns_BX) ** 2, (clipped - returns_BX) ** 2)
  return jnp.sum(jnp.where(weight_BX > 0, per_token, 0.0) * weight_BX, axis=-1)


def _branch_loss(values_BX, branch, cfg: CriticConfig):
  loss_B = value_loss(
    values_BX, branch["old_values_BX"], branch["returns_BX"], branch["weight_BX"], cfg.value_clip
  )
  scored = branch["weight_BX"] > 0
  aux = dict(
    value_sum=jnp.sum(jnp.where(scored, values_BX, 0.0), -1),
    clip_sum=jnp.sum(scored & (jnp.abs(values_BX - branch["old_values_BX"]) > cfg.value_clip), -1),
    tokens=scored.sum(-1),
  )
  return loss_B, aux


def head(
  model_cfg: tfm.ModelConfig,
  cfg: Optional[CriticConfig] = None,
  cb: Optional[CriticBatch] = None,
  body_params=None,
) -> engine.Head:
  """The value head on the one engine: a value for every position of every path (the
  trunk's, then each level's tokens, predicted by the hidden state before each) and PPO's
  clipped value loss per path (branch or root-to-leaf path of a tree). With body_params (shared critic) the transformer is a constant: the backward
  stops at the head, except through the trunk values."""
  fold = lambda x_BRX: x_BRX.reshape(-1, x_BRX.shape[-1])
  path = (
    None
    if cb is None
    else dict(
      returns_BX=fold(cb.returns_BRX),
      old_values_BX=fold(cb.old_values_BRX),
      weight_BX=fold(_weights_BRX(cb.batch)),
    )
  )
  return engine.Head(
    body=lambda params: _body(params, body_params),
    score=lambda params, h_MTD, _: (value_head(params["head"], h_MTD), None),
    value=lambda values_MX, _, path: _branch_loss(values_MX, path, cfg),
    path=path,
  )


def param_shardings(mesh, model_cfg, params):
  """Where the critic's params live on `mesh`: its transformer ('model') like the policy's,
  the value head replicated. `params` (or their shapes) give the tree: {'model', 'head'} or
  {'head'} (critic.share)."""
  out = {"head": jax.tree.map(lambda _: sharding.replicated(mesh), params["head"])}
  if "model" in params:
    out["model"] = sharding.param_shardings(mesh, model_cfg)
  return out


def batch_shardings(mesh, cb: CriticBatch) -> CriticBatch:
  """A CriticBatch of NamedShardings: the replay batch's (sharding.batch_shardings), the
  per-token targets split by prompt and branch (leaf) like the tails (leaves)."""
  targets = lambda name, x: sharding.named_sharding(
    mesh, f"critic_batch.{name}", np.shape(x), ("batch", "branch", None)
  )
  return CriticBatch(
    sharding.batch_shardings(mesh, cb.batch),
    targets("returns_BRX", cb.returns_BRX),
    targets("old_values_BRX", cb.old_values_BRX),
  )


def naive_values(params, batch, model_cfg, body_params=None) -> jax.Array:
  """Values of every path position, each path as its own sequence (engine.path_sequences):
  [B, L, X]."""
  tokens_MS, valid_MS, back = engine.path_sequences(batch)
  h_MSD = tfm.forward(_body(params, body_params), model_cfg, tokens_MS, valid_MS)
  first = batch.root_BP.shape[1] - batch.trunk_len  # the first scored position
  values_MX = back(value_head(params["head"], h_MSD[:, first - 1 : -1]))
  return values_MX.reshape(batch.root_BP.shape[0], batch.n_leaves, -1)


def naive_loss(params, cb: CriticBatch, model_cfg, cfg: CriticConfig, body_params=None):
  """The naive twin of the critic loss: every path its own sequence with its own targets
  (the engine's naive twin with the value head), (loss, aux_BR per path)."""
  return engine.naive_loss(params, cb.batch, model_cfg, None, head(model_cfg, cfg, cb, body_params))


def loss_and_grad(
  params,
  cb: CriticBatch,
  model_cfg,
  cfg: CriticConfig,
  mode: str = "replay",
  body_params=None,
  mesh=None,
):
  """(loss, aux_BR, grads w.r.t. params) through the one engine with the value head;
  body_params: the policy's params for a shared critic (params = {'head'}), None for a
  separate value model. mesh (call it inside one jit, cb placed with `batch_shardings`): the
  engine's mesh path, the prefix context-parallel, branches over `context`, the critic's
  transformer and its grads sharded like the policy's (the head replicated); the naive twin
  runs under the partitioner's defaults, from the inputs' shardings."""
  return engine.loss_and_grad(
    params,
    cb.batch,
    model_cfg,
    None,
    mode,
    mesh=mesh,
    head=head(model_cfg, cfg, cb, body_params),
    p_shardings=None if mesh is None else param_shardings(mesh, model_cfg, params),
  )


def values(params, model_cfg, batch, body_params=None) -> jax.Array:
  """Values of every path position from ONE replay forward (the engine's, value head): [B,
  L, X] (0 where a node is padded; an inner node's value repeated on its paths). The 'old'
  values of PPO, computed once per sampled batch. body_params: the policy's params for a
  shared critic (params = {'head'})."""
  v_levels, trunk_v_BW = engine.forward(
    params, batch, model_cfg, head=head(model_cfg, body_params=body_params)
  )
  B, L = batch.root_BP.shape[0], batch.n_leaves
  per_path = lambda x_BNT: jnp.repeat(x_BNT, L // x_BNT.shape[1], axis=1)
  return jnp.concatenate(
    [jnp.broadcast_to(trunk_v_BW[:, None], (B, L, batch.trunk_len))]
    + [per_path(v) for v in v_levels],
    -1,
  )


# ----------------------------------------------------------------------------- GAE (host)


def gae(rewards_BR, values_BRX, scored_BRX, gamma: float, lam: float):
  """GAE per path (a flat branch, or a tree's root-to-leaf path) over its scored positions
  in order, skipping the rest (padding between levels, unscored tool text): each scored
  token is a step, the path's reward at its last one, V = 0 after it. A token of an inner
  node lies on several paths and gets each path's own advantage and return there (they
  differ by the leaf's reward and the values below the node), as the engine scores every
  path with its own targets. Returns (advantages_BRX, returns_BRX), 0 where not scored."""
  values = np.where(scored_BRX, np.asarray(values_BRX, np.float64), 0.0)
  scored = np.asarray(scored_BRX, bool)
  X = scored.shape[-1]
  last_BR = X - 1 - np.argmax(scored[..., ::-1], -1)  # the last scored position
  rewards_BRX = np.where(
    np.arange(X) == last_BR[..., None], np.asarray(rewards_BR, np.float64)[..., None], 0.0
  )
  adv = np.zeros_like(values)
  running = np.zeros(values.shape[:-1])  # the next scored step's advantage
  next_value = np.zeros(values.shape[:-1])  # ... and its value (0 past the last)
  for x in reversed(range(X)):
    s = scored[..., x]
    delta = rewards_BRX[..., x] + gamma * next_value - values[..., x]
    adv[..., x] = np.where(s, delta + gamma * lam * running, 0.0)
    running = np.where(s, adv[..., x], running)
    next_value = np.where(s, values[..., x], next_value)
  return adv, np.where(scored, adv + values, 0.0)


def explained_variance(values_BRX, returns_BRX, valid_BRX) -> float:
  """1 - Var(returns - values) / Var(returns) over scored tokens."""
  m = np.asarray(valid_BRX, bool)
  ret = np.asarray(returns_BRX)[m]
  var = ret.var()
  return float(1.0 - (ret - np.asarray(values_BRX)[m]).var() / var) if var > 0 else float("nan")


def pooled_explained_variance(records) -> float:
  """Explained variance pooled over several steps' batches, from their per-step sums:
  1 - sum_s n_s mse_s / sum_s n_s (var_s + (mean_s - M)^2), M the tokens' overall mean.
  Records carry `value/tokens` (n), `value/sq_err` (mse), `value/return_var`,
  `value/return_mean`. The denominator is the pooled returns' variance around ONE mean:
  the mean of the per-step variances alone leaves the spread of the batch means out while
  the numerator keeps it, so a critic that predicts the right overall mean everywhere would
  read below 0 (about -0.1 on ppo_haystack, whose 8-prompt batches' mean rewards vary).
  NaN when the returns do not vary."""
  rows = [r for r in records if r.get("value/tokens")]
  if not rows:
    return float("nan")
  n = np.asarray([r["value/tokens"] for r in rows], np.float64)
  mse = np.asarray([r["value/sq_err"] for r in rows], np.float64)
  var = np.asarray([r["value/return_var"] for r in rows], np.float64)
  mean = np.asarray([r["value/return_mean"] for r in rows], np.float64)
  total = np.sum(n * (var + (mean - np.sum(n * mean) / n.sum()) ** 2))
  return float(1.0 - np.sum(n * mse) / total) if total > 0 else float("nan")


def whiten(adv_BRX, valid_BRX, eps: float = 1e-8):
  m = np.asarray(valid_BRX, bool)
  a = adv_BRX[m]
  return np.where(m, (adv_BRX - a.mean()) / (a.std() + eps), 0.0)
