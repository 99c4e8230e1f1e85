"""experiments/longctx_speed.py's protocol, without running a model: each side's command line
(the naive twin is ours with replay.mode=naive; TRL its own side), how a process's exit reads
(killed, timed out), a point from the lines a side wrote (a killed side keeps the steps it
reached) and a prompt length's ratios; bench_trl's per-side medians."""

import json

import pytest

from experiments import bench_trl, longctx_speed

OPTS = dict(
  experiment="needle_smollm2", steps=4, warmup=1, remat="full", sets=["loss.kl_coef=0.02"]
)


def flags_of(cmd):
  return [a for a in cmd if a.startswith("--")]


def test_each_side_is_bench_trl_in_its_own_process():
  ours = longctx_speed.side_command("ours", 2048, "/hf", "/o.jsonl", OPTS)
  naive = longctx_speed.side_command("naive", 2048, "/hf", "/o.jsonl", OPTS)
  trl = longctx_speed.side_command("trl", 2048, "/hf", "/o.jsonl", OPTS)
  assert ours[1].endswith("experiments/bench_trl.py")
  assert "--side=ours" in ours and "--side=ours" in naive and "--side=trl" in trl
  for cmd in (ours, naive, trl):
    f = flags_of(cmd)
    assert "--set=task.prompt_len=2048" in f and "--hf_folder=/hf" in f and "--remat=full" in f
    assert "--experiment=needle_smollm2" in f and "--set=loss.kl_coef=0.02" in f
    assert not any(a.startswith("--batch") for a in f)  # 0: the recipe's, not passed
  # the naive twin differs from ours by the replay mode alone
  assert set(flags_of(naive)) - set(flags_of(ours)) == {"--set=replay.mode=naive"}
  assert set(flags_of(trl)) ^ set(flags_of(ours)) == {"--side=trl", "--side=ours"}
  with_b = longctx_speed.side_command(
    "ours", 1024, "/hf", "/o", {**OPTS, "batch": 1, "branches": 16}
  )
  assert "--batch=1" in with_b and "--branches=16" in with_b
  with pytest.raises(ValueError, match="side='vllm'"):
    longctx_speed.side_command("vllm", 1024, "/hf", "/o", OPTS)


@pytest.mark.parametrize(
  "rc, timed_out, want",
  [
    (0, False, "ok"),
    (-9, False, "killed"),
    (137, False, "killed"),
    (1, False, "error"),
    (-9, True, "timeout"),
  ],
)
def test_how_a_process_ended(rc, timed_out, want):
  assert longctx_speed.status_of(rc, timed_out) == want


def step(i, s):
  return {"side": "ours", "index": i, "step": s, "update": s / 2}


def summary(side, step_s, rss, useful=None):
  name = "trl" if side == "trl" else "ours"
  row = {"summary": True, "median_s": {name: {k: step_s for k in longctx_speed.PHASES}}}
  return {**row, "peak_rss_mb": rss, "shape": {"B": 2}, "useful_flop_ratio": useful}


def test_a_point_from_a_finished_and_a_killed_side():
  done = longctx_speed.point_record(
    "naive", 4096, 0, False, 12.34, [step(0, 9.0), step(1, 4.0), summary("naive", 4.0, 900.0)]
  )
  assert done["status"] == "ok" and done["steps_reached"] == 2 and done["step_s"] == [9.0, 4.0]
  assert done["median_s"]["step"] == 4.0 and done["peak_rss_mb"] == 900.0 and done["wall_s"] == 12.3
  killed = longctx_speed.point_record("trl", 8192, -9, False, 600.0, [step(0, 500.0)])
  assert killed["status"] == "killed" and killed["steps_reached"] == 1 and "median_s" not in killed


def test_the_curve_line_divides_by_ours():
  points = {
    "ours": longctx_speed.point_record(
      "ours", 1024, 0, False, 1, [summary("ours", 2.0, 1000.0, 7.5)]
    ),
    "naive": longctx_speed.point_record(
      "naive", 1024, 0, False, 1, [summary("naive", 14.0, 3000.0)]
    ),
    "trl": longctx_speed.point_record("trl", 1024, 137, False, 1, []),
  }
  c = longctx_speed.curve_record(1024, points)
  assert c["ratio_naive_over_ours"]["step"] == 7.0 and c["peak_naive_over_ours"] == 3.0
  assert "ratio_trl_over_ours" not in c and c["status"]["trl"] == "killed"
  assert c["useful_flop_ratio"] == 7.5 and c["sides_ok"] == "naive,ours"
  assert c["step_s"] == {"ours": 2.0, "naive": 14.0} and c["update_s"]["naive"] == 14.0


def test_lines_cut_by_a_kill_are_dropped(tmp_path):
  path = tmp_path / "side.jsonl"
  path.write_text(json.dumps(step(0, 1.0)) + "\n" + '{"side": "ours", "ind')
  assert longctx_speed.read_lines(str(path)) == [step(0, 1.0)]
  assert longctx_speed.read_lines(str(tmp_path / "absent.jsonl")) == []


def test_side_medians_leave_out_the_warmup():
  rows = [
    {**{k: v for k in bench_trl.PHASES}, "reward_mean": 0.5, "loadavg_1m": [1.0, 1.0]}
    for v in (100.0, 3.0, 5.0, 4.0)
  ]
  m = bench_trl.side_medians(rows, warmup=1)
  assert m["step"] == 4.0 and m["timed_steps"] == 3 and m["reward_curve"] == [0.5] * 4
  one = bench_trl.side_medians(rows[:1], warmup=1)  # a single (slow) step: itself, said so
  assert one["step"] == 100.0 and one["timed_steps"] == 0


def test_a_long_first_timed_step_stands_alone():
  rows = [{"step": s} for s in (1200.0, 950.0)]
  # the warm-up step alone never stops it; the first timed one does where it is long
  assert not bench_trl.stop_early(rows[:1], warmup=1, long_step_s=900)
  assert bench_trl.stop_early(rows, warmup=1, long_step_s=900)
  assert not bench_trl.stop_early(rows, warmup=1, long_step_s=1000)
  assert not bench_trl.stop_early(rows, warmup=1, long_step_s=0)  # off
  # later steps are not judged again: a point that started short keeps its --steps
  assert not bench_trl.stop_early(rows + [{"step": 5000.0}], warmup=1, long_step_s=900)
  cmd = longctx_speed.side_command("trl", 8192, "/hf", "/o", {**OPTS, "long_step_s": 900.0})
  assert "--long_step_s=900.0" in cmd


def test_the_figure_reads_every_run_in_the_file(tmp_path):
  def point(side, P, step_s, flop=None):
    rec = longctx_speed.point_record(side, P, 0, False, 1, [summary(side, step_s, 100.0, flop)])
    return json.loads(json.dumps(rec))

  lines = [
    {"kind": "header"},
    point("ours", 1024, 2.0, 7.0),
    point("trl", 1024, 12.0),
    point("naive", 1024, 13.0),
    {"kind": "header"},  # a second run appended: 2,048 tokens
    point("ours", 2048, 3.0, 11.0),
    point("naive", 2048, 30.0),
    {"kind": "point", "side": "trl", "prompt_len": 2048, "status": "timeout", "step_s": [900.0]},
  ]
  c = longctx_speed.plot(lines, str(tmp_path / "curve.png"))
  assert c["step"]["ours"] == {1024: 2.0, 2048: 3.0} and c["step"]["trl"] == {1024: 12.0}
  assert c["flop"] == {1024: 7.0, 2048: 11.0} and c["update"]["naive"][2048] == 30.0
  assert (tmp_path / "curve.png").stat().st_size > 10_000


def test_the_figure_reads_several_files_in_order(tmp_path):
  first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  first.write_text(json.dumps({"kind": "point", "side": "ours", "prompt_len": 4096}) + "\n")
  second.write_text(json.dumps({"kind": "point", "side": "trl", "prompt_len": 4096}) + "\n")
  runs = longctx_speed.read_runs([str(first), str(second), str(tmp_path / "absent.jsonl")])
  assert [r["side"] for r in runs] == ["ours", "trl"]
