"""The one advantage module: group estimators registered by name (`algo.advantage`), applied per
level of any fan-outs (`levels`; a flat group is fan-outs (R,), the depth-1 tree). The
per-token GAE of PPO, which needs a critic, lives in `critic.py` and is PPO's (`algo.name=ppo`).

Host-side numpy in float64, cast to float32 once at the end (`levels`, `compute`): rewards
arrive on the host as float64 (the tasks' numpy), the group statistics of a handful of siblings
cost nothing there, and one dtype for flat groups and trees means one formula to check against
a hand-written reference (tests/core/advantages_test.py). Until 2026-12 GRPO's flat path ran
in float32 through jax; the two round differently in the last bit of a few advantages.

A new estimator is one function:

  @advantages.register("my_baseline")
  def my_baseline(rewards_BR, train_cfg):
    return rewards_BR - rewards_BR.min(axis=1, keepdims=True)
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

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
  """The estimator `name` over each row's group: rewards [G, R] -> advantages [G, R] float32
  (`levels` of fan-outs (R,))."""
  (adv,) = levels(name, rewards_BR, np.shape(rewards_BR)[1:], train_cfg)
  return adv


def nodes(fanouts: Sequence[int], d: int) -> int:
  """Nodes at level d of one prompt's tree: R_1 * ... * R_d."""
  return math.prod(fanouts[:d])


def levels(name: str, rewards_BR, fanouts: Sequence[int], train_cfg=None) -> list[np.ndarray]:
  """Tree-aware group advantages, one float32 array per level 1..depth ([B, nodes at level d]),
  from the leaves' rewards [B, R_1 * ... * R_depth].

  A node's value is the mean of its leaves' rewards (a leaf's: its own); the estimator `name`
  runs over each set of siblings (the R_d children of one parent), so every node is judged
  against its siblings. Fan-outs (R,): the estimator over each prompt's group."""
  check(name)
  if name in NEEDS_CRITIC:
    raise ValueError(f"algo.advantage={name!r} is per token and needs a critic (critic.py)")
  rewards_BR = np.asarray(rewards_BR, np.float64)
  B = rewards_BR.shape[0]
  if rewards_BR.shape != (B, nodes(fanouts, len(fanouts))):
    raise ValueError(
      f"advantages.levels: rewards shape {rewards_BR.shape}; expected [B, leaves] = "
      f"{(B, nodes(fanouts, len(fanouts)))} for fan-outs {tuple(fanouts)}"
    )
  out = []
  for d in range(1, len(fanouts) + 1):
    values_BN = rewards_BR.reshape(B, nodes(fanouts, d), -1).mean(-1)  # mean of leaves below
    groups_GR = values_BN.reshape(-1, fanouts[d - 1])  # siblings share a parent
    adv = np.asarray(ESTIMATORS[name](groups_GR, train_cfg), np.float64)
    out.append(adv.reshape(B, -1).astype(np.float32))
  return out


@register("grpo")
def grpo(rewards_BR, train_cfg, eps: float = 1e-6):
  """(r - mean_R) / (std_R + 1e-6): centred and divided by the group's (population) std."""
  del train_cfg
  centred = rewards_BR - rewards_BR.mean(axis=1, keepdims=True)
  return centred / (rewards_BR.std(axis=1, keepdims=True) + eps)


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
