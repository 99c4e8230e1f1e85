"""The tree task and trainer: the two-turn task's prompts, answers and rewards; a tiny tree
run end to end (warm-up trees, then sampled 2x2 trees through tree replay) with resume."""

import json
import os

import numpy as np
import pytest

from branch_replay import tasks, tree, tree_train
from branch_replay.config import Config, apply_overrides
from branch_replay.tokenizer import TOKENIZER
from models import transformer as tfm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_turn_task():
  task = tasks.make(tasks.TaskConfig(name="tree_haystack", prompt_len=40, n_keys=3,
                                     sft_prompt_len=20))
  ex = task.sample(np.random.default_rng(0))
  haystack, query = ex.prompt[:-2], ex.prompt[-2:]
  assert len(ex.prompt) == 40 - 1 and query == "?" + ex.key.lower()
  assert haystack.count(ex.key) == 1 and ex.key + ex.value in haystack  # the record `Kv`
  assert task.reward(ex, ex.key, ex.value) == 1.0
  assert task.reward(ex, "", ex.value) == 0.0  # an empty first turn (EOS)
  assert task.reward(ex, ex.key, ex.value + "1") == 0.0
  root, turns = task.supervised(np.random.default_rng(1))
  assert len(turns) == 3
  for q, a, v in turns:
    assert q == "?" + a.lower() and len(a) == 1 and a + v in root
  batch = tree_train.sft_batch(task, np.random.default_rng(2),
                               Config(task=task.cfg, train=Config().train), TOKENIZER)
  tree.validate(batch, TOKENIZER.vocab_size)
  assert batch.fanouts == (3, 1)
  scored = np.asarray(batch.levels[0].scored_BRT)
  assert not scored[..., :2].any() and scored[..., 2:].all()  # `?k` unscored, `K` scored


@pytest.mark.slow  # ~1 min of compiles on an idle 2-core CPU
def test_tree_run_end_to_end(tmp_path):
  cfg = apply_overrides(Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size)), [
      "task.name=tree_haystack", "task.prompt_len=24", "task.n_keys=2",
      "task.sft_prompt_len=16", "tree.fanouts=2x2", "train.sft_steps=2", "train.rl_steps=2",
      "train.batch_size=2", "train.sft_batch_size=2", "train.eval_size=2",
      "train.progress=false", "train.plot=false", "train.checkpoint_every=2"])
  from branch_replay import trainer
  out = trainer.run(cfg, str(tmp_path / "run"))
  records = [json.loads(l) for l in open(out["metrics"])]
  train_recs = [r for r in records if r["kind"] == "train"]
  assert [r["phase"] for r in train_recs] == ["sft", "sft", "rl", "rl"]
  for r in train_recs[2:]:
    assert np.isfinite(r["loss/policy"]) and 0 <= r["reward/mean"] <= 1
    # 2 prompts x (24 root + 2 x 1 first-turn + 4 x 2 second-turn positions); naive: 4 paths
    assert r["replay/computed_tokens"] == 2 * (24 + 2 * 1 + 4 * 2)
    assert r["replay/naive_equiv_tokens"] == 2 * 4 * (24 + 1 + 2)
  assert [r["step"] for r in records if r["kind"] == "eval"] == [2, 4]
  # Resume: a longer run continues from the step-4 checkpoint.
  more = apply_overrides(cfg, ["train.rl_steps=3"])
  trainer.run(more, str(tmp_path / "run"))
  steps = [json.loads(l)["step"] for l in open(out["metrics"]) if '"train"' in l]
  assert steps == [0, 1, 2, 3, 4]
