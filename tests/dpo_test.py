"""DPO end to end: preference pairs from the task and from JSON lines, reference log-probs
through the shared prefix, metrics, and the bad-input paths."""

import json

import numpy as np
import pytest

from branch_replay import dpo, metrics
from branch_replay import trainer
from branch_replay.config import Config, apply_overrides
from models import transformer as tfm


def tiny(*overrides):
  return apply_overrides(Config(model=tfm.preset("tiny")), [
      "train.n_branches=2", "loss.name=dpo", "task.prompt_len=20", "task.n_keys=2",
      "train.sft_steps=1",
      "train.rl_steps=3", "train.batch_size=2", "train.sft_batch_size=2",
      "train.eval_size=0", "train.progress=false", "train.plot=false",
      "train.checkpoint_every=2", "train.learning_rate=1e-2", *overrides])


def test_dpo_run_end_to_end_and_resume(tmp_path):
  s = trainer.run(tiny(), str(tmp_path / "a"))
  recs = [r for r in metrics.read(s["metrics"]) if r.get("phase") == "dpo"]
  assert len(recs) == 3
  for k in ("dpo/accuracy", "dpo/margin", "rewards/chosen", "rewards/rejected", "loss/policy"):
    assert all(np.isfinite(r[k]) for r in recs), k
  # The first step's policy is the reference: margin 0, loss log 2 per pair.
  assert recs[0]["dpo/margin"] == 0.0 and recs[0]["loss/policy"] == pytest.approx(
      2 * np.log(2), rel=1e-5)
  assert recs[-1]["dpo/margin"] > 0  # the updates separate chosen from rejected
  s2 = trainer.run(tiny("train.rl_steps=4"), str(tmp_path / "a"))  # resume restores the ref
  assert len([r for r in metrics.read(s2["metrics"]) if r.get("phase") == "dpo"]) == 4


def test_pairs_from_jsonl(tmp_path):
  path = tmp_path / "pairs.jsonl"
  rows = [{"prompt": "ab.K3?K", "chosen": "3", "rejected": "4"},
          {"prompt": "x", "chosen": "12", "rejected": "7"}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  pairs = dpo.load_pairs(str(path))
  assert pairs[1] == dpo.Pair("x", "12", "7")
  batch = dpo.make_batch(pairs, 8, 2)
  assert batch.tails_BRT.shape == (2, 2, 3)
  np.testing.assert_array_equal(batch.tail_valid_BRT[1], [[1, 1, 1], [1, 1, 0]])


@pytest.mark.slow
def test_dpo_run_from_jsonl(tmp_path):
  path = tmp_path / "pairs.jsonl"
  rows = [{"prompt": "ab.K3?K", "chosen": "3", "rejected": "4"},
          {"prompt": "x", "chosen": "12", "rejected": "7"}]
  path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
  s = trainer.run(tiny(f"dpo.pairs_file={path}", "train.rl_steps=1"), str(tmp_path / "run"))
  assert s["steps"] == 2


@pytest.mark.parametrize("lines, match", [
    (['{"prompt": "a", "chosen": "b", "rejected": "c"}', '{"prompt": "a", "chosen": "b"}'],
     r"pairs.jsonl:2: field 'rejected' missing"),
    (['{"prompt": "a", "chosen": 3, "rejected": "c"}'], r":1: field 'chosen' missing or not a"),
    (["not json"], r":1: not valid JSON"),
    (['["a", "b"]'], r":1: expected a JSON object, got list"),
    ([], r"no preference pairs"),
])
def test_bad_pairs_file_names_the_line(tmp_path, lines, match):
  path = tmp_path / "pairs.jsonl"
  path.write_text("\n".join(lines))
  with pytest.raises(ValueError, match=match):
    dpo.load_pairs(str(path))


@pytest.mark.parametrize("overrides, match", [
    (["train.n_branches=3"], r"train.n_branches=3: DPO trains on \(chosen, rejected\) pairs"),
    (["dpo.pairs_file=/nonexistent.jsonl"], r"dpo.pairs_file='/nonexistent.jsonl': no such"),
    (["train.ppo_epochs=2"], r"do not apply to preference pairs"),
])
def test_bad_dpo_config(overrides, match):
  with pytest.raises(ValueError, match=match):
    tiny(*overrides)
