"""Per-token RL objectives (GRPO, PPO-clip, plain policy gradient, DPO) registered by name.

An objective scores each token from (logp, old_logp, ref_logp, advantage); per-token values
are weighted by the aggregation mode and summed per branch; `combine` folds the R branch
sums of a prompt into the loss (a plain sum for additive objectives, a pair term for DPO).
Both replay and the naive twin call exactly these functions.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean", "sum")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  name: str = "grpo"
  aggregation: str = "token_mean"  # token_mean | seq_mean | sum
  epsilon: float = 0.2  # PPO clip below
  epsilon_high: Optional[float] = None  # PPO clip above (DAPO clip-higher); None = epsilon
  kl_coef: float = 0.0  # k3 KL to the reference policy
  beta: float = 0.1  # DPO temperature

  def __post_init__(self):
    if self.name not in OBJECTIVES:
      raise ValueError(f"loss.name={self.name!r}: expected one of {sorted(OBJECTIVES)}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"loss.aggregation={self.aggregation!r}: expected one of {AGGREGATIONS}")
    if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
      raise ValueError(f"loss.epsilon={self.epsilon}, epsilon_high={self.epsilon_high}: "
                       "expected >= 0")
    if self.kl_coef < 0:
      raise ValueError(f"loss.kl_coef={self.kl_coef}: expected >= 0")

  @property
  def objective(self) -> "Objective":
    return OBJECTIVES[self.name]


@dataclasses.dataclass(frozen=True)
class Objective:
  token_fn: Callable  # (logp, old_logp, ref_logp, advantage, cfg) -> per-token value
  combine: Optional[Callable] = None  # (branch_values_RB, cfg) -> scalar; None = sum
  needs_ref: bool = False
  fixed_aggregation: Optional[str] = None  # DPO sums log-probs whatever the config says

  @property
  def additive(self) -> bool:
    return self.combine is None


def k3_kl(logp, ref_logp):
  """Schulman's k3 estimator of KL(pi || ref), non-negative, unbiased."""
  log_ratio = ref_logp - logp
  return jnp.exp(log_ratio) - log_ratio - 1.0


def ppo_clip_token(logp, old_logp, ref_logp, adv, cfg: LossConfig):
  """-min(r A, clip(r, 1-eps, 1+eps_high) A) (+ kl_coef * k3). GRPO uses it with
  group-normalised advantages; PPO with critic advantages."""
  eps_high = cfg.epsilon if cfg.epsilon_high is None else cfg.epsilon_high
  ratio = jnp.exp(logp - old_logp)
  clipped = jnp.clip(ratio, 1.0 - cfg.epsilon, 1.0 + eps_high)
  loss = -jnp.minimum(ratio * adv, clipped * adv)
  if cfg.kl_coef:
    loss = loss + cfg.kl_coef * k3_kl(logp, ref_logp)
  return loss


def pg_token(logp, old_logp, ref_logp, adv, cfg: LossConfig):
  """REINFORCE: -A log p (+ kl)."""
  del old_logp
  loss = -adv * logp
  if cfg.kl_coef:
    loss = loss + cfg.kl_coef * k3_kl(logp, ref_logp)
  return loss


def dpo_token(logp, old_logp, ref_logp, adv, cfg):
  del old_logp, adv, cfg
  return logp - ref_logp


def dpo_combine(values_RB, cfg: LossConfig):
  """Branch 0 is chosen, branch 1 rejected: -log sigmoid(beta * (margin_c - margin_r))."""
  if values_RB.shape[0] != 2:
    raise ValueError(f"dpo: expected R=2 branches (chosen, rejected), got R={values_RB.shape[0]}")
  return -jnp.sum(jax.nn.log_sigmoid(cfg.beta * (values_RB[0] - values_RB[1])))


OBJECTIVES = {
    "grpo": Objective(ppo_clip_token),
    "ppo": Objective(ppo_clip_token),
    "pg": Objective(pg_token),
    "dpo": Objective(dpo_token, combine=dpo_combine, needs_ref=True, fixed_aggregation="sum"),
}


def aggregation_weights(cfg: LossConfig, tail_valid_BRT, trunk_len: int):
  """Per-token weights (tail_w_BRT, trunk_w_BR per trunk token) for the aggregation mode.

  They depend only on masks, so replay and naive share them exactly.
  token_mean: 1 / (all scored tokens of the batch); seq_mean: 1 / (B*R*len(branch));
  sum: 1. A branch's length counts its trunk tokens.
  """
  mode = cfg.objective.fixed_aggregation or cfg.aggregation
  valid = tail_valid_BRT.astype(jnp.result_type(float))  # f64 under x64
  B, R, _ = valid.shape
  len_BR = valid.sum(-1) + trunk_len
  if mode == "token_mean":
    w_BR = jnp.full((B, R), 1.0) / jnp.maximum(len_BR.sum(), 1.0)
  elif mode == "seq_mean":
    w_BR = 1.0 / (B * R * jnp.maximum(len_BR, 1.0))
  else:
    w_BR = jnp.ones((B, R))
  return w_BR[..., None] * valid, w_BR


def group_advantages(rewards_BR, *, use_std: bool = True, eps: float = 1e-6):
  """GRPO advantages: (r - mean_R) / (std_R + eps), or without the std (Dr. GRPO)."""
  centered = rewards_BR - rewards_BR.mean(axis=1, keepdims=True)
  if not use_std:
    return centered
  return centered / (rewards_BR.std(axis=1, keepdims=True) + eps)
