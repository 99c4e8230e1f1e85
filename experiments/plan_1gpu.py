"""The one-GPU plan: the trainer's own RL step at Llama-3-8B (and Qwen3-8B) shapes, B=1 prompt,
P=131,072 prefix positions, R=16 branches of T=512: the Config `run.py --model_dir=...
--model_dtype=bfloat16 --set=lora.rank=16` builds (train_config: LoRA rank 16, alpha 32, on
every projection of every block; the frozen base in bf16, the adapters and their AdamW state in
float32, compute in bf16; GRPO with KL against the base, loss.kl_coef=0.02), with full remat
per layer (scanned layers), the blockwise attention kernel (on the GPU: blockwise or tokamax's
fused kernel, --attention), the MLP in chunks of --mlp_chunk positions and the log-probs in
chunks of 1,024 of the R*T scored tokens (model.mlp_chunk, model.logits_chunk_rows). The
arguments are init_state's TrainState (train/state.py:abstract_state: shapes only) and a GRPO
batch with old and reference log-probs and advantages; the step is the trainer's jitted
rl_step (train/steps.py: `compiled(...).rl_step`, the state donated): no second
implementation.

  # compile only, by XLA:GPU for an H200 and an H100 without a GPU (experiments/gpu_target.py),
  # one subprocess per row:
  python experiments/plan_1gpu.py --out=experiments/results/plan_1gpu_trainer_step_2026-12-05.jsonl
  python experiments/plan_1gpu.py --backend=cpu   # the CPU backend's footprint (a proxy)
  python experiments/plan_1gpu.py --model=llama3_8b --layers=2 --layers=4 --prefix_len=131072
  # on one GPU (experiments/gpu_check.sh): init_state's random bf16 base, compile, 1 warm-up +
  # 2 timed steps (a `compiled` line and a `step` line per step as they happen, then the row)
  python experiments/plan_1gpu.py --run --prefix_len=131072 --out=$OUT/one_gpu_8b.jsonl

Per compiled row (`step.lower(state, batch).compile().memory_analysis()`): argument /
output / temporary / alias bytes, the total (args + temps + outputs - aliases), the memory JAX
is given on each card (usable_gb: --mem_fraction, the XLA_PYTHON_CLIENT_MEM_FRACTION the GPU
check sets, 0.95, x the card's memory), fits (total <= usable) and fits_with_headroom (total
<= 0.9 x usable), the state's bytes by shapes (state_bytes: per model parameter), and the step
time predicted from its FLOPs at 40% and 60% MFU and by experiments/cost_model.py (calibrated
matmul efficiency, flash attention at 0.35 (0.2-0.55), element-wise passes; one device, no
communication). What a row is not: sampling (its KV cache) and reference scoring, which run
as their own jitted functions between steps.

--backend=gpu (the default) compiles with XLA's GPU compiler for each --target card through
jax's CUDA plugin with no device (deviceless AOT): the GPU's own buffer assignment and
schedule (bf16 kept bf16; nothing autotuned). --backend=cpu is the older proxy: the CPU
backend has no bf16 matmul and stores many bf16 intermediates in f32, so it overstates the
GPU's footprint. Rows also carry `gpu_estimate`: cost_model.memory's parts in bf16 with LoRA's
state, an analytic estimate. The run mode measures the real peak on a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time


from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS
HEADROOM = 0.9  # the target: the compiled total within 90% of the memory JAX is given
MEM_FRACTION = 0.95  # XLA_PYTHON_CLIENT_MEM_FRACTION of the GPU check (jax's default: 0.75)
KL_COEF = 0.02  # the GRPO step has a KL term (reference log-probs as an input), as the recipe
MFUS = (0.4, 0.6)
PEAK_TFLOPS = {"H200": 989.0, "H20": 148.0, "H100": 989.0}  # dense bf16


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_multi_integer("prefix_len", [131072, 65536, 32768], "P values")
  flags.DEFINE_multi_string("model", ["llama3_8b", "qwen3_8b"], "llama3_8b | qwen3_8b | tiny")
  flags.DEFINE_multi_integer("layers", [0], "n_layers override per row (0: the model's own)")
  flags.DEFINE_integer("tail_len", 512, "T")
  flags.DEFINE_integer("branches", 16, "R")
  flags.DEFINE_integer("prompts", 1, "B")
  flags.DEFINE_integer("rank", 16, "LoRA rank (alpha = 2 x rank)")
  flags.DEFINE_integer("mlp_chunk", 8192, "model.mlp_chunk (0: the MLP whole)")
  flags.DEFINE_bool("logits_chunk_rows", True, "model.logits_chunk_rows")
  flags.DEFINE_string("attention", "blockwise", "model.attention (fused: GPU only)")
  flags.DEFINE_enum(
    "backend", "gpu", ["gpu", "cpu"], "compile rows: XLA:GPU deviceless (gpu) or the CPU proxy"
  )
  flags.DEFINE_multi_enum(
    "target", ["H200", "H100"], ["H200", "H100", "H20"], "backend=gpu: the cards compiled for"
  )
  flags.DEFINE_float(
    "mem_fraction",
    MEM_FRACTION,
    "XLA_PYTHON_CLIENT_MEM_FRACTION the GPU check sets: a row fits a card when its compiled "
    "total is within 90% of this fraction of the card's memory",
  )
  flags.DEFINE_bool("run", False, "materialise random weights and time steps (a GPU)")
  flags.DEFINE_integer("reps", 2, "run: timed steps after the warm-up")
  flags.DEFINE_integer("timeout_s", 1800, "per compiled row")
  flags.DEFINE_string("worker", "", "internal: 'model;P;layers' -> one JSON line")
  flags.DEFINE_string("out", "", "append JSON lines here")


QWEN3_8B = dict(
  vocab_size=151936,
  d_model=4096,
  n_layers=36,
  n_heads=32,
  n_kv_heads=8,
  head_dim=128,
  mlp_hidden=12288,
  rope_theta=1000000.0,
  qk_norm=True,
)


def model_config(
  name: str,
  layers: int = 0,
  mlp_chunk: int = 8192,
  logits_chunk_rows: bool = True,
  attention: str = "blockwise",
):
  """The plan's model: bf16 weights and compute, full remat, scanned layers, chunks."""
  from experiments import cost_model
  from models import transformer as tfm

  if name == "llama3_8b":
    base = cost_model.LLAMA3_8B
  elif name == "qwen3_8b":
    base = tfm.ModelConfig(**QWEN3_8B)
  elif name == "tiny":
    base = tfm.preset("tiny", attention_block_q=16, attention_block_k=16, logits_chunk=16)
  else:
    raise ValueError(f"--model={name!r}: expected 'llama3_8b', 'qwen3_8b' or 'tiny'")
  cfg = dataclasses.replace(
    base,
    dtype="bfloat16",
    param_dtype="bfloat16",
    remat="full",
    scan_layers=True,
    attention=attention,
    mlp_chunk=mlp_chunk or None,
    logits_chunk_rows=logits_chunk_rows,
  )
  return dataclasses.replace(cfg, n_layers=layers) if layers else cfg


def check_row(P: int, T: int, R: int, B: int, rank: int) -> None:
  for name, v in (
    ("prefix_len", P),
    ("tail_len", T),
    ("branches", R),
    ("prompts", B),
    ("rank", rank),
  ):
    if not isinstance(v, int) or v < 1:
      raise ValueError(f"--{name}={v!r}: expected an int >= 1")


def train_config(model_cfg, rank: int, B: int, R: int, kl_coef: float = KL_COEF):
  """The run's Config: the plan's model (a bf16 base), LoRA rank `rank` (alpha 2 x rank) on
  every projection, GRPO with KL against the base (loss.kl_coef), B prompts x R branches:
  what `run.py --model_dir=... --model_dtype=bfloat16 --set=lora.rank=16` trains."""
  from branch_replay.config import Config
  from branch_replay.core.losses import LossConfig
  from branch_replay.config import TrainConfig
  from models.lora import LoraConfig

  return Config(
    model=model_cfg,
    loss=LossConfig(name="grpo", kl_coef=kl_coef),
    train=TrainConfig(batch_size=B, n_branches=R, learning_rate=1e-5),
    lora=LoraConfig(rank=rank, alpha=2.0 * rank),
  )


def trainer_step(cfg):
  """The jitted RL step the trainer runs (branch_replay/train/runtime.py: `Runtime(cfg, tok).fns(...)
  .rl_step`, the state donated): engine.loss_and_grad over the adapters (the bf16 base
  attached, merged inside each layer), the GRPO + KL objective at the sampler's temperature,
  AdamW on the float32 adapters. No second implementation."""
  from branch_replay.data.tokenizer import TOKENIZER
  from branch_replay.train import runtime

  return runtime.Runtime(cfg, TOKENIZER).fns(TOKENIZER.eos_id).rl_step


def batch_of(B, P, R, T, make):
  """A GRPO batch with KL: prompt, tails, advantages, the behaviour (old) and reference
  log-probs the trainer's rollout gives the step. make(shape, dtype, name) -> a leaf."""
  from branch_replay.core import tree

  return tree.flat(
    prefix_BP=make((B, P), "int32", "tokens"),
    prefix_valid_BP=make((B, P), "bool", "valid"),
    tails_BRT=make((B, R, T), "int32", "tokens"),
    tail_valid_BRT=make((B, R, T), "bool", "valid"),
    advantages_BR=make((B, R), "float32", "advantages"),
    old_logp_BRT=make((B, R, T), "float32", "logp"),
    ref_logp_BRT=make((B, R, T), "float32", "logp"),
  )


def abstract_args(cfg, B, P, R, T):
  """(state, batch) as ShapeDtypeStructs: the TrainState init_state builds from the Config
  (train/state.py:abstract_state: base in model.param_dtype, float32 adapters and AdamW
  state), nothing allocated."""
  import jax
  import jax.numpy as jnp
  from branch_replay.train import state as train_state

  state = train_state.abstract_state(cfg)
  batch = batch_of(
    B, P, R, T, lambda shape, dtype, _: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
  )
  return state, batch


def state_bytes(state) -> dict:
  """The train state's bytes by part (arrays or ShapeDtypeStructs): the frozen base, the
  trained parameters (LoRA: the adapters), the optimizer state, a reference copy; and per
  parameter of the model (the base's, or the params' without LoRA)."""
  parts = dict(
    base=nbytes(state.base),
    params=nbytes(state.params),
    opt_state=nbytes(state.opt_state),
    ref_params=nbytes(state.ref_params),
  )
  parts["total"] = sum(parts.values())
  model = state.params if state.base is None else state.base
  n = sum(x.size for x in __import__("jax").tree.leaves(model))
  parts["model_params"] = n
  parts["bytes_per_param"] = parts["total"] / n
  return parts


def nbytes(tree) -> int:
  import jax

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def gpu_estimate(cfg, B, P, R, T, adapter_params: int) -> dict:
  """cost_model.memory in bf16 (replay, remat, flash, one device), its parameter part
  replaced by LoRA's state: the bf16 base (2 B/param) + adapters, their gradient and AdamW
  moments (16 B/param), plus one stacked bf16 copy of the layers' weights (the scan's); the
  logits block at 1,024 tokens, the MLP's working set chunked."""
  from experiments import cost_model, flops

  shape = cost_model.Shape(B, R, P, T)
  ex = cost_model.Execution(attention="flash", remat=True, compute_bytes=2, logits_chunk=1024)
  parts = cost_model.memory(cfg, shape, "replay", ex)
  parts.pop("total")
  parts["params_grads_optimizer"] = 0.0
  parts["base_bf16"] = cost_model.param_count(cfg) * 2
  # the scan stacks the per-layer weights on the fly (transformer.run_layers): one bf16 copy
  # of the layers' weights (the prefix's, kept for its backward; the tails' may share it)
  parts["stacked_layer_weights"] = cfg.n_layers * flops.layer_macs(cfg) * 2
  parts["adapters_grads_adamw"] = adapter_params * 16
  if cfg.mlp_chunk and cfg.mlp_chunk < P:  # the 3 F-sized activations (+ cotangents) chunked
    parts["layer_working_set"] -= 2 * B * (P - cfg.mlp_chunk) * 3 * cfg.mlp_hidden * 2
  gb = {k: round(v / 1e9, 2) for k, v in parts.items()}
  gb["total"] = round(sum(parts.values()) / 1e9, 2)
  return gb


def predict(cfg, B, P, R, T) -> dict:
  """Step time on one GPU: useful FLOPs (experiments/flops.py: fwd + bwd, causal pairs once)
  at 40% / 60% MFU, and cost_model's prediction (remat's extra forward, flash attention)."""
  from experiments import cost_model, flops
  from experiments.plan_8gpu import FLASH_EFFICIENCY, FLASH_RANGE, MATMUL_EFFICIENCY

  useful = flops.step_flops(cfg, flops.flat(B, R, P, T, "replay"))
  shape = cost_model.Shape(B, R, P, T)
  ex = cost_model.Execution(attention="flash", remat=True, compute_bytes=2)
  counts = cost_model.step_counts(cfg, shape, "replay", ex)
  ew = cost_model.layer_table(cfg, shape, "replay", ex)["elementwise_bytes"] * cfg.n_layers
  out = dict(
    useful_pflop=round(useful / 1e15, 3),
    executed_pflop=round(counts["total_flops"] / 1e15, 3),
    step_s={},
  )
  for gpu in cost_model.GPUS:
    name = next(n for n in ("H200", "H100", "H20") if n in gpu.name)
    one = dataclasses.replace(gpu, name=name)
    t = cost_model.predict_time(counts, MATMUL_EFFICIENCY, FLASH_EFFICIENCY, one, 1, ew, 0.0)
    lo, hi = (
      cost_model.predict_time(counts, MATMUL_EFFICIENCY, e, one, 1, ew, 0.0)["step_s"]
      for e in FLASH_RANGE[::-1]
    )
    row = {f"mfu_{int(m * 100)}": round(useful / (m * gpu.bf16_tflops * 1e12), 1) for m in MFUS}
    row.update(
      cost_model=round(t["step_s"], 1),
      cost_model_range=[round(lo, 1), round(hi, 1)],
      cost_model_mfu=round(useful / (t["step_s"] * gpu.bf16_tflops * 1e12), 3),
    )
    out["step_s"][name] = row
  return out


def usable_gb(fraction: float) -> dict:
  """The memory JAX may use on each card: XLA_PYTHON_CLIENT_MEM_FRACTION x the card's total
  (experiments/gpu_target.py's CARDS: what the driver reports)."""
  from experiments import gpu_target

  return {g: round(c.memory_bytes * fraction / 1e9, 2) for g, c in gpu_target.CARDS.items()}


def compiled_total(mem) -> int:
  """args + temps + outputs - aliases (the donated state's buffers counted once)."""
  return (
    mem.argument_size_in_bytes
    + mem.temp_size_in_bytes
    + mem.output_size_in_bytes
    - mem.alias_size_in_bytes
  )


def compile_row(model: str, P: int, layers: int, target: str = "H200") -> dict:
  """One compile-only row on this process's one device: the trainer's RL step (trainer_step)
  on the abstract TrainState of the run's Config, for `target` (backend=gpu) or the CPU."""
  cfg = model_config(model, layers, FLAGS.mlp_chunk, FLAGS.logits_chunk_rows, FLAGS.attention)
  B, R, T = FLAGS.prompts, FLAGS.branches, FLAGS.tail_len
  check_row(P, T, R, B, FLAGS.rank)
  run_cfg = train_config(cfg, FLAGS.rank, B, R)
  step = trainer_step(run_cfg)
  args = abstract_args(run_cfg, B, P, R, T)
  if FLAGS.backend == "gpu":
    from experiments import gpu_target

    args = gpu_target.place(args, gpu_target.device(target))
    backend = gpu_target.describe(target)
  else:
    backend = "cpu (proxy: bf16 intermediates stored as f32)"
  t0 = time.time()
  mem = step.lower(*args).compile().memory_analysis()
  compile_s = time.time() - t0
  total = compiled_total(mem)
  gb = lambda b: round(b / 1e9, 3)
  state, _ = args
  sb = state_bytes(state)
  usable = usable_gb(FLAGS.mem_fraction)
  row = dict(
    model=model,
    n_layers=cfg.n_layers,
    full_model=not layers,
    P=P,
    T=T,
    R=R,
    B=B,
    rank=FLAGS.rank,
    targets=",".join(run_cfg.lora.targets),
    step="train/steps.py rl_step (trainer_step), GRPO with KL (old + reference log-probs)",
    kl_coef=run_cfg.loss.kl_coef,
    base_dtype=cfg.param_dtype,
    adapter_dtype=str(jax_dtype_name(state.params)),
    compute_dtype=cfg.dtype,
    remat=cfg.remat,
    attention=cfg.attention,
    mlp_chunk=cfg.mlp_chunk,
    logits_chunk=cfg.logits_chunk,
    logits_chunk_rows=cfg.logits_chunk_rows,
    target=target if FLAGS.backend == "gpu" else None,
    compile_s=round(compile_s, 1),
    argument_gb=gb(mem.argument_size_in_bytes),
    temp_gb=gb(mem.temp_size_in_bytes),
    output_gb=gb(mem.output_size_in_bytes),
    alias_gb=gb(mem.alias_size_in_bytes),
    total_gb=gb(total),
    total_bytes=total,
    base_gb=gb(sb["base"]),
    adapter_params=sb["params"] // 4,
    adapter_state_gb=gb(sb["params"] + sb["opt_state"]),
    state_bytes_per_param=round(sb["bytes_per_param"], 4),
    mem_fraction=FLAGS.mem_fraction,
    usable_gb=usable,
    headroom=HEADROOM,
    fits={g: total / 1e9 <= cap for g, cap in usable.items()},
    fits_with_headroom={g: total / 1e9 <= HEADROOM * cap for g, cap in usable.items()},
    memory_backend=backend,
  )
  row["gpu_estimate_gb"] = gpu_estimate(cfg, B, P, R, T, row["adapter_params"])
  row["gpu_estimate_fits_with_headroom"] = {
    g: row["gpu_estimate_gb"]["total"] <= HEADROOM * cap for g, cap in usable.items()
  }
  row["prediction"] = predict(cfg, B, P, R, T)
  return row


def jax_dtype_name(tree) -> str:
  """The one dtype of a tree's leaves ('float32'), or them joined when mixed."""
  import jax

  return ",".join(sorted({str(x.dtype) for x in jax.tree.leaves(tree)}))


def run_row(model: str, P: int, emit=lambda row: None) -> dict:
  """On this process's first device: the TrainState init_state builds (random bf16 base,
  float32 adapters with B != 0 so both halves move), a random GRPO + KL batch, the trainer's
  RL step compiled, 1 warm-up + --reps timed steps: step seconds, MFU (useful FLOPs /
  (seconds x the card's bf16 peak)), peak device memory. emit(line) gets a `compiled` line
  (the GPU compile's footprint) and a `step` line per step as they happen, so a run stopped
  by a time limit still leaves what it measured."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.train import state as train_state
  from experiments import flops

  cfg = model_config(model, 0, FLAGS.mlp_chunk, FLAGS.logits_chunk_rows, FLAGS.attention)
  B, R, T = FLAGS.prompts, FLAGS.branches, FLAGS.tail_len
  check_row(P, T, R, B, FLAGS.rank)
  run_cfg = train_config(cfg, FLAGS.rank, B, R)
  step = trainer_step(run_cfg)
  t0 = time.time()
  state = train_state.init_state(run_cfg)
  state = state.replace(params=jax.tree.map(lambda x: x + 1e-3, state.params))
  rng = np.random.default_rng(0)

  def make(shape, dtype, kind):
    if kind == "tokens":
      return jnp.asarray(rng.integers(0, cfg.vocab_size, shape), jnp.int32)
    if kind == "valid":
      return jnp.ones(shape, bool)
    if kind == "logp":
      return jnp.asarray(-rng.uniform(0.5, 6.0, shape), jnp.float32)
    return jnp.asarray(rng.normal(size=shape), jnp.float32)

  batch = batch_of(B, P, R, T, make)
  jax.block_until_ready((state, batch))
  init_s = time.time() - t0
  t0 = time.time()
  compiled = step.lower(state, batch).compile()
  compile_s = time.time() - t0
  mem = compiled.memory_analysis()
  dev = jax.devices()[0]
  gb = lambda b: None if b is None else round(b / 1e9, 3)
  peak_gb = lambda: gb((dev.memory_stats() or {}).get("peak_bytes_in_use"))
  compiled_gb = None if mem is None else gb(compiled_total(mem))
  emit(
    dict(
      kind="compiled",
      model=model,
      P=P,
      device_kind=dev.device_kind,
      init_s=round(init_s, 1),
      compile_s=round(compile_s, 1),
      compiled_total_gb=compiled_gb,
      peak_gb=peak_gb(),
    )
  )
  times, losses_ = [], []
  for i in range(FLAGS.reps + 1):
    t0 = time.perf_counter()
    state, out = jax.block_until_ready(compiled(state, batch))
    seconds = time.perf_counter() - t0
    if i:
      times.append(seconds)
    loss = float(out["loss/policy"])
    losses_.append(loss)
    emit(
      dict(
        kind="step",
        model=model,
        P=P,
        step=i,
        warm_up=i == 0,
        seconds=round(seconds, 3),
        loss=loss,
        kl=float(out["kl"]),
        peak_gb=peak_gb(),
      )
    )
  stats = dev.memory_stats() or {}
  useful = flops.step_flops(cfg, flops.flat(B, R, P, T, "replay"))
  step_s = float(np.median(times))
  kind = dev.device_kind
  peak = next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
  return dict(
    model=model,
    n_layers=cfg.n_layers,
    P=P,
    T=T,
    R=R,
    B=B,
    rank=FLAGS.rank,
    kl_coef=run_cfg.loss.kl_coef,
    step="train/steps.py rl_step (trainer_step), GRPO with KL (old + reference log-probs)",
    attention=cfg.attention,
    mlp_chunk=cfg.mlp_chunk,
    device=str(dev),
    device_kind=kind,
    init_s=round(init_s, 1),
    compile_s=round(compile_s, 1),
    step_s=round(step_s, 3),
    step_times=[round(t, 3) for t in times],
    losses=losses_,
    finite=bool(np.all(np.isfinite(losses_))),
    useful_pflop=round(useful / 1e15, 3),
    mfu=None if peak is None else round(useful / (step_s * peak * 1e12), 4),
    mfu_peak_tflops=peak,
    peak_gb=gb(stats.get("peak_bytes_in_use")),
    bytes_limit_gb=gb(stats.get("bytes_limit")),
    compiled_total_gb=compiled_gb,
  )


def run_subprocess(model: str, P: int, layers: int, target: str, passed, env) -> dict:
  argv = [
    sys.executable,
    os.path.abspath(__file__),
    *passed,
    f"--worker={model};{P};{layers};{target}",
  ]
  try:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=FLAGS.timeout_s)
  except subprocess.TimeoutExpired:
    return dict(
      model=model, P=P, n_layers=layers, target=target, error=f"compile over {FLAGS.timeout_s} s"
    )
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if lines:
    return json.loads(lines[-1])
  return dict(
    model=model,
    P=P,
    n_layers=layers,
    target=target,
    error=f"exit {proc.returncode}: {proc.stderr[-600:]}",
  )


def main(argv):
  del argv
  if FLAGS.worker:
    model, P, layers, target = FLAGS.worker.split(";")
    print(json.dumps(compile_row(model, int(P), int(layers), target)), flush=True)
    return
  for model in FLAGS.model:  # bad input before any compilation
    model_config(model)
    for P in FLAGS.prefix_len:
      check_row(P, FLAGS.tail_len, FLAGS.branches, FLAGS.prompts, FLAGS.rank)
  from experiments import provenance

  writer = provenance.ResultsWriter(
    FLAGS.out, "plan_1gpu_run" if FLAGS.run else "plan_1gpu", with_jax=FLAGS.run
  )
  if FLAGS.run:  # in this process, on its device
    for model in FLAGS.model:
      for P in FLAGS.prefix_len:
        writer.write({"kind": "run", **run_row(model, P, writer.write)})
    return
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1")
  passed = [
    a
    for a in sys.argv[1:]
    if not a.startswith(("--out", "--prefix_len", "--model", "--layers", "--target"))
  ]
  # backend=cpu: one compile (the proxy has no card)
  targets = FLAGS.target if FLAGS.backend == "gpu" else FLAGS.target[:1]
  for target in targets:
    for model in FLAGS.model:
      for layers in FLAGS.layers:
        for P in FLAGS.prefix_len:
          row = run_subprocess(model, P, layers, target, passed, env)
          writer.write({"kind": "row", **row})


if __name__ == "__main__":
  define_flags()
  app.run(main)
