#!/usr/bin/env bash
# The device check, in one try on a fresh GPU image that holds only this working tree (no .git
# needed) and its own CUDA jax/flax/optax: no network, no install. From the checkout's root:
#
#   GIT_COMMIT=<the commit the tree was copied from> OUT=/tmp/gpu_out bash experiments/gpu_check.sh
#
# Steps and their time on the card (each under `timeout`, capped at what is left of BUDGET_S,
# default 630 s, so the whole script ends within 11 minutes, compile included):
#   0. the card (nvidia_smi_q.txt, env.txt)                                    ~5 s
#   1. preflight (experiments/gpu_preflight.py): every module the later steps   <= 60 s
#      import, jax/jaxlib/flax/optax versions, the card, one tiny compiled       (killed at
#      trainer step, the one-GPU row's shape from the card's memory; stops the    90 s)
#      script with one `preflight: FAILED: ...` line naming what is missing
#   2. the one-GPU row (experiments/plan_1gpu.py --run): Llama-3-8B shapes,     <= 450 s
#      R=16 x T=512, LoRA rank 16, bf16; P=131,072 on an H200 (warm-up + 1
#      timed step), P=65,536 on an H100 80GB (warm-up + 2); a `compiled` line,
#      a `step` line per step and the `run` row (step time, MFU, peak device
#      memory, bytes_limit) written as they happen
#   3. fused == blockwise (experiments/fused_check.py), only where the image   <= 90 s
#      has tokamax (requirements-gpu.txt); otherwise a `skipped` line
#   EXTRA=1: then the bench_replay rows (small preset; the large preset at 8K-131K, both kernels):
#      tens of minutes, outside the 11-minute budget (EXTRA_BUDGET_S, default 3600 s).
# What each step did goes to $OUT/gpu_check.jsonl as soon as it ends (rc, seconds, limit,
# timed out or skipped), the scripts' own JSON lines to $OUT/*.jsonl, their output to log.txt:
# a timeout keeps everything that finished. Exit status: 2 when the preflight stops the check,
# 1 when a later step failed, else 0.
# MFU = useful FLOPs (causal attention counted once) / (step seconds x 989 TFLOP/s, the
# H100/H200 dense bf16 peak), computed by plan_1gpu.py.
# The limits: BUDGET_S, PREFLIGHT_S, ONE_GPU_S, FUSED_S (seconds) override the defaults.
# SMOKE=1: the same steps at tiny shapes on a CPU (JAX_PLATFORMS=cpu unless set; the fused
# check runs tokamax's contract in plain jax), with limits for a slow shared CPU.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
# The scripts import branch_replay, models and experiments from the checkout itself: no
# `pip install -e .` on the device image.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# JAX may take 95% of the card (its default is 75%: ~61 GB of an H100, too little for the
# 8B row); the 5% left (4-7 GB) holds the CUDA context and what is allocated outside XLA.
# Preallocated: the row needs ~90% of that memory, and one arena claimed at start does not
# fragment as memory grown on demand can (JAX's GPU memory notes); one process at a time
# uses the card, so nothing else needs the rest.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-true}
# Results lines take the commit from here where the copy has no .git (experiments/provenance.py).
export GIT_COMMIT=${GIT_COMMIT:-$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:-/tmp/gpu_out}
SMOKE=${SMOKE:-0}
EXTRA=${EXTRA:-0}
PY=${PYTHON:-python3}
if [ "$SMOKE" = 1 ]; then  # a loaded CPU compiles far slower than the card
  export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
  BUDGET_S=${BUDGET_S:-2400} PREFLIGHT_S=${PREFLIGHT_S:-300} ONE_GPU_S=${ONE_GPU_S:-900}
  FUSED_S=${FUSED_S:-600}
else
  BUDGET_S=${BUDGET_S:-630} PREFLIGHT_S=${PREFLIGHT_S:-90} ONE_GPU_S=${ONE_GPU_S:-450}
  FUSED_S=${FUSED_S:-90}
fi
MIN_STEP_S=30
mkdir -p "$OUT" || exit 2
LOG="$OUT/log.txt" STEPS="$OUT/gpu_check.jsonl"
if ! command -v timeout > /dev/null; then
  echo "gpu_check: FAILED: no 'timeout' command (coreutils) on this image" | tee -a "$LOG"
  exit 2
fi

# record STEP STATUS [EXTRA_JSON]: one line of gpu_check.jsonl, written at once.
record() {
  printf '{"step": "%s", "status": "%s", "elapsed_s": %d%s}\n' "$1" "$2" "$SECONDS" \
    "${3:+, $3}" | tee -a "$STEPS"
}

# run_step NAME LIMIT_S CMD...: CMD under `timeout`, its limit capped at what is left of
# BUDGET_S (skipped below MIN_STEP_S), its output into log.txt; returns CMD's status.
run_step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - SECONDS))
  ((limit > left)) && limit=$left
  if ((limit < MIN_STEP_S)); then
    record "$name" skipped "\"reason\": \"${left} s left of the ${BUDGET_S} s budget\""
    return 1
  fi
  local t0=$SECONDS
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]} status=ok
  ((rc == 124 || rc == 137)) && status=timed_out
  ((rc != 0 && rc != 124 && rc != 137)) && status=failed
  record "$name" "$status" "\"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit"
  return "$rc"
}

# 0. The card and the settings.
record settings started "\"smoke\": $SMOKE, \"mem_fraction\": \"$XLA_PYTHON_CLIENT_MEM_FRACTION\", \
\"preallocate\": \"$XLA_PYTHON_CLIENT_PREALLOCATE\", \"git_commit\": \"$GIT_COMMIT\", \
\"budget_s\": $BUDGET_S, \"date\": \"$(date -u +%Y-%m-%dT%H:%M:%SZ)\""
nvidia-smi -q > "$OUT/nvidia_smi_q.txt" 2>&1 || echo "no nvidia-smi" > "$OUT/nvidia_smi_q.txt"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  date -u
  echo "git_commit $GIT_COMMIT"
  env | grep -E '^(XLA_|JAX_|PYTHONPATH=)' | sort
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. Preflight: stops here, with its one line, when anything is missing.
smoke_flag=()
[ "$SMOKE" = 1 ] && smoke_flag=(--smoke)
if ! run_step preflight "$PREFLIGHT_S" "$PY" experiments/gpu_preflight.py \
  ${smoke_flag[@]+"${smoke_flag[@]}"} --out="$OUT/preflight.jsonl" --shape_out="$OUT/shape.env"
then
  echo "gpu_check: stopped after the preflight (its FAILED line above says why)" | tee -a "$LOG"
  exit 2
fi
. "$OUT/shape.env"
status=0

# 2. The one-GPU row at the card's shape (gpu_preflight.py's ONE_GPU_SHAPES).
run_step one_gpu_row "$ONE_GPU_S" "$PY" experiments/plan_1gpu.py --run --model="$ONE_GPU_MODEL" \
  --prefix_len="$ONE_GPU_PREFIX_LEN" --tail_len="$ONE_GPU_TAIL_LEN" \
  --branches="$ONE_GPU_BRANCHES" --rank="$ONE_GPU_RANK" --mlp_chunk="$ONE_GPU_MLP_CHUNK" \
  --reps="$ONE_GPU_REPS" --out="$OUT/one_gpu_8b.jsonl" || status=1

# 3. fused == blockwise (float32, rtol 1e-3 on the outputs and every gradient).
if [ "$SMOKE" = 1 ]; then
  run_step fused_check "$FUSED_S" "$PY" experiments/fused_check.py --kernel=reference \
    --preset=tiny --prefix_len=24 --tail_len=8 --branches=2 --out="$OUT/fused_check.jsonl" \
    || status=1
elif [ "$TOKAMAX_AVAILABLE" = 1 ]; then
  run_step fused_check "$FUSED_S" "$PY" experiments/fused_check.py \
    --out="$OUT/fused_check.jsonl" || status=1
else
  record fused_check skipped '"reason": "no tokamax on this image (requirements-gpu.txt)"'
fi

# EXTRA=1: the replay benchmark, both kernels, outside the 11-minute budget.
if [ "$EXTRA" = 1 ]; then
  BUDGET_S=$((SECONDS + ${EXTRA_BUDGET_S:-3600}))
  B=("$PY" experiments/bench_replay.py --out="$OUT/gpu_bench.jsonl" --memory_cap_mb=130000)
  for attn in blockwise fused; do
    if [ "$SMOKE" = 1 ]; then
      run_step "bench_tiny_$attn" 900 "${B[@]}" --preset=tiny --dtype=float32 --prefix_len=64 \
        --tail_len=8 --branches=4 --reps=1 --attention=$attn
      continue
    fi
    # The CPU target shape (small preset, float32, full-precision matmuls for the gradient check).
    run_step "bench_small_$attn" 600 env JAX_DEFAULT_MATMUL_PRECISION=highest "${B[@]}" \
      --preset=small --dtype=float32 --prefix_len=2048 --tail_len=128 --branches=16 \
      --attention=$attn
    # The ~0.9B `large` preset, bf16 compute on fp32 masters, remat on both paths: P = 8K, 32K
    # and 131,072, R=16, T=512. Naive is expected to stop first.
    run_step "bench_large_$attn" 900 "${B[@]}" --preset=large --dtype=bfloat16 --remat=full \
      --nocheck_grads --reps=3 --prefix_len=8192 --prefix_len=32768 --tail_len=512 \
      --branches=16 --attention=$attn
    run_step "bench_large_131k_$attn" 900 "${B[@]}" --preset=large --dtype=bfloat16 \
      --remat=full --nocheck_grads --reps=1 --prefix_len=131072 --tail_len=512 --branches=16 \
      --attention=$attn
  done
fi
record total done "\"exit_status\": $status"
exit $status
