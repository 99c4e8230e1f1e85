"""A task's supervised warm-up batches (train.sft_steps before the phase): its long prefix
shared by its reference answers, one per tail (flat), or its warm-up trees (`TurnsTask
.warmup_tree`, a task of several turns). Advantage 1: the objective is -log p."""

from __future__ import annotations

import chex
import numpy as np

from branch_replay.core import tree
from branch_replay.data import tasks


def warmup_batch(task, rng: np.random.Generator, batch_size: int, tok) -> tree.TreeBatch:
  """`batch_size` prefixes of the task's warm-up: with several turns (`task.turns`) its trees
  (tree_haystack's: the haystack, one opening per key, its value below); else each prompt's
  reference tails (`task.supervised`), left-padded to task.sft_prompt_len, tails right-padded
  to task.sft_tail_len (EOS included)."""
  if task.turns:
    return task.warmup_tree(rng, batch_size, tok)
  items = [task.supervised(rng) for _ in range(batch_size)]
  prefix_BP, prefix_valid_BP = tasks.encode_prompts([p for p, _ in items], task.sft_prompt_len, tok)
  T = task.sft_tail_len
  tails = [tasks.encode_right(t, T, tok) for _, t in items]
  tails_BRT = np.stack([t for t, _ in tails])
  valid_BRT = np.stack([v for _, v in tails])
  B, R = tails_BRT.shape[:2]
  chex.assert_shape([tails_BRT, valid_BRT], (B, R, T))
  chex.assert_shape([prefix_BP, prefix_valid_BP], (B, task.sft_prompt_len))
  return tree.flat(
    prefix_BP=prefix_BP,
    prefix_valid_BP=prefix_valid_BP,
    tails_BRT=tails_BRT,
    tail_valid_BRT=valid_BRT,
    advantages_BR=np.ones(tails_BRT.shape[:2], np.float32),
  )
