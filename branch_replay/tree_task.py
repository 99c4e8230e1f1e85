"""A multi-turn task whose turns branch: a two-turn lookup in a haystack.

The prompt hides key records `Kv` (an uppercase key, value digits) in filler and ends with
`?k` (a key asked for in lowercase). Turn 1 must name the key, `K`; turn 2 must give its
value, `v<eos>`, which lies deep in the long prompt. Sampled as a tree: R_1 first turns per
prompt, R_2 second turns of each; a leaf's reward is 1 when both turns are right, so a wrong
first turn dooms all its leaves. Registered as task `tree_haystack` (its options are the
haystack task's).
(Variants with a turn separator `K;`, or alias records `ak` making turn 1 a lookup too, were
not learned by the 2-layer model's warm-up within a few minutes: see the README.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from branch_replay import tasks
from branch_replay.tokenizer import TOKENIZER

@dataclasses.dataclass(frozen=True)
class TreeExample:
  prompt: str  # text after BOS, ends with `?a`
  key: str  # turn 1's answer
  value: str  # that key's value: turn 2's answer (before EOS)
  prompt_ids: Optional[tuple] = None  # token ids (BOS included) when the task tokenized it


@tasks.register("tree_haystack")
class TreeHaystack(tasks.Task):
  """`?k` -> turn 1 `K` -> turn 2 the value of record `Kv`."""

  Options = tasks.Haystack.Options  # prompt_len, n_keys, value_len, sft_prompt_len (validated)

  def __init__(self, cfg, tokenizer=TOKENIZER):
    super().__init__(cfg, tokenizer)
    self.max_prompt_len = cfg.prompt_len
    self.sft_prompt_len = cfg.sft_prompt_len or cfg.prompt_len
    self.turn_lengths = (1, cfg.value_len + 1)  # `K`, then `v<eos>`
    self._haystack = tasks.Haystack(cfg, tokenizer)

  def check(self, cfg) -> None:
    if len(cfg.tree.fanout_tuple) != 2:
      raise ValueError(f"tree.fanouts={cfg.tree.fanouts!r}: task {cfg.task.name!r} has two "
                       "turns; expected two fan-outs, e.g. '4x4'")

  def stop_tokens(self, tok=TOKENIZER):
    """Per turn: EOS (turn 1 is one token; an EOS there leaves it empty, hence wrong)."""
    return ((tok.eos_id,), (tok.eos_id,))

  def sample(self, rng: np.random.Generator, prompt_len: int | None = None) -> TreeExample:
    ex = self._haystack.sample(rng, prompt_len or self.cfg.prompt_len)  # ends `?K`
    key = ex.prompt[-1]
    return TreeExample(ex.prompt[:-1] + key.lower(), key, ex.answer)

  def first_turn_right(self, example: TreeExample, turn1: str) -> bool:
    return turn1 == example.key

  def reward(self, example: TreeExample, turn1: str, turn2: str) -> float:
    """1 when turn 1 names the asked key and turn 2 is its value (decoded up to EOS)."""
    return float(self.first_turn_right(example, turn1) and turn2 == example.value)

  def supervised(self, rng: np.random.Generator):
    """Warm-up tree: the haystack is the root; one opening per key, `?kK` (the question
    `?k` unscored, the answer `K` scored), each continued by its value `v<eos>`."""
    haystack, tails = self._haystack.supervised(rng)  # tails `?Kv` per record
    n = self.cfg.value_len
    return haystack, [(f"?{t[1].lower()}", t[1], t[2:2 + n]) for t in tails]

