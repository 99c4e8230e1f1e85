"""The greedy evaluation on held-out prompts: one completion per prompt (trees: one path, every
turn greedy), rewarded by the task. One function for flat groups and trees; the mean is the
run's `eval/greedy_reward` (the trainer takes it), the per-prompt rewards give `eval/n`, `eval/correct` and the
Wilson interval (metrics.eval_record)."""

from __future__ import annotations

import jax
import numpy as np

from branch_replay.config import Config
from branch_replay.core import sampler, sharding
from branch_replay.data import tasks


def eval_examples(task, cfg: Config) -> list:
  """train.eval_size held-out prompts (draws from a stream training never uses)."""
  return task.eval_examples(cfg.train.seed, cfg.train.eval_size)


def greedy_rewards(
  fns, params, task, examples, cfg: Config, tok, *, done=(), on_chunk=None
) -> np.ndarray:
  """The reward of each prompt's greedy completion, [len(examples)] in the task's reward dtype
  (a tree: its one greedy path's leaf reward). In chunks of train.eval_batch prompts (0: all at
  once; the last chunk padded with its last prompt); every call pads to the task's prompt
  length, so one compiled shape serves every chunk and every evaluation of a run. With
  train.eval_shared_prefix, the ids every prompt starts with (a k-shot header) are
  prefilled once per call (`sampler.shared_header`) and the rests pad to the prompt length
  less the header.

  A long evaluation can be followed and resumed: `on_chunk(rewards_so_far)` is called after
  every chunk with the rewards of examples[:k] (k = the prompts done), and `done`, the rewards
  of examples[:len(done)] from an earlier call that was stopped, skips those prompts (chunks
  answer as one call does, so the result equals an uninterrupted run's)."""
  t = cfg.train
  if len(done) > len(examples):
    raise ValueError(f"done: {len(done)} rewards, expected at most len(examples)={len(examples)}")
  ids = [
    list(e.prompt_ids)
    if getattr(e, "prompt_ids", None) is not None
    else tok.encode(e.prompt, bos=True)
    for e in examples
  ]
  extra = {}  # the shared header, when there is one
  if t.eval_shared_prefix:
    header_H, ids = sampler.shared_header(ids)
    extra = {"header_H": header_H} if len(header_H) else {}
  L = max([task.max_prompt_len - len(extra.get("header_H", ()))] + [len(x) for x in ids])
  n = t.eval_batch or len(examples)
  out = [np.asarray(done)] if len(done) else []
  for i in range(len(done), len(examples), n):
    chunk = ids[i : i + n]
    chunk = chunk + [chunk[-1]] * (n - len(chunk))
    prompt_BP, valid_BP = tasks.encode_prompts(
      [tasks.Example("", "", prompt_ids=tuple(x)) for x in chunk], L, tok
    )
    s = fns.greedy(
      params, prompt_BP=prompt_BP, prompt_valid_BP=valid_BP, key=jax.random.key(0), **extra
    )
    s = sharding.to_host(s)  # numpy on every process (gathered when arrays span several)
    got = examples[i : i + n]
    r = task.leaf_rewards(got, jax.tree.map(lambda x: x[: len(got)], s), tok)  # the task's shape
    out.append(np.asarray(r).reshape(len(got), -1).mean(-1))
    if on_chunk is not None:
      on_chunk(np.concatenate(out))
  return np.concatenate(out)
