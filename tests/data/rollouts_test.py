"""Rollouts from a file: bad lines fail naming file:line and the field before any compute;
a tiny run trains on epochs of the file (recording our scoring where logprobs are absent),
resumes mid-file exactly, and logs the step's time by phase and the tree's ratio."""

import json
import os

import jax
import numpy as np
import pytest

from branch_replay.train import metrics, trainer
from branch_replay.data import tasks
from branch_replay.config import Config, apply_overrides
from branch_replay.data.tasks import TaskConfig
from branch_replay.data.tokenizer import TOKENIZER
from models import transformer as tfm

GOOD = {"prompt": "ab=", "responses": ["cba", "cbd", "xy", "cbaa"], "rewards": [1, 0, 0, 0.5]}


def write(path, lines):
  path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
  return str(path)


def make(path, **options):
  return tasks.make(TaskConfig(name="rollouts", path=path, **options), TOKENIZER)


BAD = [
  ({"responses": ["a"], "rewards": [1]}, "missing field 'prompt'"),
  ({"prompt": "a", "rewards": [1]}, "missing field 'responses'"),
  ({"prompt": "a", "responses": ["a"]}, "missing field 'rewards'"),
  ({**GOOD, "rewards": [1, 0, 0]}, "field 'rewards' has 3 entries, expected 4"),
  ({**GOOD, "rewards": [1, 0, float("nan"), 0]}, "field 'rewards' holds a non-finite"),
  ({**GOOD, "responses": ["cba", "", "xy", "c"]}, "field 'responses'[1] is empty"),
  ({**GOOD, "responses": [[5, 6], [], [7], [8]]}, "field 'responses'[1] is empty"),
  (
    {**GOOD, "logprobs": [[-1.0] * 4, [-1.0] * 3, [-1.0] * 3, [-1.0] * 5]},
    "field 'logprobs'[1] (the tokenized response, EOS included) has 3 entries, expected 4",
  ),
  ({**GOOD, "turns": [[0] * 4, [0] * 4, [1] * 3, [0] * 5]}, "field 'turns'[2]: every token"),
  ({**GOOD, "responses": [[5, 6], [10**6], [7], [8]]}, "field 'responses'[1]: token ids"),
  ("{not json", "not valid JSON"),
]


@pytest.mark.parametrize("line,message", BAD)
def test_bad_line_names_file_line_and_field(tmp_path, line, message):
  path = write(tmp_path / "r.jsonl", [GOOD, line])
  with pytest.raises(ValueError) as e:
    make(path)
  assert f"{path}:2: " in str(e.value) and message in str(e.value), str(e.value)


def test_lines_tokenized_as_the_sampler_stops(tmp_path):
  path = write(
    tmp_path / "r.jsonl",
    [GOOD, {**GOOD, "responses": [[5, 6], [5, 7], [9], [4]], "prompt": [1, 8, 9]}],
  )
  task = make(path)
  text, ids = task.lines
  assert list(text.prompt_ids) == TOKENIZER.encode("ab=", bos=True)
  assert list(text.responses[0]) == TOKENIZER.encode("cba", eos=True)  # EOS kept, as sampled
  assert list(ids.responses[1]) == [5, 7] and list(ids.prompt_ids) == [1, 8, 9]
  assert list(make(path, stop="none").lines[0].responses[0]) == TOKENIZER.encode("cba")
  other = write(tmp_path / "s.jsonl", [GOOD, {**GOOD, "responses": ["a", "b"], "rewards": [0, 1]}])
  with pytest.raises(ValueError) as e:
    make(other)
  assert f"{other}:2: field 'responses' has 2 entries, expected 4" in str(e.value)


def lines(n=4):
  rng = np.random.default_rng(0)
  out = []
  for i in range(n):
    opening = "".join(rng.choice(list("abcdef"), 5))
    rs = [opening + "".join(rng.choice(list("xyz"), rng.integers(1, 4))) for _ in range(4)]
    line = {"prompt": f"q{i}=", "responses": rs, "rewards": rng.normal(size=4).tolist()}
    if i % 2:  # half the lines carry behaviour log-probs, half are scored by us
      # A sampler's log-probs depend on the prefix only: shared openings agree.
      line["logprobs"] = [
        [-0.1 - (sum(map(ord, (r + "$")[: t + 1])) * 7919 % 97) / 40 for t in range(len(r) + 1)]
        for r in rs
      ]
    out.append(line)
  return out


def config(path, *overrides):
  return apply_overrides(
    Config(model=tfm.preset("tiny")),
    [
      "algo.name=rollouts",
      "task.name=rollouts",
      f"task.path={path}",
      "task.epochs=2",
      "train.batch_size=2",
      "train.sft_steps=0",
      "train.rl_steps=100",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "train.tensorboard=false",
      "train.checkpoint_every=1",
      "algo.ppo_epochs=2",
      "loss.kl_coef=0.05",
      *overrides,
    ],
  )


def _records(workdir):
  return [
    r for r in metrics.read(os.path.join(workdir, "metrics.jsonl")) if r.get("kind") == "train"
  ]


def test_rollouts_run_epochs_resume_and_phases(tmp_path):
  path = write(tmp_path / "r.jsonl", lines())
  full = trainer.run(config(path, "replay.verify=first"), str(tmp_path / "full"))
  recs = _records(full["workdir"])
  assert [(r["step"], r["epoch"]) for r in recs] == [(0, 0), (1, 0), (2, 1), (3, 1)]
  for r in recs:
    for phase in ("sample", "reward", "old_logp", "ref_logp", "update"):
      assert r[f"time/{phase}_s"] >= 0.0
    assert r["replay/trunk_len"] >= 5 and r["replay/tree_token_ratio"] > 1
    assert np.isfinite(r["loss/policy"])
  assert recs[0]["verify/max_rel_err"] < 2e-3 and recs[0]["time/verify_s"] > 0
  assert "verify/max_rel_err" not in recs[1]
  # Lines without logprobs (0 and 2) were scored once, before their first update.
  with open(os.path.join(full["workdir"], "recorded_logprobs.jsonl")) as f:
    recorded = [json.loads(l)["source"] for l in f]
  assert recorded == [f"{path}:1", f"{path}:3"]
  # Stopped after step 1 (mid-epoch), resumed: the same steps, the same parameters.
  workdir = str(tmp_path / "resumed")
  trainer.run(config(path, "train.rl_steps=1"), workdir)
  resumed = trainer.run(config(path), workdir)
  assert [r["step"] for r in _records(workdir)] == [0, 1, 2, 3]
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
    full["final_params"],
    resumed["final_params"],
  )
  strip = lambda rs: [
    {k: v for k, v in r.items() if not k.startswith(("time/", "verify/"))} for r in rs
  ]
  assert strip(_records(workdir)) == strip(recs)


def test_rollouts_config_selects_the_rollouts_algorithm(tmp_path):
  """run.py hands trainer.run the algorithm the config selects: a rollouts task gets the
  rollouts algorithm (no sampling), whatever the loss."""
  from branch_replay import algorithms

  path = write(tmp_path / "r.jsonl", lines())
  for loss in ("grpo", "ppo", "pg"):
    cfg = config(path, f"loss.name={loss}")
    assert algorithms.for_config(cfg).__name__ == "Rollouts"
  with pytest.raises(ValueError, match=r"train.sft_steps=2: expected 0"):
    trainer.run(config(path, "train.sft_steps=2"), str(tmp_path / "w"))
