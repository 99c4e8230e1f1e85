"""The long-context speed curve on the real model: one GRPO step of the needle recipe
(experiments/configs/needle_smollm2.py: SmolLM2-135M-Instruct, LoRA r16, KL, B x R branches of
T tokens) at several prompt lengths, for three sides, each in a process of its own:

  ours   branch replay (the recipe as it runs)
  naive  our naive twin (--set=replay.mode=naive: every branch its own sequence), the same code
         otherwise: the prefix sharing alone apart
  trl    TRL's GRPOTrainer on the same weights, prompts (our token ids), R, T, temperature, LoRA
         targets, optimizer and reward (experiments/bench_trl.py's matched settings)

Each side is `experiments/bench_trl.py --side=ours|trl` in its own process (no framework shares
the other's memory or threads), the order of the sides rotating from one prompt length to the
next. Every process reads one HF folder exported once from the GGUF. The same recomputation
on both frameworks (--remat: our model.remat; TRL's gradient checkpointing on unless none).

Per point and side: the medians of each phase (generation, reward, reference log-probs,
update, the whole step) over the steps after --warmup, and the process's peak RSS; a `curve`
line per prompt length: TRL / ours and naive / ours per phase, beside the useful-FLOP ratio
(experiments/flops.py). A side that fails (killed: out of memory on this machine; an error) or
runs past --timeout_s is recorded with the steps it reached, and not run at longer prompts.
A side whose first timed step takes longer than --long_step_s (15 min) keeps that single timed
step (its summary's steps_run says so). --plot draws every run appended to --out (and to the
files of --plot_with, read first): seconds per step against P, and the speedups beside the
useful-FLOP ratio; --plot_only redraws it.

  python experiments/longctx_speed.py --prompt_lens=1024,2048,4096,8192 --steps=4 \\
      --out=experiments/results/longctx_speed_cpu.jsonl \\
      --plot=experiments/results/longctx_speed_cpu.png
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "experiments", "bench_trl.py")
SIDES = ("ours", "naive", "trl")

from absl import app, flags  # noqa: E402

from experiments.bench_trl import PHASES  # noqa: E402  (the phases each side times)

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_list("prompt_lens", ["1024", "2048", "4096", "8192"], "task.prompt_len points")
  flags.DEFINE_list("sides", list(SIDES), "ours | naive | trl")
  flags.DEFINE_string("experiment", "needle_smollm2", "the recipe (experiments/registry.py)")
  flags.DEFINE_integer("steps", 4, "steps per side and point, warm-up included")
  flags.DEFINE_integer("warmup", 1, "first steps left out of the medians (compiles, warm-up)")
  flags.DEFINE_string("remat", "full", "model.remat for ours; TRL checkpoints unless none")
  flags.DEFINE_integer("batch", 0, "B prompts per step (0: the recipe's)")
  flags.DEFINE_integer("branches", 0, "R completions per prompt (0: the recipe's)")
  flags.DEFINE_integer("max_new_tokens", 0, "T (0: the recipe's)")
  flags.DEFINE_multi_string("set", [], "more overrides of the recipe, on every side")
  flags.DEFINE_float(
    "long_step_s", 900.0, "a side keeps a single timed step where that step takes longer (0: off)"
  )
  flags.DEFINE_integer("timeout_s", 3600, "a side's process is stopped past this (per point)")
  flags.DEFINE_string("out", "", "append the JSON lines to this file")
  flags.DEFINE_string("plot", "", "draw the curve of --out's lines (all its runs) to this PNG")
  flags.DEFINE_bool("plot_only", False, "only redraw --plot from --out, running nothing")
  flags.DEFINE_list(
    "plot_with", [], "earlier results files --plot also draws (--out's lines win at a length)"
  )


def side_command(side: str, prompt_len: int, hf_folder: str, out: str, opts: dict) -> list:
  """bench_trl.py's command line for one side at one prompt length."""
  if side not in SIDES:
    raise ValueError(f"side={side!r}: expected one of {SIDES}")
  cmd = [
    sys.executable,
    BENCH,
    f"--side={'trl' if side == 'trl' else 'ours'}",
    f"--experiment={opts['experiment']}",
    f"--hf_folder={hf_folder}",
    f"--steps={opts['steps']}",
    f"--warmup={opts['warmup']}",
    f"--remat={opts['remat']}",
    f"--long_step_s={opts.get('long_step_s', 0.0)}",
    f"--out={out}",
    f"--set=task.prompt_len={prompt_len}",
  ]
  for name in ("batch", "branches", "max_new_tokens"):
    if opts.get(name):
      cmd.append(f"--{name}={opts[name]}")
  cmd += [f"--set={s}" for s in opts.get("sets", ())]
  if side == "naive":
    cmd.append("--set=replay.mode=naive")
  return cmd


def status_of(rc, timed_out: bool) -> str:
  """ok | timeout | killed (SIGKILL: on this machine the kernel's out-of-memory killer) | error."""
  if timed_out:
    return "timeout"
  if rc == 0:
    return "ok"
  if rc in (-9, 137):
    return "killed"
  return "error"


def point_record(side: str, prompt_len: int, rc, timed_out: bool, wall_s: float, lines) -> dict:
  """One side at one prompt length, from its process's exit and the JSON lines it wrote."""
  steps = [r for r in lines if "index" in r and not r.get("summary")]
  summary = next((r for r in lines if r.get("summary")), None)
  rec = {
    "kind": "point",
    "side": side,
    "prompt_len": prompt_len,
    "status": status_of(rc, timed_out),
    "rc": rc,
    "wall_s": round(wall_s, 1),
    "steps_reached": len(steps),
    "step_s": [r["step"] for r in steps],  # every step, warm-up included
  }
  if summary is not None:
    name = "trl" if side == "trl" else "ours"
    rec.update(
      median_s=summary["median_s"][name],
      peak_rss_mb=summary.get("peak_rss_mb"),
      shape=summary.get("shape"),
      useful_flop_ratio=summary.get("useful_flop_ratio"),
      trl_settings=summary.get("trl_settings"),
    )
  return rec


def curve_record(prompt_len: int, points: dict) -> dict:
  """A prompt length's ratios: TRL / ours and naive / ours per phase (where both ran), peak
  memory ratios, and the useful-FLOP ratio of the shape ours ran."""
  ok = {s: p for s, p in points.items() if p.get("median_s")}
  rec = {
    "kind": "curve",
    "prompt_len": prompt_len,
    "status": {s: p["status"] for s, p in points.items()},
    # flat, for a table's `where` (several runs of one length appended to one file)
    "sides_ok": ",".join(sorted(ok)),
  }
  if "ours" in ok:
    base = ok["ours"]["median_s"]
    for other in ("trl", "naive"):
      if other in ok:
        rec[f"ratio_{other}_over_ours"] = {
          k: ok[other]["median_s"][k] / base[k] for k in PHASES if base.get(k, 0) > 0
        }
        mine, theirs = ok["ours"].get("peak_rss_mb"), ok[other].get("peak_rss_mb")
        if mine and theirs:
          rec[f"peak_{other}_over_ours"] = theirs / mine
    rec["useful_flop_ratio"] = ok["ours"].get("useful_flop_ratio")
  rec["peak_rss_mb"] = {s: p.get("peak_rss_mb") for s, p in points.items()}
  # each side's medians and how many steps they are of (the table reads this line alone)
  for phase in ("step", "update", "generate", "ref_logp"):
    rec[f"{phase}_s"] = {s: p["median_s"][phase] for s, p in ok.items()}
  rec["timed_steps"] = {s: p["median_s"].get("timed_steps") for s, p in ok.items()}
  return rec


def read_lines(path: str) -> list:
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:  # a line cut by a kill
        pass
  return out


def read_runs(paths: list) -> list:
  """The lines of several results files in order (a later file's point wins at a length)."""
  return [line for path in paths for line in read_lines(path)]


def curve_of(lines: list) -> dict:
  """The figure's data from the results lines (one file, or several runs appended): per side,
  prompt length -> median seconds per step and update (the last point line of each wins); per
  prompt length the useful-FLOP ratio."""
  out = {"step": {}, "update": {}, "flop": {}}
  for r in lines:
    if r.get("kind") != "point" or not r.get("median_s"):
      continue
    P, side = r["prompt_len"], r["side"]
    for phase in ("step", "update"):
      out[phase].setdefault(side, {})[P] = r["median_s"][phase]
    if side == "ours" and r.get("useful_flop_ratio"):
      out["flop"][P] = r["useful_flop_ratio"]
  return out


def plot(lines: list, path: str) -> dict:
  """Seconds per step against P for each side (left); TRL / ours and naive / ours for the whole
  step and the update against P beside the useful-FLOP ratio (right). Returns curve_of(lines)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  c = curve_of(lines)
  fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
  for side, pts in sorted(c["step"].items()):
    Ps = sorted(pts)
    left.plot(Ps, [pts[P] for P in Ps], marker="o", label=side)
  left.set(xscale="log", yscale="log", xlabel="prompt tokens P", ylabel="seconds per GRPO step")
  left.set_title("one step (median)")
  left.legend()
  ours = c["step"].get("ours", {})
  for other, style in (("trl", "-"), ("naive", "--")):
    for phase, marker in (("step", "o"), ("update", "s")):
      mine, theirs = c[phase].get("ours", {}), c[phase].get(other, {})
      Ps = sorted(P for P in theirs if P in mine)
      if Ps:
        right.plot(
          Ps,
          [theirs[P] / mine[P] for P in Ps],
          style,
          marker=marker,
          label=f"{other} / ours, {phase}",
        )
  Ps = sorted(P for P in c["flop"] if P in ours)
  if Ps:
    right.plot(Ps, [c["flop"][P] for P in Ps], ":", color="k", label="useful-FLOP ratio")
  right.set(xscale="log", xlabel="prompt tokens P", ylabel="times faster than ours' time")
  right.set_title("speedup of branch replay")
  right.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return c


def run_side(cmd: list, timeout_s: float):
  """(rc, timed_out, wall_s): the side's process, stopped past timeout_s."""
  t0 = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    _, err = proc.communicate(timeout=timeout_s)
    timed_out = False
  except subprocess.TimeoutExpired:
    proc.kill()
    _, err = proc.communicate()
    timed_out = True
  if proc.returncode not in (0, None) and not timed_out:
    sys.stderr.write(err.decode(errors="replace")[-4000:])
  return proc.returncode, timed_out, time.perf_counter() - t0


def main(argv):
  del argv
  from experiments import bench_trl
  from experiments.provenance import ResultsWriter

  if FLAGS.plot_only:
    if not (FLAGS.plot and FLAGS.out):
      raise app.UsageError("--plot_only: give --out (the results to read) and --plot (the PNG)")
    print(json.dumps(plot(read_runs([*FLAGS.plot_with, FLAGS.out]), FLAGS.plot)))
    return

  # every side reads the HF folder that torch + transformers export, and TRL's is trl's:
  # named now (requirements-peer.txt), not as a child process's traceback
  bench_trl.require_peers()

  opts = dict(
    experiment=FLAGS.experiment,
    steps=FLAGS.steps,
    warmup=FLAGS.warmup,
    remat=FLAGS.remat,
    long_step_s=FLAGS.long_step_s,
    batch=FLAGS.batch,
    branches=FLAGS.branches,
    max_new_tokens=FLAGS.max_new_tokens,
    sets=FLAGS.set,
  )
  sides = list(FLAGS.sides)
  for s in sides:
    if s not in SIDES:
      raise app.UsageError(f"--sides: {s!r}, expected some of {','.join(SIDES)}")
  lens = [int(p) for p in FLAGS.prompt_lens]
  writer = ResultsWriter(FLAGS.out, "longctx_speed", argv=sys.argv, with_jax=False)
  work = tempfile.mkdtemp(prefix="longctx_speed_")
  hf = os.path.join(work, "hf")
  subprocess.run([sys.executable, BENCH, f"--export_only={hf}"], cwd=ROOT, check=True)
  writer.write({"kind": "header", "opts": opts, "prompt_lens": lens, "sides": sides})
  failed = {}  # side -> the prompt length it failed at
  for k, P in enumerate(lens):
    order = sides[k % len(sides) :] + sides[: k % len(sides)]
    points = {}
    for side in order:
      if side in failed:
        status, at = failed[side]
        points[side] = writer.write_plain(
          {"kind": "point", "side": side, "prompt_len": P, "status": f"skipped ({status} at {at})"}
        )
        continue
      out = os.path.join(work, f"{side}_{P}.jsonl")
      cmd = side_command(side, P, hf, out, opts)
      rc, timed_out, wall = run_side(cmd, FLAGS.timeout_s)
      points[side] = writer.write_plain(point_record(side, P, rc, timed_out, wall, read_lines(out)))
      if points[side]["status"] != "ok":
        failed[side] = (points[side]["status"], P)
    writer.write(curve_record(P, points))
    if FLAGS.plot and FLAGS.out:
      plot(read_runs([*FLAGS.plot_with, FLAGS.out]), FLAGS.plot)


if __name__ == "__main__":
  define_flags()
  app.run(main)
