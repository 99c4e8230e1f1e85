"""experiments/longctx_accuracy.py's sampled rows: R completions per prompt through the RL
sampler, counted per sample and per group (reward variance), on the tiny model."""

import jax
import numpy as np
import pytest

from branch_replay.config import Config
from branch_replay.core import sampler
from branch_replay.data import tasks
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.train import evaluate, state as train_state
from experiments import longctx_accuracy
from experiments.configs import base
from models import transformer as tfm


def test_sampled_counts_samples_and_groups(monkeypatch):
  task_cfg = tasks.TaskConfig(name="needle", prompt_len=480, n_keys=2)
  task = tasks.make(task_cfg)
  cfg = base.config(
    task_cfg,
    model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size),
    train=base.train(eval_size=3),
    sampler=sampler.SamplerConfig(max_new_tokens=task.max_answer_len + 1),
  )
  params = train_state.init_state(Config(model=cfg.model)).params
  examples = evaluate.eval_examples(task, cfg)
  # Rewards by hand: prompt 0 all right, prompt 1 half, prompt 2 none (3 prompts x R=2).
  pattern = {0: [1.0, 1.0], 1: [1.0, 0.0], 2: [0.0, 0.0]}
  seen = []

  def rewards(got, completions):
    assert all(len(c) == 2 for c in completions) and len(completions) == len(got)
    seen.extend(got)
    return np.asarray([pattern[examples.index(e)] for e in got])

  monkeypatch.setattr(task, "rewards", rewards)
  row = longctx_accuracy.sampled(
    cfg, task, TOKENIZER, params, examples, 0.7, samples=2, batch=2, seed=0
  )
  assert seen == examples  # each prompt once, the padded chunk's copy not rewarded
  assert (row["n"], row["samples"], row["correct"]) == (3, 2, 3)
  assert row["accuracy"] == pytest.approx(0.5)
  assert row["informative_frac"] == pytest.approx(1 / 3)
  assert row["prompts_with_any_correct"] == 2
  assert row["ci95_low"] < 0.5 < row["ci95_high"] and row["temperature"] == 0.7
  jax.clear_caches()


def test_progress_lines_resume_their_own_point(tmp_path, capsys):
  """progress_writer appends the rewards so far; resume_point finds the last line of the same
  point (another point's lines and a line cut by a kill are passed over)."""
  path = str(tmp_path / "progress.jsonl")
  key = dict(task="needle", prompt_len=8192, options={"n_keys": 16}, seed=0, n=5, eval_batch=2)
  other = dict(key, prompt_len=4096)
  assert longctx_accuracy.resume_point(path, key) == ([], 0.0)  # no file yet
  on_chunk = longctx_accuracy.progress_writer(path, key, 5, before_s=10.0)
  on_chunk(np.array([1.0, 0.0]))
  on_chunk(np.array([1.0, 0.0, 1.0, 1.0]))
  longctx_accuracy.progress_writer(path, other, 5, before_s=0.0)(np.array([0.0, 0.0]))
  with open(path, "a") as f:
    f.write('{"key": {"task": "needle", "prompt_len": 8192, "opt')  # cut by a kill
  assert "4/5 done, 3 correct" in capsys.readouterr().err
  rewards, seconds = longctx_accuracy.resume_point(path, key)
  assert rewards == [1.0, 0.0, 1.0, 1.0] and seconds >= 10.0
  assert longctx_accuracy.resume_point(path, other)[0] == [0.0, 0.0]
  assert longctx_accuracy.resume_point(path, dict(key, seed=1)) == ([], 0.0)
