"""Benchmark: one training step's loss+gradient, naive vs branch replay, as JSON lines.

Each variant runs in its own subprocess (clean memory accounting): warm-up, then the median
of --reps timed steps; peak RSS growth is the peak during the timed steps minus the RSS
after imports. Ratios are measured in one run, so a noisy shared machine affects both sides.

  python experiments/bench_replay.py                      # P=2048 T=128 R=16, small preset
  python experiments/bench_replay.py --sweep              # P{512..4096} x T{64,128} x R{8,16}
  python experiments/bench_replay.py --prefix_len=512 --tail_len=64 --branches=8 --reps=3
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python experiments/bench_replay.py --mesh=data:2,fsdp:2,context:2 --prefix_len=512 \
    --tail_len=64 --branches=8 --prompts=4   # + per-device memory of each compiled step

Measured: experiments/results/cpu_long_context_2026-11-30.jsonl and
cpu_sweep_blockwise_2026-11-30.jsonl (tables `long_context`, `sweep` in docs/performance.md).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

if __name__ == "__main__" and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # quiet on machines without a GPU

from absl import app, flags  # noqa: E402

from experiments import compare, flops  # noqa: E402
from experiments.measure import PeakRSS, matmul_gflops, release_freed_heap  # noqa: E402,F401

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_multi_integer("prefix_len", [2048], "P: shared prefix tokens (repeatable)")
  flags.DEFINE_multi_integer("tail_len", [128], "T: tail tokens per branch (repeatable)")
  flags.DEFINE_multi_integer("branches", [16], "R: branches per prompt (repeatable)")
  flags.DEFINE_integer("prompts", 1, "B: prompts per step")
  flags.DEFINE_integer(
    "reps",
    5,
    "timed repetitions after warm-up (median reported); 0 in a "
    "--worker: compile and report the footprint only",
  )
  flags.DEFINE_bool("check_grads", True, "compare replay's gradient with naive's")
  flags.DEFINE_string("preset", "small", "model size preset (models.transformer.PRESETS)")
  flags.DEFINE_string("dtype", "float32", "compute dtype (both paths)")
  flags.DEFINE_string("param_dtype", "float32", "parameter (master weight) dtype")
  flags.DEFINE_integer("branch_chunk", 0, "stream tails in chunks of C branches (0 = all R)")
  flags.DEFINE_string("remat", "none", "per-layer remat policy, both paths: none|full|dots|offload")
  flags.DEFINE_string("attention", "blockwise", "attention implementation, both paths")
  flags.DEFINE_integer("block_q", 0, "attention query block (0 = the model default)")
  flags.DEFINE_integer("block_k", 0, "attention key block (0 = the model default)")
  flags.DEFINE_integer("logits_chunk", 1024, "tokens per logits chunk, both paths (0 = unchunked)")
  flags.DEFINE_bool("scan_layers", True, "lax.scan over layers (both paths)")
  flags.DEFINE_string(
    "loss",
    "grpo",
    "objective (branch_replay.core.losses.OBJECTIVES; dpo needs "
    "--branches=2), or 'value': PPO's critic (value model + head, clipped "
    "value loss on every scored token, critic.py)",
  )
  flags.DEFINE_string(
    "model_from",
    "",
    "take the model from this experiment's get_config() "
    "(e.g. grpo_haystack) instead of --preset (dtype/remat/attention flags "
    "still apply)",
  )
  flags.DEFINE_float("memory_cap_mb", 16000, "a variant whose compiled step needs more reports oom")
  flags.DEFINE_bool("sweep", False, "run the README sweep: P{1K,2K,4K,8K} x T{128,512} x R{8,16}")
  flags.DEFINE_string(
    "worker", "", "internal: run one variant ('naive' or 'replay') and print JSON"
  )
  flags.DEFINE_string("grads_out", "", "internal: where a worker saves its gradient")
  flags.DEFINE_string("out", "", "also append the JSON lines to this file")
  flags.DEFINE_string(
    "mesh",
    "",
    "device mesh for both paths, e.g. context:8 or data:2,fsdp:2,"
    "context:2 (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=8)",
  )


def model_config():
  from models import transformer as tfm

  blocks = {
    k: v
    for k, v in (("attention_block_q", FLAGS.block_q), ("attention_block_k", FLAGS.block_k))
    if v
  }
  remat = {"true": "full", "false": "none"}.get(FLAGS.remat.lower(), FLAGS.remat)
  options = dict(
    dtype=FLAGS.dtype,
    param_dtype=FLAGS.param_dtype,
    remat=remat,
    attention=FLAGS.attention,
    logits_chunk=FLAGS.logits_chunk or None,
    scan_layers=FLAGS.scan_layers,
    **blocks,
  )
  if FLAGS.model_from:
    import dataclasses
    from experiments import registry

    base = registry.get_config(FLAGS.model_from).model
    return dataclasses.replace(base, **options)
  return tfm.preset(FLAGS.preset, **options)


def run_worker(mode, P, T, R):
  import jax
  import jax.numpy as jnp
  import numpy as np
  import psutil
  from branch_replay.core import engine, losses, tree
  from models import transformer as tfm

  jnp.zeros(()).block_until_ready()  # the backend is up: count from here
  rss_after_imports = psutil.Process().memory_info().rss

  cfg = model_config()
  B = FLAGS.prompts
  params = tfm.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  dt = cfg.compute_dtype
  batch = tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P)), jnp.int32),
    prefix_valid_BP=jnp.ones((B, P), bool),
    tails_BRT=jnp.asarray(rng.integers(0, cfg.vocab_size, (B, R, T)), jnp.int32),
    tail_valid_BRT=jnp.ones((B, R, T), bool),
    advantages_BR=jnp.asarray(rng.normal(size=(B, R)), dt),
  )
  chunk = FLAGS.branch_chunk or None
  if FLAGS.loss == "value":  # PPO's critic: its own transformer + value head, both modes
    step, params, batch = _value_step(cfg, mode, batch, rng)
    return _measure(mode, step, params, batch, rss_after_imports)
  loss_cfg = losses.LossConfig(name=FLAGS.loss)
  if loss_cfg.objective.needs_ref:  # e.g. DPO: reference log-probs of every tail token
    batch = batch.with_leaves(ref_logp_BRT=jnp.asarray(-rng.exponential(size=(B, R, T)), dt))
  tree.validate(batch, cfg.vocab_size, chunk)
  step = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, mode, chunk)[::2])
  if FLAGS.mesh:  # both paths on the mesh: params FSDP/tensor-sharded, batch by the RULES
    from branch_replay.core import sharding

    mesh = sharding.make_mesh(FLAGS.mesh)
    params = sharding.put(params, sharding.param_shardings(mesh, cfg))
    batch = sharding.put(batch, sharding.batch_shardings(mesh, batch))
    if mode == "replay":
      step = jax.jit(
        lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, "replay", chunk, mesh=mesh)[::2]
      )
  _measure(mode, step, params, batch, rss_after_imports)


def _value_step(cfg, mode, batch, rng):
  """PPO's critic step on the bench batch: random returns and old values on the X = T scored
  tokens of every branch (no trunk), the critic's clipped value loss through
  critic.loss_and_grad (replay: prefix once, folded tails; naive: B*R full sequences)."""
  import jax
  import jax.numpy as jnp
  from branch_replay.core import critic

  if FLAGS.mesh or FLAGS.branch_chunk:
    raise ValueError(
      "--loss=value: the critic runs unsharded and unchunked; expected "
      f"--mesh='' and --branch_chunk=0, got {FLAGS.mesh!r}, {FLAGS.branch_chunk}"
    )
  B, R, T = batch.leaves.tokens_BRT.shape
  params = critic.init_params(cfg, jax.random.key(0))
  params["head"] = {
    "w_D": jnp.asarray(rng.normal(size=cfg.d_model) / cfg.d_model**0.5, cfg.weight_dtype),
    "b": jnp.zeros((), cfg.weight_dtype),
  }
  cb = critic.CriticBatch(
    batch,
    jnp.asarray(rng.uniform(size=(B, R, T)), jnp.float32),
    jnp.asarray(rng.uniform(size=(B, R, T)), jnp.float32),
  )
  ccfg = critic.CriticConfig()
  step = jax.jit(lambda p, b: critic.loss_and_grad(p, b, cfg, ccfg, mode)[::2])
  return step, params, cb


def _measure(mode, step, params, batch, rss_after_imports):
  """Compile (footprint, cap), warm up, time --reps steps; print one JSON line."""
  import jax
  import numpy as np

  try:
    compiled = step.lower(params, batch).compile()
  except jax.errors.JaxRuntimeError as e:  # e.g. the compiler's autotuner cannot allocate
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    print(json.dumps(dict(mode=mode, oom=True)), flush=True)
    return
  mem = compiled.memory_analysis()
  need_mb = None
  if mem is not None:
    need_mb = (
      mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    ) / 2**20
  result = dict(mode=mode, compiled_mb=None if need_mb is None else round(need_mb, 1))
  if FLAGS.mesh:  # what one device must hold, from the compiled SPMD executable
    from branch_replay.core import sharding

    report = sharding.memory_report(compiled)
    result["per_device_mb"] = round(report["total_bytes"] / 2**20, 1)
    result["per_device_temp_mb"] = round(report["temp_bytes"] / 2**20, 1)
  if need_mb is not None and need_mb > FLAGS.memory_cap_mb:
    result["oom"] = True
    print(json.dumps(result), flush=True)
    return
  if FLAGS.reps == 0:  # compile only: the footprint, no step run
    result.update(backend=jax.default_backend(), device=str(jax.devices()[0].device_kind))
    print(json.dumps(result), flush=True)
    return
  times, cpu_times = [], []
  try:
    jax.block_until_ready(compiled(params, batch))  # warm-up
    release_freed_heap()  # the compiler's freed heap (both modes alike)
    with PeakRSS() as rss:
      for _ in range(FLAGS.reps):
        t0, c0 = time.perf_counter(), time.process_time()
        loss, grads = compiled(params, batch)
        jax.block_until_ready(grads)
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.process_time() - c0)
  except jax.errors.JaxRuntimeError as e:  # the estimate fit, the allocation did not
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    result["oom"] = True
    print(json.dumps(result), flush=True)
    return
  # cpu_seconds: CPU time of all this process's threads (robust to other jobs on a shared
  # machine, unlike wall time; on an idle machine wall ~ cpu_seconds / busy cores).
  result.update(
    seconds=float(np.median(times)),
    times=[round(t, 4) for t in times],
    cpu_seconds=round(float(np.median(cpu_times)), 4),
    peak_mb=round((rss.peak - rss_after_imports) / 2**20, 1),
    loss=float(loss),
    backend=jax.default_backend(),
    device=str(jax.devices()[0].device_kind),
  )
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    result["device_peak_mb"] = round(stats["peak_bytes_in_use"] / 2**20, 1)
  if FLAGS.grads_out:
    leaves = {str(i): np.asarray(x, np.float64) for i, x in enumerate(jax.tree.leaves(grads))}
    np.savez(FLAGS.grads_out, **leaves)
  print(json.dumps(result), flush=True)


def spawn(mode, P, T, R, grads_out):
  argv = [
    sys.executable,
    os.path.abspath(__file__),
    f"--worker={mode}",
    f"--prefix_len={P}",
    f"--tail_len={T}",
    f"--branches={R}",
    f"--prompts={FLAGS.prompts}",
    f"--reps={FLAGS.reps}",
    f"--preset={FLAGS.preset}",
    f"--dtype={FLAGS.dtype}",
    f"--param_dtype={FLAGS.param_dtype}",
    f"--attention={FLAGS.attention}",
    f"--block_q={FLAGS.block_q}",
    f"--block_k={FLAGS.block_k}",
    f"--logits_chunk={FLAGS.logits_chunk}",
    f"--scan_layers={FLAGS.scan_layers}",
    f"--branch_chunk={FLAGS.branch_chunk}",
    f"--remat={FLAGS.remat}",
    f"--memory_cap_mb={FLAGS.memory_cap_mb}",
    f"--grads_out={grads_out}",
    f"--mesh={FLAGS.mesh}",
    f"--loss={FLAGS.loss}",
    f"--model_from={FLAGS.model_from}",
  ]
  proc = subprocess.run(argv, capture_output=True, text=True)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
  if proc.returncode or not lines:
    return dict(mode=mode, error=(proc.stderr or proc.stdout)[-2000:], returncode=proc.returncode)
  return json.loads(lines[-1])


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker, FLAGS.prefix_len[0], FLAGS.tail_len[0], FLAGS.branches[0])
    return
  cfg = model_config()
  grid = (
    [(P, T, R) for P in (1024, 2048, 4096, 8192) for T in (128, 512) for R in (8, 16)]
    if FLAGS.sweep
    else [(P, T, R) for P in FLAGS.prefix_len for T in FLAGS.tail_len for R in FLAGS.branches]
  )
  ceiling = matmul_gflops()
  B = FLAGS.prompts
  for P, T, R in grid:
    with tempfile.TemporaryDirectory() as tmp:
      paths = {
        m: os.path.join(tmp, f"{m}.npz") if FLAGS.check_grads else "" for m in ("naive", "replay")
      }
      runs = {m: spawn(m, P, T, R, paths[m]) for m in ("replay", "naive")}
      value = FLAGS.loss == "value"
      replay_flops = flops.step_flops(cfg, flops.flat(B, R, P, T, "replay"), value_head=value)
      naive_flops = flops.step_flops(cfg, flops.flat(B, R, P, T, "naive"), value_head=value)
      rep, nai = runs["replay"], runs["naive"]
      row = dict(
        prefix_len=P,
        tail_len=T,
        branches=R,
        prompts=B,
        preset=None if FLAGS.model_from else FLAGS.preset,
        dtype=FLAGS.dtype,
        param_dtype=FLAGS.param_dtype,
        attention=FLAGS.attention,
        remat=FLAGS.remat,
        logits_chunk=FLAGS.logits_chunk,
        loss=FLAGS.loss,
        model_from=FLAGS.model_from or None,
        branch_chunk=FLAGS.branch_chunk or R,
        token_ratio=round(R * (P + T) / (P + R * T), 3),
        flop_ratio=round(naive_flops / replay_flops, 3),
        replay_s="oom" if rep.get("oom") else rep.get("seconds"),
        naive_s="oom" if nai.get("oom") else nai.get("seconds"),
        replay_cpu_s=rep.get("cpu_seconds"),
        naive_cpu_s=nai.get("cpu_seconds"),
        replay_peak_mb="oom" if rep.get("oom") else rep.get("peak_mb"),
        naive_peak_mb="oom" if nai.get("oom") else nai.get("peak_mb"),
        replay_compiled_mb=rep.get("compiled_mb"),
        naive_compiled_mb=nai.get("compiled_mb"),
        matmul_gflops=round(ceiling, 1),
        backend=rep.get("backend"),
        device=rep.get("device"),
        date=time.strftime("%Y-%m-%d"),
      )
      if rep.get("seconds"):
        row["replay_gflops"] = round(replay_flops / rep["seconds"] / 1e9, 1)
      if rep.get("seconds") and nai.get("seconds"):
        row["speedup"] = round(nai["seconds"] / rep["seconds"], 3)
        row["speedup_over_flop_ratio"] = round(row["speedup"] / row["flop_ratio"], 3)
        if rep.get("cpu_seconds") and nai.get("cpu_seconds"):
          row["cpu_speedup"] = round(nai["cpu_seconds"] / rep["cpu_seconds"], 3)
        if nai.get("peak_mb"):
          row["peak_mem_ratio"] = round(rep["peak_mb"] / nai["peak_mb"], 3)
      else:
        row["speedup"] = None
      if FLAGS.mesh:
        row["mesh"] = FLAGS.mesh
      for m in ("replay", "naive"):
        for key in ("per_device_mb", "per_device_temp_mb"):
          if key in runs[m]:
            row[f"{m}_{key}"] = runs[m][key]
        if "device_peak_mb" in runs[m]:
          row[f"{m}_device_peak_mb"] = runs[m]["device_peak_mb"]
        if "error" in runs[m]:
          row[f"{m}_error"] = runs[m]["error"]
      if FLAGS.check_grads and os.path.exists(paths["naive"]) and os.path.exists(paths["replay"]):
        row["grad_max_rel_err"] = compare.npz_max_rel_err(paths["replay"], paths["naive"])
        row["loss_abs_err"] = abs(rep["loss"] - nai["loss"])
      else:
        row["grad_max_rel_err"] = None
    emit(row)


def emit(row):
  from experiments import provenance  # commit, dirty flag, command, jax/devices, machine, date

  provenance.emit(row, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
