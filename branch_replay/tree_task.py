"""A multi-turn task whose turns branch: two-step retrieval in a haystack.

The prompt hides key records `Kv` (an uppercase key, value digits) and alias records `aK`
(a lowercase alias naming a key) in filler, and ends with `?a`. Turn 1 must name the key the
alias points to, `K;`; turn 2 must give that key's value, `v<eos>`. Sampled as a tree: R_1
first turns per prompt, R_2 second turns of each; a leaf's reward is 1 when both turns are
right. Registered as task `tree_haystack` (its options are TaskConfig's haystack fields).
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from branch_replay import tasks
from branch_replay.tokenizer import TOKENIZER

TURN_END = ";"


@dataclasses.dataclass(frozen=True)
class TreeExample:
  prompt: str  # text after BOS, ends with `?a`
  key: str  # the key the alias names: turn 1's answer (before TURN_END)
  value: str  # that key's value: turn 2's answer (before EOS)


class TreeHaystack:
  """Two-turn alias -> key -> value retrieval."""

  def __init__(self, cfg: tasks.TaskConfig):
    need = 1 + 2 * cfg.n_keys * (1 + cfg.value_len) + 2
    for name in ("prompt_len", "sft_prompt_len"):
      if getattr(cfg, name) and getattr(cfg, name) < need:
        raise ValueError(f"task.{name}={getattr(cfg, name)}: expected >= {need} to hold "
                         f"n_keys={cfg.n_keys} records and aliases + the query")
    self.cfg = cfg
    self.max_prompt_len = cfg.prompt_len
    self.sft_prompt_len = cfg.sft_prompt_len or cfg.prompt_len
    self.turn_lengths = (2, cfg.value_len + 1)  # `K;`, then `v<eos>`

  def stop_tokens(self, tok=TOKENIZER):
    """Per turn: turn 1 ends at TURN_END (or EOS), turn 2 at EOS."""
    return ((tok.encode(TURN_END)[0], tok.eos_id), (tok.eos_id,))

  def _haystack(self, rng, prompt_len):
    cfg = self.cfg
    width = 1 + cfg.value_len  # `Kv` and `aK` alike when value_len == 1; aliases use 2
    L = prompt_len - 1 - 2  # BOS and the query excluded
    chars = ["."] * L
    keys = rng.choice(list(string.ascii_uppercase), size=cfg.n_keys, replace=False)
    aliases = rng.choice(list(string.ascii_lowercase), size=cfg.n_keys, replace=False)
    slots = rng.choice(L // width, size=2 * cfg.n_keys, replace=False)
    values = {}
    for i, key in enumerate(keys):
      values[key] = "".join(rng.choice(list(string.digits), size=cfg.value_len))
      chars[slots[i] * width:slots[i] * width + width] = [key, *values[key]]
      alias = [aliases[i], key] + ["."] * (width - 2)
      chars[slots[cfg.n_keys + i] * width:slots[cfg.n_keys + i] * width + width] = alias
    return "".join(chars), keys, aliases, values

  def sample(self, rng: np.random.Generator, prompt_len: int | None = None) -> TreeExample:
    haystack, keys, aliases, values = self._haystack(rng, prompt_len or self.cfg.prompt_len)
    ask = int(rng.integers(self.cfg.n_keys))
    return TreeExample(haystack + "?" + aliases[ask], keys[ask], values[keys[ask]])

  def reward(self, example: TreeExample, turn1: str, turn2: str) -> float:
    """1 when turn 1 is `K;` for the right key and turn 2 its value (decoded up to EOS)."""
    return float(turn1 == example.key + TURN_END and turn2 == example.value)

  def supervised(self, rng: np.random.Generator):
    """Warm-up tree: the haystack is the root; one opening per alias, `?aK;` (the query
    `?a` unscored, the answer `K;` scored), each continued by its value `v<eos>`."""
    haystack, keys, aliases, values = self._haystack(rng, self.sft_prompt_len)
    return haystack, [(f"?{a}", f"{k}{TURN_END}", values[k]) for a, k in zip(aliases, keys)]


tasks.TASKS.setdefault("tree_haystack", TreeHaystack)
