"""DPO end to end: preference pairs from the task and from JSON lines, reference log-probs
through the shared prefix, metrics, and the bad-input paths."""

import json

import jax
import numpy as np
import pytest

from branch_replay.data import dpo, tasks
from branch_replay.core import engine, sampler
from branch_replay.train import metrics
from branch_replay.train import trainer
from models import transformer as tfm
from helpers import tiny_run, tiny_tree_run


DPO_RUN = (
  "algo.name=dpo",
  "loss.name=dpo",
  "train.sft_steps=1",
  "train.rl_steps=3",
  "train.batch_size=2",
  "train.sft_batch_size=2",
  "train.checkpoint_every=2",
  "train.learning_rate=1e-2",
)


def tiny(*overrides):
  return tiny_run("train.n_branches=2", *DPO_RUN, *overrides)


def test_dpo_run_end_to_end_and_resume(tmp_path):
  s = trainer.run(tiny(), str(tmp_path / "a"))
  recs = [r for r in metrics.read(s["metrics"]) if r.get("phase") == "dpo"]
  assert len(recs) == 3
  for k in ("dpo/accuracy", "dpo/margin", "rewards/chosen", "rewards/rejected", "loss/policy"):
    assert all(np.isfinite(r[k]) for r in recs), k
  # The first step's policy is the reference: margin 0, loss log 2 per pair.
  assert recs[0]["dpo/margin"] == 0.0 and recs[0]["loss/policy"] == pytest.approx(
    2 * np.log(2), rel=1e-5
  )
  assert recs[-1]["dpo/margin"] > 0  # the updates separate chosen from rejected
  s2 = trainer.run(tiny("train.rl_steps=4"), str(tmp_path / "a"))  # resume restores the ref
  assert len([r for r in metrics.read(s2["metrics"]) if r.get("phase") == "dpo"]) == 4


def test_pairs_from_jsonl(tmp_path):
  path = tmp_path / "pairs.jsonl"
  rows = [
    {"prompt": "ab.K3?K", "chosen": "3", "rejected": "4"},
    {"prompt": "x", "chosen": "12", "rejected": "7"},
  ]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  pairs = dpo.load_pairs(str(path))
  assert pairs[1] == dpo.Pair("x", "12", "7")
  batch = dpo.make_batch(pairs, 8, 2)
  assert batch.leaves.tokens_BRT.shape == (2, 2, 3)
  np.testing.assert_array_equal(batch.leaves.valid_BRT[1], [[1, 1, 1], [1, 1, 0]])


@pytest.mark.slow
def test_dpo_run_from_jsonl(tmp_path):
  path = tmp_path / "pairs.jsonl"
  rows = [
    {"prompt": "ab.K3?K", "chosen": "3", "rejected": "4"},
    {"prompt": "x", "chosen": "12", "rejected": "7"},
  ]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  s = trainer.run(tiny(f"algo.pairs_file={path}", "train.rl_steps=1"), str(tmp_path / "run"))
  assert s["steps"] == 2


@pytest.mark.parametrize(
  "lines, match",
  [
    (
      ['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": "b"}'],
      r"pairs.jsonl:2: field 'rejected' missing",
    ),
    (['{"prompt": "a", "chosen": 3, "rejected": "c"}'], r":1: field 'chosen' missing or not a"),
    (["not json"], r":1: not valid JSON"),
    (['["a", "b"]'], r":1: expected a JSON object, got list"),
    ([], r"no preference pairs"),
  ],
)
def test_bad_pairs_file_names_the_line(tmp_path, lines, match):
  path = tmp_path / "pairs.jsonl"
  path.write_text("\n".join(lines))
  with pytest.raises(ValueError, match=match):
    dpo.load_pairs(str(path))


@pytest.mark.parametrize(
  "overrides, match",
  [
    (["train.n_branches=3"], r"train.n_branches=3: DPO trains on \(chosen, rejected\) pairs"),
    (["algo.pairs_file=/nonexistent.jsonl"], r"algo.pairs_file='/nonexistent.jsonl': no such"),
    (
      ["algo.ppo_epochs=2"],
      r"unknown field 'ppo_epochs' of algo \(an option of algo.name='grpo' or 'ppo'",
    ),
  ],
)
def test_bad_dpo_config(overrides, match):
  with pytest.raises(ValueError, match=match):
    tiny(*overrides)


def tiny_tree(*overrides):
  return tiny_tree_run(*DPO_RUN, *overrides)


def test_dpo_on_trees_end_to_end(tmp_path):
  """DPO on preference trees (haystack -> one opening per record -> (chosen, rejected)): the
  first step's policy is the reference (margin 0, log 2 per pair: B x records pairs), and the
  updates separate chosen from rejected."""
  s = trainer.run(tiny_tree(), str(tmp_path / "run"))
  recs = [r for r in metrics.read(s["metrics"]) if r.get("phase") == "dpo"]
  assert len(recs) == 3
  assert recs[0]["dpo/margin"] == 0.0 and recs[0]["loss/policy"] == pytest.approx(
    2 * 2 * np.log(2), rel=1e-5
  )
  assert recs[-1]["dpo/margin"] > 0
  assert recs[0]["replay/prefix_tokens"] < recs[0]["replay/naive_equiv_tokens"]


def test_preference_tree_scores_equal_its_flat_pairs():
  """The tree layout means the flat pairs (prefix = haystack + opening, tails = chosen,
  rejected): the leaves' log-probs through the tree equal the tails' through the flat batch."""
  cfg = tiny_tree()
  task = tasks.make(cfg.task)
  batch = task.preference_trees(np.random.default_rng(3), 2)
  assert batch.fanouts == (2, 2)
  tok = tasks.TOKENIZER
  root = [
    tok.decode(row[valid], strict=False)
    for row, valid in zip(np.asarray(batch.root_BP), np.asarray(batch.root_valid_BP))
  ]
  texts = lambda level: [
    [tok.decode(r[v], strict=False) for r, v in zip(rows, valid)]
    for rows, valid in zip(np.asarray(level.tokens_BRT), np.asarray(level.valid_BRT))
  ]
  openings, answers = texts(batch.levels[0]), texts(batch.levels[1])
  pairs = [
    dpo.Pair(root[b] + openings[b][r], answers[b][2 * r], answers[b][2 * r + 1])
    for b in range(2)
    for r in range(2)
  ]
  assert all(p.chosen != p.rejected for p in pairs)
  flat = dpo.make_batch(pairs, task.sft_prompt_len + 4, cfg.task.value_len, tok)
  params = tfm.init_params(cfg.model, jax.random.key(0))
  (_, tree_leaf_BRT), _ = engine.forward(params, batch, cfg.model)
  flat_BRT, _ = sampler.score(params, cfg.model, flat)
  np.testing.assert_allclose(
    np.asarray(tree_leaf_BRT).reshape(4, 2, -1), np.asarray(flat_BRT), rtol=1e-5, atol=1e-6
  )


def test_dpo_on_trees_refuses_what_it_cannot_pair(tmp_path):
  with pytest.raises(
    ValueError,
    match=r"tree.fanouts='2x3' with algo.name='dpo': DPO pairs the "
    r"last level's siblings",
  ):
    tiny_tree("tree.fanouts=2x3")
  pairs = tmp_path / "p.jsonl"
  pairs.write_text('{"prompt": "a", "chosen": "1", "rejected": "2"}\n')
  with pytest.raises(ValueError, match=r"algo.pairs_file=.* with tree.fanouts='2x2'"):
    tiny_tree(f"algo.pairs_file={pairs}")
  with pytest.raises(
    ValueError,
    match=r"tree.fanouts='3x2' with algo.name='dpo': the preference trees of task "
    r"'tree_haystack' have fan-outs \(2, 2\).*expected '2x2'",
  ):
    trainer.run(tiny_tree("tree.fanouts=3x2"), str(tmp_path / "w"))


def test_dpo_cannot_stream():
  with pytest.raises(ValueError, match=r"replay.branch_chunk=1 with loss.name='dpo': streaming"):
    tiny("replay.branch_chunk=1")
