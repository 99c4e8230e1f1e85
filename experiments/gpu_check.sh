#!/usr/bin/env bash
# The device check: the replay benchmark on one GPU, JSON lines under $OUT.
# Run from the repo root on the device machine:  bash experiments/gpu_check.sh
# (its image brings its own jax/flax/optax; our pins apply to the CPU machines only).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; \
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$OUT/env.txt"
B="python3 experiments/bench_replay.py --out=$OUT/gpu_bench.jsonl --memory_cap_mb=120000"
# 1. The CPU target shape (small preset, float32), then a 4x longer prefix.
$B --preset=small --dtype=float32 --prefix_len=2048 --prefix_len=8192 --tail_len=128 \
   --branches=16 2>&1 | tee -a "$OUT/log.txt"
# 2. A ~1B-parameter model (large preset), bfloat16, remat on both paths, growing prefixes:
#    naive's dense attention stops fitting long before replay's does.
$B --preset=large --dtype=bfloat16 --remat --nocheck_grads --prefix_len=2048 \
   --prefix_len=8192 --prefix_len=16384 --tail_len=512 --branches=16 2>&1 | tee -a "$OUT/log.txt"
