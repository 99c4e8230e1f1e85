"""Benchmark: branch replay vs naive on a hybrid model (Qwen3.5 layout: 3 Gated DeltaNet
layers per full-attention layer) beside the pure-attention preset of the same size, as JSON
lines. Each (preset, mode, P) runs in its own `bench_replay.py --worker` subprocess; P values
in --compile_only are compiled, not run (the compiled footprint from memory_analysis).

  python experiments/bench_hybrid.py --out=experiments/results/hybrid_cpu_2026-12-01.jsonl
  python experiments/bench_hybrid.py --timed=0 --compile_only=32768 --modes=replay  # memory

The useful-FLOP count of a linear layer is its projections, its convolution and the
recurrent form of the delta rule (3 H x J products per value head and token: read, write,
output); the chunked form's intra-chunk work is overhead, as remat's recomputation is.
Results: experiments/results/hybrid_cpu_2026-12-01.jsonl.
"""

from __future__ import annotations

import os
import shutil
import time

if __name__ == "__main__" and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

from experiments import bench_replay, flops  # noqa: E402  (define_flags: bench_replay's too)

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments):
  bench_replay's (--reps, --dtype, --out, ...) and its own."""
  bench_replay.define_flags()
  flags.DEFINE_multi_string("presets", ["hybrid_small", "small"], "model presets to compare")
  flags.DEFINE_multi_integer("timed", [2048], "P values timed (both modes)")
  flags.DEFINE_multi_integer("compile_only", [8192, 32768], "P values only compiled")
  flags.DEFINE_multi_string("modes", ["replay", "naive"], "paths to run (0 in --timed: none)")


def main(argv):
  del argv
  from models import transformer as tfm

  T, R, B = FLAGS.tail_len[0], FLAGS.branches[0], FLAGS.prompts
  reps = FLAGS.reps
  for P in [p for p in (*FLAGS.timed, *FLAGS.compile_only) if p > 0]:
    for preset in FLAGS.presets:
      FLAGS.preset = preset
      FLAGS.reps = reps if P in FLAGS.timed else 0
      cfg = tfm.preset(preset)
      runs = {
        m: bench_replay.spawn(m, P, T, R, "") if m in FLAGS.modes else {}
        for m in ("replay", "naive")
      }
      rep, nai = runs["replay"], runs["naive"]
      flop_ratio = flops.useful_flop_ratio(
        cfg, flops.flat(B, R, P, T, "naive"), flops.flat(B, R, P, T, "replay")
      )
      row = dict(
        preset=preset,
        layer_types=list(cfg.layer_types or []),
        prefix_len=P,
        tail_len=T,
        branches=R,
        prompts=B,
        dtype=FLAGS.dtype,
        timed=FLAGS.reps > 0,
        reps=FLAGS.reps,
        flop_ratio=round(flop_ratio, 3),
        replay_compiled_mb=rep.get("compiled_mb"),
        naive_compiled_mb=nai.get("compiled_mb"),
        replay_s=rep.get("seconds"),
        naive_s=nai.get("seconds"),
        replay_cpu_s=rep.get("cpu_seconds"),
        naive_cpu_s=nai.get("cpu_seconds"),
        replay_peak_mb=rep.get("peak_mb"),
        naive_peak_mb=nai.get("peak_mb"),
        backend=rep.get("backend"),
        date=time.strftime("%Y-%m-%d"),
      )
      if rep.get("cpu_seconds") and nai.get("cpu_seconds"):
        row["cpu_speedup"] = round(nai["cpu_seconds"] / rep["cpu_seconds"], 3)
        row["cpu_speedup_over_flop_ratio"] = round(row["cpu_speedup"] / flop_ratio, 3)
      if rep.get("seconds") and nai.get("seconds"):
        row["speedup"] = round(nai["seconds"] / rep["seconds"], 3)
        row["speedup_over_flop_ratio"] = round(row["speedup"] / flop_ratio, 3)
      for m in ("replay", "naive"):
        if runs[m].get("oom"):
          row[f"{m}_oom"] = True
        if "error" in runs[m]:
          row[f"{m}_error"] = runs[m]["error"][-500:]
      bench_replay.emit(row)


if __name__ == "__main__":
  define_flags()
  app.run(main)
