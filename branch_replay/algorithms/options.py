"""The `algo` config section: `algo.name` picks the algorithm (algorithms/__init__.py), and
each algorithm has its own options, set flat: `--set=algo.name=ppo --set=algo.ppo_epochs=2`.
An option another algorithm owns is refused by name (`algo.pairs_file: not an option of algo
'grpo'`). The objective (`loss.*`), the value model (`critic.*`, PPO's) and the data
(`task.*`) keep their own sections. No heavy imports: config.py reads this module."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from branch_replay.core import advantages
from branch_replay.sections import NamedSection, NoOptions


def _int_at_least(options, names, low: int):
  for name in names:
    value = getattr(options, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
      raise ValueError(f"algo.{name}={value!r}: expected an int >= {low}")


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
    _int_at_least(self, ("ppo_epochs", "minibatches", "max_sample_rounds"), 1)
    _int_at_least(self, ("overlong_buffer",), 0)
    if not self.overlong_penalty >= 0:
      raise ValueError(f"algo.overlong_penalty={self.overlong_penalty!r}: expected >= 0")


def _check_estimator(name: str):
  if name in advantages.NEEDS_CRITIC:
    raise ValueError(
      f"algo.advantage={name!r}: per-token advantages come from PPO's critic; "
      "expected algo.name=ppo (or a group estimator: "
      f"{sorted(advantages.ESTIMATORS)})"
    )
  advantages.check(name)


@dataclasses.dataclass(frozen=True)
class GRPOOptions(SampledOptions):
  """GRPO and its family on sampled groups or trees."""

  advantage: str = "grpo"  # a group estimator (advantages.py): grpo | dr_grpo | rloo | yours
  advantage_std: bool = True  # grpo: divide by the group std (False: centred only)

  def __post_init__(self):
    super().__post_init__()
    _check_estimator(self.advantage)


@dataclasses.dataclass(frozen=True)
class PPOOptions(SampledOptions):
  """PPO: GRPO's sampling and epochs; advantages from the critic's values by GAE (the value
  model's own options: the `critic` section)."""

  advantage = "gae"  # not an option: what PPO's advantages are


@dataclasses.dataclass(frozen=True)
class DPOOptions:
  pairs_file: str = ""  # JSON lines {"prompt", "chosen", "rejected"}; "" = pairs from the task

  def __post_init__(self):
    if self.pairs_file and not os.path.isfile(self.pairs_file):
      raise ValueError(f"algo.pairs_file={self.pairs_file!r}: no such file")


@dataclasses.dataclass(frozen=True)
class RolloutsOptions:
  """Completions from a file (task.name=rollouts): group advantages, passes over each batch."""

  advantage: str = "grpo"
  advantage_std: bool = True
  ppo_epochs: int = 1

  def __post_init__(self):
    _int_at_least(self, ("ppo_epochs",), 1)
    _check_estimator(self.advantage)


OPTIONS = {
  "grpo": GRPOOptions,
  "ppo": PPOOptions,
  "dpo": DPOOptions,
  "sft": NoOptions,
  "rollouts": RolloutsOptions,
}


@dataclasses.dataclass(frozen=True, init=False)
class AlgoConfig(NamedSection):
  """`name` picks the algorithm; `options` is its own dataclass (`OPTIONS[name]`), given and
  read flat: AlgoConfig(name="ppo", ppo_epochs=2); `cfg.algo.ppo_epochs`."""

  name: str = "grpo"
  options: Any = None
  section, default = "algo", "grpo"

  @classmethod
  def options_class(cls, name: str) -> type:
    if name not in OPTIONS:
      raise ValueError(f"algo.name={name!r}: expected one of {sorted(OPTIONS)}")
    return OPTIONS[name]

  @staticmethod
  def owners(field: str) -> list[str]:
    """The algorithms that have option `field` (for the message refusing it elsewhere)."""
    return [n for n, o in OPTIONS.items() if field in {f.name for f in dataclasses.fields(o)}]


# Options that lived in other sections before the `algo` section (configs saved then, and old
# command lines): old field -> new field.
MOVED = {
  **{
    f"train.{name}": f"algo.{name}"
    for name in (
      "advantage",
      "advantage_std",
      "ppo_epochs",
      "minibatches",
      "dynamic_sampling",
      "max_sample_rounds",
      "overlong_buffer",
      "overlong_penalty",
    )
  },
  "dpo.pairs_file": "algo.pairs_file",
}


def migrate(saved: dict) -> dict:
  """A config dict saved before the `algo` section, in today's layout: the algorithm named
  as the old fields implied it (a rollouts file, preference pairs, GAE's critic, else GRPO),
  the moved options under `algo` (those the algorithm has)."""
  if "algo" in saved:
    return saved
  saved = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
  old = {}
  for path in MOVED:
    section, field = path.split(".")
    if field in saved.get(section, {}):
      old[field] = saved[section].pop(field)
  saved.pop("dpo", None)
  if saved.get("task", {}).get("name") == "rollouts":
    name = "rollouts"
  elif saved.get("loss", {}).get("name") == "dpo":
    name = "dpo"
  elif old.get("advantage") in advantages.NEEDS_CRITIC:
    name = "ppo"
  else:
    name = "grpo"
  fields = {f.name for f in dataclasses.fields(OPTIONS[name])}
  saved["algo"] = {"name": name, **{k: v for k, v in old.items() if k in fields}}
  return saved
