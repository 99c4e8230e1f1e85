"""The algorithm registry: `algo.name` -> the module and class of an algorithm
(branch_replay/algorithms/, its protocol in algorithms/__init__.py), resolved by name with
importlib as tasks are, so the config (an algorithm's `Options` and `check(cfg)`) and the trainer
(its class) reach one without importing up; and what every sampling algorithm's options share
(`SampledOptions`) with the checks they use.
"""

from __future__ import annotations

import dataclasses
import importlib

from branch_replay.core import advantages, losses
from branch_replay.data import tasks

# name -> (module, class): `algo.name` selects one; each serves flat and tree rollouts
# (rollout.py decides which).
ALGORITHMS = {
  "grpo": ("branch_replay.algorithms.grpo", "GRPO"),
  "ppo": ("branch_replay.algorithms.ppo", "PPO"),
  "dpo": ("branch_replay.algorithms.dpo", "DPO"),
  "sft": ("branch_replay.algorithms.sft", "SFT"),
  "rollouts": ("branch_replay.algorithms.rollouts", "Rollouts"),
}


def register(name: str, module: str, cls: str) -> None:
  """One more algorithm: `module` (dotted, importable) defines class `cls` and `Options`."""
  if name in ALGORITHMS and ALGORITHMS[name] != (module, cls):
    raise ValueError(f"algorithm {name!r}: already registered as {ALGORITHMS[name]}")
  ALGORITHMS[name] = (module, cls)


def _module(name: str):
  if name not in ALGORITHMS:
    raise ValueError(f"algo.name={name!r}: expected one of {sorted(ALGORITHMS)}")
  return importlib.import_module(ALGORITHMS[name][0])


def get(name: str):
  return getattr(_module(name), ALGORITHMS[name][1])


def for_config(cfg):
  return get(cfg.algo.name)


def options_class(name: str) -> type:
  """The `Options` dataclass of algorithm `name` (the `algo` section's fields)."""
  return _module(name).Options


def check(cfg) -> None:
  """What the selected algorithm needs of the other sections (Config.__post_init__ calls it),
  by field: what its class declares (`objectives`, `uses_critic`, `auto_tree`: base.Algorithm),
  what every sampling algorithm's options need (`SampledOptions.check`), then its module's own
  `check(cfg)`, if it has one."""
  name, cls = cfg.algo.name, get(cfg.algo.name)
  trains = _objectives_of(name)
  if cfg.loss.name not in trains:
    others = [n for n in ALGORITHMS if n != name and cfg.loss.name in _objectives_of(n)]
    raise ValueError(
      f"loss.name={cfg.loss.name!r} with algo.name={name!r}: expected "
      + (f"algo.name={others[0]!r}" if others else f"loss.name in {sorted(trains)}")
    )
  default = type(cfg.critic)()
  if not cls.uses_critic and cfg.critic != default:
    changed = [
      f.name
      for f in dataclasses.fields(default)
      if getattr(cfg.critic, f.name) != getattr(default, f.name)
    ]
    users = [n for n in ALGORITHMS if get(n).uses_critic]
    raise ValueError(
      f"critic.{changed[0]}={getattr(cfg.critic, changed[0])!r} with algo.name={name!r}: the "
      f"critic is the value model of {users}; expected algo.name in {users} or the critic's "
      "defaults"
    )
  if cfg.replay.auto_tree and not cls.auto_tree:
    layouts = [n for n in ALGORITHMS if get(n).auto_tree]
    raise ValueError(
      f"algo.name={name!r} with replay.auto_tree=true: its batches (per-token advantages, a "
      "critic's batch, preference pairs, warm-up batches or a file's lines) are not sampled "
      f"groups laid out as their trie; expected algo.name in {layouts}"
    )
  if isinstance(cfg.algo.options, SampledOptions):
    cfg.algo.options.check(cfg)
  fn = getattr(_module(name), "check", None)
  if fn is not None:
    fn(cfg)


def _objectives_of(name: str) -> tuple:
  """The loss.name values algorithm `name` trains: its class's `objectives`, else every
  objective of sampled groups (losses.OBJECTIVES' trainable ones)."""
  declared = get(name).objectives
  if declared is not None:
    return tuple(declared)
  return tuple(n for n, o in losses.OBJECTIVES.items() if o.trainable)


def owners(field: str) -> list[str]:
  """The algorithms that have option `field` (for the message refusing it elsewhere)."""
  return [n for n in ALGORITHMS if field in {f.name for f in dataclasses.fields(options_class(n))}]


# ----------------------------------------------------------------------------- the base


def int_at_least(options, names, low: int):
  for name in names:
    value = getattr(options, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"algo.{name}={value!r}: expected an int >= {low}")


def check_estimator(name: str):
  if name in advantages.NEEDS_CRITIC:
    raise ValueError(
      f"algo.advantage={name!r}: per-token advantages come from PPO's critic; "
      "expected algo.name=ppo (or a group estimator: "
      f"{sorted(advantages.ESTIMATORS)})"
    )
  advantages.check(name)


@dataclasses.dataclass(frozen=True)
class SampledOptions:
  """What every algorithm that samples groups (flat or tree) shares."""

  ppo_epochs: int = 1  # passes over each sampled batch
  minibatches: int = 1  # replay steps per pass, the batch split by prompt (divides batch_size)
  dynamic_sampling: bool = False  # DAPO: drop all-equal-reward groups, refill from new prompts
  max_sample_rounds: int = 4  # DAPO: sampling rounds per step at most
  overlong_buffer: int = 0  # DAPO overlong shaping: tokens before the limit where it starts
  overlong_penalty: float = 1.0  # DAPO overlong shaping: reward penalty at the limit

  def __post_init__(self):
    int_at_least(self, ("ppo_epochs", "minibatches", "max_sample_rounds"), 1)
    int_at_least(self, ("overlong_buffer",), 0)
    if not self.overlong_penalty >= 0:
      raise ValueError(f"algo.overlong_penalty={self.overlong_penalty!r}: expected >= 0")

  def check(self, cfg) -> None:
    """What these options need of the other sections (algorithms.check calls it)."""
    if cfg.train.batch_size % self.minibatches:
      raise ValueError(
        f"algo.minibatches={self.minibatches}: expected a divisor of "
        f"train.batch_size={cfg.train.batch_size} (minibatches split the prompts)"
      )
    shape = tasks.rollout_shape(cfg)
    if getattr(self, "advantage", None) == "rloo" and min(shape.fanouts) < 2:
      raise ValueError(
        f"algo.advantage='rloo' with {shape.setting}: leave-one-out needs >= 2 siblings at "
        "every level; expected every fan-out >= 2"
      )
