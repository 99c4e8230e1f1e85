"""Where PrefixGrouper's step goes, beside experiments/profile_replay.py's view of ours: the same
model, weights, tokens and loss as experiments/bench_peer.py (its `write_inputs` and
`peer_step_fn`: PrefixGrouper at full strength; --explicit_mask: the explicit-mask twin on every
attention call, as bench_peer ran it before issue 45), one torch.profiler trace of --trace_reps
steps after two warm-up steps; every aten op's self CPU time per step, and the time by class:
`matmul` (mm, bmm, addmm, linear), `attention` (scaled_dot_product_attention's forward and
backward kernels), `elementwise` (every other op). One JSON line per class and per op (with
provenance), and the median step with the attention calls per step by path.

  pip install -r requirements-peer.txt
  python experiments/profile_peer.py --prefix_len=1024 --tail_len=512 --branches=8 \
      --out=experiments/results/profile_peer_cpu_T512_2026-12-04.jsonl
  # after issue 45 (full strength) and the twin it replaced, at a small shape on a loaded
  # machine (load ~11 on 2 cores): attention 1,037 vs 1,159 ms per step, elementwise 4,608 vs
  # 6,066 (CPU self time; the step times, 8.8 vs 8.0 s, are the load's, not the method's)
  python experiments/profile_peer.py --prefix_len=1024 --tail_len=128 --branches=8 --reps=3 \
      --trace_reps=2 --explicit_mask=false \
      --out=experiments/results/profile_peer_cpu_P1024_full_strength_2026-12-05.jsonl
  python experiments/profile_peer.py --prefix_len=1024 --tail_len=128 --branches=8 --reps=3 \
      --trace_reps=2 --explicit_mask=true \
      --out=experiments/results/profile_peer_cpu_P1024_explicit_mask_2026-12-05.jsonl
"""

from __future__ import annotations

import json
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_integer("prefix_len", 2048, "P")
  flags.DEFINE_integer("tail_len", 128, "T")
  flags.DEFINE_integer("branches", 16, "R")
  flags.DEFINE_string("preset", "small", "model size preset (as bench_peer's)")
  flags.DEFINE_integer("threads", 2, "torch's intra-op threads")
  flags.DEFINE_integer("reps", 4, "timed steps (median) before the trace")
  flags.DEFINE_integer("trace_reps", 2, "steps under the profiler")
  flags.DEFINE_integer("top", 25, "ops reported")
  flags.DEFINE_string("out", "", "write the JSON lines here (else stdout only)")
  flags.DEFINE_bool(
    "explicit_mask",
    False,
    "the peer's attention with an explicit mask on every call (bench_peer's naive twin, the "
    "bench before issue 45) instead of its fast paths",
  )


def op_class(name: str) -> str:
  """An aten op's class: matmul, attention (SDPA's kernels) or elementwise (the rest)."""
  if "scaled_dot_product" in name or "flash_attention" in name:
    return "attention"
  if name in ("aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear"):
    return "matmul"
  return "elementwise"


def main(argv):
  del argv
  import importlib.util

  missing = [
    m for m in ("torch", "transformers", "prefix_grouper") if importlib.util.find_spec(m) is None
  ]
  if missing:
    raise SystemExit(
      f"profile_peer: the peer needs {', '.join(missing)} (not installed); run "
      "pip install -r requirements-peer.txt"
    )
  import numpy as np
  from torch.profiler import ProfilerActivity, profile

  from experiments import bench_peer, provenance

  P, T, R = FLAGS.prefix_len, FLAGS.tail_len, FLAGS.branches
  with tempfile.TemporaryDirectory() as folder:
    cfg = bench_peer.write_inputs(folder, P, T, R)
    batch = dict(np.load(os.path.join(folder, "batch.npz")))
    step, _ = bench_peer.peer_step_fn(
      folder, batch, FLAGS.threads, fast_attention=not FLAGS.explicit_mask
    )
    step(), step()  # warm-up
    times = []
    for _ in range(FLAGS.reps):
      t0 = time.perf_counter()
      step()
      times.append(time.perf_counter() - t0)
    bench_peer.ATTENTION_CALLS.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
      for _ in range(FLAGS.trace_reps):
        step()
    calls = {k: n // FLAGS.trace_reps for k, n in bench_peer.ATTENTION_CALLS.items()}
  ops = sorted(
    (
      (e.key, e.self_cpu_time_total / 1e3 / FLAGS.trace_reps, e.count / FLAGS.trace_reps)
      for e in prof.key_averages()
    ),
    key=lambda x: -x[1],
  )
  total = sum(ms for _, ms, _ in ops)
  shape = dict(
    prefix_len=P,
    tail_len=T,
    branches=R,
    preset=FLAGS.preset,
    n_layers=cfg.n_layers,
    d_model=cfg.d_model,
    dtype="float32",
    explicit_mask=FLAGS.explicit_mask,
  )
  classes = {}
  for name, ms, _ in ops:
    classes[op_class(name)] = classes.get(op_class(name), 0.0) + ms
  lines = [
    dict(
      kind="summary",
      step_s=round(float(np.median(times)), 4),
      traced_ms_per_step=round(total, 1),
      attention_calls_per_step=calls,
      n_params=bench_peer.model_size(cfg)["n_params"],
      **shape,
    )
  ]
  lines += [
    dict(kind="class", op_class=c, ms_per_step=round(ms, 1), share=round(ms / total, 3), **shape)
    for c, ms in sorted(classes.items(), key=lambda x: -x[1])
  ]
  lines += [
    dict(
      kind="op",
      rank=i + 1,
      op=name,
      op_class=op_class(name),
      ms_per_step=round(ms, 2),
      calls_per_step=calls,
      **shape,
    )
    for i, (name, ms, calls) in enumerate(ops[: FLAGS.top])
  ]
  prov = provenance.provenance()
  text = "\n".join(json.dumps(dict(line, provenance=prov)) for line in lines)
  print(text, flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  define_flags()
  app.run(main)
