"""The 8-GPU plan in numbers: Llama-3-8B shapes, B=1 prompt, P=131,072 prefix positions,
R=16 branches of T=512, the replay train step (loss + gradient + AdamW) compiled for an
8-device mesh on 8 fake CPU devices, compile only (`.lower().compile()` of abstract
arguments: no weights allocated, no step run).

  python experiments/plan_8gpu.py --prefix_len=8192 --mesh=context:8 \
      --out=experiments/results/plan_8gpu_cpu_2026-12-02.jsonl

Per row (one subprocess each, with a timeout): per-device compiled memory (arguments,
outputs, temporaries; sharding.memory_report) and whether it fits 96 GB (H20), 80 GB (H100),
141 GB (H200); the collectives of the compiled step (experiments/hlo_collectives.py, loop
trip counts multiplied) by category against `comm_formula` from the shapes; the cost
model's step time per GPU (experiments/cost_model.py: FLOPs / calibrated rate + elementwise
+ this row's communication over cost_model's link_gbps).

--params=fsdp_context is the code as it is (sharding.param_rules: on a mesh with a `context`
axis parameters are sharded over `fsdp` x `context`, ZeRO-3 over every device of the mesh).
--params=fsdp is the rule before it (RULES: parameters over `fsdp` only; on context:8 every
device holds all 8B parameters and their AdamW moments), applied here by replacing
sharding.param_rules in the worker, values unchanged (a sharding only). B=1: the batch maps
to (data, fsdp), so a mesh with data*fsdp > 1 cannot split one prompt (ValueError from the
batch shardings).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import time


from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """The command line's flags, defined when the script runs (not on import: the tests import
  this module beside other experiments whose flags share names, e.g. bench_replay's
  prefix_len)."""
  flags.DEFINE_multi_integer("prefix_len", [131072], "P values")
  flags.DEFINE_multi_string("mesh", ["context:8"], "8-device mesh specs")
  flags.DEFINE_multi_string("params", ["fsdp_context"], "fsdp | fsdp_context (see docstring)")
  flags.DEFINE_string(
    "cache",
    "sharded",
    "sharded (the code: the prefix cache crosses to the "
    "tails split over the sequence) | gathered (whole on every device)",
  )
  flags.DEFINE_integer("tail_len", 512, "T")
  flags.DEFINE_integer("branches", 16, "R")
  flags.DEFINE_integer("prompts", 1, "B")
  flags.DEFINE_string("model", "llama3_8b", "llama3_8b | small (attribution) | tiny (tests)")
  flags.DEFINE_integer("timeout_s", 3000, "per row")
  flags.DEFINE_string("worker", "", "internal: 'P;mesh;params' -> one JSON line")
  flags.DEFINE_string("out", "", "append JSON lines here")
  flags.DEFINE_string("markdown", "", "only write --out's rows as a markdown table here")
  flags.DEFINE_string("hlo_dir", "", "write each row's compiled HLO text here")


N_DEVICES = 8
GPU_GB = {"H20": 96.0, "H100": 80.0, "H200": 141.0}
PARAM_RULES = ("fsdp", "fsdp_context")
# The cost model's calibration (experiments/results/cost_model_blockwise_2026-11-30.jsonl):
# the H200 bf16 fit's matmul efficiency and the assumed flash-attention efficiency (range).
MATMUL_EFFICIENCY, FLASH_EFFICIENCY, FLASH_RANGE = 0.7617, 0.35, (0.2, 0.55)


def model_config(name: str):
  from experiments import cost_model
  from models import transformer as tfm

  if name == "llama3_8b":
    base = cost_model.LLAMA3_8B
  elif name == "small":  # as experiments/context_parallel_memory.py compiles it
    base = tfm.preset("small", dtype="bfloat16", param_dtype="float32")
  elif name == "tiny":
    base = tfm.preset("tiny", dtype="float32", attention_block_q=16, attention_block_k=16)
  else:
    raise ValueError(f"--model={name!r}: expected 'llama3_8b', 'small' or 'tiny'")
  return dataclasses.replace(base, remat="full", scan_layers=True, context_parallel="all_gather")


def mesh_sizes(spec: str, n_devices: int = N_DEVICES) -> dict[str, int]:
  """The mesh's axis sizes; ValueError unless they use exactly n_devices."""
  from branch_replay.core import sharding

  return sharding.parse_mesh_spec(spec, n_devices)


def check_row(P: int, spec: str, params: str, B: int, n_devices: int = N_DEVICES) -> dict:
  """Bad input before any compilation: the mesh must use the 8 devices, P must split over
  `context`, B over data*fsdp, and --params must be one of PARAM_RULES."""
  sizes = mesh_sizes(spec, n_devices)
  if P % sizes["context"]:
    raise ValueError(
      f"prefix_len P={P} is not divisible by the mesh's context axis of size "
      f"{sizes['context']} (mesh {spec!r}): expected a multiple of "
      f"{sizes['context']}"
    )
  if B % (sizes["data"] * sizes["fsdp"]):
    raise ValueError(
      f"prompts B={B} is not divisible by data*fsdp="
      f"{sizes['data'] * sizes['fsdp']} (mesh {spec!r}): the batch axis maps "
      "to (data, fsdp)"
    )
  if params not in PARAM_RULES:
    raise ValueError(f"params={params!r}: expected one of {PARAM_RULES}")
  return sizes


def comm_formula(
  cfg, B, P, R, T, sizes, params, kv_bytes, weight_bytes, grad_bytes=4, cache="sharded"
):
  """Bytes one device sends per step (ring model), from the shapes, by category.

  kv_prefix: the prefix attention's K/V all-gather over `context`, per layer for K and V,
    twice (the forward, and remat's recomputation in the backward), and the reduce-scatter
    of its dK/dV once.
  kv_tails: the tails' attention, the same again (the cache crosses to the tails in its
    sequence shards and each tail layer gathers its K/V once, then again in remat, and
    reduce-scatters the tails' dK/dV once); with cache='gathered', every layer's K/V
    gathered once at the crossing and its cotangent reduce-scattered once (2 of those 3).
  weights: each layer's weights all-gathered over the parameter shards per pass over the
    model: prefix forward, tails forward, tails backward (recompute + gradient), prefix
    backward (4 passes), and the embedding + head once per pass that uses them.
  grads: the fp32 gradient reduce-scattered over the parameter shards (fsdp_context) or,
    with parameters replicated over `context`, all-reduced over it (the prefix shards and
    the branch shards each hold a partial gradient).
  """
  from experiments import cost_model

  d, f, t, c = sizes["data"], sizes["fsdp"], sizes["tensor"], sizes["context"]
  L, K, H = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
  kv_elems = B // (d * f) * P * (K // t) * H  # one layer's K (or V), gathered
  kv = 2 * L * 3 * kv_elems * (c - 1) / c * kv_bytes if c > 1 else 0.0
  n_params = cost_model.param_count(cfg) / t
  shards = f * c if params == "fsdp_context" else f
  frac = (shards - 1) / shards
  weights = 4 * n_params * weight_bytes * frac
  if params == "fsdp_context" or c == 1:
    grads = n_params * grad_bytes * frac
  else:  # reduce-scatter over fsdp, then an all-reduce of the 1/f shard over context
    grads = n_params * grad_bytes * frac + 2 * n_params / f * grad_bytes * (c - 1) / c
  kv_tails = kv if cache == "sharded" else kv * 2 / 3
  return dict(
    kv_prefix=kv,
    kv_tails=kv_tails,
    weights=weights,
    grads=grads,
    total=kv + kv_tails + weights + grads,
  )


def param_shapes(cfg, sizes) -> set:
  """Every parameter leaf's dimensions (sorted: XLA may permute a layout), unstacked from
  the scanned layers too, and each with one dimension divided by a shard count of the mesh
  (a gathered or scattered shard)."""
  import jax
  from models import transformer as tfm

  leaves = jax.tree.leaves(jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0))))
  divisors = {
    n
    for n in (sizes["fsdp"], sizes["context"], sizes["tensor"], sizes["fsdp"] * sizes["context"])
    if n > 1
  }
  out = set()
  for leaf in leaves:
    for s in (tuple(leaf.shape), tuple(leaf.shape[1:])):
      out.add(tuple(sorted(s)))
      out.update(
        tuple(sorted(s[:i] + (s[i] // n,) + s[i + 1 :]))
        for i in range(len(s))
        for n in divisors
        if s[i] % n == 0
      )
  return out


def classify(op, cfg, B, P, sizes, p_shapes) -> str:
  """kv_prefix / kv_tails: the K/V all-gathers and dK/dV reduce-scatters of the prefix's and
  the tails' context-parallel attention, by their name scopes (context_parallel.PREFIX_SCOPE,
  TAILS_SCOPE; the transposes keep them). Without them (model.context_parallel='gspmd', or
  code before the tails' shard_map): the prefix's all-gathers [B, P, K, H] and
  reduce-scatters [B, P/C, K, H], and as kv_tails other all-gathers of a whole layer's prefix
  K/V (the partitioner's tail attention, in the kernel's [B, K, P, H] layout). weights:
  all-gathers, grads: reduce-scatters / all-reduces, whose bytes are mostly parameter-shaped
  arrays; other: the rest (the tails' partitioned attention statistics, loss sums, indices).
  Shapes are compared as sorted dimensions."""
  from experiments import hlo_collectives as hc
  from models.attention import context_parallel as cp

  d, f, t, c = sizes["data"], sizes["fsdp"], sizes["tensor"], sizes["context"]
  Bl, K, H = B // (d * f), cfg.n_kv_heads // t, cfg.head_dim
  key = lambda s: tuple(sorted(s))
  kv_full, kv_shard = key((Bl, P, K, H)), key((Bl, P // c, K, H))
  arrays = [(s, hc.DTYPE_BYTES[dt] * math.prod(s)) for dt, s in op.arrays]
  kv_shaped = any(key(s) in (kv_full, kv_shard) for s, _ in arrays)  # not the masks [B, P]
  for scope, cat in ((cp.PREFIX_SCOPE, "kv_prefix"), (cp.TAILS_SCOPE, "kv_tails")):
    if op.kind in ("all-gather", "reduce-scatter") and f"/{scope}/" in op.name and kv_shaped:
      return cat
  if op.kind == "all-gather" and any(key(s) == kv_full for s, _ in arrays):
    return "kv_prefix" if any(s == (Bl, P, K, H) for s, _ in arrays) else "kv_tails"
  if op.kind == "reduce-scatter" and any(s == (Bl, P // c, K, H) for s, _ in arrays):
    return "kv_prefix"
  param_b = sum(b for s, b in arrays if key(s) in p_shapes and key(s) not in (kv_full, kv_shard))
  if op.kind in ("all-gather", "reduce-scatter", "all-reduce") and param_b * 2 > sum(
    b for _, b in arrays
  ):
    return "weights" if op.kind == "all-gather" else "grads"
  return "other"


CATEGORIES = ("kv_prefix", "kv_tails", "weights", "grads", "other")
FORMULA_CATEGORIES = CATEGORIES[:-1]


def hlo_comm(hlo_text, cfg, B, P, sizes) -> dict:
  from experiments import hlo_collectives as hc

  out = {k: 0.0 for k in CATEGORIES}
  n_ops = {k: 0 for k in CATEGORIES}
  p_shapes = param_shapes(cfg, sizes)
  for op in hc.collectives(hlo_text):
    if op.group <= 1:
      continue
    cat = classify(op, cfg, B, P, sizes, p_shapes)
    out[cat] += op.count * hc.link_bytes(op)
    n_ops[cat] += op.count
  out["total"] = sum(out.values())
  return dict(bytes=out, ops=n_ops)


def worker(
  P: int,
  spec: str,
  params_rule: str,
  model: str = "llama3_8b",
  B: int = 1,
  R: int = 16,
  T: int = 512,
  hlo_dir: str = "",
  cache: str = "sharded",
) -> dict:
  """One row: compile the replay train step for abstract arguments on the mesh's first
  devices (the CLI passes 8-device meshes only; the test a smaller toy mesh)."""
  from branch_replay.core import sharding

  cfg = model_config(model)
  n = math.prod(int(s.split(":")[1]) for s in spec.split(","))
  sizes = check_row(P, spec, params_rule, B, n)
  param_rules, cache_axes = sharding.param_rules, sharding.CACHE_AXES
  if params_rule == "fsdp":  # the rule before param_rules: parameters over fsdp only
    sharding.param_rules = lambda mesh: sharding.RULES
  if cache == "gathered":  # the crossing's layout before the cache stayed sharded
    sharding.CACHE_AXES = dict(cache_axes, kv=("batch", None, "kv_heads", "head_dim"))
  elif cache != "sharded":
    raise ValueError(f"cache={cache!r}: expected 'sharded' or 'gathered'")
  try:
    return dict(
      _compile_row(cfg, P, spec, params_rule, model, B, R, T, n, sizes, hlo_dir, cache), cache=cache
    )
  finally:
    sharding.param_rules, sharding.CACHE_AXES = param_rules, cache_axes


def _compile_row(cfg, P, spec, params_rule, model, B, R, T, n, sizes, hlo_dir, cache):
  import jax
  from branch_replay.core import sharding
  from experiments import measure

  mesh = sharding.make_mesh(spec, jax.devices()[:n])
  t0 = time.time()
  compiled, (params, opt_state) = measure.compile_replay_step(cfg, mesh, B, P, R, T)
  compile_s = time.time() - t0
  report = sharding.memory_report(compiled)
  text = compiled.as_text()
  if hlo_dir:
    os.makedirs(hlo_dir, exist_ok=True)
    name = f"{model}_P{P}_{spec.replace(':', '').replace(',', '_')}_{params_rule}.hlo"
    with open(os.path.join(hlo_dir, name), "w") as f:
      f.write(text)
  hlo = hlo_comm(text, cfg, B, P, sizes)
  # CPU's XLA computes bf16 in f32 (its collectives included): the HLO check uses 4 bytes,
  # the GPU prediction the compute dtype's 2.
  formula_cpu = comm_formula(cfg, B, P, R, T, sizes, params_rule, 4, 4, cache=cache)
  gb = lambda b: round(b / 1e9, 3)
  rnd = lambda d: {k: round(v) for k, v in d.items()}
  per_device_gb = gb(report["total_bytes"])
  return dict(
    model=model,
    P=P,
    T=T,
    R=R,
    B=B,
    mesh=spec,
    params=params_rule,
    compile_s=round(compile_s, 1),
    per_device_gb=per_device_gb,
    argument_gb=gb(report["argument_bytes"]),
    output_gb=gb(report["output_bytes"]),
    temp_gb=gb(report["temp_bytes"]),
    alias_gb=gb(report["alias_bytes"]),
    param_opt_gb=gb(sharding.per_device_bytes((params, opt_state))),
    fits={g: per_device_gb <= cap for g, cap in GPU_GB.items()},
    hlo_comm_bytes=rnd(hlo["bytes"]),
    hlo_comm_ops=hlo["ops"],
    formula_comm_bytes_cpu_dtypes=rnd(formula_cpu),
  )


def predict(row: dict) -> dict:
  """cost_model's step time per GPU for this row's shape and mesh: FLOPs / calibrated rate,
  elementwise passes, and the communication of `comm_formula` in GPU dtypes (bf16 K/V and
  gathered weights, fp32 gradients) over cost_model's link_gbps, not overlapped; and the
  same with the compiled step's collectives instead (step_s_compiled_comm: CPU dtypes,
  f32, so an upper bound for the bf16 traffic)."""
  from experiments import cost_model

  cfg = model_config(row["model"])
  sizes = mesh_sizes(row["mesh"], math.prod(int(s.split(":")[1]) for s in row["mesh"].split(",")))
  shape = cost_model.Shape(row["B"], row["R"], row["P"], row["T"])
  ex = cost_model.Execution(
    attention="flash",
    remat=True,
    compute_bytes=2,
    context=sizes["context"],
    shard=sizes["fsdp"] * sizes["context"],
  )
  counts = cost_model.step_counts(cfg, shape, "replay", ex)
  ew = cost_model.layer_table(cfg, shape, "replay", ex)["elementwise_bytes"] * cfg.n_layers
  comm = comm_formula(
    cfg,
    row["B"],
    row["P"],
    row["R"],
    row["T"],
    sizes,
    row["params"],
    2,
    2,
    cache=row.get("cache", "sharded"),
  )
  hlo_bytes = row["hlo_comm_bytes"]["total"]
  out = {}
  for gpu in cost_model.GPUS:
    t = cost_model.predict_time(
      counts, MATMUL_EFFICIENCY, FLASH_EFFICIENCY, gpu, N_DEVICES, ew, comm["total"]
    )
    lo, hi = (
      cost_model.predict_time(counts, MATMUL_EFFICIENCY, e, gpu, N_DEVICES, ew, comm["total"])[
        "step_s"
      ]
      for e in FLASH_RANGE[::-1]
    )
    compiled_comm_s = hlo_bytes / (gpu.link_gbps * 1e9)
    out[gpu.name] = dict(
      {k: round(v, 2) for k, v in t.items()},
      step_s_range=[round(lo, 1), round(hi, 1)],
      compiled_comm_s=round(compiled_comm_s, 2),
      step_s_compiled_comm=round(t["step_s"] - t["comm_s"] + compiled_comm_s, 2),
    )
  return dict(
    total_pflop=round(counts["total_flops"] / 1e15, 2),
    comm_gb_gpu={k: round(v / 1e9, 2) for k, v in comm.items()},
    link_gbps=cost_model.GPUS[0].link_gbps,
    step_time=out,
  )


def run_row(P: int, spec: str, params: str, passed, env) -> dict:
  argv = [sys.executable, os.path.abspath(__file__), *passed, f"--worker={P};{spec};{params}"]
  try:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=FLAGS.timeout_s)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if lines:
      return json.loads(lines[-1])
    return dict(
      P=P, mesh=spec, params=params, error=f"exit {proc.returncode}: {proc.stderr[-600:]}"
    )
  except subprocess.TimeoutExpired:
    return dict(P=P, mesh=spec, params=params, error=f"compile over {FLAGS.timeout_s} s")


def markdown(rows) -> str:
  """The results file's rows as a table (GB = 1e9 bytes, per device, per step)."""
  head = (
    "| P | mesh | params | compile s | per-device GB (args / temp) | fits H20 96 / H100 80 "
    "/ H200 141 | comm GB formula, CPU f32 dtypes (kv_prefix, kv_tails, weights, grads) | "
    "comm GB compiled (kv_prefix, kv_tails, weights, grads, other) | step s H20 / H100 / "
    "H200 (formula comm) | "
    "same, compiled comm |"
  )
  out = [head, "|" + "---|" * 10]
  for r in rows:
    if r.get("kind") != "row":
      continue
    if "error" in r:
      out.append(f"| {r['P']} | {r['mesh']} | {r['params']} | {r['error'][:80]} |" + " |" * 6)
      continue
    g = lambda b: f"{b / 1e9:.1f}"
    f, h = r["formula_comm_bytes_cpu_dtypes"], r["hlo_comm_bytes"]
    st = r["prediction"]["step_time"]
    yes = lambda ok: "yes" if ok else "no"
    out.append(
      f"| {r['P']} | {r['mesh']} | {r['params']} | {r['compile_s']:.0f} | "
      f"{r['per_device_gb']:.1f} ({r['argument_gb']:.1f} / {r['temp_gb']:.1f}) | "
      f"{' / '.join(yes(r['fits'][k]) for k in GPU_GB)} | "
      f"{g(f['total'])} ({', '.join(g(f.get(k, 0.0)) for k in FORMULA_CATEGORIES)}) | "
      f"{g(h['total'])} ({', '.join(g(h[k]) for k in CATEGORIES)}) | "
      f"{' / '.join(str(v['step_s']) for v in st.values())} | "
      f"{' / '.join(str(v['step_s_compiled_comm']) for v in st.values())} |"
    )
  return "\n".join(out) + "\n"


def main(argv):
  del argv
  if FLAGS.markdown:
    from experiments import provenance

    with open(FLAGS.markdown, "w") as f:
      f.write(markdown(provenance.read(FLAGS.out)))
    return
  if FLAGS.worker:
    P, spec, params = FLAGS.worker.split(";")
    print(
      json.dumps(
        worker(
          int(P),
          spec,
          params,
          FLAGS.model,
          FLAGS.prompts,
          FLAGS.branches,
          FLAGS.tail_len,
          FLAGS.hlo_dir,
          FLAGS.cache,
        )
      ),
      flush=True,
    )
    return
  for P in FLAGS.prefix_len:  # bad input before any subprocess starts
    for spec in FLAGS.mesh:
      for params in FLAGS.params:
        check_row(P, spec, params, FLAGS.prompts)
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, "plan_8gpu", with_jax=False)
  env = dict(
    os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={N_DEVICES}"
  )
  passed = [
    a for a in sys.argv[1:] if not a.startswith(("--out", "--prefix_len", "--mesh", "--params"))
  ]
  for P in FLAGS.prefix_len:
    for spec in FLAGS.mesh:
      for params in FLAGS.params:
        row = run_row(P, spec, params, passed, env)
        if "error" not in row:
          row["prediction"] = predict(row)
        writer.write({"kind": "row", **row})


if __name__ == "__main__":
  define_flags()
  app.run(main)
