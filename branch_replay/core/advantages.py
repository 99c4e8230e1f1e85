"""Advantage estimators registered by name (`algo.advantage`): rewards of a prompt's R
branches -> one advantage per branch. Host-side numpy; the per-token GAE of PPO, which needs a
critic, lives in `critic.py` and is PPO's (`algo.name=ppo`).

A new estimator is one function:

  @advantages.register("my_baseline")
  def my_baseline(rewards_BR, train_cfg):
    return rewards_BR - rewards_BR.min(axis=1, keepdims=True)
"""

from __future__ import annotations

from typing import Callable

import numpy as np

ESTIMATORS: dict[str, Callable] = {}
NEEDS_CRITIC = {"gae"}  # per-token estimators computed from a critic's values (critic.py)


def register(name: str):
  def deco(fn):
    if name in ESTIMATORS or name in NEEDS_CRITIC:
      raise ValueError(f"advantage estimator {name!r} is already registered")
    ESTIMATORS[name] = fn
    return fn

  return deco


def names() -> list[str]:
  return sorted(set(ESTIMATORS) | NEEDS_CRITIC)


def check(name: str) -> None:
  if name not in ESTIMATORS and name not in NEEDS_CRITIC:
    raise ValueError(
      f"algo.advantage={name!r}: unknown advantage estimator; expected one of {names()}"
    )


def compute(name: str, rewards_BR, train_cfg) -> np.ndarray:
  check(name)
  if name in NEEDS_CRITIC:
    raise ValueError(f"algo.advantage={name!r} is per token and needs a critic (critic.py)")
  return np.asarray(ESTIMATORS[name](np.asarray(rewards_BR, np.float64), train_cfg), np.float32)


@register("grpo")
def grpo(rewards_BR, train_cfg):
  """(r - mean_R) / (std_R + 1e-6); with algo.advantage_std=false only centred (Dr. GRPO).
  In float32 through jax, exactly as the trainer always computed it (runs reproduce)."""
  import jax.numpy as jnp
  from branch_replay.core import losses

  return np.asarray(
    losses.group_advantages(
      jnp.asarray(rewards_BR, jnp.float32), use_std=getattr(train_cfg, "advantage_std", True)
    )
  )


@register("dr_grpo")
def dr_grpo(rewards_BR, train_cfg):
  """Dr. GRPO: centred by the group mean, not divided by its std."""
  del train_cfg
  return rewards_BR - rewards_BR.mean(axis=1, keepdims=True)


@register("rloo")
def rloo(rewards_BR, train_cfg):
  """REINFORCE leave-one-out: r_i - mean_{j != i} r_j = R/(R-1) (r_i - mean_R)."""
  del train_cfg
  R = rewards_BR.shape[1]
  if R < 2:
    raise ValueError(f"algo.advantage='rloo': expected n_branches >= 2, got R={R}")
  return (rewards_BR * R - rewards_BR.sum(axis=1, keepdims=True)) / (R - 1)
