"""algorithms/grpo.py: the GRPO family (RLOO, GSPO, DAPO's dynamic sampling) trains through
the one loop."""

import dataclasses

import numpy as np
import pytest

from branch_replay.core import advantages, losses
from branch_replay.train import metrics
from branch_replay.train import trainer
from helpers import rl_run as tiny


def test_grpo_family_runs_rloo_gspo_dapo(tmp_path, monkeypatch):
  """The trainer takes each option to where it acts: the shaped rewards of the kept groups
  to the rloo estimator (whose advantages are leave-one-out), the gspo objective's sequence
  function into the compiled step, DAPO's rounds and kept fraction into the metrics."""
  seen, traced = [], []
  rloo = advantages.ESTIMATORS["rloo"]
  monkeypatch.setitem(
    advantages.ESTIMATORS,
    "rloo",
    lambda r_BR, t: seen.append((np.array(r_BR), rloo(r_BR, t))) or seen[-1][1],
  )
  gspo = losses.OBJECTIVES["gspo"]
  monkeypatch.setitem(
    losses.OBJECTIVES,
    "gspo",
    dataclasses.replace(gspo, sequence_fn=lambda *a: traced.append(1) or gspo.sequence_fn(*a)),
  )
  cfg = tiny(
    "loss.name=gspo",
    "loss.aggregation=seq_mean",
    "algo.advantage=rloo",
    "algo.dynamic_sampling=true",
    "algo.max_sample_rounds=2",
    "algo.overlong_buffer=1",
    "train.checkpoint_every=1",
  )
  s = trainer.run(cfg, str(tmp_path / "g"))
  recs = [r for r in metrics.read(s["metrics"]) if r.get("kind") == "train"]
  assert len(recs) == len(seen) == 2 and traced  # one estimate per step; gspo compiled
  for r, (rewards_BR, adv_BR) in zip(recs, seen):
    R = rewards_BR.shape[1]
    np.testing.assert_allclose(
      adv_BR, (rewards_BR * R - rewards_BR.sum(1, keepdims=True)) / (R - 1), rtol=1e-6
    )
    assert r["reward/shaped_mean"] == pytest.approx(rewards_BR.mean(), abs=1e-6)
    assert r["reward/shaped_mean"] <= r["reward/mean"] + 1e-6  # the overlong penalty is >= 0
    assert 1 <= r["dapo/rounds"] <= 2
    informative = int((rewards_BR.std(1) > 0).sum())  # kept groups come first
    assert r["dapo/kept_frac"] == pytest.approx(min(informative, 4) / 4)
    if r["dapo/rounds"] == 1:  # stopped early: every group of the batch was informative
      assert informative == 4
