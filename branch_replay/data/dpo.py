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


def format_summary(s: dict) -> str:
  return (
    f"dpo/accuracy (mean of first/last {s['window']} DPO steps): "
    f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}; "
    f"margin {s['margin_after']:.3f}\ntime: {s['wall_s']:.0f} s\nmetrics: {s['metrics']}"
  )
