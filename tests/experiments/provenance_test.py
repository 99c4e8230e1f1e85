"""Results carry their provenance; a run's workdir converts to a results file; results_table
renders any results file."""

import json
import os
import subprocess
import sys

import pytest

from experiments import provenance, results_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_writer_lines_carry_commit_command_jax_machine_and_date(tmp_path):
  path = tmp_path / "r.jsonl"
  w = provenance.ResultsWriter(str(path), "unit", argv=["exp.py", "--flag=a b"], echo=False)
  w.write({"P": 4, "replay_s": 0.5})
  w.write({"P": 8, "replay_s": 1.0})
  rows = provenance.read(str(path))
  assert [r["P"] for r in rows] == [4, 8]
  p = rows[0]["provenance"]
  head = subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  assert p["git_commit"] == head and isinstance(p["git_dirty"], bool)
  assert p["command"] == "python exp.py '--flag=a b'"
  assert p["backend"] == "cpu" and p["device_count"] == 8 and p["jax"]
  assert p["cpu_count"] >= 1 and p["hostname"] and p["date"].startswith("20")
  assert rows[0]["experiment"] == "unit"
  if sys.platform.startswith("linux"):  # the ISA that decides XLA's CPU float paths
    assert p["cpu_isa"] in ("avx512f", "avx2", "avx", "sse4_2", None) and "cpu_model" in p


def test_a_tree_without_git_takes_the_commit_from_git_commit(monkeypatch):
  """A copy of the checkout without .git (a device machine's): the commit gpu_check.sh passes
  in GIT_COMMIT, marked as such; neither: None, as before."""
  monkeypatch.setattr(provenance, "_git", lambda *args: None)
  provenance.git_info.cache_clear()
  try:
    monkeypatch.setenv("GIT_COMMIT", "0123abc")
    info = provenance.git_info()
    assert info["git_commit"] == "0123abc" and info["git_commit_from"] == "env"
    assert info["git_dirty"] is None
    provenance.git_info.cache_clear()
    monkeypatch.setenv("GIT_COMMIT", "unknown")
    assert provenance.git_info()["git_commit"] is None
    provenance.git_info.cache_clear()
    monkeypatch.delenv("GIT_COMMIT")
    assert provenance.git_info() == {"git_commit": None, "git_branch": None, "git_dirty": None}
  finally:
    provenance.git_info.cache_clear()


def _fake_workdir(tmp_path):
  from branch_replay import config as config_lib
  from experiments.configs import grpo_haystack

  cfg = grpo_haystack.get_config()
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text(json.dumps(config_lib.to_dict(cfg)))
  recs = []
  for step in range(cfg.train.total_steps):
    rec = {
      "step": step,
      "kind": "train",
      "phase": "sft" if step < 600 else "rl",
      "time/step_s": 0.1,
      "replay/computed_tokens": 10,
      "replay/naive_equiv_tokens": 40,
    }
    if step >= 600:
      rec["reward/mean"] = 0.5 if step < 610 else 0.75
    recs.append(rec)
  recs += [
    {"step": 600, "kind": "eval", "eval/greedy_reward": 0.25},
    {"step": 750, "kind": "eval", "eval/greedy_reward": 0.5},
  ]
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
  return workdir


def test_workdir_metrics_become_a_results_file_with_its_command(tmp_path):
  workdir = _fake_workdir(tmp_path)
  out = tmp_path / "default_run.jsonl"
  proc = subprocess.run(
    [
      sys.executable,
      "experiments/provenance.py",
      f"--workdir={workdir}",
      f"--out={out}",
      "--command=python run.py --workdir=X",
      '--run_info={"git_commit": "abc"}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = provenance.read(str(out))
  header, summary = rows[0], rows[-1]
  assert header["kind"] == "header" and header["run"] == {"git_commit": "abc"}
  assert header["run_command"] == "python run.py --workdir=X"
  assert header["config"]["train"]["rl_steps"] == 150 and "provenance" in header
  assert len(rows) == 1 + 752 + 1
  assert summary["kind"] == "summary" and "provenance" in summary
  # the summary is computed from the lines in between: last 10 RL rewards are 0.75
  assert summary["first"] == {"reward/mean": 0.5} and summary["last"] == {"reward/mean": 0.75}
  assert summary["eval_before"] == 0.25 and summary["eval_after"] == 0.5
  assert summary["computed_tokens"] == 7500 and summary["naive_equiv_tokens"] == 30000
  assert (summary["steps"], summary["phase_steps"], summary["window"]) == (750, 150, 10)
  md = results_table.table(results_table.load([str(out)], ["kind=summary"]))
  assert "| 0.25 | " in md and "| 0.5 | " in md  # the evaluations, as scalar columns


def test_missing_workdir_files_fail_naming_them(tmp_path):
  with pytest.raises(ValueError, match="metrics.jsonl and config.json"):
    provenance.metrics_to_results(str(tmp_path), str(tmp_path / "o.jsonl"), "cmd")


def test_results_table_renders_bench_and_generic_files():
  bench = results_table.load(
    [os.path.join(ROOT, "experiments/results/superseded/cpu_sweep_2026-11-30.jsonl")]
  )
  md = results_table.table(bench).splitlines()
  assert md[0].startswith("| P | T | R |") and len(md) == 2 + len(bench)
  assert "| 4096 | 64 | 8 | small | float32 | oom |" in md[2 + 12]
  rows = [{"a": 1, "b": 0.5, "nested": {"x": 1}}, {"a": 2, "c": "x|y"}]
  assert results_table.table(rows).splitlines() == [
    "| a | b | c |",
    "|---|---|---|",
    "| 1 | 0.5 | - |",
    "| 2 | - | x\\|y |",
  ]
  assert results_table.table(rows, ["c"]).splitlines()[2:] == ["| - |", "| x\\|y |"]
