"""Benchmark: attention forward+backward, dense oracle vs blockwise at several block sizes.

Prefix self-attention of the small preset (N=4 query heads, K=2 kv heads, H=64), float32,
one prompt: the gradient of sum(o * w) w.r.t. q, k, v under one jax.jit. Prints one JSON line
per (impl, P, block sizes): compile seconds, the median of --reps fwd+bwd seconds, and useful
GFLOP/s counting causal attention once (fwd 4*P*P/2*N*H, fwd+bwd 2.5x that), the process's
CPU seconds per step and its busiest thread's CPU seconds per step (both less sensitive to
other jobs than wall time; the busiest thread approximates the wall time on an idle machine),
and a float32
1024 x 1024 matmul's GFLOP/s (experiments/measure.py: median of 5; the committed
attention_cpu_2026-11-30.jsonl took the best of 5) measured in the same run (the machine's
reference rate: the CPU is shared
and noisy, so compare rows of one run).

  python experiments/bench_attention.py                        # P=2048, dense + block sweep
  python experiments/bench_attention.py --prefix_len=8192 --impl=blockwise --blocks=512x512
  python experiments/bench_attention.py --mode=tail --prefix_len=2048 --tail_len=128 \
      --branches=16                                            # the replay tail's attention
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.measure import matmul_gflops  # noqa: E402
from models import attention  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_multi_integer("prefix_len", [2048], "P: prefix tokens (repeatable)")
  flags.DEFINE_enum(
    "mode",
    "prefix",
    ["prefix", "tail"],
    "prefix: causal self-attention over P; tail: R*T tail queries against the "
    "shared P-token prefix (folded) + their own keys causally",
  )
  flags.DEFINE_integer("tail_len", 128, "T (tail mode)")
  flags.DEFINE_integer("branches", 16, "R (tail mode)")
  flags.DEFINE_multi_string("impl", ["dense", "blockwise"], "implementations (repeatable)")
  flags.DEFINE_multi_string(
    "blocks",
    ["64x64", "64x128", "128x64", "128x128", "256x256", "512x512"],
    "block_q x block_k for blockwise",
  )
  flags.DEFINE_integer("heads", 4, "N")
  flags.DEFINE_integer("kv_heads", 2, "K")
  flags.DEFINE_integer("head_dim", 64, "H")
  flags.DEFINE_integer("reps", 3, "timed repetitions (median)")
  flags.DEFINE_integer("window", 0, "sliding window (0: none)")
  flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "q/k/v dtype")


def thread_ticks():
  """CPU clock ticks used so far by each thread of this process (Linux)."""
  out = {}
  for t in os.listdir("/proc/self/task"):
    try:
      fields = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    out[t] = int(fields[11]) + int(fields[12])
  return out


def inputs(P):
  N, K, H = FLAGS.heads, FLAGS.kv_heads, FLAGS.head_dim
  dt = jnp.dtype(FLAGS.dtype)
  rng = np.random.default_rng(0)
  new = lambda *s: jnp.asarray(rng.normal(size=s), dt)
  pos_BP = jnp.arange(P)[None]
  valid_BP = jnp.ones((1, P), bool)
  if FLAGS.mode == "prefix":
    return (
      new(1, P, N, H),
      pos_BP,
      valid_BP,
      [attention.KeySegment(new(1, P, K, H), new(1, P, K, H), pos_BP, valid_BP, causal=True)],
    )
  R, T = FLAGS.branches, FLAGS.tail_len
  pos_BT = jnp.broadcast_to(P + jnp.arange(T)[None], (R, T))
  valid_BT = jnp.ones((R, T), bool)
  return (
    new(R, T, N, H),
    pos_BT,
    valid_BT,
    [
      attention.KeySegment(new(1, P, K, H), new(1, P, K, H), pos_BP, valid_BP),
      attention.KeySegment(new(R, T, K, H), new(R, T, K, H), pos_BT, valid_BT, causal=True),
    ],
  )


def useful_flops(P):
  N, H = FLAGS.heads, FLAGS.head_dim
  if FLAGS.mode == "prefix":
    pairs = P * P / 2
  else:
    R, T = FLAGS.branches, FLAGS.tail_len
    pairs = R * T * (P + T / 2)
  return 2.5 * 4 * pairs * N * H


def bench(impl, P, block_q, block_k):
  q, q_pos, q_valid, segs = inputs(P)
  window = FLAGS.window or None

  def loss(q, kvs):
    s = [seg._replace(k_BSKH=k, v_BSKH=v) for seg, (k, v) in zip(segs, kvs)]
    o = attention.attend(
      q, q_pos, q_valid, s, impl=impl, window=window, block_q=block_q, block_k=block_k
    )
    return jnp.sum(o.astype(jnp.float32) * jnp.float32(0.01))

  kvs = [(s.k_BSKH, s.v_BSKH) for s in segs]
  t = time.perf_counter()
  step = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(q, kvs).compile()
  compile_s = time.perf_counter() - t
  jax.block_until_ready(step(q, kvs))
  times, cpu = [], []
  ticks0 = thread_ticks()
  for _ in range(FLAGS.reps):
    t, c = time.perf_counter(), time.process_time()
    jax.block_until_ready(step(q, kvs))
    times.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
  ticks1 = thread_ticks()
  busiest = max(ticks1[t] - ticks0.get(t, 0) for t in ticks1) / os.sysconf("SC_CLK_TCK")
  sec = float(np.median(times))
  return dict(
    impl=impl,
    mode=FLAGS.mode,
    P=P,
    T=FLAGS.tail_len if FLAGS.mode == "tail" else P,
    R=FLAGS.branches if FLAGS.mode == "tail" else 1,
    block_q=block_q,
    block_k=block_k,
    dtype=FLAGS.dtype,
    window=window,
    compile_s=round(compile_s, 2),
    fwd_bwd_s=round(sec, 4),
    min_s=round(min(times), 4),
    cpu_s=round(float(np.median(cpu)), 4),
    busiest_thread_s=round(busiest / FLAGS.reps, 4),
    useful_gflops=round(useful_flops(P) / sec / 1e9, 2),
  )


def main(_):
  print(json.dumps(dict(matmul_gflops=round(matmul_gflops(n=1024), 1))), flush=True)
  for P in FLAGS.prefix_len:
    for impl in FLAGS.impl:
      blocks = (
        [(0, 0)] if impl == "dense" else [tuple(map(int, b.split("x"))) for b in FLAGS.blocks]
      )
      for bq, bk in blocks:
        print(json.dumps(bench(impl, P, bq or 512, bk or 512)), flush=True)
  print(json.dumps(dict(matmul_gflops=round(matmul_gflops(n=1024), 1))), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
