"""Q3: how far does memory go? The longest prefix P each path can take one loss+gradient
step on, per branch count R, under a memory cap: grow P by doubling, then bisect, each trial
in its own subprocess (bench_replay.py's worker: compiled footprint, then a real step whose
peak RSS growth on a CPU, or device peak on a GPU, must stay under the cap).

  python experiments/q3_memory_frontier.py --cap_mb=12000 \
      --out=experiments/results/q3_cpu_$(date +%F).jsonl         # CPU, small preset
  python experiments/q3_memory_frontier.py --preset=large --dtype=bfloat16 --remat=full \
      --cap_mb=130000 --start=2048 --max_prefix_len=262144       # one GPU
  python experiments/q3_memory_frontier.py --preset=tiny --branches=2 --start=16 \
      --max_prefix_len=64 --granularity=16 --cap_mb=2000         # the smoke test's size

Lines: kind=trial (mode, R, P, fits, compiled/peak MB or the reason it did not fit) and
kind=frontier (mode, R, the longest P that fit, the first that did not, the memory
of the longest). Measured (--compiled_only, 20 GB cap): docs/reproduction.md, Q3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Flags of the command line (defined only when run as a script, so the tests can
  import several experiments)."""
  flags.DEFINE_multi_integer("branches", [4, 8, 16], "R values")
  flags.DEFINE_multi_string("mode", ["replay", "naive"], "paths")
  flags.DEFINE_integer("tail_len", 128, "T")
  flags.DEFINE_integer("prompts", 1, "B")
  flags.DEFINE_string("preset", "small", "model preset")
  flags.DEFINE_string("dtype", "float32", "dtype")
  flags.DEFINE_string("remat", "none", "remat policy of both paths: none|full|dots")
  flags.DEFINE_integer("branch_chunk", 0, "replay tails in chunks of C (0 = all)")
  flags.DEFINE_float("cap_mb", 12000, "memory cap per trial (MB)")
  flags.DEFINE_integer("start", 512, "first P tried")
  flags.DEFINE_integer("max_prefix_len", 1 << 20, "stop growing here")
  flags.DEFINE_integer("granularity", 256, "bisect down to this many positions")
  flags.DEFINE_integer("timeout_s", 1800, "a trial running longer counts as not fitting")
  flags.DEFINE_bool(
    "compiled_only",
    False,
    "a trial fits iff XLA's compiled footprint of the "
    "step (temp + arguments + outputs) is under the cap; no step is run (fast, "
    "deterministic; the measured peaks of real steps are in bench_replay's rows)",
  )
  flags.DEFINE_string("out", "", "append JSON lines here")


BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_replay.py")


def trial(mode, P, R, opts) -> dict:
  """One step of `mode` at prefix P in a fresh process; fits iff it compiled under the cap,
  ran, and its measured peak stayed under the cap."""
  argv = [
    sys.executable,
    BENCH,
    f"--worker={mode}",
    f"--prefix_len={P}",
    f"--tail_len={opts['tail_len']}",
    f"--branches={R}",
    f"--prompts={opts['prompts']}",
    f"--reps={0 if opts.get('compiled_only') else 1}",
    f"--preset={opts['preset']}",
    f"--dtype={opts['dtype']}",
    f"--remat={opts['remat']}",
    f"--branch_chunk={opts['branch_chunk']}",
    f"--memory_cap_mb={opts['cap_mb']}",
  ]
  try:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=opts["timeout_s"])
  except subprocess.TimeoutExpired:
    return dict(fits=False, reason="timeout")
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:  # e.g. killed by the kernel's OOM killer
    return dict(fits=False, reason=f"exit {proc.returncode}: {(proc.stderr or '')[-300:]}")
  res = json.loads(lines[-1])
  peak = res.get("device_peak_mb", res.get("peak_mb"))
  out = dict(compiled_mb=res.get("compiled_mb"), peak_mb=peak, seconds=res.get("seconds"))
  if res.get("oom"):
    return dict(out, fits=False, reason="compiled footprint over the cap or runtime oom")
  if peak is not None and peak > opts["cap_mb"]:
    return dict(out, fits=False, reason="measured peak over the cap")
  if opts.get("compiled_only") and res.get("compiled_mb") is None:
    return dict(out, fits=False, reason="no compiled footprint on this backend")
  return dict(out, fits=True, measured="compiled" if opts.get("compiled_only") else "run")


def frontier(mode, R, opts, writer, trial_fn=trial) -> dict:
  """Double P from opts['start'] until a trial fails (or max_prefix_len), then bisect to
  opts['granularity']."""
  g, results = opts["granularity"], {}

  def run(P):
    res = trial_fn(mode, P, R, opts)
    results[P] = res
    writer.write({"kind": "trial", "mode": mode, "R": R, "P": P, "T": opts["tail_len"], **res})
    return res["fits"]

  good, bad, P = None, None, opts["start"]
  while P <= opts["max_prefix_len"]:
    if run(P):
      good, P = P, P * 2
    else:
      bad = P
      break
  if good is not None and bad is not None:
    while bad - good > g:
      mid = (good + bad) // 2 // g * g
      if mid <= good:
        break
      if run(mid):
        good = mid
      else:
        bad = mid
  best = results.get(good, {})
  return writer.write(
    {
      "kind": "frontier",
      "mode": mode,
      "R": R,
      "T": opts["tail_len"],
      "longest_prefix": good,
      "first_failing": bad,
      "capped_by_max": bad is None,
      "cap_mb": opts["cap_mb"],
      "peak_mb_at_longest": best.get("peak_mb"),
      "compiled_mb_at_longest": best.get("compiled_mb"),
      **{k: opts.get(k) for k in ("preset", "dtype", "remat", "prompts", "compiled_only")},
    }
  )


def main(argv):
  del argv
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, "q3_memory_frontier", with_jax=False)
  opts = {
    k: getattr(FLAGS, k)
    for k in (
      "tail_len",
      "prompts",
      "preset",
      "dtype",
      "remat",
      "branch_chunk",
      "cap_mb",
      "start",
      "max_prefix_len",
      "granularity",
      "timeout_s",
      "compiled_only",
    )
  }
  for R in FLAGS.branches:
    for mode in FLAGS.mode:
      frontier(mode, R, opts, writer)


if __name__ == "__main__":
  define_flags()
  app.run(main)
