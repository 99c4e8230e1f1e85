"""The tree task and trainer: the two-turn task's prompts, answers and rewards; a tiny tree
run end to end (warm-up trees, then sampled 2x2 trees through tree replay) with resume."""

import json
import os

import numpy as np
import pytest

from branch_replay import rollout
from branch_replay.data import supervised
from branch_replay.data import tasks
from branch_replay.core import tree
from branch_replay.config import Config, apply_overrides
from branch_replay.data.tokenizer import TOKENIZER
from models import transformer as tfm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_two_turn_task():
  task_cfg = tasks.TaskConfig(name="tree_haystack", prompt_len=40, n_keys=3, sft_prompt_len=20)
  task = tasks.make(task_cfg)
  ex = task.sample(np.random.default_rng(0))
  haystack, query = ex.prompt[:-2], ex.prompt[-2:]
  assert len(ex.prompt) == 40 - 1 and query == "?" + ex.key.lower()
  assert haystack.count(ex.key) == 1 and ex.key + ex.value in haystack  # the record `Kv`
  assert task.reward(ex, (ex.key, ex.value)) == 1.0
  assert task.reward(ex, ("", ex.value)) == 0.0  # an empty first turn (EOS)
  assert task.reward(ex, (ex.key, ex.value + "1")) == 0.0
  root, turns = task.supervised(np.random.default_rng(1))
  assert len(turns) == 3
  for q, a, v in turns:
    assert q == "?" + a.lower() and len(a) == 1 and a + v in root
  batch = supervised.warmup_batch(task, np.random.default_rng(2), 16, TOKENIZER)
  tree.validate(batch, TOKENIZER.vocab_size)
  assert batch.fanouts == (3, 1)
  scored = np.asarray(batch.levels[0].scored_BRT)
  assert not scored[..., :2].any() and scored[..., 2:].all()  # `?k` unscored, `K` scored


@pytest.mark.slow  # ~1 min of compiles on an idle 2-core CPU
def test_tree_run_end_to_end(tmp_path):
  cfg = apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size)),
    [
      "task.name=tree_haystack",
      "task.prompt_len=24",
      "task.n_keys=2",
      "task.sft_prompt_len=16",
      "tree.fanouts=2x2",
      "train.sft_steps=2",
      "train.rl_steps=2",
      "train.batch_size=2",
      "train.sft_batch_size=2",
      "train.eval_size=2",
      "train.progress=false",
      "train.plot=false",
      "train.checkpoint_every=2",
    ],
  )
  from branch_replay.train import trainer

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


def test_tree_overlong_shaping_counts_every_turn_of_the_path():
  """A leaf's length is its ancestors' valid tokens plus its own (a hand loop over paths)."""
  from branch_replay.core import sampler

  rng = np.random.default_rng(0)
  B, lengths = 2, (3, 4)  # fan-outs (2, 3): 2 nodes, then 6
  valid = [
    np.arange(T)[None, None] < rng.integers(0, T + 1, (B, n, 1)) for T, n in zip(lengths, (2, 6))
  ]
  samples = sampler.TreeSamples(
    tuple(np.zeros(v.shape, np.int32) for v in valid),
    tuple(valid),
    tuple(np.zeros(v.shape) for v in valid),
  )
  assert rollout.path_lengths(samples)[1] == sum(lengths)
  got = rollout.overlong(samples, buffer=3, penalty=0.5)
  for b in range(B):
    for leaf in range(6):
      n = valid[0][b, leaf // 3].sum() + valid[1][b, leaf].sum()
      assert got[b, leaf] == pytest.approx(rollout.overlong_penalty(n, 7, 3, 0.5))
  assert got.min() < 0  # the penalty binds somewhere
  assert rollout.overlong(samples, buffer=0, penalty=0.5) == 0.0


def test_tree_dynamic_sampling_and_overlong_shaping(tmp_path, monkeypatch):
  """DAPO on trees: prompts whose leaves' shaped rewards are all equal are replaced by fresh
  prompts' trees; the advantages are the tree-aware ones of the kept prompts' shaped rewards
  (raw reward + the path-length penalty)."""
  from branch_replay.core import advantages
  from branch_replay.train import metrics, trainer

  seen = []
  dynamic_sample = rollout.dynamic_sample
  monkeypatch.setattr(
    rollout, "dynamic_sample", lambda *a: seen.append(dynamic_sample(*a)) or seen[-1]
  )
  advantages_of = []
  levels = advantages.levels
  monkeypatch.setattr(
    advantages,
    "levels",
    lambda name, r, *a, **k: advantages_of.append(r) or levels(name, r, *a, **k),
  )
  cfg = apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size)),
    [
      "task.name=tree_haystack",
      "task.prompt_len=16",
      "task.n_keys=2",
      "tree.fanouts=2x2",
      "train.sft_steps=0",
      "train.rl_steps=1",
      "train.batch_size=2",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "algo.dynamic_sampling=true",
      "algo.max_sample_rounds=3",
      "algo.overlong_buffer=2",
      "sampler.temperature=1.0",
      "algo.advantage=rloo",
    ],
  )
  s = trainer.run(cfg, str(tmp_path / "dapo"))
  (rec,) = [r for r in metrics.read(s["metrics"]) if r.get("kind") == "train"]
  ((rows, rewards_BR, stats),) = seen
  assert 1 <= rec["dapo/rounds"] == stats["dapo/rounds"] <= 3
  np.testing.assert_array_equal(advantages_of[-1], rewards_BR)  # shaped, kept first
  informative = rewards_BR.max(1) > rewards_BR.min(1)
  assert rec["dapo/kept_frac"] == pytest.approx(informative.mean())
  assert list(informative) == sorted(informative, reverse=True)  # kept prompts come first
  penalty = rewards_BR - rows["raw_BR"]
  assert np.all(penalty <= 0) and penalty.min() < 0  # untrained turns run long: shaped
  assert rec["reward/shaped_mean"] == pytest.approx(float(rewards_BR.mean()), abs=1e-6)
  assert rec["reward/mean"] == pytest.approx(float(rows["raw_BR"].mean()), abs=1e-6)


def test_tree_reward_within_the_time_limit():
  """A tree task's per-leaf reward runs under train.reward_timeout_s too: the same values as
  without a limit; one that hangs stops naming the example and leaf."""
  import time
  from types import SimpleNamespace

  from branch_replay.data import rewards

  task_cfg = tasks.TaskConfig(name="tree_haystack", prompt_len=40, n_keys=3, sft_prompt_len=20)
  task = tasks.make(task_cfg)
  rng = np.random.default_rng(0)
  examples = [task.sample(rng) for _ in range(2)]
  enc = lambda s: [TOKENIZER.encode(ch)[-1] for ch in s]
  # Turn 1 per (example, branch) [B, 2, 1], turn 2 per leaf [B, 4, T2] (2 x 2 tree).
  t1 = np.asarray([[enc(ex.key), enc("Z")] for ex in examples])
  t2 = np.asarray(
    [[enc(ex.value), enc("0" * len(ex.value)), enc(ex.value), enc(ex.value)] for ex in examples]
  )
  samples = SimpleNamespace(tokens=(t1, t2))
  plain = task.leaf_rewards(examples, samples)
  expected = [[1.0, float(ex.value == "0" * len(ex.value)), 0.0, 0.0] for ex in examples]
  np.testing.assert_array_equal(plain, np.asarray(expected, np.float32))
  with rewards.time_limit(5.0):
    np.testing.assert_array_equal(task.leaf_rewards(examples, samples), plain)

  class Hangs(type(task)):
    def reward(self, example, turns):
      if example is examples[1] and turns[0] == "Z":
        time.sleep(2.0)
      return super().reward(example, turns)

  hangs = Hangs(task_cfg)
  with rewards.time_limit(0.3):
    with pytest.raises(
      rewards.RewardTimeout,
      match=r"task Hangs's reward on 8 leaves did not "
      r"return within train.reward_timeout_s=0.3 s; example 1 leaf 2 ",
    ):
      hangs.leaf_rewards(examples, samples)
