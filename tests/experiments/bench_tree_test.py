"""bench_tree.py runs end to end at tiny sizes and prints the keys the README reads (this
checks the plumbing; the full-size numbers are measured on a quiet machine)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = (
  "naive_s",
  "flat_s",
  "tree_s",
  "naive_peak_mb",
  "flat_peak_mb",
  "tree_peak_mb",
  "flat_flop_ratio",
  "tree_flop_ratio",
  "tree_speedup",
  "flat_speedup",
  "tree_over_flat_speedup",
  "flat_grad_max_rel_err",
  "tree_grad_max_rel_err",
  "naive_cpu_s",
  "tree_cpu_s",
  "tree_cpu_speedup",
  "tree_cpu_speedup_over_flop_ratio",
)


@pytest.mark.slow  # six subprocesses compiling: ~2 min on an idle 2-core CPU
def test_bench_tree_prints_every_key_and_exact_gradients():
  out = subprocess.run(
    [
      sys.executable,
      "experiments/bench_tree.py",
      "--preset=tiny",
      "--prefix_len=16",
      "--fanouts=2x2",
      "--lengths=4x3",
      "--reps=1",
      "--rounds=2",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-2000:]
  (row,) = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
  assert all(k in row for k in KEYS), sorted(row)
  assert row["tree_grad_max_rel_err"] < 1e-5 and row["flat_grad_max_rel_err"] < 1e-5
  # two rounds, alternating: each speedup is the median of the rounds' own ratios
  assert len(row["rounds"]) == 2
  ratios = sorted(r["naive_cpu_s"] / r["tree_cpu_s"] for r in row["rounds"])
  assert row["tree_cpu_speedup"] == round(sum(ratios) / 2, 3)
  # FLOPs: the tree computes the prompt once and each opening once; flat re-runs openings.
  assert row["tree_flop_ratio"] > row["flat_flop_ratio"] > 1
