"""DPO end to end through branch replay: preference pairs that share a long prompt.

Each prompt is one shared prefix; its two tails are the chosen (branch 0) and the rejected
(branch 1) completion, so R = 2. The reference log-probs of both come from one
shared-prefix forward of the frozen reference policy (`sampler.score`), the loss is the
objective `dpo` of losses.py; the algorithm is algorithms/dpo.py.

Pairs come from the task (haystack: chosen = the right value, rejected = a wrong one) or
from a JSON-lines file (`algo.pairs_file`), one {"prompt", "chosen", "rejected"} per line.
Metrics per step: dpo/accuracy (implicit reward of chosen > rejected), dpo/margin,
rewards/chosen, rewards/rejected (beta * log pi/ref summed over the completion).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from branch_replay.data import tasks
from branch_replay.core import tree
from branch_replay.data.tokenizer import TOKENIZER

FIELDS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class Pair:
  prompt: str
  chosen: str
  rejected: str
  prompt_ids: Optional[tuple] = None  # token ids (BOS included) when the task tokenized it


def load_pairs(path: str) -> list[Pair]:
  """Preference pairs from a JSON-lines file; a bad line is named."""
  pairs = []
  for where, row in tasks.jsonl_records(path, f"algo.pairs_file={path!r}"):
    for name in FIELDS:
      if not isinstance(row.get(name), str):
        raise ValueError(
          f"{where}: field {name!r} missing or not a string; expected fields {FIELDS}"
        )
    pairs.append(Pair(row["prompt"], row["chosen"], row["rejected"]))
  if not pairs:
    raise ValueError(f"{path}: no preference pairs")
  return pairs


def task_pair(task, rng: np.random.Generator) -> Pair:
  """A haystack prompt, its right value (chosen) and a wrong value of the same length."""
  ex = task.sample(rng)
  return Pair(ex.prompt, ex.answer, wrong_value(ex.answer, rng), getattr(ex, "prompt_ids", None))


wrong_value = tasks.wrong_value  # the rejected answer of a task's pair


def make_batch(pairs, prompt_len: int, answer_len: int, tok=TOKENIZER) -> tree.TreeBatch:
  """Prefix = BOS + prompt (left-padded), tails = [chosen, rejected] + EOS (right-padded)."""
  prefix_BP, prefix_valid_BP = tasks.encode_prompts(pairs, prompt_len, tok)
  tails = [tasks.encode_right([p.chosen, p.rejected], answer_len + 1, tok) for p in pairs]
  tails_BRT = np.stack([t for t, _ in tails])
  valid_BRT = np.stack([v for _, v in tails])
  return tree.flat(
    prefix_BP, prefix_valid_BP, tails_BRT, valid_BRT, np.zeros(tails_BRT.shape[:2], np.float32)
  )


class Pairs:
  """DPO's (chosen, rejected) pairs sharing a prompt, as TreeBatches: flat, two branches per
  prompt, from algo.pairs_file or the task (its answer and a wrong value); or with
  tree.fanouts the task's preference trees (one opening per record, a pair below each)."""

  def __init__(self, cfg, task, tok):
    self.cfg, self.task, self.tok = cfg, task, tok
    shape = tasks.rollout_shape(cfg)
    self.turns = shape.turns
    if self.turns:  # the task's preference trees (TurnsTask.preference_trees)
      try:
        fanouts = task.preference_trees(np.random.default_rng(0), 1, tok).fanouts
      except NotImplementedError:
        raise ValueError(
          f"algo.name='dpo' with {shape.setting}: task {cfg.task.name!r} makes no "
          "preference trees (TurnsTask.preference_trees); expected tree.fanouts='' and "
          "algo.pairs_file, or another task"
        ) from None
      if cfg.tree.fanout_tuple != tuple(fanouts):
        raise ValueError(
          f"tree.fanouts={cfg.tree.fanouts!r} with algo.name='dpo': the preference trees of "
          f"task {cfg.task.name!r} have fan-outs {tuple(fanouts)} (their (chosen, rejected) "
          f"pairs below each opening); expected {'x'.join(map(str, fanouts))!r}"
        )
    self.file_pairs = load_pairs(cfg.algo.pairs_file) if cfg.algo.pairs_file else None
    if self.file_pairs is not None:
      enc = lambda text: len(tok.encode(text, bos=False, eos=False))
      self.prompt_len = 1 + max(enc(p.prompt) for p in self.file_pairs)
      self.answer_len = max(enc(x) for p in self.file_pairs for x in (p.chosen, p.rejected))
    elif not self.turns:
      self.prompt_len, self.answer_len = task.max_prompt_len, task.max_answer_len

  def batch(self, step: int) -> tree.TreeBatch:
    """Step `step`'s train.batch_size pairs (advantages unused: the objective is DPO's)."""
    t = self.cfg.train
    rng = np.random.default_rng([t.seed, step])
    if self.turns:
      return self.task.preference_trees(rng, t.batch_size, self.tok)
    pairs = (
      [self.file_pairs[i] for i in rng.integers(0, len(self.file_pairs), t.batch_size)]
      if self.file_pairs is not None
      else [task_pair(self.task, rng) for _ in range(t.batch_size)]
    )
    return make_batch(pairs, self.prompt_len, self.answer_len, self.tok)


def preference_metrics(policy_logp_BR, ref_logp_BR, beta: float) -> dict:
  """Implicit rewards beta * (log pi - log ref) of chosen (0) and rejected (1)."""
  r_BR = beta * (np.asarray(policy_logp_BR, np.float64) - np.asarray(ref_logp_BR, np.float64))
  margin_B = r_BR[:, 0] - r_BR[:, 1]
  return {
    "dpo/accuracy": float(np.mean(margin_B > 0)),
    "dpo/margin": float(margin_B.mean()),
    "rewards/chosen": float(r_BR[:, 0].mean()),
    "rewards/rejected": float(r_BR[:, 1].mean()),
  }
