"""Verifiable tasks shipped with the code (no downloads): prompts, answers, programmatic rewards.

  haystack    key->value retrieval: a few `KEY value` records hidden at random depths in a
              long run of filler; the prompt ends with `?KEY` and the answer is that value.
              The answer depends only on tokens deep in the long shared prompt.
  arithmetic  short reasoning: `a+b=` with n-digit operands; the answer is the sum.

A task draws `Example`s from a numpy Generator (deterministic per seed and step) and scores
a completion string (decoded up to EOS) with `reward`: 1.0 exact match, else 0.0.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from branch_replay.tokenizer import TOKENIZER


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  name: str = "haystack"
  prompt_len: int = 256  # haystack: prompt tokens including BOS and the `?KEY` query
  n_keys: int = 4  # haystack: records hidden in the filler
  value_len: int = 1  # haystack: digits per value
  n_digits: int = 2  # arithmetic: digits per operand
  sft_prompt_len: int = 0  # haystack: warm-up prompt length (0 = prompt_len)

  def __post_init__(self):
    if self.name not in TASKS:
      raise ValueError(f"task.name={self.name!r}: expected one of {sorted(TASKS)}")
    for name in ("prompt_len", "n_keys", "value_len", "n_digits"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"task.{name}={value!r}: expected a positive int")
    if self.n_keys > len(string.ascii_uppercase):
      raise ValueError(f"task.n_keys={self.n_keys}: expected <= 26 (one uppercase letter each)")
    if not isinstance(self.sft_prompt_len, int) or self.sft_prompt_len < 0:
      raise ValueError(f"task.sft_prompt_len={self.sft_prompt_len!r}: expected an int >= 0")
    if self.name == "haystack":
      need = 1 + self.n_keys * (1 + self.value_len) + 2
      for name in ("prompt_len", "sft_prompt_len"):
        value = getattr(self, name)
        if value and value < need:
          raise ValueError(f"task.{name}={value}: expected >= {need} to hold n_keys="
                           f"{self.n_keys} records of value_len={self.value_len} + the query")
    if self.n_digits > 9:
      raise ValueError(f"task.n_digits={self.n_digits}: expected <= 9")


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str  # text after BOS
  answer: str  # the exact expected completion (EOS not included)


def exact_match(example: Example, completion: str) -> float:
  return float(completion == example.answer)


class Haystack:
  """`?K` asks for the value of record `Kv` hidden in lowercase filler."""

  def __init__(self, cfg: TaskConfig):
    self.cfg = cfg
    self.max_prompt_len = cfg.prompt_len  # BOS included
    self.max_answer_len = cfg.value_len  # characters, EOS excluded
    self.sft_prompt_len = cfg.sft_prompt_len or cfg.prompt_len

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
      chars[slot * width:(slot + 1) * width] = [key, *value]
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
    tails = [f"?{k}{haystack[haystack.index(k) + 1:haystack.index(k) + 1 + self.cfg.value_len]}"
             for k in keys]
    return haystack, tails


class Arithmetic:
  """`a+b=` -> the decimal sum."""

  def __init__(self, cfg: TaskConfig):
    self.cfg = cfg
    self.max_prompt_len = 1 + 2 * cfg.n_digits + 2
    self.max_answer_len = cfg.n_digits + 1
    self.sft_prompt_len = self.max_prompt_len

  def sample(self, rng: np.random.Generator) -> Example:
    a, b = (int(x) for x in rng.integers(0, 10 ** self.cfg.n_digits, size=2))
    return Example(f"{a}+{b}=", str(a + b))

  reward = staticmethod(exact_match)

  def supervised(self, rng: np.random.Generator):
    ex = self.sample(rng)
    return ex.prompt, [ex.answer]


TASKS = {"haystack": Haystack, "arithmetic": Arithmetic}


def make(cfg: TaskConfig):
  return TASKS[cfg.name](cfg)


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
