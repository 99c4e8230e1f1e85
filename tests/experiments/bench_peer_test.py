"""experiments/bench_peer.py end to end on a tiny shape: PrefixGrouper's step (PyTorch) and
ours on the same weights and tokens compute the same loss and the same gradient (every leaf,
float32). Skipped when the peer's requirements (requirements-peer.txt) are absent."""

import pytest
from helpers import run_script

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("prefix_grouper")


def test_peer_and_ours_agree_on_loss_and_every_gradient_in_blocks():
  """The tiny shape end to end: the bench checks loss, every gradient leaf and the peer's
  attention paths itself (it exits otherwise); the row holds N = 5 steps in each of 3 blocks
  per framework, each block's median and spread, and the model's size."""
  (row,) = run_script(
    "experiments/bench_peer.py",
    "--preset=tiny",
    "--prefix_len=24",
    "--tail_len=8",
    "--branches=3",
    "--reps=5",
    "--blocks=3",
    "--gap_s=0.01",
    "--max_load=0",
  )
  assert row["grads_agree"] and row["grad_max_rel_err"] < 1e-4, row
  assert abs(row["loss_ours"] - row["loss_peer"]) <= 1e-5 * abs(row["loss_peer"]) + 1e-7
  # PrefixGrouper at full strength: each of the 2 layers' prefix call on the causal fast path
  assert row["peer_attention_calls"] == {"causal": 2, "lower_right": 2}
  assert row["protocol"] == "blocks" and (row["reps"], row["blocks"], row["gap_s"]) == (5, 3, 0.01)
  assert (row["n_layers"], row["d_model"], row["n_params"]) == (2, 32, 26784)
  assert row["ours_remat"] == row["peer_remat"] == "none"
  for k in ("ours", "peer"):
    assert [len(b) for b in row[f"{k}_times"]] == [5, 5, 5]
    for field in ("block_s", "block_min_s", "block_max_s", "block_sys_s", "block_peak_mb"):
      assert len(row[f"{k}_{field}"]) == 3, field
    assert all(
      lo <= m <= hi
      for lo, m, hi in zip(row[f"{k}_block_min_s"], row[f"{k}_block_s"], row[f"{k}_block_max_s"])
    )
    assert row[f"{k}_block_spread"] >= 0 and row[f"{k}_sys_s"] >= 0
    assert row[f"{k}_page_faults"] >= 0 and row[f"{k}_peak_mb"] > 0
    for field in ("sys_during_steps", "reported_mb_during_steps", "other_cores_during_steps"):
      assert [len(b) for b in row[field][k]] == [5, 5, 5], field
  assert len(row["block_ratios"]) == 3 and row["ratio"] > 0 and row["warm_ratio"] > 0
  for key in (
    "ours_s",
    "peer_s",
    "ours_min_s",
    "peer_min_s",
    "ours_cpu_s",
    "peer_cpu_s",
    "glibc_tunables",
    "ours_gflops",
    "peer_gflops",
    "xla_matmul_gflops",
    "torch_matmul_gflops",
    "ours_matmul_frac",
    "peer_matmul_frac",
    "provenance",
  ):
    assert key in row, key


def test_the_protocol_is_checked_before_any_worker_starts():
  from experiments import bench_peer

  bench_peer.check_protocol(5, 3, 0.0)
  for args, field in (
    ((4, 3, 0.0), "--reps=4"),
    ((5, 2, 0.0), "--blocks=2"),
    ((5, 3, -1.0), "--gap_s"),
  ):
    with pytest.raises(SystemExit, match=field):
      bench_peer.check_protocol(*args)


def test_block_summary_reads_each_blocks_steps():
  """summarize_blocks on made-up steps: medians per block, the median of those, the spread,
  the steps after each block's first."""
  from experiments import bench_peer

  def step(s):
    return dict(
      seconds=s,
      cpu_seconds=2 * s,
      sys_seconds=0.1,
      page_faults=7,
      load=1.0,
      other_cores=0.0,
      reported_mb=None,
    )

  blocks = [
    dict(steps=[step(s) for s in (9.0, 1.0, 2.0, 3.0, 4.0)], peak_mb=10.0),
    dict(steps=[step(s) for s in (9.0, 2.0, 3.0, 4.0, 5.0)], peak_mb=12.0),
    dict(steps=[step(s) for s in (9.0, 3.0, 4.0, 5.0, 6.0)], peak_mb=11.0),
  ]
  out = bench_peer.summarize_blocks("ours", blocks)
  assert out["ours_block_s"] == [3.0, 4.0, 5.0] and out["ours_s"] == 4.0
  assert out["ours_block_min_s"] == [1.0, 2.0, 3.0] and out["ours_block_max_s"] == [9.0] * 3
  assert out["ours_block_spread"] == 0.5  # (5 - 3) / 4
  assert out["ours_warm_s"] == 3.5  # the median of the 12 steps after each block's first
  assert out["ours_min_s"] == 1.0 and out["ours_cpu_s"] == 8.0 and out["ours_sys_s"] == 0.1
  assert out["ours_block_peak_mb"] == [10.0, 12.0, 11.0] and out["ours_page_faults"] == 7


@pytest.mark.parametrize("Tq,S", [(7, 7), (1, 7), (3, 11), (11, 11)])
def test_fast_attention_paths_equal_the_explicit_mask(Tq, S):
  """sdpa_bottom_right's fast paths (is_causal on square calls, causal_lower_right on tails)
  against its naive twin (an explicit [b, 1, Tq, S] mask) and against attention written out,
  float64, outputs and every input's gradient, with grouped-query heads."""
  import torch

  from experiments import bench_peer

  g = torch.Generator().manual_seed(0)
  b, N, K, H = 2, 4, 2, 5
  q = torch.randn(b, N, Tq, H, dtype=torch.float64, generator=g)
  k = torch.randn(b, K, S, H, dtype=torch.float64, generator=g)
  v = torch.randn(b, K, S, H, dtype=torch.float64, generator=g)
  cot = torch.randn(b, Tq, N, H, dtype=torch.float64, generator=g)
  valid = torch.ones(b, S, dtype=torch.bool)

  def written_out(q, k, v):
    k, v = k.repeat_interleave(N // K, 1), v.repeat_interleave(N // K, 1)
    s = torch.einsum("bnqh,bnsh->bnqs", q, k) * 0.3
    visible = torch.arange(S)[None, :] <= torch.arange(Tq)[:, None] + (S - Tq)
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("bnqs,bnsh->bqnh", p, v)

  def run(fn):
    qkv = [x.clone().requires_grad_(True) for x in (q, k, v)]
    out = fn(*qkv)
    (out * cot).sum().backward()
    return [out.detach()] + [x.grad for x in qkv]

  bench_peer.ATTENTION_CALLS.clear()
  fast = run(lambda q, k, v: bench_peer.sdpa_bottom_right(q, k, v, valid, 0.3))
  assert dict(bench_peer.ATTENTION_CALLS) == {"causal" if Tq == S else "lower_right": 1}
  naive = run(lambda q, k, v: bench_peer.sdpa_bottom_right(q, k, v, valid, 0.3, fast=False))
  assert dict(bench_peer.ATTENTION_CALLS)["masked"] == 1
  ref = run(written_out)
  for a, n, r in zip(fast, naive, ref):
    torch.testing.assert_close(a, n, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-12)


def test_padded_keys_take_the_explicit_mask():
  """A padded key (PrefixGrouper's [b, S] mask with a False) leaves the fast paths: the mask
  hides it."""
  import torch

  from experiments import bench_peer

  g = torch.Generator().manual_seed(1)
  q, k, v = (torch.randn(1, 2, n, 3, dtype=torch.float64, generator=g) for n in (4, 6, 6))
  valid = torch.tensor([[True, False, True, True, True, True]])
  bench_peer.ATTENTION_CALLS.clear()
  out = bench_peer.sdpa_bottom_right(q, k, v, valid)
  assert dict(bench_peer.ATTENTION_CALLS) == {"masked": 1}
  k2, v2 = k.clone(), v.clone()
  k2[:, :, 1], v2[:, :, 1] = 100.0, -100.0  # what a hidden key holds cannot matter
  torch.testing.assert_close(bench_peer.sdpa_bottom_right(q, k2, v2, valid), out)
  with pytest.raises(ValueError, match="expected Tq <= S"):
    bench_peer.sdpa_bottom_right(k, q, q, valid[:, :4])


def test_the_bench_refuses_disagreeing_frameworks():
  from experiments import bench_peer

  same, calls = {"ours": -0.5, "peer": -0.5}, {"causal": 4, "lower_right": 4}
  bench_peer.check_agreement(same, 1e-6, "w", True, calls, 4)
  with pytest.raises(SystemExit, match="losses differ"):
    bench_peer.check_agreement({"ours": -0.5, "peer": -0.6}, 1e-6, "w", True, calls, 4)
  with pytest.raises(SystemExit, match="gradients differ: .* at w"):
    bench_peer.check_agreement(same, 3e-3, "w", False, calls, 4)
  with pytest.raises(SystemExit, match="attention calls"):
    bench_peer.check_agreement(same, 1e-6, "w", True, {"masked": 8}, 4)


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


@pytest.mark.parametrize("explicit_mask", [False, True])
def test_profile_peer_names_the_peers_time_by_class(explicit_mask):
  """experiments/profile_peer.py on the tiny shape: PrefixGrouper's step by aten op, every op
  in one of three classes, the classes summing to the traced time; the attention calls per step
  by path (the fast paths, or with --explicit_mask the mask on all of them)."""
  rows = run_script(
    "experiments/profile_peer.py",
    "--preset=tiny",
    "--prefix_len=24",
    "--tail_len=8",
    "--branches=3",
    "--reps=1",
    "--trace_reps=1",
    f"--explicit_mask={explicit_mask}",
  )
  (summary,) = [r for r in rows if r["kind"] == "summary"]
  classes = {r["op_class"]: r["ms_per_step"] for r in rows if r["kind"] == "class"}
  assert {"matmul", "attention"} <= set(classes) <= {"matmul", "attention", "elementwise"}
  assert abs(sum(classes.values()) - summary["traced_ms_per_step"]) < 0.5
  assert summary["step_s"] > 0 and rows[-1]["provenance"]["command"].startswith("python")
  want = {"masked": 4} if explicit_mask else {"causal": 2, "lower_right": 2}
  assert summary["attention_calls_per_step"] == want
  assert (summary["n_layers"], summary["d_model"], summary["n_params"]) == (2, 32, 26784)
