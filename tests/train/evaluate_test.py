"""train/evaluate.py: the one greedy evaluation, per prompt, for flat groups and trees; chunks
of train.eval_batch give each prompt the same answer as one call (one padded shape)."""

import dataclasses

import numpy as np
import pytest

from branch_replay import rollout
from branch_replay.data import tasks
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.train import evaluate, runtime
from branch_replay.train import state as train_state
from helpers import tiny_run, tiny_tree_run


def _rewards(cfg, eval_batch, shared_prefix=False, **kw):
  """Each prompt's 'reward': a fingerprint of its greedy tokens (the tasks' own rewards of an
  untrained model are mostly 0, which would hide a prompt given another's answer)."""
  train = dataclasses.replace(cfg.train, eval_batch=eval_batch, eval_shared_prefix=shared_prefix)
  cfg = dataclasses.replace(cfg, train=train)
  task = tasks.make(cfg.task)
  fingerprint = lambda ids: float(sum((i + 1) * int(t) for i, t in enumerate(np.ravel(ids))))
  task.rewards = lambda got, completions: np.asarray(
    [[fingerprint([ord(ch) for ch in c]) for c in cs] for cs in completions]
  )
  if cfg.tree.fanouts:  # a flat task's leaf_rewards are its rewards of the completions
    task.leaf_rewards = lambda got, s, tok: np.asarray(
      [
        [fingerprint(np.concatenate([np.ravel(np.asarray(x)[b]) for x in s.tokens]))]
        for b in range(len(got))
      ]
    )
  fns = rollout.compiled(runtime.Runtime(cfg, TOKENIZER), task)
  params = train_state.init_state(cfg).params
  examples = evaluate.eval_examples(task, cfg)
  got = evaluate.greedy_rewards(fns, params, task, examples, cfg, TOKENIZER, **kw)
  return got


@pytest.mark.parametrize("run", [tiny_run, tiny_tree_run], ids=["flat", "tree"])
def test_per_prompt_and_chunks_equal_one_call(run):
  cfg = run("train.eval_size=5", "sampler.max_new_tokens=3")
  whole = _rewards(cfg, 0)
  assert whole.shape == (5,)  # one reward per prompt (a tree: its one greedy path's)
  assert len(set(whole)) > 1  # the prompts' answers differ: the comparison can fail
  np.testing.assert_array_equal(_rewards(cfg, 2), whole)  # chunks 2, 2, 1 (+1 padding)


@pytest.mark.parametrize("run", [tiny_run, tiny_tree_run], ids=["flat", "tree"])
def test_a_shared_header_prefilled_once_gives_every_prompt_its_answer(run):
  """train.eval_shared_prefix, flat and trees: the ids every prompt starts with prefilled once,
  in chunks or in one call, answer as the full prompts do."""
  cfg = run("train.eval_size=5", "sampler.max_new_tokens=3")
  whole = _rewards(cfg, 0)
  np.testing.assert_array_equal(_rewards(cfg, 0, shared_prefix=True), whole)
  np.testing.assert_array_equal(_rewards(cfg, 2, shared_prefix=True), whole)


def test_progress_per_chunk_and_a_resumed_evaluation_equal_one_call():
  """on_chunk sees the rewards so far after every chunk; `done` (a stopped run's rewards)
  skips those prompts, and the rest answer as in one call, from any resume point."""
  cfg = tiny_run("train.eval_size=5", "sampler.max_new_tokens=3")
  seen = []
  whole = _rewards(cfg, 2, on_chunk=lambda r: seen.append(np.array(r)))
  assert [len(r) for r in seen] == [2, 4, 5]
  for r in seen:
    np.testing.assert_array_equal(r, whole[: len(r)])
  for k in (2, 3):  # on a chunk boundary and off it
    np.testing.assert_array_equal(_rewards(cfg, 2, done=whole[:k]), whole)
  # the done prompts are skipped, not recomputed: their given rewards come back as they are
  marked = _rewards(cfg, 2, done=np.full(2, -1.0))
  np.testing.assert_array_equal(marked, np.concatenate([[-1.0, -1.0], whole[2:]]))
  with pytest.raises(ValueError, match="done: 6 rewards"):
    _rewards(cfg, 2, done=np.zeros(6))
