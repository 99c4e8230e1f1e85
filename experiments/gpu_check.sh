#!/usr/bin/env bash
# The device check: fused == blockwise, then the replay benchmark on one GPU, both attention
# kernels, both paths (naive, replay). JSON lines + the environment under $OUT.
# Run from the repo root on the device machine:  bash experiments/gpu_check.sh
# (its image brings its own jax/flax/optax; pip install -r requirements-gpu.txt adds tokamax).
# MFU = useful FLOPs (causal attention counted once) / (seconds x 989 TFLOP/s, the H200's
# dense bf16 peak): experiments/results_table.py computes it from the JSON lines.
# SMOKE=1: tiny shapes, to check the script itself on a CPU (there the fused kernel is the
# plain-jax reference of tokamax's contract, and the fused bench rows record the refusal).
# ONE_GPU_ONLY=1: stop after step 2 (the one-GPU 8B row), for a 15-minute device budget:
# the fused check (~1-2 min) + the 8B row (init + compile + 3 steps, capped at
# ONE_GPU_TIMEOUT_S, default 600 s).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
SMOKE=${SMOKE:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"; \
  date -u; git rev-parse HEAD 2>/dev/null; \
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"; \
  python3 -c "import tokamax; print('tokamax', tokamax.__version__)" 2>&1 | tail -1; } \
  > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
B="python3 experiments/bench_replay.py --out=$OUT/gpu_bench.jsonl --memory_cap_mb=130000"
status=0
if [ "$SMOKE" = 1 ]; then
  python3 experiments/fused_check.py --kernel=reference --preset=tiny --prefix_len=24 \
     --tail_len=8 --branches=2 --out="$OUT/fused_check.jsonl" 2>&1 | tee -a "$OUT/log.txt" \
     || status=1
  nvidia-smi -q > "$OUT/nvidia_smi_q.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia_smi_q.txt"
  python3 experiments/plan_1gpu.py --run --model=tiny --prefix_len=64 --tail_len=8 \
     --branches=4 --rank=2 --mlp_chunk=16 --out="$OUT/one_gpu_8b.jsonl" 2>&1 \
     | tee -a "$OUT/log.txt" || status=1
  [ "${ONE_GPU_ONLY:-0}" = 1 ] && exit $status
  for attn in blockwise fused; do
    $B --preset=tiny --dtype=float32 --prefix_len=64 --tail_len=8 --branches=4 --reps=1 \
       --attention=$attn 2>&1 | tee -a "$OUT/log.txt"
  done
  exit $status
fi
# 1. fused == blockwise (float32, rtol 1e-3 on the outputs and every gradient).
python3 experiments/fused_check.py --out="$OUT/fused_check.jsonl" 2>&1 | tee -a "$OUT/log.txt" \
   || status=1
# 2. The one-GPU plan's row (experiments/plan_1gpu.py): Llama-3-8B shapes, random weights,
#    LoRA rank 16 on q/k/v/o/gate/up/down, the base frozen in bf16, bf16 compute, full remat,
#    MLP chunks of 8,192, log-probs chunked over the 16 x 512 tail tokens; P=131,072, R=16,
#    T=512; 1 warm-up + 2 timed steps: init/compile/step seconds, MFU (989 TFLOP/s), peak
#    device memory (memory_stats), the compiled footprint. The card: nvidia_smi_q.txt.
nvidia-smi -q > "$OUT/nvidia_smi_q.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia_smi_q.txt"
timeout "${ONE_GPU_TIMEOUT_S:-600}" python3 experiments/plan_1gpu.py --run --model=llama3_8b \
   --prefix_len=131072 --tail_len=512 --branches=16 --rank=16 --reps=2 \
   --out="$OUT/one_gpu_8b.jsonl" 2>&1 | tee -a "$OUT/log.txt" || status=1
[ "${ONE_GPU_ONLY:-0}" = 1 ] && exit $status
# 3. The CPU target shape (small preset, float32, full-precision matmuls for the gradient check).
for attn in blockwise fused; do
  JAX_DEFAULT_MATMUL_PRECISION=highest $B --preset=small --dtype=float32 --prefix_len=2048 \
     --tail_len=128 --branches=16 --attention=$attn 2>&1 | tee -a "$OUT/log.txt"
done
# 4. The ~0.9B `large` preset, bf16 compute on fp32 masters, remat on both paths: P = 8K, 32K
#    (the MFU target) and 131,072 (16 x 131K = 2.1M token positions on one GPU), R=16, T=512,
#    both kernels. Naive is expected to stop first.
for attn in fused blockwise; do
  $B --preset=large --dtype=bfloat16 --remat=full --nocheck_grads --reps=3 --prefix_len=8192 \
     --prefix_len=32768 --tail_len=512 --branches=16 --attention=$attn 2>&1 | tee -a "$OUT/log.txt"
  $B --preset=large --dtype=bfloat16 --remat=full --nocheck_grads --reps=1 --prefix_len=131072 \
     --tail_len=512 --branches=16 --attention=$attn 2>&1 | tee -a "$OUT/log.txt"
done
exit $status
