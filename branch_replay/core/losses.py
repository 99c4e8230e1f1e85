"""RL objectives (GRPO, PPO-clip, GSPO, plain policy gradient, DPO) registered by name.

An objective scores one branch of every prompt from its per-token (logp, old_logp, ref_logp,
advantage) over the branch's scored tokens (the shared trunk's, then its own tail's):
either per token (`token_fn`, weighted by the aggregation mode and summed) or per sequence
(`sequence_fn`, e.g. GSPO's sequence-level ratio). `combine` folds the R branch values of a
prompt into the loss (a plain sum for additive objectives, a pair term for DPO).
Both replay and the naive twin call exactly these functions.

A new objective is one function registered here (or in its own module) with `@register`:

  @losses.register("my_pg", needs_ref=False)
  def my_pg(logp, old_logp, ref_logp, adv, cfg):
    return -adv * logp
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

AGGREGATIONS = ("token_mean", "seq_mean", "sum")


@dataclasses.dataclass(frozen=True)
class Objective:
  token_fn: Optional[Callable] = None  # (logp, old_logp, ref_logp, advantage, cfg) -> per token
  # (logp_BX, old_BX, ref_BX, adv_BX, valid_BX, weight_BX, cfg) -> value_B; replaces token_fn
  sequence_fn: Optional[Callable] = None
  combine: Optional[Callable] = None  # (branch_values_RB, cfg) -> scalar; None = sum
  needs_ref: bool = False  # reference log-probs are required (DPO)
  fixed_aggregation: Optional[str] = None  # DPO sums log-probs whatever the config says
  n_branches: Optional[int] = None  # R the objective requires (DPO: 2)
  trainable: bool = True  # the sampling trainer can use it (DPO trains on preference pairs)

  @property
  def additive(self) -> bool:
    return self.combine is None


OBJECTIVES: dict[str, Objective] = {}


def register(name: str, **options):
  """Decorator: register a per-token function (or, with sequence=True, a per-branch one)
  as the objective `name` (`loss.name=name`)."""
  sequence = options.pop("sequence", False)

  def deco(fn):
    if name in OBJECTIVES:
      raise ValueError(f"objective {name!r} is already registered")
    OBJECTIVES[name] = (
      Objective(sequence_fn=fn, **options) if sequence else Objective(token_fn=fn, **options)
    )
    return fn

  return deco


def get(name: str) -> Objective:
  if name not in OBJECTIVES:
    raise ValueError(f"loss.name={name!r}: unknown objective; expected one of {sorted(OBJECTIVES)}")
  return OBJECTIVES[name]


@dataclasses.dataclass(frozen=True)
class LossConfig:
  name: str = "grpo"
  aggregation: str = "token_mean"  # token_mean | seq_mean | sum
  epsilon: float = 0.2  # PPO/GSPO clip below
  epsilon_high: Optional[float] = None  # clip above (DAPO clip-higher); None = epsilon
  kl_coef: float = 0.0  # k3 KL to the reference policy
  beta: float = 0.1  # DPO temperature
  # Log-probs are those of softmax(logits / temperature): the sampler's distribution. The
  # trainer sets it from sampler.temperature; 1 = the raw policy.
  temperature: float = 1.0

  def __post_init__(self):
    get(self.name)
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"loss.aggregation={self.aggregation!r}: expected one of {AGGREGATIONS}")
    if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
      raise ValueError(
        f"loss.epsilon={self.epsilon}, epsilon_high={self.epsilon_high}: expected >= 0"
      )
    if self.kl_coef < 0:
      raise ValueError(f"loss.kl_coef={self.kl_coef}: expected >= 0")
    if not self.beta > 0:
      raise ValueError(f"loss.beta={self.beta}: expected > 0")
    if not (0 < self.temperature < float("inf")):
      raise ValueError(f"loss.temperature={self.temperature}: expected a finite number > 0")

  @property
  def objective(self) -> Objective:
    return get(self.name)

  @property
  def needs_ref(self) -> bool:
    """Reference log-probs are required: by the objective (DPO) or by the KL penalty."""
    return self.objective.needs_ref or self.kl_coef > 0

  @property
  def eps_high(self) -> float:
    return self.epsilon if self.epsilon_high is None else self.epsilon_high


def k3_kl(logp, ref_logp):
  """Schulman's k3 estimator of KL(pi || ref), non-negative, unbiased."""
  log_ratio = ref_logp - logp
  return jnp.exp(log_ratio) - log_ratio - 1.0


def _kl(loss, logp, ref_logp, cfg):
  return loss + cfg.kl_coef * k3_kl(logp, ref_logp) if cfg.kl_coef else loss


def ppo_clip_token(logp, old_logp, ref_logp, adv, cfg: LossConfig):
  """-min(r A, clip(r, 1-eps, 1+eps_high) A) (+ kl_coef * k3). GRPO uses it with
  group-normalised advantages; PPO with GAE advantages from a critic."""
  ratio = jnp.exp(logp - old_logp)
  clipped = jnp.clip(ratio, 1.0 - cfg.epsilon, 1.0 + cfg.eps_high)
  return _kl(-jnp.minimum(ratio * adv, clipped * adv), logp, ref_logp, cfg)


register("grpo")(ppo_clip_token)
register("ppo")(ppo_clip_token)


@register("pg")
def pg_token(logp, old_logp, ref_logp, adv, cfg: LossConfig):
  """REINFORCE: -A log p (+ kl)."""
  del old_logp
  return _kl(-adv * logp, logp, ref_logp, cfg)


@register("gspo", sequence=True)
def gspo_sequence(logp_BX, old_BX, ref_BX, adv_BX, valid_BX, weight_BX, cfg: LossConfig):
  """GSPO: the sequence ratio s = exp(mean over the branch's tokens of (logp - old_logp)),
  the geometric mean of its token ratios, clipped per branch: -min(s A, clip(s) A). The
  branch's value is weighted by the sum of its token weights (seq_mean: 1/(B R))."""
  n_B = jnp.maximum(valid_BX.sum(-1), 1)
  log_s_B = jnp.sum(jnp.where(valid_BX, logp_BX - old_BX, 0.0), -1) / n_B
  s_B = jnp.exp(log_s_B)
  adv_B = jnp.sum(jnp.where(valid_BX, adv_BX, 0.0), -1) / n_B  # a branch's advantage
  clipped = jnp.clip(s_B, 1.0 - cfg.epsilon, 1.0 + cfg.eps_high)
  value_B = -jnp.minimum(s_B * adv_B, clipped * adv_B) * jnp.sum(weight_BX, -1)
  if cfg.kl_coef:
    value_B = value_B + cfg.kl_coef * jnp.sum(k3_kl(logp_BX, ref_BX) * weight_BX, -1)
  return value_B


def dpo_combine(values_RB, cfg: LossConfig):
  """Branch 0 is chosen, branch 1 rejected: -log sigmoid(beta * (margin_c - margin_r))."""
  if values_RB.shape[0] != 2:
    raise ValueError(f"dpo: expected R=2 branches (chosen, rejected), got R={values_RB.shape[0]}")
  return -jnp.sum(jax.nn.log_sigmoid(cfg.beta * (values_RB[0] - values_RB[1])))


@register(
  "dpo", combine=dpo_combine, needs_ref=True, fixed_aggregation="sum", n_branches=2, trainable=False
)
def dpo_token(logp, old_logp, ref_logp, adv, cfg):
  """A branch's value is its log-ratio to the reference, log pi - log ref, summed."""
  del old_logp, adv, cfg
  return logp - ref_logp


def branch_value(logp_BX, old_BX, ref_BX, adv_BX, valid_BX, weight_BX, cfg: LossConfig):
  """The objective's value of one branch of every prompt over its X scored tokens."""
  obj = cfg.objective
  if obj.sequence_fn is not None:
    return obj.sequence_fn(logp_BX, old_BX, ref_BX, adv_BX, valid_BX, weight_BX, cfg)
  return jnp.sum(obj.token_fn(logp_BX, old_BX, ref_BX, adv_BX, cfg) * weight_BX, axis=-1)


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
