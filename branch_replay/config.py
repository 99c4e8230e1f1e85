"""The run's configuration: frozen nested dataclasses that validate themselves, and the
`--set=section.field=value` override parser (an unknown section or field fails at once).
"""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any, Optional, Sequence

from branch_replay import registry  # an algorithm's options and check, by name
from branch_replay.core import advantages
from branch_replay.sections import NamedSection
from branch_replay.core.critic import CriticConfig
from branch_replay.core.losses import LossConfig
from branch_replay.core.sampler import SamplerConfig
from branch_replay.data import tasks
from branch_replay.data.tasks import TaskConfig
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.core.tree import TreeConfig
from models import lora as lora_lib
from models.lora import LoraConfig
from models.transformer import ModelConfig

MODES = ("replay", "naive")


# ----------------------------------------------------------------------------- the algorithm


@dataclasses.dataclass(frozen=True, init=False)
class AlgoConfig(NamedSection):
  """`name` picks the algorithm (registry.ALGORITHMS); `options` is its own dataclass (its
  module's `Options`), given and read flat: AlgoConfig(name="ppo", ppo_epochs=2);
  `cfg.algo.ppo_epochs`. An option another algorithm owns is refused by name (`algo.pairs_file:
  not an option of algo 'grpo'`)."""

  name: str = "grpo"
  options: Any = None
  section, default = "algo", "grpo"

  @classmethod
  def options_class(cls, name: str) -> type:
    return registry.options_class(name)  # the algorithm's module, imported by name

  @staticmethod
  def owners(field: str) -> list[str]:
    """The algorithms that have option `field` (for the message refusing it elsewhere)."""
    return registry.owners(field)


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


# Dr. GRPO had two spellings until 2026-12: algo.advantage=dr_grpo, and algo.advantage_std=false
# beside advantage=grpo. A saved config's `advantage_std` becomes the one spelling (`migrate`).
RETIRED = {"algo.advantage_std": "algo.advantage=dr_grpo (centred, not divided by the std)"}


def _one_spelling(options: dict) -> dict:
  """Saved algorithm options without `advantage_std`: false with the GRPO estimator is Dr. GRPO
  (with any other estimator it never had an effect)."""
  if "advantage_std" not in options:
    return options
  options = dict(options)
  if options.pop("advantage_std") is False and options.get("advantage", "grpo") == "grpo":
    options["advantage"] = "dr_grpo"
  return options


def migrate(saved: dict) -> dict:
  """A config dict saved before today's layout, in today's: before the `algo` section, the
  algorithm named as the old fields implied it (a rollouts file, preference pairs, GAE's
  critic, else GRPO), the moved options under `algo` (those the algorithm has); Dr. GRPO in
  its one spelling (`RETIRED`)."""
  if "algo" in saved:
    if isinstance(saved["algo"], dict) and "advantage_std" in saved["algo"]:
      saved = {**saved, "algo": _one_spelling(saved["algo"])}
    return saved
  saved = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
  old = {}
  for path in MOVED:
    section, field = path.split(".")
    if field in saved.get(section, {}):
      old[field] = saved[section].pop(field)
  old = _one_spelling(old)
  saved.pop("dpo", None)
  if saved.get("task", {}).get("name") == "rollouts":
    name = "rollouts"
  elif saved.get("loss", {}).get("name") == "dpo":
    name = "dpo"
  elif old.get("advantage") in advantages.NEEDS_CRITIC:
    name = "ppo"
  else:
    name = "grpo"
  fields = {f.name for f in dataclasses.fields(registry.options_class(name))}
  saved["algo"] = {"name": name, **{k: v for k, v in old.items() if k in fields}}
  return saved


# ----------------------------------------------------------------------------- the config


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
  mode: str = "replay"  # replay | naive (every branch as its own sequence, for A/B)
  branch_chunk: Optional[int] = None  # stream the R branches in chunks of this size
  # [rollouts] first-step self-check (verify.py): first | off | auto (first for --model_dir)
  verify: str = "auto"
  # [autotree] the sampler's flat groups laid out as their token trie (trie.py: a shared
  # opening becomes trunk, shared runs a level) and trained as a TreeBatch, same step, same
  # gradient; False: the flat batch
  auto_tree: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"replay.mode={self.mode!r}: expected one of {MODES}")
    if self.verify not in ("auto", "first", "off"):  # [rollouts]
      raise ValueError(f"replay.verify={self.verify!r}: expected one of auto, first, off")
    if self.branch_chunk is not None and (
      not isinstance(self.branch_chunk, int) or self.branch_chunk < 1
    ):
      raise ValueError(f"replay.branch_chunk={self.branch_chunk!r}: expected None or an int >= 1")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  seed: int = 0
  sft_steps: int = 0  # supervised warm-up steps (through the same engine) before RL
  rl_steps: int = 50
  batch_size: int = 8  # B prompts per RL step
  n_branches: int = 8  # R sampled branches per prompt (the GRPO group)
  sft_batch_size: int = 16  # prefixes per warm-up step
  learning_rate: float = 1e-3  # RL
  sft_learning_rate: float = 3e-3
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  checkpoint_every: int = 50
  keep_checkpoints: int = 2
  eval_size: int = 64  # held-out prompts scored greedily before and after RL (0 = off)
  eval_batch: int = 0  # prompts per greedy-evaluation call (0 = all at once)
  eval_shared_prefix: bool = False  # prefill the ids all eval prompts share once (k-shot)
  eval_before: bool = True  # False: only the final evaluation (the before one known already)
  progress: bool = True  # tqdm bar on the terminal
  plot: bool = True  # workdir/metrics.png at the end
  tensorboard: bool = True  # TensorBoard event files beside metrics.jsonl (same keys)
  # Checkpoints written by orbax in the background (the step goes on while the files are
  # written; still committed by one atomic rename); false: every save blocks the step
  async_checkpoints: bool = True
  # SIGTERM/SIGINT: the step in progress finishes, its checkpoint is written, the run exits
  # 128 + the signal; past this many seconds after the signal it exits 124 at once (the
  # last committed checkpoint stands). docs/training.md, "Preemption and faults"
  preemption_grace_s: float = 120.0
  # A reward call (one step's batch) running longer stops the run naming the example that
  # hangs (rewards.py); 0 = no limit
  reward_timeout_s: float = 600.0
  # the algorithm's own options (advantages, epochs, DAPO, ...): the `algo` section

  def __post_init__(self):
    for name in ("sft_steps", "rl_steps", "eval_size", "eval_batch"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f"train.{name}={value!r}: expected an int >= 0")
    for name in (
      "batch_size",
      "n_branches",
      "sft_batch_size",
      "checkpoint_every",
      "keep_checkpoints",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"train.{name}={value!r}: expected an int >= 1")
    for name in ("learning_rate", "sft_learning_rate", "grad_clip"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and 0 < value < float("inf")):
        raise ValueError(f"train.{name}={value!r}: expected a finite number > 0")
    if not 0 <= self.weight_decay < float("inf"):
      raise ValueError(f"train.weight_decay={self.weight_decay!r}: expected >= 0")
    if not (
      isinstance(self.preemption_grace_s, (int, float))
      and 0 < self.preemption_grace_s < float("inf")
    ):
      raise ValueError(
        f"train.preemption_grace_s={self.preemption_grace_s!r}: expected a "
        "finite number of seconds > 0"
      )
    if not (
      isinstance(self.reward_timeout_s, (int, float)) and 0 <= self.reward_timeout_s < float("inf")
    ):
      raise ValueError(
        f"train.reward_timeout_s={self.reward_timeout_s!r}: expected a finite "
        "number of seconds >= 0 (0 = no limit)"
      )

  @property
  def total_steps(self) -> int:
    return self.sft_steps + self.rl_steps


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = ModelConfig(vocab_size=TOKENIZER.vocab_size)
  loss: LossConfig = LossConfig()
  replay: ReplayConfig = ReplayConfig()
  train: TrainConfig = TrainConfig()
  # the algorithm and its own options (its module's Options): grpo | ppo | dpo | sft | rollouts
  # (a factory: the algorithm's module is imported when a Config is made, not with this one)
  algo: AlgoConfig = dataclasses.field(default_factory=AlgoConfig)
  sampler: SamplerConfig = SamplerConfig()
  task: TaskConfig = TaskConfig()
  critic: CriticConfig = CriticConfig()  # PPO's value model (algo.name=ppo)
  mesh: str = ""  # e.g. "data:2,fsdp:2"; "" = one device
  tree: TreeConfig = TreeConfig()  # fan-outs of sampled trees (algorithms/grpo.py); "" = flat
  # LoRA (models/lora.py): rank 0 = full fine-tuning; rank > 0 trains adapters on
  # lora.targets, the base frozen (no gradient, no optimizer state, not checkpointed)
  lora: LoraConfig = LoraConfig()

  def __post_init__(self):
    if self.model.vocab_size < TOKENIZER.vocab_size:
      raise ValueError(
        f"model.vocab_size={self.model.vocab_size}: expected >= the "
        f"tokenizer's {TOKENIZER.vocab_size}"
      )
    self._check_task()
    if self.replay.branch_chunk is not None and self.loss.objective.combine is not None:
      raise ValueError(
        f"replay.branch_chunk={self.replay.branch_chunk} with loss.name="
        f"{self.loss.name!r}: streaming needs an objective that sums over "
        "branches (DPO combines each pair); expected replay.branch_chunk=None"
      )
    # What the selected algorithm needs of the other sections: its objectives, critic and
    # layout (declared by its class), its options' and its module's check(cfg).
    registry.check(self)
    if self.tree.fanouts:
      self._check_tree()
    elif self.loss.name == "grpo" and self.train.n_branches < 2:
      raise ValueError(
        f"train.n_branches={self.train.n_branches}: GRPO normalises over a group, expected >= 2"
      )
    self._check_sampler()
    if self.lora.enabled:
      lora_lib.adapter_shapes(self.model, self.lora)  # targets on no layer: ValueError
    self._check_param_dtype()
    if self.replay.auto_tree and self.tree.fanouts:
      raise ValueError(
        f"tree.fanouts={self.tree.fanouts!r} with replay.auto_tree=true: sampled trees are "
        "trees already; expected ''"
      )
    chunk = self.replay.branch_chunk
    if chunk is not None and not self.tree.fanouts and self.train.n_branches % chunk:
      raise ValueError(
        f"replay.branch_chunk={chunk}: expected a divisor of "
        f"train.n_branches={self.train.n_branches}"
      )
    if self.mesh and not re.fullmatch(r"[a-z]+:\d+(,[a-z]+:\d+)*", self.mesh):
      raise ValueError(f"mesh={self.mesh!r}: expected '' or 'axis:size,...' e.g. 'data:2,fsdp:2'")

  def _check_param_dtype(self):
    """A bf16 model.param_dtype is the frozen LoRA base stored as bf16 (adapters and their
    AdamW state in float32, models/lora.py:adapter_dtype). bf16 masters for full fine-tuning
    are refused: an AdamW update at a fine-tuning learning rate is below bf16's resolution and
    rounds away. (LoRA with a value model, PPO, is refused by the algorithm's check.)"""
    if self.model.param_dtype != "bfloat16":
      return
    if not self.lora.enabled:
      raise ValueError(
        "model.param_dtype='bfloat16' with lora.rank=0: bf16 master weights for full "
        "fine-tuning are not supported (updates round away); expected "
        "model.param_dtype='float32', or LoRA (lora.rank > 0) over a frozen bf16 base"
      )

  def _check_task(self):
    """What the task states of its rollouts (tasks.Task: `algorithm`, `turns`) against the
    algorithm and tree.fanouts, by field."""
    task = tasks.task_class(self.task.name)
    if task.algorithm is not None and self.algo.name != task.algorithm:
      raise ValueError(
        f"task.name={self.task.name!r} with algo.name={self.algo.name!r}: expected "
        f"algo.name={task.algorithm!r} (the one algorithm that trains its data)"
      )
    fanouts = self.tree.fanout_tuple
    if task.turns and len(fanouts) != task.turns:
      raise ValueError(
        f"tree.fanouts={self.tree.fanouts!r}: task {self.task.name!r} is sampled as a tree of "
        f"its {task.turns} turns; expected {task.turns} fan-outs, e.g. "
        f"{'x'.join(['2'] * task.turns)!r}"
      )
    if not task.turns and fanouts:
      raise ValueError(
        f"tree.fanouts={self.tree.fanouts!r} with task.name={self.task.name!r}: the task's "
        "completions are one turn each (flat groups; a rollouts file's lines are laid out as "
        "their trie by task.auto_tree); expected '' or a task of several turns (e.g. "
        "task.name='tree_haystack')"
      )

  def _check_sampler(self):
    if not self.train.rl_steps:
      return
    s = self.sampler
    if s.top_k or s.top_p < 1.0:
      raise ValueError(
        f"sampler.top_k={s.top_k}, sampler.top_p={s.top_p}: RL trains "
        "against softmax(logits / temperature), not a filtered distribution; "
        "expected top_k=0 and top_p=1 (the ratio would be off-policy)"
      )
    if s.temperature == 0:
      raise ValueError(
        "sampler.temperature=0: RL needs sampled branches (greedy gives R "
        "identical ones); expected > 0"
      )
    if self.loss.temperature not in (1.0, s.temperature):
      raise ValueError(
        f"loss.temperature={self.loss.temperature}: the trainer scores at "
        f"sampler.temperature={s.temperature}; leave loss.temperature at 1"
      )

  def _check_tree(self):
    """Tree rollouts (tree.fanouts): what the tree trainer cannot serve is refused here, by
    field, rather than ignored."""
    fanouts = self.tree.fanout_tuple
    chunk = self.replay.branch_chunk
    if chunk is not None and fanouts[-1] % chunk:
      raise ValueError(
        f"replay.branch_chunk={chunk}: expected a divisor of the last fan-out "
        f"{fanouts[-1]} (tree.fanouts={self.tree.fanouts!r}; chunks stream the "
        "leaves of each parent)"
      )
    t, default = self.train, TrainConfig()
    refused = [  # (field, value, expected, why)
      (
        "train.n_branches",
        t.n_branches,
        (default.n_branches,),
        "a tree's branches are its fan-outs (tree.fanouts)",
      ),
      (
        "sampler.trunk_len",
        self.sampler.trunk_len,
        (0,),
        "a tree samples its own levels (a trunk is a fan-out-1 level)",
      ),
    ]
    for field, value, expected, why in refused:
      if value not in expected:
        raise ValueError(
          f"{field}={value!r} with tree.fanouts={self.tree.fanouts!r}: {why}; "
          f"expected {' or '.join(map(repr, expected))}"
        )

  @property
  def uses_critic(self) -> bool:
    """The algorithm trains a value model (critic.py; PPO's: its advantages come from it)."""
    return registry.get(self.algo.name).uses_critic


# ----------------------------------------------------------------------------- overrides


def _parse(text: str, hint, where: str):
  origin = typing.get_origin(hint)
  if origin is typing.Union or type(hint).__name__ == "UnionType":
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if text.lower() in ("none", "null") and len(args) < len(typing.get_args(hint)):
      return None
    errors = []
    for arg in args:  # the first type that parses it (model.remat: true | full | dots)
      try:
        return _parse(text, arg, where)
      except ValueError as e:
        errors.append(str(e).split(": ", 1)[-1])
    raise ValueError(f"{where}={text!r}: {' or '.join(errors)}")
  if hint is bool:
    if text.lower() in ("true", "1", "yes"):
      return True
    if text.lower() in ("false", "0", "no"):
      return False
    raise ValueError(f"{where}={text!r}: expected true or false")
  if hint in (int, float):
    try:
      return hint(text)
    except ValueError:
      raise ValueError(f"{where}={text!r}: expected {hint.__name__}") from None
  if hint is str:
    return text
  if origin is tuple:  # e.g. lora.targets=q,k,v
    return tuple(
      _parse(item.strip(), typing.get_args(hint)[0], where)
      for item in text.split(",")
      if item.strip()
    )
  raise ValueError(f"{where}: cannot be set from the command line (type {hint})")


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
  """`section.field=value` strings applied in order (`task.name` and `algo.name` first: the
  other fields of those sections are that task's or algorithm's options). A section checks
  its own fields as each is set; what ties sections together is checked once, on the result
  (`--set=loss.name=dpo --set=algo.name=dpo` in either order)."""
  names_first = lambda item: not item.strip().startswith(("task.name=", "algo.name="))
  overrides = sorted(overrides, key=names_first)
  top = {f.name: f for f in dataclasses.fields(Config)}
  fields = {name: getattr(cfg, name) for name in top}  # the sections, validated once at the end
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"--set {item!r}: expected section.field=value")
    path, text = item.split("=", 1)
    retired = RETIRED.get(path.strip()) or RETIRED.get(MOVED.get(path.strip()))
    if retired:
      raise ValueError(f"--set {path.strip()!r}: retired; one spelling now: {retired}")
    if path.strip() in MOVED:
      hint = " (train.advantage=gae is algo.name=ppo)" if path.strip() == "train.advantage" else ""
      raise ValueError(
        f"--set {path.strip()!r}: moved to {MOVED[path.strip()]!r}, "
        f"an option of the algorithm (algo.name){hint}"
      )
    parts = path.strip().split(".")
    if parts[0] not in top:
      raise ValueError(
        f"--set {path!r}: unknown config section {parts[0]!r}; expected one of {sorted(top)}"
      )
    if len(parts) == 1:
      if dataclasses.is_dataclass(fields[parts[0]]):
        raise ValueError(f"--set {path!r}: {parts[0]!r} is a section; set one of its fields")
      hints = typing.get_type_hints(Config)
      fields[parts[0]] = _parse(text, hints[parts[0]], path)
      continue
    if len(parts) != 2 or not dataclasses.is_dataclass(fields[parts[0]]):
      raise ValueError(f"--set {path!r}: expected section.field")
    section = fields[parts[0]]
    # A section may list its own settable fields (the task: its name + that task's options).
    settable = getattr(section, "settable", None)
    hints = (
      settable()
      if settable
      else {
        f.name: typing.get_type_hints(type(section))[f.name] for f in dataclasses.fields(section)
      }
    )
    names = list(hints)
    if parts[1] not in names:
      owners = getattr(section, "owners", lambda field: [])(parts[1])
      owned = f" (an option of {parts[0]}.name={' or '.join(map(repr, owners))})" if owners else ""
      raise ValueError(
        f"--set {path!r}: unknown field {parts[1]!r} of {parts[0]}{owned}; expected one of {names}"
      )
    hint = hints[parts[1]]
    fields[parts[0]] = dataclasses.replace(section, **{parts[1]: _parse(text, hint, path)})
  return dataclasses.replace(cfg, **fields)


def to_dict(cfg: Config) -> dict:
  d = dataclasses.asdict(cfg)
  d["task"] = cfg.task.to_dict()  # flat: name + that task's options
  d["algo"] = cfg.algo.to_dict()
  return d


def from_dict(d: dict) -> Config:
  d = migrate(d)  # saved before the `algo` section
  kinds = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}
  kwargs = {k: (kinds[k](**v) if dataclasses.is_dataclass(kinds[k]) else v) for k, v in d.items()}
  return Config(**kwargs)


# Fields a resumed run may change; any other difference means the checkpoint belongs to
# another experiment.
RESUMABLE = (
  "train.rl_steps",
  "train.checkpoint_every",
  "train.keep_checkpoints",
  "train.eval_size",
  "train.eval_batch",
  "train.eval_shared_prefix",
  "train.eval_before",
  "train.progress",
  "train.plot",
  "train.tensorboard",
  "train.async_checkpoints",
  "train.preemption_grace_s",
  "train.reward_timeout_s",
  "replay.mode",
  "model.flat_matmuls",  # the same products, summed in another order (as replay.mode's twin)
  "replay.branch_chunk",
  "replay.auto_tree",
  "mesh",
  "algo.max_sample_rounds",
  "algo.pairs_file",
)


def incompatible(saved: dict, cfg: Config) -> list[str]:
  """'field: saved X, now Y' for every difference that forbids resuming."""
  now = json.loads(json.dumps(to_dict(cfg)))
  # a config saved before a section existed had that section's defaults
  saved = json.loads(json.dumps({"lora": dataclasses.asdict(LoraConfig()), **migrate(saved)}))
  flat = lambda d: {
    f"{s}.{k}" if isinstance(v, dict) else s: vv
    for s, v in d.items()
    for k, vv in (v.items() if isinstance(v, dict) else [(None, v)])
  }
  a, b = flat(saved), flat(now)
  for section in ("task", "algo"):  # options another task or algorithm had are not ours
    if a.get(f"{section}.name") == b.get(f"{section}.name"):
      a = {k: v for k, v in a.items() if not k.startswith(f"{section}.") or k in b}
  return [
    f"{k}: saved {a.get(k)!r}, now {b.get(k)!r}"
    for k in sorted(set(a) | set(b))
    if k not in RESUMABLE and a.get(k) != b.get(k)
  ]
