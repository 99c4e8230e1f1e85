"""experiments/bench_peer.py end to end on a tiny shape: PrefixGrouper's step (PyTorch) and
ours on the same weights and tokens compute the same loss and the same gradient (every leaf,
float32). Skipped when the peer's requirements (requirements-peer.txt) are absent."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("prefix_grouper")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_peer_and_ours_agree_on_loss_and_every_gradient():
  out = subprocess.run(
    [
      sys.executable,
      "experiments/bench_peer.py",
      "--preset=tiny",
      "--prefix_len=24",
      "--tail_len=8",
      "--branches=3",
      "--reps=2",
      "--max_load=0",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-3000:]
  (row,) = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
  assert row["grads_agree"] and row["grad_max_rel_err"] < 1e-4, row
  assert abs(row["loss_ours"] - row["loss_peer"]) <= 1e-5 * abs(row["loss_peer"]) + 1e-7
  assert len(row["ours_times"]) == len(row["peer_times"]) == 2
  assert row["ours_s"] > 0 and row["peer_s"] > 0 and row["ratio"] > 0
  for key in (
    "ours_peak_mb",
    "peer_peak_mb",
    "ours_gflops",
    "xla_matmul_gflops",
    "torch_matmul_gflops",
    "provenance",
  ):
    assert key in row, key


def test_profile_peer_names_the_peers_time_by_class():
  """experiments/profile_peer.py on the tiny shape: PrefixGrouper's step by aten op, every op
  in one of three classes, the classes summing to the traced time."""
  out = subprocess.run(
    [
      sys.executable,
      "experiments/profile_peer.py",
      "--preset=tiny",
      "--prefix_len=24",
      "--tail_len=8",
      "--branches=3",
      "--reps=1",
      "--trace_reps=1",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
  (summary,) = [r for r in rows if r["kind"] == "summary"]
  classes = {r["op_class"]: r["ms_per_step"] for r in rows if r["kind"] == "class"}
  assert {"matmul", "attention"} <= set(classes) <= {"matmul", "attention", "elementwise"}
  assert abs(sum(classes.values()) - summary["traced_ms_per_step"]) < 0.5
  assert summary["step_s"] > 0 and rows[-1]["provenance"]["command"].startswith("python")
