"""experiments/time_to_accuracy.py: each side's budgeted command line (the same recipe, budget
and recomputation; ours saved at TRL's step count), reading a side's summary, the comparison of
two evaluations, bench_trl's budget stop; and (slow) the evaluation of PEFT adapter folders on
the packaged SmolLM2: a fresh adapter (B = 0) scores exactly as the base does."""

import json
import os

import pytest

from experiments import bench_trl, time_to_accuracy

OPTS = dict(experiment="math_smollm2", max_steps=400, remat="full", budget_s=1800.0, sets=["x.y=1"])


def flags_of(cmd):
  return [a for a in cmd if a.startswith("--")]


def test_both_sides_get_the_same_budget_and_recipe():
  trl = time_to_accuracy.side_command("trl", "/w", "/hf", OPTS)
  ours = time_to_accuracy.side_command("ours", "/w", "/hf", OPTS, save_at=7)
  assert "--side=trl" in trl and "--side=ours" in ours
  assert "--save_adapter=/w/trl" in trl and "--save_adapter=/w/ours" in ours
  assert "--save_at=7" in ours and not any(a.startswith("--save_at") for a in trl)
  # everything else the same: budget, recipe, remat, overrides, the HF folder
  differ = set(flags_of(trl)) ^ set(flags_of(ours))
  assert differ == {
    "--side=trl",
    "--side=ours",
    "--save_adapter=/w/trl",
    "--save_adapter=/w/ours",
    "--out=/w/trl.jsonl",
    "--out=/w/ours.jsonl",
    "--save_at=7",
  }
  for a in ("--budget_s=1800.0", "--remat=full", "--set=x.y=1", "--hf_folder=/hf", "--warmup=0"):
    assert a in trl
  with pytest.raises(ValueError, match="ours only"):
    time_to_accuracy.side_command("trl", "/w", "/hf", OPTS, save_at=3)
  with pytest.raises(ValueError, match="side='naive'"):
    time_to_accuracy.side_command("naive", "/w", "/hf", OPTS)


def test_a_side_without_a_summary_is_named(tmp_path):
  path = tmp_path / "trl.jsonl"
  path.write_text(json.dumps({"side": "trl", "index": 0}) + "\n")
  with pytest.raises(RuntimeError, match="trl.jsonl: no summary"):
    time_to_accuracy.side_summary(str(path))
  with open(path, "a") as f:
    f.write(json.dumps({"summary": True, "steps_run": 1}) + "\n")
  assert time_to_accuracy.side_summary(str(path))["steps_run"] == 1


def rec(acc, lo, hi):
  return {"eval/greedy_reward": acc, "eval/ci95_low": lo, "eval/ci95_high": hi}


def test_two_evaluations_compared_with_their_intervals():
  evals = {"a": rec(0.6, 0.5, 0.7), "b": rec(0.3, 0.2, 0.4), "c": rec(0.45, 0.35, 0.55)}
  ab = time_to_accuracy.compare(evals, "a", "b")
  assert ab["difference"] == pytest.approx(0.3) and not ab["intervals_overlap"]
  assert ab["a"] == [0.6, 0.5, 0.7] and ab["b"] == [0.3, 0.2, 0.4]
  assert time_to_accuracy.compare(evals, "a", "c")["intervals_overlap"]
  assert time_to_accuracy.compare(evals, "c", "b")["intervals_overlap"]


def test_paired_counts_the_problems_each_alone_solved():
  evals = {
    "ours": {"rewards": [1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]},
    "trl": {"rewards": [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]},
  }
  p = time_to_accuracy.paired(evals, "ours", "trl")
  assert (p["both"], p["only_a"], p["only_b"], p["neither"]) == (2, 4, 0, 2)
  assert p["mcnemar_p"] == pytest.approx(2 / 16)  # 4 discordant, all one way: 2 * 0.5**4
  even = time_to_accuracy.paired({"a": {"rewards": [1, 0]}, "b": {"rewards": [0, 1]}}, "a", "b")
  assert even["mcnemar_p"] == 1.0
  with pytest.raises(ValueError, match="ours has 8 rewards, short 1"):
    time_to_accuracy.paired({**evals, "short": {"rewards": [1.0]}}, "ours", "short")


def test_the_budget_stop():
  assert not bench_trl.over_budget(1799.0, 1800.0)
  assert bench_trl.over_budget(1800.0, 1800.0) and bench_trl.over_budget(2400.0, 1800.0)
  assert not bench_trl.over_budget(1e9, 0.0)  # off


@pytest.mark.slow
def test_a_fresh_adapter_scores_as_the_base(tmp_path):
  """The evaluation path TRL's adapter takes (a PEFT folder -> load_peft -> our greedy
    evaluation) on the real recipe: a folder saved with B = 0 changes nothing; one of another rank
  is refused by name."""
  import jax

  from models import gguf
  from models import lora as lora_lib

  try:
    path = gguf.smollm2_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  recipe = time_to_accuracy.load_recipe("math_smollm2", path, 3, ["train.eval_batch=3"])
  cfg = recipe[0]
  fresh = lora_lib.init_adapters(cfg.model, cfg.lora, jax.random.key(1))
  folder = os.path.join(tmp_path, "fresh")
  lora_lib.save_peft(folder, cfg.model, cfg.lora, fresh)
  done = []
  got = time_to_accuracy.evaluate_adapters(
    recipe, {"base": None, "fresh": folder}, lambda name, rec: done.append((name, rec))
  )
  assert [name for name, _ in done] == ["base", "fresh"]  # a line as each adapter is scored
  assert got["base"]["eval/n"] == got["fresh"]["eval/n"] == 3
  assert got["fresh"]["eval/greedy_reward"] == got["base"]["eval/greedy_reward"]
  assert got["fresh"]["rewards"] == got["base"]["rewards"] and len(got["base"]["rewards"]) == 3
  assert sum(got["base"]["rewards"]) / 3 == pytest.approx(got["base"]["eval/greedy_reward"])
  assert got["fresh"]["adapter"] == folder and got["base"]["adapter"] is None
  # the folder goes through PEFT's import, which refuses an adapter the recipe does not run
  other = lora_lib.LoraConfig(rank=8, alpha=cfg.lora.alpha, targets=cfg.lora.targets)
  wrong = os.path.join(tmp_path, "rank8")
  lora_lib.save_peft(
    wrong, cfg.model, other, lora_lib.init_adapters(cfg.model, other, jax.random.key(2))
  )
  with pytest.raises(ValueError, match="r=8 but lora.rank=16"):
    time_to_accuracy.evaluate_adapters(recipe, {"wrong": wrong})


@pytest.mark.slow
@pytest.mark.parametrize("side", ["trl", "ours"])
def test_a_budgeted_side_stops_and_saves_an_adapter_we_load(tmp_path, side):
  """bench_trl.py --side=trl|ours with a budget spent by its first step: one step run (of
  --steps=3), its adapter written as a PEFT folder (TRL: trainer.save_model; ours: save_peft,
  also at --save_at) that load_peft reads onto the recipe's model."""
  import subprocess
  import sys

  pytest.importorskip("trl")
  from models import gguf
  from models import lora as lora_lib

  try:
    path = gguf.smollm2_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  sets = ["task.prompt_len=256", "task.n_keys=2"]
  out = tmp_path / "side.jsonl"
  cmd = [
    sys.executable,
    bench_trl.__file__,
    f"--side={side}",
    "--experiment=needle_smollm2",
    "--batch=1",
    "--branches=2",
    "--steps=3",
    "--warmup=0",
    "--budget_s=0.001",
    f"--save_adapter={tmp_path / 'adapter'}",
    f"--out={out}",
  ] + [f"--set={s}" for s in sets]
  if side == "ours":
    cmd.append("--save_at=1")
  subprocess.run(cmd, check=True, cwd=os.path.dirname(os.path.dirname(bench_trl.__file__)))
  summary = time_to_accuracy.side_summary(str(out))
  assert summary["steps_run"] == 1 and summary["budget_s"] == 0.001
  assert summary["train_wall_s"] > 0
  cfg = time_to_accuracy.load_recipe("needle_smollm2", path, 0, sets)[0]
  folders = ["final"] + (["step_1"] if side == "ours" else [])
  for name in folders:
    found, adapters = lora_lib.load_peft(str(tmp_path / "adapter" / name), cfg.model, cfg.lora)
    assert found.rank == cfg.lora.rank and len(adapters) == cfg.model.n_layers
