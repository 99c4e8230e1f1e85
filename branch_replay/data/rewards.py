"""Rewards by name: `exact_match`, `numeric`, `regex`, `contains`, or any `module:function`.

A reward scores a whole batch at once: `fn(examples, completions, **kwargs) -> N floats`, one
per (example, completion) pair (the trainer passes every prompt's R branches, flattened).
An example's `answer` and its other fields (`example.fields`: every key of a JSON line) are
what a reward reads. Register a new one in its own file:

  @rewards.register("length_penalty", needs=("answer",))
  def length_penalty(examples, completions, *, scale=0.1):
    return [float(c == e.answer) - scale * len(c) for e, c in zip(examples, completions)]

`compute` calls a reward and stops the run on garbage: an exception, a wrong count or a
non-finite value is a ValueError naming the example (its file:line when it came from one).
Under `time_limit(seconds)` (the trainer's `train.reward_timeout_s`) a call that has not
returned after `seconds` is a `RewardTimeout` naming the example that hangs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import threading
import time
from typing import Callable, Sequence

import chex
import einops
import numpy as np


@dataclasses.dataclass(frozen=True)
class Reward:
  name: str
  fn: Callable  # fn(examples, completions, **kwargs) -> sequence of N floats
  needs: tuple = ()  # example fields every example must carry (checked when data loads)


REWARDS: dict[str, Reward] = {}


def register(name: str, needs: Sequence[str] = ()):
  """Decorator: make `fn(examples, completions, **kwargs)` a reward called `name`."""

  def wrap(fn):
    if name in REWARDS:
      raise ValueError(f"reward {name!r} is already registered ({REWARDS[name].fn})")
    REWARDS[name] = Reward(name, fn, tuple(needs))
    return fn

  return wrap


# Built-in rewards registered by a task module (imported when first asked for by name, as
# tasks.py imports a task's module): the name resolves, and the list of names in an error is
# the same, whatever was imported before.
BUILTIN_MODULES = {
  "needle_number": "branch_replay.data.longctx",
  "variable_set": "branch_replay.data.longctx",
}


def get(spec: str) -> Reward:
  """A registered name, or `module:function` (imported; `needs` read from the function's
  optional `needs` attribute)."""
  if spec not in REWARDS and spec in BUILTIN_MODULES:
    importlib.import_module(BUILTIN_MODULES[spec])
  if spec in REWARDS:
    return REWARDS[spec]
  if ":" in spec:
    module_name, _, attr = spec.partition(":")
    try:
      fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
      raise ValueError(
        f"task.reward={spec!r}: cannot import {attr!r} from {module_name!r} ({e})"
      ) from None
    if not callable(fn):
      raise ValueError(f"task.reward={spec!r}: {module_name}.{attr} is not callable")
    return Reward(spec, fn, tuple(getattr(fn, "needs", ())))
  raise ValueError(
    f"task.reward={spec!r}: unknown reward; expected one of "
    f"{sorted(set(REWARDS) | set(BUILTIN_MODULES))} or 'module:function'"
  )


def _where(example) -> str:
  source = getattr(example, "source", "")
  return f"{source} " if source else ""


class RewardTimeout(TimeoutError):
  """A reward call ran past `time_limit` (train.reward_timeout_s)."""


_LIMIT_S = [0.0]  # the time limit of reward calls (0: none), set by `time_limit`


@contextlib.contextmanager
def time_limit(seconds: float):
  """Within: every `compute` whose reward call runs longer than `seconds` raises
  RewardTimeout (0 = no limit). The call runs in a daemon thread; one that never returns is
  left behind (Python cannot stop a thread) and the run stops."""
  previous, _LIMIT_S[0] = _LIMIT_S[0], float(seconds)
  try:
    yield
  finally:
    _LIMIT_S[0] = previous


_HUNG = object()


def _call(fn, args, kwargs, seconds: float):
  """fn(*args, **kwargs), or _HUNG when it has not returned after `seconds` (0: no limit);
  its exception is raised here."""
  if not seconds:
    return fn(*args, **kwargs)
  box = {}

  def target():
    try:
      box["value"] = fn(*args, **kwargs)
    except BaseException as e:  # re-raised in the caller's thread
      box["error"] = e

  thread = threading.Thread(target=target, name="reward", daemon=True)
  thread.start()
  thread.join(seconds)
  if thread.is_alive():
    return _HUNG
  if "error" in box:
    raise box["error"]
  return box["value"]


def _first_hung(thunks, seconds: float):
  """(index of the first thunk that alone does not return within `seconds`, or None; how
  many were tried), trying them in order while a budget of 2 x `seconds` lasts. A thunk that
  raises returns (an error is not a hang)."""
  deadline, tried = time.monotonic() + 2 * seconds, 0
  for i, thunk in enumerate(thunks):
    if deadline - time.monotonic() < seconds:
      break  # the budget ran out before a probe could run its full limit
    tried += 1
    try:
      if _call(thunk, (), {}, seconds) is _HUNG:
        return i, tried
    except Exception:
      continue
  return None, tried


def _timeout(reward: Reward, flat_examples, flat_texts, R: int, kwargs, seconds: float):
  """The error of a batch call that hung: each pair alone finds the first example that does
  not return in time (`_first_hung`)."""
  pairs = list(zip(flat_examples, flat_texts))
  i, tried = _first_hung(
    (lambda ex=ex, text=text: reward.fn([ex], [text], **kwargs) for ex, text in pairs), seconds
  )
  if i is not None:
    ex, text = pairs[i]
    which = (
      f"{_where(ex)}example {i // R} branch {i % R} (prompt {ex.prompt[-60:]!r}, "
      f"completion {text[:60]!r}) alone does not return within it"
    )
  else:
    which = (
      f"none of the {tried} completion(s) tried alone ran past it: the batch as a "
      "whole is too slow (raise train.reward_timeout_s)"
    )
  return RewardTimeout(
    f"reward {reward.name!r} did not return within "
    f"train.reward_timeout_s={seconds:g} s on {len(flat_texts)} completions; "
    f"{which}: stopping (this step is not taken; the last checkpoint "
    "stands)"
  )


def limited(what: str, fn, probes=()):
  """fn() under `time_limit` (for rewards that are not a `Reward`: a tree task's per-leaf
  `task.reward`). Past the limit: a RewardTimeout naming `what` and the first of `probes`
  ((description, thunk) pairs, read only then, each tried alone: `_first_hung`) that does
  not return in time."""
  seconds = _LIMIT_S[0]
  got = _call(fn, (), {}, seconds)
  if got is not _HUNG:
    return got
  seen = []

  def thunks():
    for description, thunk in probes:
      seen.append(description)
      yield thunk

  i, _ = _first_hung(thunks(), seconds)
  which = (
    f"{seen[i]} alone does not return within it"
    if i is not None
    else "no single call tried alone ran past it (raise train.reward_timeout_s)"
  )
  raise RewardTimeout(
    f"{what} did not return within train.reward_timeout_s={seconds:g} s; "
    f"{which}: stopping (this step is not taken; the last checkpoint stands)"
  )


def compute(
  reward: Reward, examples: Sequence, completions_BR: Sequence[Sequence[str]], **kwargs
) -> np.ndarray:
  """Rewards [B, R] (float32) of R completions per example, in one call of the reward."""
  B, R = len(examples), len(completions_BR[0]) if len(completions_BR) else 0
  # One call for all B*R pairs, flattened row-major: pair n = (b, r) with n = b*R + r.
  flat_examples = [ex for ex, row in zip(examples, completions_BR) for _ in row]
  flat_texts = [text for row in completions_BR for text in row]
  seconds = _LIMIT_S[0]
  try:
    values = _call(reward.fn, (flat_examples, flat_texts), kwargs, seconds)
  except Exception as e:  # the reward's own bug or a bad example: name it and stop
    i = getattr(e, "example_index", None)
    at = (
      f" on example {i} ({_where(flat_examples[i])}prompt {flat_examples[i].prompt[-60:]!r})"
      if isinstance(i, int) and 0 <= i < len(flat_examples)
      else ""
    )
    raise ValueError(f"reward {reward.name!r} raised{at}: {type(e).__name__}: {e}") from e
  if values is _HUNG:
    raise _timeout(reward, flat_examples, flat_texts, R, kwargs, seconds)
  try:
    values_N = np.asarray(values, np.float64).reshape(-1)
  except (TypeError, ValueError):
    raise ValueError(
      f"reward {reward.name!r}: expected {B * R} numbers, got {values!r:.200}"
    ) from None
  if values_N.shape != (B * R,):
    raise ValueError(
      f"reward {reward.name!r}: returned {values_N.size} values for {B * R} "
      f"completions ({B} prompts x {R} branches)"
    )
  bad = np.flatnonzero(~np.isfinite(values_N))
  if bad.size:
    i = int(bad[0])
    ex = flat_examples[i]
    raise ValueError(
      f"reward {reward.name!r} returned {values_N[i]} for {_where(ex)}example "
      f"{i // R} branch {i % R} (prompt {ex.prompt[-60:]!r}, completion "
      f"{flat_texts[i][:60]!r}): expected a finite number; stopping rather "
      "than training on it"
    )
  rewards_BR = einops.rearrange(values_N, "(B R) -> B R", B=B, R=R).astype(np.float32)
  chex.assert_shape(rewards_BR, (B, R))
  return rewards_BR


# ----------------------------------------------------------------------------- built-ins


class _Indexed(Exception):
  """An error tagged with the index of the example that caused it (for `compute`)."""

  def __init__(self, index: int, message: str):
    super().__init__(message)
    self.example_index = index


@register("exact_match", needs=("answer",))
def exact_match(examples, completions):
  """1 when the completion (decoded up to EOS) is exactly the answer, else 0."""
  return [float(c == e.answer) for e, c in zip(examples, completions)]


def _number(text: str):
  match = re.search(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", text.replace(",", ""))
  return float(match.group()) if match else None


@register("numeric", needs=("answer",))
def numeric(examples, completions, *, tolerance: float = 1e-6, relative: bool = False):
  """1 when the first number in the completion is within `tolerance` of the answer
  (absolute, or relative to |answer| with relative=True), else 0."""
  out = []
  for i, (e, c) in enumerate(zip(examples, completions)):
    target = _number(e.answer)
    if target is None:
      raise _Indexed(i, f"answer {e.answer!r} holds no number")
    got = _number(c)
    scale = abs(target) if relative else 1.0
    out.append(float(got is not None and abs(got - target) <= tolerance * scale))
  return out


@register("regex")
def regex(examples, completions, *, pattern: str = ""):
  """1 when the completion fully matches the regular expression: the example's own `pattern`
  field, else the `pattern` option."""
  cache = {}
  out = []
  for i, (e, c) in enumerate(zip(examples, completions)):
    p = (e.fields or {}).get("pattern", pattern)
    if not p:
      raise _Indexed(
        i,
        "no pattern: give the example a 'pattern' field or set "
        'task.reward_options={"pattern": ...}',
      )
    if p not in cache:
      try:
        cache[p] = re.compile(p)
      except re.error as err:
        raise _Indexed(i, f"pattern {p!r} does not compile: {err}") from None
    out.append(float(cache[p].fullmatch(c) is not None))
  return out


@register("contains", needs=("answer",))
def contains(examples, completions, *, case_sensitive: bool = True):
  """1 when the answer occurs anywhere in the completion, else 0."""
  fold = (lambda s: s) if case_sensitive else str.lower
  return [float(fold(e.answer) in fold(c)) for e, c in zip(examples, completions)]


_GSM8K_FINAL = re.compile(r"####\s*([-+$]?[\d,]*\.?\d+)")


def final_number_of(text: str):
  """The number after `####` (GSM8K's final-answer mark), else the last number in the text;
  None when there is none. Commas and a leading $ are dropped."""
  match = _GSM8K_FINAL.search(text)
  if match:
    return float(match.group(1).replace(",", "").replace("$", ""))
  numbers = re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)", text.replace(",", ""))
  return float(numbers[-1]) if numbers else None


@register("final_number", needs=("answer",))
def final_number(examples, completions):
  """GSM8K's grading: 1 when the completion's final number (after `####`, else its last
  number) equals the answer's (after `####`), else 0."""
  out = []
  for i, (e, c) in enumerate(zip(examples, completions)):
    target = final_number_of(e.answer)
    if target is None:
      raise _Indexed(i, f"answer {e.answer!r} holds no number (expected '... #### 42')")
    got = final_number_of(c)
    out.append(float(got is not None and abs(got - target) <= 1e-6 * max(1.0, abs(target))))
  return out
