"""A multi-turn task whose turns branch: a two-turn lookup in a haystack.

The prompt hides key records `Kv` (an uppercase key, value digits) in filler and ends with
`?k` (a key asked for in lowercase). Turn 1 must name the key, `K`; turn 2 must give its
value, `v<eos>`, which lies deep in the long prompt. Sampled as a tree: R_1 first turns per
prompt, R_2 second turns of each; a leaf's reward is 1 when both turns are right, so a wrong
first turn dooms all its leaves. Registered as task `tree_haystack` (its options are the
haystack task's); a `turns.TurnsTask` of two turns.
(Variants with a turn separator `K;`, or alias records `ak` making turn 1 a lookup too, were
not learned by the 2-layer model's warm-up within a few minutes: see the README.)
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from branch_replay.data import tasks, turns
from branch_replay.core import tree
from branch_replay.data.tokenizer import TOKENIZER


@dataclasses.dataclass(frozen=True)
class TreeExample:
  prompt: str  # text after BOS, ends with `?a`
  key: str  # turn 1's answer
  value: str  # that key's value: turn 2's answer (before EOS)
  prompt_ids: Optional[tuple] = None  # token ids (BOS included) when the task tokenized it


@tasks.register("tree_haystack")
class TreeHaystack(turns.TurnsTask):
  """`?k` -> turn 1 `K` -> turn 2 the value of record `Kv`."""

  Options = tasks.Haystack.Options  # prompt_len, n_keys, value_len, sft_prompt_len (validated)
  turns = 2
  metric_names = ("turn1",)  # reward/turn1: the first turns' accuracy

  def __init__(self, cfg, tokenizer=TOKENIZER):
    super().__init__(cfg, tokenizer)
    self.max_prompt_len = cfg.prompt_len
    self.sft_prompt_len = cfg.sft_prompt_len or cfg.prompt_len
    self.turn_lengths = (1, cfg.value_len + 1)  # `K`, then `v<eos>`
    self._haystack = tasks.Haystack(cfg, tokenizer)

  def sample(self, rng: np.random.Generator, prompt_len: int | None = None) -> TreeExample:
    ex = self._haystack.sample(rng, prompt_len or self.cfg.prompt_len)  # ends `?K`
    key = ex.prompt[-1]
    return TreeExample(ex.prompt[:-1] + key.lower(), key, ex.answer)

  def first_turn_right(self, example: TreeExample, turn1: str) -> bool:
    return turn1 == example.key

  def reward(self, example: TreeExample, turns: tuple) -> float:
    """1 when turn 1 names the asked key and turn 2 is its value (each decoded up to EOS:
    turn 1 is one token; an EOS there leaves it empty, hence wrong)."""
    turn1, turn2 = turns
    return float(self.first_turn_right(example, turn1) and turn2 == example.value)

  def prompt_metrics(self, examples, samples, tok=TOKENIZER) -> dict:
    """turn1: each prompt's share of right first turns."""
    rows = turns.texts(samples.tokens[0], tok)
    return {
      "turn1": np.asarray(
        [np.mean([self.first_turn_right(e, x) for x in row]) for e, row in zip(examples, rows)]
      )
    }

  def warmup_tree(self, rng: np.random.Generator, n: int, tok=TOKENIZER) -> tree.TreeBatch:
    """n warm-up trees (`supervised`, `turn_tree`): each key's opening and its value."""
    items = [self.supervised(rng) for _ in range(n)]
    return turn_tree(self, items, lambda b, r, value: [value], tok)

  def preference_trees(self, rng: np.random.Generator, n: int, tok=TOKENIZER) -> tree.TreeBatch:
    """Preference trees: root = a haystack, level 1 = one opening `?kK` per record, level 2 =
    (chosen: its value, rejected: a wrong one), fan-outs (n_keys, 2). Chosen and rejected
    share the haystack and the opening, so the pair's log-ratio margin is that of the last
    turn alone (the shared tokens cancel)."""
    items = [self.supervised(rng) for _ in range(n)]
    return turn_tree(self, items, lambda b, r, value: [value, tasks.wrong_value(value, rng)], tok)

  def supervised(self, rng: np.random.Generator):
    """Warm-up tree: the haystack is the root; one opening per key, `?kK` (the question
    `?k` unscored, the answer `K` scored), each continued by its value `v<eos>`."""
    haystack, tails = self._haystack.supervised(rng)  # tails `?Kv` per record
    n = self.cfg.value_len
    return haystack, [(f"?{t[1].lower()}", t[1], t[2 : 2 + n]) for t in tails]


# ------------------------------------------------- the turns as trees (warm-up, DPO, rewards)


def _encode_nodes(texts, length, tok, eos):
  ids = np.zeros((len(texts), length), np.int32)
  valid = np.zeros((len(texts), length), bool)
  for i, text in enumerate(texts):
    row = tok.encode(text, eos=eos)
    ids[i, : len(row)], valid[i, : len(row)] = row, True
  return ids, valid


def turn_tree(task, items, children, tok=TOKENIZER) -> tree.TreeBatch:
  """A tree of the task's turns: root = each item's haystack, level 1 = its openings `?kK` (the
  question unscored), level 2 = each opening's children (`children(b, r, value)` -> second
  turns; `<eos>` appended); advantage 1 everywhere (the warm-up's -log p; DPO ignores it)."""
  B, R = len(items), len(items[0][1])
  root_BP, root_valid_BP = tasks.encode_left([h for h, _ in items], task.sft_prompt_len, tok)
  T1 = 2 + task.turn_lengths[0]
  query = [q + a for _, turns in items for q, a, _ in turns]
  tokens1, valid1 = _encode_nodes(query, T1, tok, eos=False)
  scored1 = valid1 & (np.arange(T1) >= 2)  # `?k` is the question, not the policy's turn
  seconds = [
    c
    for b, (_, turns) in enumerate(items)
    for r, (_, _, v) in enumerate(turns)
    for c in children(b, r, v)
  ]
  R2 = len(seconds) // (B * R)
  tokens2, valid2 = _encode_nodes(seconds, task.turn_lengths[1], tok, eos=True)
  shape = lambda x, n: x.reshape(B, n, -1)
  levels = (
    tree.TreeLevel(
      shape(tokens1, R), shape(valid1, R), shape(scored1, R), np.ones((B, R), np.float32)
    ),
    tree.TreeLevel(
      shape(tokens2, R * R2), shape(valid2, R * R2), None, np.ones((B, R * R2), np.float32)
    ),
  )
  return tree.TreeBatch(root_BP, root_valid_BP, levels, fanouts=(R, R2))
