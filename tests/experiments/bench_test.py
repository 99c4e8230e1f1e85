"""The benchmark runs end to end and prints the keys the README's table reads (tiny shapes:
this checks the plumbing; the numbers live in experiments/results/)."""

import pytest
from helpers import run_script

KEYS = (
  "prefix_len",
  "tail_len",
  "branches",
  "naive_s",
  "replay_s",
  "speedup",
  "token_ratio",
  "flop_ratio",
  "naive_peak_mb",
  "replay_peak_mb",
  "grad_max_rel_err",
  "replay_gflops",
  "matmul_gflops",
)


def bench(*flags):
  return run_script(
    "experiments/bench_replay.py",
    "--preset=tiny",
    "--prefix_len=16",
    "--tail_len=4",
    "--branches=2",
    "--reps=1",
    *flags,
  )


def test_bench_prints_every_key_and_exact_gradients():
  (row,) = bench()
  assert all(k in row for k in KEYS), sorted(row)
  assert row["token_ratio"] == round(2 * 20 / (16 + 2 * 4), 3)
  assert row["grad_max_rel_err"] < 1e-5 and row["speedup"] > 0


@pytest.mark.slow  # 78 s
def test_bench_reports_oom_instead_of_running():
  (row,) = bench("--memory_cap_mb=0.001", "--nocheck_grads")
  assert row["naive_s"] == "oom" and row["replay_s"] == "oom"
