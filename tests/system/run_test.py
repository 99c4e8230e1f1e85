"""The trainer end to end on a tiny model: a 3-step run, resume == uninterrupted, replay ==
naive, determinism, and the bad-input paths (workdir, incompatible checkpoint, CLI; the NaN
stop: tests/train/trainer_test.py)."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from branch_replay.train import metrics, summary, trainer
from branch_replay.config import apply_overrides
from helpers import short_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED = (
  "step",
  "reward/mean",
  "reward/std",
  "loss/policy",
  "kl",
  "entropy",
  "grad/norm",
  "replay/prefix_tokens",
  "replay/tail_tokens",
  "replay/naive_equiv_tokens",
  "time/step_s",
  "time/sample_s",
)


def _train_records(workdir):
  return [
    r for r in metrics.read(os.path.join(workdir, "metrics.jsonl")) if r.get("kind") == "train"
  ]


def _untimed(records):
  return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in records]


def test_three_step_run_end_to_end_and_same_seed_same_metrics(tmp_path):
  cfg = short_run(
    "train.eval_size=4",
    "train.plot=true",
    "loss.kl_coef=0.05",
    "train.checkpoint_every=2",
    "sampler.trunk_len=1",
  )
  s = trainer.run(cfg, str(tmp_path / "a"))
  recs = _train_records(s["workdir"])
  assert [r["step"] for r in recs] == [0, 1, 2]
  assert [r["phase"] for r in recs] == ["sft", "rl", "rl"]
  for r in recs[1:]:
    assert all(k in r for k in REQUIRED), sorted(r)
    assert 0.0 <= r["reward/mean"] <= 1.0 and np.isfinite(r["loss/policy"])
    # B*P prefix positions + B*R*T tail positions vs B*R*(P+T) for the naive twin.
    P = 20 + 1  # prompt + trunk
    assert (r["replay/prefix_tokens"], r["replay/tail_tokens"], r["replay/naive_equiv_tokens"]) == (
      2 * P,
      2 * 4 * 2,
      2 * 4 * (P + 2),
    )
  evals = [r for r in metrics.read(s["metrics"]) if r.get("kind") == "eval"]
  assert [r["step"] for r in evals] == [1, 3]
  assert sorted(os.listdir(s["checkpoint"])) == ["2", "3"]
  assert os.path.getsize(s["plot"]) > 1000
  assert "token positions computed" in summary.render(s)
  # The same seed in a fresh workdir gives the same metrics.
  s2 = trainer.run(cfg, str(tmp_path / "b"))
  assert _untimed(_train_records(s2["workdir"])) == _untimed(recs)
  # A different seed does not.
  s3 = trainer.run(apply_overrides(cfg, ["train.seed=1"]), str(tmp_path / "c"))
  assert _untimed(_train_records(s3["workdir"])) != _untimed(recs)


@pytest.mark.slow  # 89 s; trainer_test checks the loop resumes
def test_resume_equals_uninterrupted(tmp_path):
  full = trainer.run(short_run("train.rl_steps=3"), str(tmp_path / "full"))
  workdir = str(tmp_path / "resumed")
  trainer.run(short_run("train.rl_steps=1"), workdir)  # stops after step 2 (checkpoint 2)
  resumed = trainer.run(short_run("train.rl_steps=3"), workdir)  # restores 2, runs 2, 3
  recs = _train_records(workdir)
  assert [r["step"] for r in recs] == [0, 1, 2, 3]
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6),
    full["final_params"],
    resumed["final_params"],
  )
  assert _untimed(recs) == _untimed(_train_records(full["workdir"]))


@pytest.mark.slow  # 77 s; verify_test and frozen_flat_test check the two modes agree
def test_replay_and_naive_modes_agree(tmp_path):
  a = trainer.run(short_run("train.rl_steps=2"), str(tmp_path / "replay"))
  b = trainer.run(short_run("train.rl_steps=2", "replay.mode=naive"), str(tmp_path / "naive"))
  ra, rb = _train_records(a["workdir"]), _train_records(b["workdir"])
  assert len(ra) == len(rb) == 3
  for x, y in zip(ra, rb):
    assert x.get("reward/mean") == y.get("reward/mean")
    np.testing.assert_allclose(x["loss/policy"], y["loss/policy"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x["grad/norm"], y["grad/norm"], rtol=1e-4, atol=1e-6)
    assert x["replay/naive_equiv_tokens"] == y["replay/computed_tokens"]
    assert x["replay/computed_tokens"] < y["replay/computed_tokens"]
  # (Parameters are not compared: Adam divides by sqrt(v), so float32 rounding in a
  # near-zero gradient entry becomes an O(lr) difference. tests/core/replay_test.py holds the
  # gradients themselves to tight tolerances.)


def test_unwritable_workdir_fails_before_compute(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match="--workdir=.*not a writable directory"):
    trainer.run(short_run(), str(blocker / "sub"))


def test_incompatible_checkpoint_is_an_error(tmp_path):
  workdir = str(tmp_path / "w")
  trainer.run(short_run("train.rl_steps=1"), workdir)
  with pytest.raises(ValueError, match=r"incompatible config: model.d_model: saved 32, now 64"):
    trainer.run(short_run("model.d_model=64"), workdir)
  with pytest.raises(ValueError, match=r"train.n_branches: saved 4, now 2"):
    trainer.run(short_run("train.n_branches=2"), workdir)


def _cli(*args):
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, "run.py"), *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )


def test_cli_usage_error_exits_with_the_message():  # the one start-up of run.py itself
  out = _cli("--experiment=nope")
  assert out.returncode != 0
  assert "--experiment='nope': unknown; expected one of [" in out.stderr, out.stderr[-2000:]
  assert "grpo_haystack" in out.stderr


@pytest.mark.parametrize(
  "args, message",
  [
    (["--experiment=nope"], "--experiment='nope': unknown; expected one of ["),
    (["--set=train.n_branchez=8"], "unknown field 'n_branchez' of train"),
    (["--set=task.name=sorting"], "task.name='sorting'"),
    (["--bogus=1"], "Unknown command line flag 'bogus'"),
    (["--mode=fast"], "--mode"),
    (["extra"], "unexpected arguments: ['extra']"),
  ],
)
def test_cli_usage_errors_name_the_culprit(args, message):
  import run

  with pytest.raises(run.app.UsageError) as e:
    run.parse(["run.py", *args])
  assert message in str(e.value)


def test_cli_parses_the_experiment_and_overrides():
  import run

  fv, cfg, init_params, tok = run.parse(
    [
      "run.py",
      "--experiment=tree_haystack",
      "--mode=naive",
      "--set=train.rl_steps=3",
      "--workdir=/tmp/x",
    ]
  )
  assert (cfg.tree.fanouts, cfg.replay.mode, cfg.train.rl_steps) == ("4x4", "naive", 3)
  assert fv.workdir == "/tmp/x" and init_params is None and tok is None
