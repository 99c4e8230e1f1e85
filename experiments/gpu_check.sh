#!/usr/bin/env bash
# The device check: the replay benchmark on one GPU, JSON lines under $OUT.
# Run from the repo root on the device machine:  bash experiments/gpu_check.sh
# (its image brings its own jax/flax/optax; our pins apply to the CPU machines only).
# MFU = useful FLOPs (causal attention counted once) / (seconds x 989 TFLOP/s, the H200's
# dense bf16 peak): experiments/results_table.py computes it from the JSON lines.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
SMOKE=${SMOKE:-0}  # SMOKE=1: tiny sizes, to check the script itself on a CPU
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; date -u; \
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; } \
  2>&1 | tee "$OUT/env.txt"
B="python3 experiments/bench_replay.py --out=$OUT/gpu_bench.jsonl --memory_cap_mb=130000"
if [ "$SMOKE" = 1 ]; then
  $B --preset=tiny --dtype=float32 --prefix_len=64 --tail_len=8 --branches=4 --reps=1 \
     2>&1 | tee -a "$OUT/log.txt"
  exit 0
fi
# 1. The CPU target shape (small preset, float32, full-precision matmuls for the gradient check).
JAX_DEFAULT_MATMUL_PRECISION=highest $B --preset=small --dtype=float32 --prefix_len=2048 \
   --tail_len=128 --branches=16 2>&1 | tee -a "$OUT/log.txt"
# 2. The ~0.9B `large` preset, bf16 compute on fp32 masters, remat on both paths, blockwise
#    attention on both: P = 8K, 32K (the MFU target) and 131,072 (16 x 131K = 2.1M token
#    positions: the announcement's step on one GPU). Naive is expected to stop first.
$B --preset=large --dtype=bfloat16 --remat=full --nocheck_grads --reps=3 --prefix_len=8192 \
   --prefix_len=32768 --tail_len=512 --branches=16 2>&1 | tee -a "$OUT/log.txt"
$B --preset=large --dtype=bfloat16 --remat=full --nocheck_grads --reps=1 --prefix_len=131072 \
   --tail_len=512 --branches=16 2>&1 | tee -a "$OUT/log.txt"
