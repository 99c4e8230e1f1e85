"""experiments/bench_peer.py end to end on a tiny shape: PrefixGrouper's step (PyTorch) and
ours on the same weights and tokens compute the same loss and the same gradient (every leaf,
float32). Skipped when the peer's requirements (requirements-peer.txt) are absent."""

import pytest
from helpers import run_script

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("prefix_grouper")


def test_peer_and_ours_agree_on_loss_and_every_gradient():
  (row,) = run_script(
    "experiments/bench_peer.py",
    "--preset=tiny",
    "--prefix_len=24",
    "--tail_len=8",
    "--branches=3",
    "--reps=2",
    "--max_load=0",
  )
  assert row["grads_agree"] and row["grad_max_rel_err"] < 1e-4, row
  assert abs(row["loss_ours"] - row["loss_peer"]) <= 1e-5 * abs(row["loss_peer"]) + 1e-7
  assert len(row["ours_times"]) == len(row["peer_times"]) == 2
  assert row["ours_s"] > 0 and row["peer_s"] > 0 and row["ratio"] > 0
  assert row["ours_page_faults"] >= 0 and row["peer_page_faults"] >= 0
  assert row["ours_sys_s"] >= 0 and row["peer_sys_s"] >= 0
  assert [len(row["sys_during_steps"][k]) for k in ("ours", "peer")] == [2, 2]
  assert [len(row["reported_mb_during_steps"][k]) for k in ("ours", "peer")] == [2, 2]
  assert row["ours_warm_s"] is None and row["warm_ratio"] is None  # 2 reps: no second of a pair
  for key in (
    "glibc_tunables",
    "ours_peak_mb",
    "peer_peak_mb",
    "ours_gflops",
    "xla_matmul_gflops",
    "torch_matmul_gflops",
    "provenance",
  ):
    assert key in row, key


def test_both_workers_get_the_same_malloc_tunables():
  """--hugepages adds glibc's huge-page tunable to the one environment both workers get (where
  it applies), keeping other tunables; --nohugepages removes it, as a plain process has it."""
  from branch_replay.train import hugepages as hp
  from experiments import bench_peer

  base = {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{hp.TUNABLE}", "PATH": "/bin"}
  off = bench_peer.worker_environ(base, False)
  assert off == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"}
  assert bench_peer.worker_environ({"PATH": "/bin"}, False) == {"PATH": "/bin"}
  on = bench_peer.worker_environ(base, True)
  system, libc = bench_peer.platform.system(), bench_peer.platform.libc_ver()[0]
  applies = hp.wanted({}, system, libc, hp.thp_mode())
  want = f"glibc.malloc.arena_max=2:{hp.TUNABLE}" if applies else "glibc.malloc.arena_max=2"
  assert on == {"GLIBC_TUNABLES": want, "PATH": "/bin"}


def test_profile_peer_names_the_peers_time_by_class():
  """experiments/profile_peer.py on the tiny shape: PrefixGrouper's step by aten op, every op
  in one of three classes, the classes summing to the traced time."""
  rows = run_script(
    "experiments/profile_peer.py",
    "--preset=tiny",
    "--prefix_len=24",
    "--tail_len=8",
    "--branches=3",
    "--reps=1",
    "--trace_reps=1",
  )
  (summary,) = [r for r in rows if r["kind"] == "summary"]
  classes = {r["op_class"]: r["ms_per_step"] for r in rows if r["kind"] == "class"}
  assert {"matmul", "attention"} <= set(classes) <= {"matmul", "attention", "elementwise"}
  assert abs(sum(classes.values()) - summary["traced_ms_per_step"]) < 0.5
  assert summary["step_s"] > 0 and rows[-1]["provenance"]["command"].startswith("python")
