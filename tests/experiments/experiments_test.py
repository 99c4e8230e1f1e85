"""Smoke tests of the reproduction experiments (Q1, Q2, Q3, Q5) at tiny sizes: they run,
write the lines their READMEs read, and their comparisons are computed from the data."""

import jax
import numpy as np
import pytest

from experiments import provenance, q1_wallclock, q2_convergence, q3_memory_frontier
from experiments import q5_objectives, rl_step

TINY = [
  "model.d_model=16",
  "model.n_layers=1",
  "model.n_kv_heads=2",
  "model.n_heads=2",
  "model.head_dim=8",
  "model.mlp_hidden=32",
  "train.batch_size=2",
  "train.n_branches=2",
  "task.n_keys=2",
  "task.prompt_len=24",
  "task.sft_prompt_len=16",
  "train.sft_batch_size=2",
  "train.eval_size=2",
  "sampler.max_new_tokens=2",
]


def writer(tmp_path, name):
  return provenance.ResultsWriter(str(tmp_path / f"{name}.jsonl"), name, echo=False)


@pytest.mark.slow  # 67 s
def test_q1_times_every_phase_of_both_modes(tmp_path):
  rows = q1_wallclock.run(
    [24], ["replay", "naive"], 1, "grpo_haystack", TINY, writer(tmp_path, "q1")
  )
  assert [(r["P"], r["mode"]) for r in rows] == [(24, "replay"), (24, "naive")]
  phases = ("data_s", "sample_s", "reward_s", "assemble_s", "update_s")
  for r in rows:
    assert all(r[k] >= 0 for k in phases) and "provenance" in r
    assert r["step_s"] == pytest.approx(sum(r[k] for k in phases))
  assert rows[1]["step_speedup_of_replay"] == pytest.approx(rows[1]["step_s"] / rows[0]["step_s"])
  assert len(provenance.read(str(tmp_path / "q1.jsonl"))) == 2


def test_q1_on_an_imported_model_uses_its_weights_tokenizer_and_lora(tmp_path):
  """--model_dir: the Stepper holds run.py's imported weights (the frozen LoRA base here) and
  samples with the checkpoint's own tokenizer; --prefix_len=0 keeps the experiment's prompt
  length; the row names the model, its size, dtype and LoRA rank, and the positions computed."""
  from helpers import make_hf_folder

  model_cfg, params = make_hf_folder(tmp_path / "hf")
  sets = [o for o in TINY if not o.startswith("model.")] + ["lora.rank=2"]
  stepper = q1_wallclock.stepper_for("grpo_haystack", sets, "replay", str(tmp_path / "hf"))
  assert stepper.cfg.task.prompt_len == 24 and stepper.tok.vocab_size == 79
  jax.tree.map(np.testing.assert_array_equal, stepper.state.base, params)
  rows = q1_wallclock.run(
    [0], ["replay"], 1, "grpo_haystack", sets, writer(tmp_path, "q1m"), str(tmp_path / "hf")
  )
  (row,) = rows
  assert (row["P"], row["mode"]) == (24, "replay")
  n = sum(x.size for x in jax.tree.leaves(params))
  assert row["model"] == dict(
    name="hf",
    d_model=model_cfg.d_model,
    n_layers=model_cfg.n_layers,
    n_params=n,
    dtype="float32",
    param_dtype="float32",
    remat="none",
    lora_rank=2,
  )
  B, R, T = row["B"], row["R"], row["T"]
  assert row["positions"]["prefix"] == B * 24 and row["positions"]["tails"] <= B * R * T
  assert row["positions"]["naive_equivalent"] == B * R * (24 + row["positions"]["tails"] // (B * R))


def test_identical_batch_gradients_agree_and_the_cosine_is_computed_from_them():
  cfg = rl_step.config_for("grpo_haystack", TINY)
  stepper = rl_step.Stepper(cfg)
  batch, _, _ = stepper.batch(0)
  batch = batch.with_leaves(advantages_BR=jax.numpy.asarray([[1.0, -1.0], [0.5, -0.5]]))
  both = rl_step.grads_both_modes(stepper.state.params, batch, cfg)
  cmp = rl_step.compare_grads(both)
  (_, gr), (_, gn) = both["replay"], both["naive"]
  assert cmp["grad_cosine"] == pytest.approx(gr @ gn / np.linalg.norm(gr) / np.linalg.norm(gn))
  assert 1 - cmp["grad_cosine"] < 1e-6 and cmp["grad_rel_diff"] < 1e-4
  zero = rl_step.compare_grads({"replay": (0.0, gr * 0), "naive": (0.0, gn)})
  assert zero["grad_cosine"] is None  # a zero gradient has no direction


def synthetic_curves():
  """Two seeds per mode; naive's band is [0, 1] everywhere, replay's mean leaves it at step 3."""
  rows = []
  for seed, (n, r) in enumerate(
    [((0.0, 0.0, 0.0, 0.0), (0.2, 0.4, 0.5, 1.5)), ((1.0, 1.0, 1.0, 1.0), (0.4, 0.6, 0.7, 1.5))]
  ):
    for step in range(4):
      rows.append(
        {
          "mode": "naive",
          "seed": seed,
          "step": step,
          "phase": "rl",
          "reward/mean": n[step],
          "loss/policy": 0.1,
        }
      )
      rows.append(
        {
          "mode": "replay",
          "seed": seed,
          "step": step,
          "phase": "rl",
          "reward/mean": r[step],
          "loss/policy": 0.1,
        }
      )
  return rows


def test_q2_verdict_bands_and_plot_from_curves(tmp_path):
  rows = synthetic_curves()
  v = q2_convergence.verdict(rows, 1)
  # replay means 0.3, 0.5, 0.6, 1.5: inside naive's [0, 1] at 3 of 4 steps; naive's mean
  # 0.5 inside replay's bands [0.2,0.4], [0.4,0.6], [0.5,0.7], [1.5,1.5] at steps 1, 2
  assert v["replay_mean_inside_naive_band"] == 0.75
  assert v["naive_mean_inside_replay_band"] == 0.5
  assert v["final_reward_replay"] == 1.5 and v["final_reward_naive"] == 0.5
  smooth = q2_convergence.verdict(rows, 2)  # running mean over 2 steps: replay 1.05 at the end
  assert smooth["replay_mean_inside_naive_band"] == 0.75
  cos = [
    {"step": 0, "grad_cosine": 1.0 - 1e-13, "one_minus_cosine": 1e-13, "grad_rel_diff": 1e-6},
    {"step": 1, "grad_cosine": None, "one_minus_cosine": None, "grad_rel_diff": None},
  ]
  png = q2_convergence.plot(rows, cos, str(tmp_path / "q2.png"), 1)
  assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_q2_trains_both_modes_and_compares_gradients(tmp_path):
  w = writer(tmp_path, "q2")
  overrides = TINY + ["train.sft_steps=2", "train.eval_size=0"]
  rows = q2_convergence.curves(
    "grpo_haystack", overrides, [0, 1], ["replay", "naive"], 2, str(tmp_path / "runs"), w
  )
  assert {(r["mode"], r["seed"]) for r in rows} == {
    (m, s) for m in ("replay", "naive") for s in (0, 1)
  }
  cos = q2_convergence.cosines("grpo_haystack", overrides, 0, 2, str(tmp_path / "runs"), w)
  assert [r["step"] for r in cos] == [0, 1]
  assert all(r["grad_cosine"] is None or 1 - r["grad_cosine"] < 1e-5 for r in cos)
  assert q2_convergence.verdict(rows, 1)["steps_compared"] == 2


def test_q3_bisection_finds_the_frontier(tmp_path):
  calls = []

  def fake(mode, P, R, opts):
    calls.append(P)
    return dict(fits=P <= 1000 // R, peak_mb=P)

  opts = dict(tail_len=4, start=16, max_prefix_len=4096, granularity=8, cap_mb=1.0)
  row = q3_memory_frontier.frontier("replay", 4, opts, writer(tmp_path, "q3"), fake)
  assert row["longest_prefix"] == 248 and row["first_failing"] == 256  # 250 rounded to 8
  assert calls[:5] == [16, 32, 64, 128, 256] and row["peak_mb_at_longest"] == 248
  capped = q3_memory_frontier.frontier(
    "replay", 1, dict(opts, max_prefix_len=64), writer(tmp_path, "q3"), fake
  )
  assert capped["longest_prefix"] == 64 and capped["capped_by_max"]


@pytest.mark.slow  # 76 s
def test_q3_one_real_trial_in_a_subprocess():
  opts = dict(
    tail_len=4,
    prompts=1,
    preset="tiny",
    dtype="float32",
    remat=False,
    branch_chunk=0,
    cap_mb=4000.0,
    timeout_s=600,
  )
  res = q3_memory_frontier.trial("replay", 16, 2, opts)
  assert res["fits"] and res["compiled_mb"] > 0 and res["seconds"] > 0
  assert res["measured"] == "run"
  compiled = q3_memory_frontier.trial("naive", 16, 2, dict(opts, compiled_only=True))
  assert compiled["fits"] and compiled["measured"] == "compiled"
  assert compiled["seconds"] is None and compiled["compiled_mb"] > res["compiled_mb"] * 0.5


@pytest.mark.slow  # 80 s; core/critic_test checks the critic through replay
def test_q5_critic_step_through_replay_matches_naive():
  (row,) = q5_objectives.measure(
    "value",
    16,
    dict(
      tail_len=4, branches=3, prompts=1, reps=1, preset="tiny", dtype="float32", memory_cap_mb=4000
    ),
  )
  assert row["objective"] == row["loss"] == "value" and row["branches"] == 3
  assert row["grad_max_rel_err"] < 1e-5 and row["loss_abs_err"] < 1e-5 and row["speedup"] > 0


@pytest.mark.slow
def test_q5_dpo_through_replay_matches_naive():
  (row,) = q5_objectives.measure(
    "dpo",
    16,
    dict(
      tail_len=4, branches=4, prompts=1, reps=1, preset="tiny", dtype="float32", memory_cap_mb=4000
    ),
  )
  assert row["objective"] == row["loss"] == "dpo" and row["branches"] == 2
  assert row["grad_max_rel_err"] < 1e-5 and row["speedup"] > 0


def test_q2_verdict_over_runs_from_several_files(tmp_path):
  def curve_file(name, seeds, offset):
    w = writer(tmp_path, name)
    for mode in ("replay", "naive"):
      for seed in seeds:
        for step in range(12):
          w.write(
            {
              "kind": "curve",
              "mode": mode,
              "seed": seed,
              "step": step,
              "phase": "rl",
              "reward/mean": 0.5 + 0.01 * step + offset * seed,
            }
          )
    return str(tmp_path / f"{name}.jsonl")

  a, b = curve_file("a", [0, 1], 0.01), curve_file("b", [2], 0.01)
  rows, cos_rows = q2_convergence.from_results([a, b])
  assert sorted({(r["mode"], r["seed"]) for r in rows}) == [
    ("naive", 0),
    ("naive", 1),
    ("naive", 2),
    ("replay", 0),
    ("replay", 1),
    ("replay", 2),
  ]
  assert cos_rows == []
  v = q2_convergence.verdict(rows, window=3)  # identical curves: each inside the other's band
  assert v["steps_compared"] == 12 and v["replay_mean_inside_naive_band"] == 1.0
  with pytest.raises(ValueError, match="seed=2 is in both"):
    q2_convergence.from_results([b, b])


def test_every_experiment_script_is_in_exactly_one_kind_and_configs_have_get_config():
  import glob
  import os
  from experiments import registry

  root = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "experiments"
  )
  scripts = {
    os.path.basename(p)[:-3]
    for p in glob.glob(os.path.join(root, "[!_]*.py"))
    + glob.glob(os.path.join(root, "configs", "[!_]*.py"))
  }
  listed = [n for names in registry.KINDS.values() for n in names]
  assert len(listed) == len(set(listed)), "a script listed under two kinds"
  assert scripts == set(listed), (sorted(scripts - set(listed)), sorted(set(listed) - scripts))
  configs = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(root, "configs", "*.py"))}
  assert configs - {"__init__", "base"} == set(registry.CONFIGS)  # base: what they share
  for name in registry.CONFIGS:
    assert "def get_config(" in open(os.path.join(root, "configs", f"{name}.py")).read(), name
  others = [
    n
    for n in scripts - set(registry.CONFIGS) - {"registry", "base"}
    if "def get_config(" in open(os.path.join(root, f"{n}.py")).read()
  ]
  assert not others, f"scripts with get_config() outside experiments/configs/: {others}"
  from experiments import grpo_haystack  # the old module path, kept importable
  from experiments.configs import grpo_haystack as moved

  assert grpo_haystack is moved
  with pytest.raises(ValueError, match=r"--experiment='nope': unknown; expected one of \["):
    registry.config_module("nope")
