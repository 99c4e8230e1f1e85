"""Per-device compiled memory of the replay train step (loss + gradient + AdamW update) under
context parallelism, compile only (`.lower().compile().memory_analysis()`, no step run), on
8 fake CPU devices: the shard_map all-gather path (model.context_parallel=all_gather) against
the partitioner's path (gspmd, the path before it), per prefix length P and mesh.

  python experiments/context_parallel_memory.py \
      --out=experiments/results/context_parallel_memory_cpu.jsonl
  python experiments/context_parallel_memory.py --preset=large --prefix_len=32768 \
      --mesh=context:1 --mesh=context:8 --mesh=fsdp:2,context:4 --scheme=all_gather

Each row compiles in its own subprocess (8 fake devices). Lines: kind=row with preset, P,
T, R, B, mesh, scheme and the per-device bytes of the compiled SPMD executable
(sharding.memory_report: arguments, outputs, temporaries, total), plus param_opt_mb, the
parameters and AdamW moments one device holds (from their shardings). bf16 compute on fp32
master weights, model.remat=full, as the issue asks. Results: README, "Context parallelism".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_multi_string("preset", ["small"], "model presets")
  flags.DEFINE_multi_integer("prefix_len", [8192, 32768], "P values")
  flags.DEFINE_multi_string(
    "mesh",
    ["context:1", "context:2", "context:4", "context:8"],
    "mesh specs over the 8 devices' first (product) devices",
  )
  flags.DEFINE_multi_string("scheme", ["all_gather", "gspmd"], "model.context_parallel values")
  flags.DEFINE_integer("tail_len", 512, "T")
  flags.DEFINE_integer("branches", 16, "R")
  flags.DEFINE_integer("prompts", 1, "B (raised to the mesh's data*fsdp size when smaller)")
  flags.DEFINE_string("dtype", "bfloat16", "compute dtype")
  flags.DEFINE_string("remat", "full", "remat policy")
  flags.DEFINE_integer("timeout_s", 1500, "per row")
  flags.DEFINE_string("worker", "", "internal: 'preset,P,mesh,scheme' -> one JSON line")
  flags.DEFINE_string("out", "", "append JSON lines here")


def worker(preset, P, spec, scheme):
  import jax
  import numpy as np
  from branch_replay.core import sharding
  from experiments import measure
  from models import transformer as tfm

  cfg = tfm.preset(
    preset, dtype=FLAGS.dtype, param_dtype="float32", remat=FLAGS.remat, context_parallel=scheme
  )
  sizes = sharding.parse_mesh_spec(
    spec, int(np.prod([int(s.split(":")[1]) for s in spec.split(",")]))
  )
  n = int(np.prod(list(sizes.values())))
  mesh = sharding.make_mesh(spec, jax.devices()[:n])
  B = max(FLAGS.prompts, sizes["data"] * sizes["fsdp"])
  R, T = FLAGS.branches, FLAGS.tail_len
  compiled, (params, opt_state) = measure.compile_replay_step(cfg, mesh, B, P, R, T)
  report = sharding.memory_report(compiled)
  mb = lambda b: round(b / 2**20, 1)
  return dict(
    preset=preset,
    P=P,
    T=T,
    R=R,
    B=B,
    mesh=spec,
    context=sizes["context"],
    scheme=scheme,
    dtype=FLAGS.dtype,
    remat=FLAGS.remat,
    per_device_mb=mb(report["total_bytes"]),
    temp_mb=mb(report["temp_bytes"]),
    argument_mb=mb(report["argument_bytes"]),
    output_mb=mb(report["output_bytes"]),
    alias_mb=mb(report["alias_bytes"]),
    param_opt_mb=mb(sharding.per_device_bytes((params, opt_state))),
  )


def main(argv):
  del argv
  if FLAGS.worker:
    preset, P, spec, scheme = FLAGS.worker.split(";")
    print(json.dumps(worker(preset, int(P), spec, scheme)), flush=True)
    return
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, "context_parallel_memory", with_jax=False)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
  passed = [
    a
    for a in sys.argv[1:]
    if not a.startswith(("--out", "--preset", "--prefix_len", "--mesh", "--scheme"))
  ]
  for preset in FLAGS.preset:
    for P in FLAGS.prefix_len:
      for spec in FLAGS.mesh:
        for scheme in FLAGS.scheme:
          if scheme == "gspmd" and spec == "context:1":
            continue  # context 1: both schemes are the same program
          argv = [
            sys.executable,
            os.path.abspath(__file__),
            *passed,
            f"--worker={preset};{P};{spec};{scheme}",
          ]
          try:
            proc = subprocess.run(
              argv, capture_output=True, text=True, env=env, timeout=FLAGS.timeout_s
            )
            lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
            row = (
              json.loads(lines[-1])
              if lines
              else dict(
                preset=preset,
                P=P,
                mesh=spec,
                scheme=scheme,
                error=f"exit {proc.returncode}: {proc.stderr[-400:]}",
              )
            )
          except subprocess.TimeoutExpired:
            row = dict(
              preset=preset,
              P=P,
              mesh=spec,
              scheme=scheme,
              error=f"compile over {FLAGS.timeout_s} s",
            )
          writer.write({"kind": "row", **row})


if __name__ == "__main__":
  define_flags()
  app.run(main)
