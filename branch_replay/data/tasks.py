"""Verifiable tasks shipped with the code (no downloads): prompts, answers, programmatic rewards.

  haystack    key->value retrieval: a few `KEY value` records hidden at random depths in a
              long run of filler; the prompt ends with `?KEY` and the answer is that value.
              The answer depends only on tokens deep in the long shared prompt.
  arithmetic  short reasoning: `a+b=` with n-digit operands; the answer is the sum.

  jsonl       your own prompts from a JSON-lines file (branch_replay/data/jsonl_task.py).
  needle, vartrack   RULER's multi-key needle and variable tracking, filled to prompt_len
              tokens of the run's tokenizer (branch_replay/data/longctx.py).

A task draws `Example`s from a numpy Generator (deterministic per seed and step) and scores
completion strings (decoded up to EOS) with `rewards` (branch_replay/data/rewards.py; the
built-ins: 1.0 exact match, else 0.0). Tasks register by name (`@register`), each with its
own `Options` dataclass, so a new task is one file.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import os
import string
from typing import Any, Optional

import numpy as np

from branch_replay.core import sampler
from branch_replay.sections import NamedSection, NoOptions
from branch_replay.data.tokenizer import TOKENIZER


def jsonl_records(path: str, what: str):
  """(where, record) for every non-blank line of a JSON-lines file, `where` = path:line; a
  missing file or a line that is not a JSON object fails naming `what` (e.g. task.path=...)
  or the line."""
  if not os.path.isfile(path):
    raise ValueError(f"{what}: no such file")
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{number}"
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
      if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
      yield where, record


TASKS: dict[str, type] = {}  # name -> task class (its options: the class's `Options`)


def register(name: str):
  """Class decorator: make a `Task` subclass available as `task.name=<name>`. Its options are
  its nested frozen dataclass `Options` (settable as `--set=task.<field>=...`)."""

  def wrap(cls):
    if name in TASKS and TASKS[name] is not cls:
      raise ValueError(f"task {name!r} is already registered ({TASKS[name]})")
    if not dataclasses.is_dataclass(getattr(cls, "Options", NoOptions)):
      raise ValueError(f"task {name!r}: {cls.__name__}.Options must be a dataclass")
    TASKS[name] = cls
    return cls

  return wrap


# Built-in tasks in their own modules, imported when first named (they import this module).
BUILTIN = {
  "jsonl": "branch_replay.data.jsonl_task",
  "tree_haystack": "branch_replay.data.tree_task",
  "rollouts": "branch_replay.data.rollouts",
  "needle": "branch_replay.data.longctx",
  "vartrack": "branch_replay.data.longctx",
}


def task_class(name: str) -> type:
  if name not in TASKS and name in BUILTIN:
    importlib.import_module(BUILTIN[name])  # registers it
  if name not in TASKS:
    raise ValueError(
      f"task.name={name!r}: expected one of {sorted(set(TASKS) | set(BUILTIN))} "
      "(a task from your own module registers itself with @tasks.register "
      "when imported)"
    )
  return TASKS[name]


@dataclasses.dataclass(frozen=True, init=False)
class TaskConfig(NamedSection):
  """`name` picks the task; `options` is that task's own frozen dataclass (`TASKS[name].Options`).
  Options are given flat, as before: TaskConfig(name="haystack", prompt_len=64) and
  `--set=task.prompt_len=64` set `options.prompt_len`; `cfg.task.prompt_len` reads it."""

  name: str = "haystack"
  options: Any = None
  section, default = "task", "haystack"

  @classmethod
  def options_class(cls, name: str) -> type:
    return getattr(task_class(name), "Options", NoOptions)


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str  # text after BOS
  answer: str  # the exact expected completion (EOS not included); "" when there is none
  fields: Optional[dict] = dataclasses.field(default=None, compare=False)  # e.g. a JSON line
  source: str = ""  # where it came from, for error messages ("data.jsonl:17")
  prompt_ids: Optional[tuple] = None  # token ids (BOS included) when the task tokenized it


def exact_match(example: Example, completion: str) -> float:
  return float(completion == example.answer)


class Task:
  """What the trainer needs of a task. Subclass, give it an `Options` dataclass, register it.

  max_prompt_len   prompt tokens (BOS included) of an RL / eval prompt
  sft_prompt_len   prefix tokens of a warm-up example
  sft_tail_len     tokens of a warm-up tail (EOS included)
  sample(rng) -> Example                 one training prompt (deterministic given rng)
  supervised(rng) -> (prefix, [tail, ...])  warm-up: a prefix (str or Example) and the
                                         texts its tails must continue it with
  rewards(examples, completions_BR) -> [B, R] floats   (default: exact match)
  eval_examples(seed, n) -> [Example]    held-out prompts for the greedy evaluation
  check(cfg)                             raise ValueError before compute if the run's
                                         config asks what the task cannot give
  Its rollouts, stated (rollout.py samples and rewards them; the config checks them):
  turns                                  0: one completion per branch (flat, R =
                                         train.n_branches); n: a tree of n turns, one
                                         tree.fanouts level each (data/turns.py: TurnsTask)
  stop_tokens(tok); turn_lengths         what ends a completion (flat: the tokenizer's stop
                                         ids; a tree: one tuple per turn) and a tree's
                                         tokens per turn (flat: (), sampler.max_new_tokens)
  leaf_rewards(examples, samples, tok) -> [B, leaves]   every leaf's reward (flat: R)
  prompt_metrics(examples, samples, tok) -> {name: [B]}  more per-prompt means, logged as
                                         reward/<name> (metric_names: the progress bar's)
  algorithm                              None, or the one algorithm that trains its data
  """

  Options = NoOptions
  reward_name = "exact_match"
  reward_options: dict = {}
  turns = 0
  turn_lengths: tuple = ()
  metric_names: tuple = ()
  algorithm = None

  def __init__(self, options, tokenizer=TOKENIZER):
    self.cfg = options
    self.tokenizer = tokenizer

  def sample(self, rng: np.random.Generator) -> Example:
    raise NotImplementedError

  def supervised(self, rng: np.random.Generator):
    ex = self.sample(rng)
    return ex, [ex.answer]

  def rewards(self, examples, completions_BR) -> np.ndarray:
    from branch_replay.data import rewards

    return rewards.compute(
      rewards.get(self.reward_name), examples, completions_BR, **self.reward_options
    )

  def stop_tokens(self, tok) -> tuple:
    """The ids that end a completion: the tokenizer's stop ids (its EOS at least)."""
    return tuple(getattr(tok, "stop_ids", (tok.eos_id,)))

  def leaf_rewards(self, examples, samples, tok) -> np.ndarray:
    """[B, R]: the reward of every sampled completion (trunk + branch, decoded up to EOS)."""
    from branch_replay.core import sampler

    return np.asarray(self.rewards(examples, sampler.completions(samples, tok)))

  def prompt_metrics(self, examples, samples, tok) -> dict:
    return {}

  def eval_examples(self, seed: int, n: int) -> list:
    rng = np.random.default_rng([seed, 2**31])  # a stream the training steps never use
    return [self.sample(rng) for _ in range(n)]

  def check(self, cfg) -> None:
    pass


@register("haystack")
class Haystack(Task):
  """`?K` asks for the value of record `Kv` hidden in lowercase filler."""

  @dataclasses.dataclass(frozen=True)
  class Options:
    prompt_len: int = 256  # prompt tokens including BOS and the `?KEY` query
    n_keys: int = 4  # records hidden in the filler
    value_len: int = 1  # digits per value
    sft_prompt_len: int = 0  # warm-up prompt length (0 = prompt_len)

    def __post_init__(self):
      for name in ("prompt_len", "n_keys", "value_len"):
        _positive(name, getattr(self, name))
      if self.n_keys > len(string.ascii_uppercase):
        raise ValueError(f"task.n_keys={self.n_keys}: expected <= 26 (one uppercase letter each)")
      if not isinstance(self.sft_prompt_len, int) or self.sft_prompt_len < 0:
        raise ValueError(f"task.sft_prompt_len={self.sft_prompt_len!r}: expected an int >= 0")
      need = 1 + self.n_keys * (1 + self.value_len) + 2
      for name in ("prompt_len", "sft_prompt_len"):
        value = getattr(self, name)
        if value and value < need:
          raise ValueError(
            f"task.{name}={value}: expected >= {need} to hold n_keys="
            f"{self.n_keys} records of value_len={self.value_len} + the query"
          )

  def __init__(self, cfg, tokenizer=TOKENIZER):
    super().__init__(cfg, tokenizer)
    self.max_prompt_len = cfg.prompt_len  # BOS included
    self.max_answer_len = cfg.value_len  # characters, EOS excluded
    self.sft_prompt_len = cfg.sft_prompt_len or cfg.prompt_len
    self.sft_tail_len = cfg.value_len + 3  # `?KEY` + value + EOS

  def sample(self, rng: np.random.Generator, prompt_len: int | None = None) -> Example:
    cfg = self.cfg
    L = (prompt_len or cfg.prompt_len) - 1 - 2  # BOS and the `?K` query excluded
    width = 1 + cfg.value_len
    chars = ["."] * L
    keys = rng.choice(list(string.ascii_uppercase), size=cfg.n_keys, replace=False)
    slots = rng.choice(L // width, size=cfg.n_keys, replace=False)
    values = []
    for key, slot in zip(keys, slots):
      value = "".join(rng.choice(list(string.digits), size=cfg.value_len))
      chars[slot * width : (slot + 1) * width] = [key, *value]
      values.append(value)
    ask = int(rng.integers(cfg.n_keys))
    return Example("".join(chars) + "?" + keys[ask], values[ask])

  reward = staticmethod(exact_match)

  def supervised(self, rng: np.random.Generator):
    """Warm-up example for branch replay: the haystack as the shared prefix, and one tail
    `?KEY value` per record, so one prefix forward serves n_keys supervised answers.
    Its length is `sft_prompt_len`: warming up on short haystacks is cheap, and RL on the
    long ones then has something to raise."""
    ex = self.sample(rng, self.sft_prompt_len)
    haystack = ex.prompt[:-2]
    keys = [c for c in haystack if c in string.ascii_uppercase]
    tails = [
      f"?{k}{haystack[haystack.index(k) + 1 : haystack.index(k) + 1 + self.cfg.value_len]}"
      for k in keys
    ]
    return haystack, tails


@register("arithmetic")
class Arithmetic(Task):
  """`a+b=` -> the decimal sum."""

  @dataclasses.dataclass(frozen=True)
  class Options:
    n_digits: int = 2  # digits per operand

    def __post_init__(self):
      _positive("n_digits", self.n_digits)
      if self.n_digits > 9:
        raise ValueError(f"task.n_digits={self.n_digits}: expected <= 9")

  def __init__(self, cfg, tokenizer=TOKENIZER):
    super().__init__(cfg, tokenizer)
    self.max_prompt_len = 1 + 2 * cfg.n_digits + 2
    self.max_answer_len = cfg.n_digits + 1
    self.sft_prompt_len = self.max_prompt_len
    self.sft_tail_len = self.max_answer_len + 1  # the sum + EOS

  def sample(self, rng: np.random.Generator) -> Example:
    a, b = (int(x) for x in rng.integers(0, 10**self.cfg.n_digits, size=2))
    return Example(f"{a}+{b}=", str(a + b))

  reward = staticmethod(exact_match)

  def supervised(self, rng: np.random.Generator):
    ex = self.sample(rng)
    return ex.prompt, [ex.answer]


def wrong_value(value: str, rng: np.random.Generator) -> str:
  """Digits of the same length as `value`, not equal to it (a preference pair's rejected
  answer)."""
  while True:
    wrong = "".join(rng.choice(list(string.digits), size=len(value)))
    if wrong != value:
      return wrong


def _positive(name, value):
  if not isinstance(value, int) or value < 1:
    raise ValueError(f"task.{name}={value!r}: expected a positive int")


@dataclasses.dataclass(frozen=True)
class Shape:
  """A run's rollouts: the fan-outs below each prompt (flat: (R,)), whether they are the
  task's turns sampled level by level (`tree.fanouts`), and the setting that chose them."""

  fanouts: tuple
  turns: bool
  setting: str  # for messages: "train.n_branches=8", "tree.fanouts='4x2'"

  def samplers(self, model_cfg, sampler_cfg, stop_tokens, turn_lengths: tuple = ()):
    """(sample, greedy): the sampler of these rollouts with the run's sampler config, and the
    greedy decoder (temperature 0, one path), not jitted. Turns: the task's turns level by
    level (`sampler.sample_tree`; stop_tokens and turn_lengths one per turn). Flat: R branches
    after the sampler's trunk (`sampler.sample`; stop_tokens the stop id or ids). Both take
    (params, prompt_BP=, prompt_valid_BP=, key=) and return samples with `path_valid` and
    `batch`."""
    if self.turns:
      sample = functools.partial(
        sampler.sample_tree,
        model_cfg=model_cfg,
        fanouts=self.fanouts,
        lengths=turn_lengths,
        stop_tokens=stop_tokens,
      )
      greedy_cfg = sampler.SamplerConfig(temperature=0.0)
      one_path = dict(fanouts=(1,) * len(self.fanouts))
    else:
      stops = (stop_tokens,) if isinstance(stop_tokens, int) else tuple(stop_tokens)
      sample = functools.partial(sampler.sample, model_cfg=model_cfg, stop_tokens=stops)
      greedy_cfg = sampler.SamplerConfig(
        max_new_tokens=sampler_cfg.max_new_tokens, temperature=0.0, trunk_len=sampler_cfg.trunk_len
      )
      sample = functools.partial(sample, n_branches=self.fanouts[0])
      one_path = dict(n_branches=1)
    return (
      functools.partial(sample, cfg=sampler_cfg),
      functools.partial(sample, cfg=greedy_cfg, **one_path),
    )


def rollout_shape(cfg) -> Shape:
  """The rollouts of a run's config, as its task states them: a task of several turns
  (`Task.turns`) is sampled as a tree, one tree.fanouts level per turn (the config checks that
  they agree); any other, flat groups of train.n_branches."""
  if task_class(cfg.task.name).turns:
    return Shape(cfg.tree.fanout_tuple, True, f"tree.fanouts={cfg.tree.fanouts!r}")
  return Shape((cfg.train.n_branches,), False, f"train.n_branches={cfg.train.n_branches}")


def make(cfg: TaskConfig, tokenizer=TOKENIZER) -> Task:
  """The task of a config, built with the run's tokenizer (tasks that read files load and
  check them here, before any compute)."""
  return task_class(cfg.name)(cfg.options, tokenizer)


def encode_prompts(items, length: int, tokenizer=TOKENIZER):
  """Prompts (prefix strings, or items with a `prompt` and optional `prompt_ids`: Examples,
  tree examples, preference pairs) as left-padded ids and validity [B, length]; an item's own
  `prompt_ids` (a task that tokenized, templated or truncated it) are used."""
  ids_BL = np.full((len(items), length), tokenizer.pad_id, np.int32)
  valid_BL = np.zeros((len(items), length), bool)
  for b, item in enumerate(items):
    if isinstance(item, str):
      ids = tokenizer.encode(item, bos=True)
    elif getattr(item, "prompt_ids", None) is not None:
      ids = list(item.prompt_ids)
    else:
      ids = tokenizer.encode(item.prompt, bos=True)
    if len(ids) > length:
      raise ValueError(f"task prompt {b}: {len(ids)} tokens, expected <= {length}")
    ids_BL[b, length - len(ids) :] = ids
    valid_BL[b, length - len(ids) :] = True
  return ids_BL, valid_BL


def _encode(texts, length: int, tokenizer, left: bool, what: str):
  ids_BL = np.full((len(texts), length), tokenizer.pad_id, np.int32)
  valid_BL = np.zeros((len(texts), length), bool)
  for b, text in enumerate(texts):
    ids = tokenizer.encode(text, bos=left, eos=not left)
    if len(ids) > length:
      raise ValueError(f"task {what} {b}: {len(ids)} tokens, expected <= {length}")
    span = slice(length - len(ids), length) if left else slice(0, len(ids))
    ids_BL[b, span] = ids
    valid_BL[b, span] = True
  return ids_BL, valid_BL


def encode_left(texts, length: int, tokenizer=TOKENIZER):
  """BOS + text, left-padded: ids and validity, numpy [B, length] (prefixes end aligned)."""
  return _encode(texts, length, tokenizer, left=True, what="prompt")


def encode_right(texts, length: int, tokenizer=TOKENIZER):
  """text + EOS, right-padded: ids and validity, numpy [B, length] (tails start aligned)."""
  return _encode(texts, length, tokenizer, left=False, what="answer")
