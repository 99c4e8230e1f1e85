"""Benchmark: one loss+gradient step on a tree batch, naive vs flat replay vs tree replay,
as JSON lines (one line per shape).

  naive  every root-to-leaf path as its own [P + T_1 + ... + T_D] sequence
         (engine.loss_and_grad, mode naive);
  flat   today's branch replay with the prompt as the prefix and each leaf's whole response
         (its openings re-run per leaf, then its tail) as one longer tail (the depth-1 tree);
  tree   tree replay (engine.py): the prompt once, each opening once, each tail once.

All three compute the same objective (an opening's tokens scored by every leaf below it with
that leaf's advantage) with the same model and attention, so their gradients agree.
Each variant runs in its own subprocess (clean memory accounting): warm-up, then the median
of --reps timed steps, wall and CPU seconds (process time: every thread); peak = RSS growth
during the timed steps (experiments/measure.py). --rounds=N runs the variants' subprocesses
N times, alternating (naive, flat, tree, naive, ...), and takes each speedup as the median of
its per-round ratios: this machine's speed drifts by 2x between minutes (its matmul probe
read 125 to 292 GFLOP/s), so only ratios of neighbouring runs compare code.

  python experiments/bench_tree.py                         # P=2048, 4x4, openings 256, tails 128
  python experiments/bench_tree.py --modes=naive,tree --rounds=3 --reps=2
  python experiments/bench_tree.py --preset=tiny --prefix_len=16 --fanouts=2x2 --lengths=4x3 --reps=1

Targets (small preset, CPU): tree faster than flat (issue 10); tree's CPU-time speedup over
naive >= 1.0 x its useful-FLOP ratio, with a lower peak than the 1,753 MB before the one
engine (issue 16).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

from experiments import compare, flops  # noqa: E402
from experiments.measure import PeakRSS, matmul_gflops  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_integer("prefix_len", 2048, "P: prompt tokens")
  flags.DEFINE_string("fanouts", "4x4", "fan-out per level, e.g. 4x4 (R_1 openings x R_2 tails)")
  flags.DEFINE_string("lengths", "256x128", "tokens per node at each level, e.g. 256x128")
  flags.DEFINE_integer("prompts", 1, "B: prompts per step")
  flags.DEFINE_integer("reps", 5, "timed repetitions after warm-up (median reported)")
  flags.DEFINE_integer(
    "rounds",
    1,
    "subprocesses per variant, alternating between variants; "
    "speedups are medians of the per-round ratios",
  )
  flags.DEFINE_string("preset", "small", "model size preset (models.transformer.PRESETS)")
  flags.DEFINE_string("dtype", "float32", "compute and parameter dtype")
  flags.DEFINE_bool("check_grads", True, "compare flat's and tree's gradients with naive's")
  flags.DEFINE_string("modes", "naive,flat,tree", "variants to run")
  flags.DEFINE_string("worker", "", "internal: run one variant and print JSON")
  flags.DEFINE_string("grads_out", "", "internal: where a worker saves its gradient")
  flags.DEFINE_string("out", "", "also append the JSON lines to this file")


def _ints(text):
  return tuple(int(x) for x in text.split("x"))


def model_config():
  from models import transformer as tfm

  return tfm.preset(FLAGS.preset, dtype=FLAGS.dtype, param_dtype=FLAGS.dtype)


def make_batches(cfg, B, P, fanouts, lengths):
  """(TreeBatch, the same objective as a flat batch): every node full, one advantage
  per leaf (inner nodes scored with their leaves' advantages, as flat replay must)."""
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.core.tree import TreeBatch, TreeLevel, flat, nodes

  rng = np.random.default_rng(0)
  n = math.prod(fanouts)
  levels = []
  for d, T in enumerate(lengths, start=1):
    R = nodes(fanouts, d)
    adv = jnp.asarray(rng.normal(size=(B, n)), cfg.compute_dtype) if d == len(fanouts) else None
    levels.append(
      TreeLevel(
        jnp.asarray(rng.integers(0, cfg.vocab_size, (B, R, T)), jnp.int32),
        jnp.ones((B, R, T), bool),
        advantages_BR=adv,
      )
    )
  root_BP = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P)), jnp.int32)
  tree_batch = TreeBatch(root_BP, jnp.ones((B, P), bool), tuple(levels), fanouts=tuple(fanouts))
  per_leaf = lambda x: jnp.repeat(x, n // x.shape[1], axis=1)
  tails_BRT = jnp.concatenate([per_leaf(l.tokens_BRT) for l in levels], axis=-1)
  return tree_batch, flat(
    prefix_BP=root_BP,
    prefix_valid_BP=jnp.ones((B, P), bool),
    tails_BRT=tails_BRT,
    tail_valid_BRT=jnp.ones(tails_BRT.shape, bool),
    advantages_BR=levels[-1].advantages_BR,
  )


def run_worker(mode):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import psutil
  from branch_replay.core import engine, losses, tree
  from models import transformer as tfm

  jnp.zeros(()).block_until_ready()
  rss_after_imports = psutil.Process().memory_info().rss
  cfg = model_config()
  fanouts, lengths = _ints(FLAGS.fanouts), _ints(FLAGS.lengths)
  params = tfm.init_params(cfg, jax.random.key(0))
  tree_batch, flat_batch = make_batches(cfg, FLAGS.prompts, FLAGS.prefix_len, fanouts, lengths)
  tree.validate(tree_batch, cfg.vocab_size)
  tree.validate(flat_batch, cfg.vocab_size)
  loss_cfg = losses.LossConfig()
  if mode == "flat":
    batch, fn = flat_batch, lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, "replay")
  else:
    batch = tree_batch
    fn = lambda p, b: engine.loss_and_grad(
      p, b, cfg, loss_cfg, "naive" if mode == "naive" else "replay"
    )
  compiled = jax.jit(lambda p, b: fn(p, b)[::2]).lower(params, batch).compile()
  jax.block_until_ready(compiled(params, batch))  # warm-up
  times, cpu_times = [], []
  with PeakRSS() as rss:
    for _ in range(FLAGS.reps):
      t0, c0 = time.perf_counter(), time.process_time()
      loss, grads = compiled(params, batch)
      jax.block_until_ready(grads)
      times.append(time.perf_counter() - t0)
      cpu_times.append(time.process_time() - c0)
  result = dict(
    mode=mode,
    seconds=float(np.median(times)),
    times=[round(t, 4) for t in times],
    cpu_seconds=float(np.median(cpu_times)),
    peak_mb=round((rss.peak - rss_after_imports) / 2**20, 1),
    loss=float(loss),
    backend=jax.default_backend(),
  )
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    result["device_peak_mb"] = round(stats["peak_bytes_in_use"] / 2**20, 1)
  if FLAGS.grads_out:
    np.savez(
      FLAGS.grads_out,
      **{str(i): np.asarray(x, np.float64) for i, x in enumerate(jax.tree.leaves(grads))},
    )
  print(json.dumps(result), flush=True)


def spawn(mode, grads_out):
  argv = [
    sys.executable,
    os.path.abspath(__file__),
    f"--worker={mode}",
    f"--prefix_len={FLAGS.prefix_len}",
    f"--fanouts={FLAGS.fanouts}",
    f"--lengths={FLAGS.lengths}",
    f"--prompts={FLAGS.prompts}",
    f"--reps={FLAGS.reps}",
    f"--preset={FLAGS.preset}",
    f"--dtype={FLAGS.dtype}",
    f"--grads_out={grads_out}",
  ]
  proc = subprocess.run(argv, capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    return dict(mode=mode, error=(proc.stderr or proc.stdout)[-2000:])
  return json.loads(lines[-1])


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker)
    return
  cfg = model_config()
  fanouts, lengths = _ints(FLAGS.fanouts), _ints(FLAGS.lengths)
  if len(fanouts) != len(lengths):
    raise app.UsageError(f"--lengths={FLAGS.lengths}: expected one per fan-out {fanouts}")
  B, P = FLAGS.prompts, FLAGS.prefix_len
  modes = FLAGS.modes.split(",")
  row = dict(
    prefix_len=P,
    fanouts=FLAGS.fanouts,
    lengths=FLAGS.lengths,
    prompts=B,
    preset=FLAGS.preset,
    dtype=FLAGS.dtype,
    matmul_gflops=round(matmul_gflops(), 1),
    date=time.strftime("%Y-%m-%d"),
  )
  # FLOPs as executed (dense masked attention: every query x key score of a segment)
  counts = {
    m: flops.step_flops(cfg, flops.tree(B, P, fanouts, lengths, m), dense=True)
    for m in ("naive", "flat", "tree")
  }
  for m, ratio in flops.tree_flop_ratios(cfg, B, P, fanouts, lengths).items():
    row[f"{m}_flop_ratio"] = round(ratio, 3)  # naive's FLOPs over flat's / tree's
  with tempfile.TemporaryDirectory() as tmp:
    paths = {m: os.path.join(tmp, f"{m}.npz") if FLAGS.check_grads else "" for m in modes}
    rounds = [{m: spawn(m, paths[m] if k == 0 else "") for m in modes} for k in range(FLAGS.rounds)]
    runs = rounds[0]
    for m in modes:
      ok = [r[m] for r in rounds if r[m].get("seconds")]
      errors = [r[m]["error"] for r in rounds if "error" in r[m]]
      if errors:
        row[f"{m}_error"] = errors[0]
      if not ok:
        row[f"{m}_s"] = row[f"{m}_peak_mb"] = None
        continue
      row[f"{m}_s"] = statistics.median([r["seconds"] for r in ok])
      row[f"{m}_cpu_s"] = statistics.median([r["cpu_seconds"] for r in ok])
      row[f"{m}_peak_mb"] = max(r["peak_mb"] for r in ok)
      if "device_peak_mb" in ok[0]:
        row[f"{m}_device_peak_mb"] = max(r["device_peak_mb"] for r in ok)
      row[f"{m}_gflops"] = round(counts[m] / row[f"{m}_s"] / 1e9, 1)
    if FLAGS.rounds > 1:
      row["rounds"] = [
        {
          f"{m}_{k}": r[m].get(key)
          for m in modes
          for k, key in (("s", "seconds"), ("cpu_s", "cpu_seconds"))
        }
        for r in rounds
      ]
    for m in ("flat", "tree"):
      paired = [
        r for r in rounds if r.get(m, {}).get("seconds") and r.get("naive", {}).get("seconds")
      ]
      if paired:
        for suffix, key in (("", "seconds"), ("_cpu", "cpu_seconds")):
          speedup = statistics.median([r["naive"][key] / r[m][key] for r in paired])
          row[f"{m}{suffix}_speedup"] = round(speedup, 3)
          row[f"{m}{suffix}_speedup_over_flop_ratio"] = round(speedup / row[f"{m}_flop_ratio"], 3)
      if (
        FLAGS.check_grads
        and "naive" in runs
        and os.path.exists(paths.get(m, ""))
        and os.path.exists(paths["naive"])
      ):
        row[f"{m}_grad_max_rel_err"] = compare.npz_max_rel_err(paths[m], paths["naive"])
        row[f"{m}_loss_abs_err"] = abs(runs[m]["loss"] - runs["naive"]["loss"])
    paired = [
      r for r in rounds if r.get("flat", {}).get("seconds") and r.get("tree", {}).get("seconds")
    ]
    if paired:
      row["tree_over_flat_speedup"] = round(
        statistics.median([r["flat"]["seconds"] / r["tree"]["seconds"] for r in paired]), 3
      )
  from experiments import provenance  # commit, command, jax/devices, machine, date

  provenance.emit(row, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
