"""train/summary.py: one summary schema for every algorithm, from metrics records alone.

Checked against hand-computed values on written records, against the summaries committed in
results files before the schema (the GRPO summary of the default run and of the SmolLM2 math
run: the same numbers under the new keys), and across every registered algorithm (the same
keys whatever the phase and metrics)."""

import json
import os

import numpy as np
import pytest

from branch_replay import registry
from branch_replay.core import critic
from branch_replay.train import phases, summary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(warmup=3, steps=8, eval_counts=False):
  """`warmup` sft steps, then `steps` rl steps with rewards 0, 1/8, ..., evaluations at the
  phase boundary and after the last step (and one in between that the summary ignores)."""
  recs = []
  for s in range(warmup):
    recs.append(
      {"kind": "train", "phase": "sft", "step": s, "loss/policy": 3.0 - s, "time/step_s": 1.0}
      | {"replay/computed_tokens": 10, "replay/naive_equiv_tokens": 10}
      | {f"time/{p}_s": 0.0 for p in phases.PHASES}
    )
  for i in range(steps):
    recs.append(
      {"kind": "train", "phase": "rl", "step": warmup + i, "reward/mean": i / 8}
      | {"loss/policy": float(-i), "time/step_s": 2.0 + i}
      | {"replay/computed_tokens": 5, "replay/naive_equiv_tokens": 20}
      | {f"time/{p}_s": 0.5 for p in phases.PHASES}
    )
  for step, reward in ((warmup, 0.25), (warmup + 4, 0.4), (warmup + steps, 0.75)):
    rec = {"kind": "eval", "step": step, "eval/greedy_reward": reward}
    if eval_counts:
      rec |= {"eval/n": 4, "eval/correct": int(4 * reward), "eval/ci95_low": reward - 0.2}
      rec |= {"eval/ci95_high": reward + 0.2}
    recs.append(rec)
  return recs


def test_the_schema_on_hand_computed_records():
  s = summary.summarize(_records(), "rl", ("reward/mean", "loss/policy"))
  assert (s["phase"], s["steps"], s["phase_steps"], s["window"]) == ("rl", 11, 8, 2)
  assert s["first"] == {"reward/mean": (0 + 1 / 8) / 2, "loss/policy": -0.5}
  assert s["last"] == {"reward/mean": (6 / 8 + 7 / 8) / 2, "loss/policy": -6.5}
  assert (s["eval_before"], s["eval_after"]) == (0.25, 0.75)  # not the one at step 7
  assert s["eval_before_n"] is None and s["eval_after_interval_above_before"] is None
  assert (s["computed_tokens"], s["naive_equiv_tokens"]) == (3 * 10 + 8 * 5, 3 * 10 + 8 * 20)
  assert (s["phase_computed_tokens"], s["phase_naive_equiv_tokens"]) == (40, 160)
  assert s["train_time_s"] == 3 * 1.0 + sum(2.0 + i for i in range(8))
  assert s["median_phase_step_s"] == 5.5  # median of 2..9
  assert s["time_by_phase"] == dict.fromkeys(phases.PHASES, 8 * 0.5)  # warm-up excluded
  json.dumps(s)  # a summary line of a results file


def test_accuracy_counts_and_the_interval_comparison():
  s = summary.summarize(_records(eval_counts=True), "rl", ("reward/mean",))
  assert (s["eval_before_n"], s["eval_before_correct"]) == (4, 1)
  assert s["eval_before_ci95"] == pytest.approx([0.05, 0.45])
  assert (s["eval_after_n"], s["eval_after_correct"]) == (4, 3)
  assert s["eval_after_ci95"] == pytest.approx([0.55, 0.95])
  assert s["eval_after_interval_above_before"] is True  # 0.55 > 0.45
  recs = _records(eval_counts=True)
  recs[-1]["eval/ci95_low"] = 0.45  # touching intervals: not above
  assert summary.summarize(recs, "rl", ())["eval_after_interval_above_before"] is False
  text = summary.render(s)
  assert "greedy eval reward before/after RL: 0.250 (1/4, 95% [0.050, 0.450]) -> 0.750" in text


def test_the_window_is_a_quarter_of_the_phase_between_1_and_10():
  assert [summary.window([0] * n) for n in (0, 3, 4, 8, 40, 41, 400)] == [1, 1, 1, 2, 10, 10, 10]
  s = summary.summarize(_records(steps=1), "rl", ("reward/mean",))
  assert s["window"] == 1 and s["first"] == s["last"] == {"reward/mean": 0.0}


def test_a_pooled_metric_pools_its_window_and_a_missing_one_is_nan():
  recs = _records()
  for i, r in enumerate(r for r in recs if r.get("phase") == "rl"):
    r |= {"value/tokens": 4, "value/sq_err": 0.1 * i, "value/return_var": 1.0}
    r |= {"value/return_mean": float(i % 2)}
  rl = [r for r in recs if r.get("phase") == "rl"]
  pooled = ("value/explained_variance", critic.pooled_explained_variance)
  s = summary.summarize(recs, "rl", (pooled, "no/such"))
  assert s["first"]["value/explained_variance"] == critic.pooled_explained_variance(rl[:2])
  assert s["last"]["value/explained_variance"] == critic.pooled_explained_variance(rl[-2:])
  assert np.isnan(s["first"]["no/such"]) and "no/such (first/last 2 RL steps): n/a" in (
    summary.render(s)
  )
  with pytest.raises(ValueError, match="expected a record key or"):
    summary.summarize(recs, "rl", (("value/ev", "not callable"),))


def test_a_run_without_its_phase_has_none_and_renders():
  s = summary.summarize(_records(steps=0)[:3], "rl", ("reward/mean",))
  assert (s["steps"], s["phase_steps"], s["eval_before"], s["median_phase_step_s"]) == (
    3,
    0,
    None,
    None,
  )
  assert np.isnan(s["first"]["reward/mean"])
  assert "time by phase" not in summary.render(s)  # no phase step timed
  assert "3 steps (0 RL)" in summary.render(s)


def test_every_registered_algorithm_has_the_same_keys():
  keys = None
  for name in sorted(registry.ALGORITHMS):
    cls = registry.get(name)
    recs = _records()
    for r in recs:
      if r.get("phase") == "rl":
        r["phase"] = cls.phase
    s = summary.summarize(recs, cls.phase, cls.summary_metrics)
    assert keys is None or set(s) == keys, name
    keys = set(s)
    assert set(s["first"]) == {m if isinstance(m, str) else m[0] for m in cls.summary_metrics}
    assert s["phase_steps"] == (8 if cls.phase != "sft" else 11), name
    assert s["time_by_phase"]["update"] == 4.0, name  # SFT's own steps too (0 s in warm-up)
    text = summary.render({**s, "wall_s": 12.0, "metrics": "/x/metrics.jsonl"})
    assert "token positions computed" in text and "metrics: /x/metrics.jsonl" in text, name


@pytest.mark.parametrize(
  "name", ["default_run_7366ed7_2026-12-06.jsonl", "math_smollm2_2026-12-04.jsonl"]
)
def test_the_legacy_grpo_summaries_of_committed_results_files(name):
  """The summary lines written by the GRPO summary before this schema, recomputed from the
  same files' records: every number the same under its new key."""
  with open(os.path.join(ROOT, "experiments", "results", name)) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  old = rows[-1]
  assert old["kind"] == "summary" and "reward_before" in old
  records = [r for r in rows if r.get("kind") in ("train", "eval")]
  new = summary.summarize(records, "rl", registry.get("grpo").summary_metrics)
  pairs = {
    "reward_before": new["first"]["reward/mean"],
    "reward_after": new["last"]["reward/mean"],
    "reward_window": new["window"],
    "rl_steps": new["phase_steps"],
    "rl_computed_tokens": new["phase_computed_tokens"],
    "rl_naive_equiv_tokens": new["phase_naive_equiv_tokens"],
    "median_rl_step_s": new["median_phase_step_s"],
  }
  same = ("steps", "eval_before", "eval_after", "computed_tokens", "naive_equiv_tokens")
  same += ("train_time_s", "time_by_phase")
  pairs |= {k: new[k] for k in same}
  for key in ("n", "correct", "ci95"):
    for when in ("before", "after"):
      if f"eval_{when}_{key}" in old:
        pairs[f"eval_{when}_{key}"] = new[f"eval_{when}_{key}"]
  if "eval_after_interval_above_before" in old:
    pairs["eval_after_interval_above_before"] = new["eval_after_interval_above_before"]
  assert {k: old[k] for k in pairs} == pairs
