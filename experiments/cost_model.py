"""Q4: a cost model of one RL update step, naive vs branch replay, calibrated on measurements.

  python experiments/cost_model.py                      # fit + predictions -> JSON lines + table
  python experiments/cost_model.py --out=experiments/results/cost_model_blockwise_2026-11-30.jsonl \
      --markdown=experiments/results/cost_model_blockwise_2026-11-30.md

1. Counting (experiments/flops.py`s layouts and per-position, per-pair, per-head MACs of the
   model shape, `tfm.ModelConfig`): per layer and per path, matmul FLOPs
   (projections, MLP; the LM head once per scored position), attention FLOPs (QK^T and PV;
   `useful` = each causal query-key pair once, `executed` = what the kernel computes: dense
   masked attention computes every pair), HBM bytes of the element-wise passes, and memory
   (parameters + AdamW state, saved residuals, the prefix cache and its cotangent, one
   layer's working set). Backward = 2x forward for matmuls; attention backward = 2x forward
   with saved probabilities (dense), 2.5x with recomputed scores (flash); remat adds one
   forward of every layer.
2. Calibration: each measured step time (bench_replay.py rows: CPU sweep, H200) is modelled
   as  t = matmul_flops * s_mm[dtype] + attention_flops * s_attn + overhead  per machine
   (seconds per FLOP; s_mm also absorbs the per-position element-wise work, which scales
   with it for one model shape; attention as executed by the engine that ran: dense, so its
   rate absorbs the soft-max passes over the scores). Non-negative least squares on
   relative error; every point's error is reported, in-sample and leave-one-out. The
   memory model is not fitted: it is compared with each point's compiled footprint.
3. Prediction: Llama-3-8B shapes, B=1 prompt, P=131,072, R=16 on 8 GPUs, context parallel
   over 8 (prefix sequence and tail branches split 8 ways) with FSDP (parameters, gradients
   and AdamW state sharded 8 ways), flash attention saving only O and the LSE, remat of every
   layer, bf16 compute, fp32 master weights. Matmul efficiency = the H200 bf16 fit's achieved
   fraction of peak; flash attention's efficiency is an assumption (--flash_efficiency, with
   a low/high range) because the engine had no flash kernel when the points were measured.
   Naive runs the R branches one at a time (gradient accumulation: the same memory as one
   sequence, R times the work); `naive_all_at_once_gb` is its memory with all R at once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np


from experiments import flops  # noqa: E402
from models import transformer as tfm  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
# The blockwise engine's CPU sweep and long-context rows (CPU seconds of each step) and the
# H200 rows (dense engine, wall time). The first round's CPU sweep (dense engine, wall time
# on a loaded machine) can be added with --points.
DEFAULT_POINTS = (
  "cpu_sweep_blockwise_2026-11-30.jsonl",
  "cpu_long_context_2026-11-30.jsonl",
  "gpu_h200_2026-11-30.jsonl",
)
# What a results line does not say but its README section does: the last line of the H200
# file repeats the first with JAX_DEFAULT_MATMUL_PRECISION=highest (full fp32 matmuls, not
# TF32), so its matmul rate is a separate parameter.
ANNOTATIONS = {("gpu_h200_2026-11-30.jsonl", 5): {"matmul_precision": "highest"}}

LLAMA3_8B = tfm.ModelConfig(
  vocab_size=128256,
  d_model=4096,
  n_layers=32,
  n_heads=32,
  n_kv_heads=8,
  head_dim=128,
  mlp_hidden=14336,
  rope_theta=500000.0,
  dtype="bfloat16",
  param_dtype="float32",
  remat=True,
)


@dataclasses.dataclass(frozen=True)
class GPU:
  name: str
  bf16_tflops: float  # dense bf16 peak
  memory_gb: float
  hbm_tbps: float
  link_gbps: float = 360.0  # achieved all-gather bus bandwidth per GPU (NVLink 4, 900 GB/s raw)


GPUS = (
  GPU("8 x H20", 148.0, 96.0, 4.0),
  GPU("8 x H100 SXM", 989.0, 80.0, 3.35),
  GPU("8 x H200", 989.0, 141.0, 4.8),
)
H200_BF16_TFLOPS = 989.0


@dataclasses.dataclass(frozen=True)
class Shape:
  B: int  # prompts
  R: int  # branches per prompt
  P: int  # prefix length
  T: int  # tail length

  def __post_init__(self):
    for name in ("B", "R", "P", "T"):
      if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
        raise ValueError(f"Shape.{name}={getattr(self, name)!r}: expected an int >= 1")


@dataclasses.dataclass(frozen=True)
class Execution:
  attention: str = "dense"  # dense: every masked pair computed, probabilities saved | flash
  remat: bool = False  # recompute every layer's forward in the backward
  compute_bytes: int = 4  # activations (bf16: 2)
  master_bytes: int = 4  # parameters / gradients (fp32 master)
  optimizer_bytes: int = 8  # AdamW m and v in fp32
  context: int = 1  # devices splitting the prefix sequence and the tail branches
  shard: int = 1  # devices sharding parameters, gradients, optimizer state (FSDP)
  naive_microbatch: int = 0  # naive sequences per pass (0: all B*R at once)
  cache: str = (
    "gathered"  # the prefix cache in the tails: gathered (whole on each device) | sharded
  )
  logits_chunk: int = 0  # positions per log-prob chunk (0: all scored positions at once)

  def __post_init__(self):
    if self.attention not in ("dense", "flash"):
      raise ValueError(f"Execution.attention={self.attention!r}: expected 'dense' or 'flash'")
    if self.cache not in ("gathered", "sharded"):
      raise ValueError(f"Execution.cache={self.cache!r}: expected 'gathered' or 'sharded'")


# ----------------------------------------------------------------------------- counting


def param_count(cfg: tfm.ModelConfig) -> int:
  """Llama-family parameters (no biases/qk-norm): embeddings, L layers, final norm, head."""
  D, N, K, H, F, V, L = (
    cfg.d_model,
    cfg.n_heads,
    cfg.n_kv_heads,
    cfg.head_dim,
    cfg.mlp_hidden,
    cfg.vocab_size,
    cfg.n_layers,
  )
  layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F + 2 * D
  return V * D * (1 if cfg.tie_embeddings else 2) + L * layer + D


def segments(shape: Shape, mode: str):
  """The path's layout (experiments/flops.py): naive's B*R sequences, or replay's prefix and
  tails."""
  return flops.flat(shape.B, shape.R, shape.P, shape.T, mode)


def step_counts(cfg: tfm.ModelConfig, shape: Shape, mode: str, ex: Execution) -> dict:
  """FLOPs (whole step, all devices) of one loss+gradient step, split by kind.

  matmul_flops: projections + MLP (fwd 1, bwd 2, remat +1) and the LM head at the scored
  positions (fwd 1, bwd 2). attention_flops: QK^T + PV as executed by `ex.attention`
  (dense: every pair, bwd 2x; flash: causal pairs once, bwd 2.5x), remat +1 forward.
  useful_attention_flops: causal pairs once, fwd 1 + bwd 2 (the work any exact method needs);
  matmul_flops + useful_attention_flops = flops.step_flops (causal), without remat.
  """
  fwd_passes = 2 if ex.remat else 1
  attn_bwd = 2.0 if ex.attention == "dense" else 2.5
  pos, pair, head_macs = flops.position_macs(cfg), flops.pair_macs(cfg), flops.head_macs(cfg)
  out = dict(
    matmul_flops=0.0,
    attention_flops=0.0,
    useful_attention_flops=0.0,
    head_flops=0.0,
    tokens=0,
    per_segment={},
  )
  for seg in segments(shape, mode):
    n, tok = seg.n, seg.tokens
    pairs = seg.pairs(dense=ex.attention == "dense")
    layers_mm = 2 * n * tok * pos * (fwd_passes + 2)
    head = 2 * n * seg.scored * head_macs * 3
    attn = 2 * n * pairs * pair * (fwd_passes + attn_bwd)
    out["matmul_flops"] += layers_mm + head
    out["head_flops"] += head
    out["attention_flops"] += attn
    out["useful_attention_flops"] += 2 * n * seg.pairs() * pair * 3
    out["tokens"] += n * tok
    out["per_segment"][seg.name] = dict(
      matmul_flops=layers_mm + head, attention_flops=attn, tokens=n * tok, pairs=n * pairs
    )
  out["total_flops"] = out["matmul_flops"] + out["attention_flops"]
  return out


def layer_table(cfg: tfm.ModelConfig, shape: Shape, mode: str, ex: Execution) -> dict:
  """Per layer (all devices): FLOPs by kind, element-wise HBM bytes, saved-residual bytes."""
  c = step_counts(dataclasses.replace(cfg, n_layers=1, vocab_size=1), shape, mode, ex)
  D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden
  b = ex.compute_bytes
  # Element-wise traffic per position and forward pass: norms, RoPE, residual adds, the
  # gated activation (reads/writes of D-, NH- and F-sized vectors); backward ~2x.
  per_token_fwd = b * (14 * D + 3 * (N + 2 * K) * H + 2 * N * H + 6 * F)
  fwd_passes = 2 if ex.remat else 1
  ew = c["tokens"] * per_token_fwd * (fwd_passes + 2)
  if ex.attention == "dense":  # fp32 scores: written, masked, max, exp, summed, read by PV,
    ew += sum(s["pairs"] for s in c["per_segment"].values()) * N * 4 * 10  # and the backward
  return dict(
    matmul_flops=c["matmul_flops"] - c["head_flops"],
    attention_flops=c["attention_flops"],
    elementwise_bytes=ew,
    saved_bytes=_saved_per_layer(cfg, shape, mode, ex, per_device=False),
  )


# ----------------------------------------------------------------------------- memory


def _saved_per_layer(cfg, shape, mode, ex, per_device=True) -> float:
  """Residuals one layer keeps for the backward (bytes)."""
  D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden
  b = ex.compute_bytes
  total = 0.0
  for seg in segments(shape, mode):
    n = seg.n
    if mode == "naive" and ex.naive_microbatch:
      n = min(n, ex.naive_microbatch)
    tok = seg.tokens
    if per_device:
      tok = tok / ex.context if seg.name in ("prefix", "full") else tok
      n = math.ceil(n / ex.context) if seg.name == "tails" else n
    if ex.remat:
      total += n * tok * D * b  # the layer input only
      continue
    # x, two norm outputs, q, k, v (roped), attention out, gate, up, act*up, + the scores
    total += n * tok * (4 * D + (N + 2 * K) * H * 2 + N * H + 3 * F) * b
    dense = seg.pairs(dense=True)
    if ex.attention == "dense":
      total += n * (dense / (seg.tokens / tok)) * N * 4  # fp32 probabilities
    else:
      total += n * tok * N * 4  # the log-sum-exp
  return total


def memory(cfg: tfm.ModelConfig, shape: Shape, mode: str, ex: Execution) -> dict:
  """Peak bytes on one device, by part (an estimate: what is alive at the prefix backward
  for replay, at the first layer's backward for naive)."""
  D, N, K, H, F, V, L = (
    cfg.d_model,
    cfg.n_heads,
    cfg.n_kv_heads,
    cfg.head_dim,
    cfg.mlp_hidden,
    cfg.vocab_size,
    cfg.n_layers,
  )
  b = ex.compute_bytes
  n_params = param_count(cfg)
  parts = {}
  parts["params_grads_optimizer"] = n_params * (2 * ex.master_bytes + ex.optimizer_bytes) / ex.shard
  gathered_layer = flops.layer_macs(cfg) * b  # one layer's weights in the compute dtype
  parts["gathered_weights"] = (2 * gathered_layer + V * D * b) if ex.shard > 1 else 0.0
  parts["saved_residuals"] = L * _saved_per_layer(cfg, shape, mode, ex)
  B, R, P, T = shape.B, shape.R, shape.P, shape.T
  kv_bytes = lambda seqs, length: seqs * L * 2 * length * K * H * b
  if mode == "replay":
    cache = kv_bytes(B, P) / (ex.context if ex.cache == "sharded" else 1)
    parts["prefix_cache"] = cache + (
      kv_bytes(B, P) / ex.context if ex.cache == "gathered" and ex.context > 1 else 0.0
    )  # + its sequence shards
    parts["prefix_cache_cotangent"] = cache
    work_tokens, work_keys, n_scored = B * P / ex.context, P, B * math.ceil(R / ex.context) * T
    kv_seqs = B
  else:
    seqs = min(B * R, ex.naive_microbatch) if ex.naive_microbatch else B * R
    work_tokens, work_keys, n_scored = seqs * (P + T) / ex.context, P + T, seqs * T / ex.context
    kv_seqs = seqs
    if ex.naive_microbatch:
      parts["gradient_accumulator"] = 0.0  # the sharded fp32 gradient above accumulates
  # One layer's backward: activations of its positions and their cotangents, the layer's
  # gathered K/V and their fp32 cotangents; dense attention adds its fp32 scores.
  work = 2 * work_tokens * (4 * D + (N + 2 * K) * H * 2 + N * H + 3 * F) * b
  work += 2 * work_keys * K * H * (b + 4) * kv_seqs
  if ex.attention == "dense":
    work += 2 * work_tokens * work_keys * N * 4
  parts["layer_working_set"] = work
  chunk = min(n_scored, ex.logits_chunk) if ex.logits_chunk else n_scored
  parts["logits"] = 2 * chunk * V * 4  # fp32 logits and their cotangent
  parts["total"] = sum(parts.values())
  return parts


# ----------------------------------------------------------------------------- calibration


def machine_of(row: dict) -> str:
  prov = row.get("provenance") or {}
  device = str(
    row.get("device")
    or row.get("backend")
    or prov.get("device_kind")
    or prov.get("backend")
    or "unknown"
  ).lower()
  return "h200" if "h200" in device else ("cpu" if device == "cpu" else device.replace(" ", "_"))


def _remat(row: dict) -> bool:
  """A row's remat policy as a bool. Rows written before bench_replay recorded `remat` do not
  say it: gpu_check.sh ran the large preset with --remat, everything else without."""
  r = row.get("remat", row.get("preset") == "large")
  return r.lower() not in ("none", "false", "") if isinstance(r, str) else bool(r)


def _row_model(row: dict):
  """(cfg, shape, attention) of a bench_replay row, or None for a row this model does not
  read (another experiment's model, the critic's step, not a bench row)."""
  if not row.get("preset") or "prefix_len" not in row or row.get("loss", "grpo") == "value":
    return None
  cfg = tfm.preset(row["preset"], dtype=row["dtype"], param_dtype=row["dtype"], remat=_remat(row))
  shape = Shape(row.get("prompts", 1), row["branches"], row["prefix_len"], row["tail_len"])
  # The blockwise kernel computes causal pairs once and saves only the LSE (flash); rows
  # without the field ran the first round's dense engine.
  attention = "flash" if row.get("attention") == "blockwise" else "dense"
  return cfg, shape, attention


def _rows(path):
  name = os.path.basename(path)
  with open(path) as f:
    lines = [l for l in f if l.strip()]
  for i, line in enumerate(lines):
    yield name, i, {**json.loads(line), **ANNOTATIONS.get((name, i), {})}


def measured_time(row: dict, mode: str, cpu_time: bool = True):
  """(seconds, machine) of a row's step, or (None, machine). On a CPU the step's process CPU
  seconds (`*_cpu_s`, all its threads) stand for it when recorded: the machine is shared,
  and other jobs inflate wall time but not the step's own CPU time. Those points are their
  own machine ("cpu core-s"), never fitted together with wall-time points."""
  t, machine = row.get(f"{mode}_s"), machine_of(row)
  if cpu_time and machine == "cpu" and isinstance(row.get(f"{mode}_cpu_s"), (int, float)):
    t, machine = row[f"{mode}_cpu_s"], "cpu core-s"
  return (float(t) if isinstance(t, (int, float)) else None), machine


def load_points(paths, cpu_time: bool = True) -> list[dict]:
  """One point per measured (row, mode): its features and time, traced to file and line."""
  points = []
  for name, i, row in (r for path in paths for r in _rows(path)):
    model = _row_model(row)
    if model is None:
      continue
    cfg, shape, attention = model
    ex = Execution(attention=attention, remat=_remat(row))
    regime = row["dtype"] + ("-" + row["matmul_precision"] if "matmul_precision" in row else "")
    for mode in ("naive", "replay"):
      t, machine = measured_time(row, mode, cpu_time)
      if t is None:
        continue
      c = step_counts(cfg, shape, mode, ex)
      points.append(
        dict(
          file=name,
          line=i + 1,
          mode=mode,
          machine=machine,
          regime=regime,
          attention=attention,
          preset=row["preset"],
          P=shape.P,
          T=shape.T,
          R=shape.R,
          B=shape.B,
          measured_s=t,
          matmul_flops=c["matmul_flops"],
          attention_flops=c["attention_flops"],
        )
      )
  return points


def memory_points(paths) -> list[dict]:
  """The memory model (not fitted) against each measured compiled footprint (argument +
  output + temp bytes of the compiled step, `*_compiled_mb`): the row's attention engine,
  one device, parameters and gradients in the run's dtype, no optimizer state (the bench
  step has none)."""
  out = []
  for name, i, row in (r for path in paths for r in _rows(path)):
    model = _row_model(row)
    if model is None:
      continue
    cfg, shape, attention = model
    b = 2 if row["dtype"] == "bfloat16" else 4
    ex = Execution(
      attention=attention, remat=_remat(row), compute_bytes=b, master_bytes=b, optimizer_bytes=0
    )
    for mode in ("naive", "replay"):
      measured = row.get(f"{mode}_compiled_mb")
      if not isinstance(measured, (int, float)):
        continue
      est = memory(cfg, shape, mode, ex)["total"] / 2**20
      out.append(
        dict(
          file=name,
          line=i + 1,
          mode=mode,
          machine=machine_of(row),
          attention=attention,
          preset=row["preset"],
          P=shape.P,
          T=shape.T,
          R=shape.R,
          measured_mb=float(measured),
          model_mb=est,
          rel_err=(est - measured) / measured,
        )
      )
  return out


def _design(points, names):
  X = np.zeros((len(points), len(names)))
  for i, p in enumerate(points):
    X[i, names.index(f"s_mm[{p['regime']}]")] = p["matmul_flops"]
    X[i, names.index("s_attn")] = p["attention_flops"]
    X[i, names.index("overhead_s")] = 1.0
  return X


def _nnls_rel(X, y):
  from scipy.optimize import nnls

  scale = X.max(axis=0)
  scale[scale == 0] = 1.0
  theta, _ = nnls((X / scale) / y[:, None], np.ones_like(y))  # minimise relative errors
  return theta / scale


def fit(points: list[dict]) -> dict:
  """Per machine: seconds per matmul FLOP (per dtype regime), per attention FLOP, and a
  per-step overhead; each point's prediction and relative error, in-sample and leave-one-out."""
  machines = {}
  for machine in sorted({p["machine"] for p in points}):
    pts = [p for p in points if p["machine"] == machine]
    names = [f"s_mm[{r}]" for r in sorted({p["regime"] for p in pts})] + ["s_attn", "overhead_s"]
    X, y = _design(pts, names), np.array([p["measured_s"] for p in pts])
    theta = _nnls_rel(X, y)
    pred = X @ theta
    loo = np.full(len(pts), np.nan)
    for i in range(len(pts)):
      keep = np.arange(len(pts)) != i
      if np.linalg.matrix_rank(X[keep][:, X[keep].any(axis=0)]) < X[:, X.any(axis=0)].shape[1]:
        continue  # without this point a parameter is undetermined
      loo[i] = X[i] @ _nnls_rel(X[keep], y[keep])
    for p, pr, lo in zip(pts, pred, loo):
      p.update(
        predicted_s=float(pr),
        rel_err=float((pr - p["measured_s"]) / p["measured_s"]),
        loo_rel_err=None if np.isnan(lo) else float((lo - p["measured_s"]) / p["measured_s"]),
      )
    errs = np.abs([p["rel_err"] for p in pts])
    params = dict(zip(names, map(float, theta)))
    rates = {
      k[2:] + "_gflops": 1e-9 / v for k, v in params.items() if k.startswith("s_") and v > 0
    }  # s_mm[float32] -> mm[float32]_gflops
    machines[machine] = dict(
      params=params,
      rates_gflops=rates,
      n_points=len(pts),
      max_abs_rel_err=float(errs.max()),
      median_abs_rel_err=float(np.median(errs)),
      within_30pct=int((errs <= 0.3).sum()),
    )
  return machines


def predict_time(
  counts: dict,
  mm_eff: float,
  attn_eff: float,
  gpu: GPU,
  n_dev: int,
  ew_bytes: float,
  comm_bytes: float,
) -> dict:
  peak = gpu.bf16_tflops * 1e12 * n_dev
  t_mm = counts["matmul_flops"] / (mm_eff * peak)
  t_attn = counts["attention_flops"] / (attn_eff * peak)
  t_ew = ew_bytes / (0.7 * gpu.hbm_tbps * 1e12 * n_dev)  # 70% of HBM bandwidth
  t_comm = comm_bytes / (gpu.link_gbps * 1e9)
  return dict(
    matmul_s=t_mm,
    attention_s=t_attn,
    elementwise_s=t_ew,
    comm_s=t_comm,
    step_s=t_mm + t_attn + t_ew + t_comm,
  )


def comm_bytes_per_device(cfg, shape, mode, ex) -> float:
  """Bytes each device receives per step: FSDP weight all-gathers (forward, remat and
  backward, per pass over the model) + gradient reduce-scatter, and context-parallel K/V
  all-gathers (forward, remat) + reduce-scatters of their cotangents (fp32)."""
  c = ex.context
  frac = (c - 1) / c
  n = param_count(cfg)
  passes = (
    2
    if mode == "replay"
    else (shape.B * shape.R // max(ex.naive_microbatch, 1) if ex.naive_microbatch else 1)
  )
  weights = (
    passes * 3 * n * ex.compute_bytes * (ex.shard - 1) / ex.shard
    + n * 4 * (ex.shard - 1) / ex.shard
  )
  kv_layer = lambda seqs, length: seqs * 2 * length * cfg.n_kv_heads * cfg.head_dim
  if mode == "replay":
    kv = kv_layer(shape.B, shape.P) * cfg.n_layers * frac * (2 * ex.compute_bytes + 4)
  else:
    kv = (
      kv_layer(shape.B * shape.R, shape.P + shape.T)
      * cfg.n_layers
      * frac
      * (2 * ex.compute_bytes + 4)
    )
  return weights + kv


def predictions(
  fits: dict, T_list, flash_eff: float, flash_range, mm_eff: float | None = None
) -> list[dict]:
  """Llama-3-8B on each of GPUS. mm_eff: achieved fraction of bf16 peak of the matmuls
  (default: the H200 bf16 fit's)."""
  if mm_eff is None:
    h200 = fits.get("h200")
    if h200 is None or h200["params"].get("s_mm[bfloat16]", 0) <= 0:
      raise ValueError(
        "the fit has no H200 bfloat16 matmul rate: expected H200 bfloat16 rows "
        "in the calibration points, or pass --matmul_efficiency"
      )
    mm_eff = 1.0 / h200["params"]["s_mm[bfloat16]"] / (H200_BF16_TFLOPS * 1e12)
  cfg = LLAMA3_8B
  rows = []
  for gpu in GPUS:
    for T in T_list:
      shape = Shape(1, 16, 131072, T)
      for mode in ("replay", "naive"):
        ex = Execution(
          attention="flash",
          remat=True,
          compute_bytes=2,
          context=8,
          shard=8,
          naive_microbatch=1 if mode == "naive" else 0,
          logits_chunk=0,
        )
        counts = step_counts(cfg, shape, mode, ex)
        per_layer = layer_table(cfg, shape, mode, ex)
        ew = per_layer["elementwise_bytes"] * cfg.n_layers
        comm = comm_bytes_per_device(cfg, shape, mode, ex)
        t = predict_time(counts, mm_eff, flash_eff, gpu, 8, ew, comm)
        lo = predict_time(counts, mm_eff, flash_range[1], gpu, 8, ew, comm)["step_s"]
        hi = predict_time(counts, mm_eff, flash_range[0], gpu, 8, ew, comm)["step_s"]
        mem = memory(cfg, shape, mode, ex)
        row = dict(
          kind="prediction",
          gpus=gpu.name,
          model="Llama-3-8B",
          mode=mode,
          B=1,
          R=16,
          P=shape.P,
          T=T,
          positions=shape.R * (shape.P + T),
          mesh="context:8 + FSDP 8",
          matmul_efficiency=round(mm_eff, 4),
          flash_efficiency=flash_eff,
          total_pflop=counts["total_flops"] / 1e15,
          **{k: v for k, v in t.items()},
          step_s_range=[lo, hi],
          memory_gb=mem["total"] / 1e9,
          memory_parts_gb={k: v / 1e9 for k, v in mem.items() if k != "total"},
          per_layer=dict(
            matmul_tflop=per_layer["matmul_flops"] / 1e12,
            attention_tflop=per_layer["attention_flops"] / 1e12,
            elementwise_gb=per_layer["elementwise_bytes"] / 1e9,
            saved_gb_per_device=_saved_per_layer(cfg, shape, mode, ex) / 1e9,
          ),
          fits=mem["total"] / 1e9 <= gpu.memory_gb * 0.92,
        )  # ~8% runtime/fragmentation
        if mode == "naive":
          all_at_once = memory(cfg, shape, mode, dataclasses.replace(ex, naive_microbatch=0))
          row["naive_all_at_once_gb"] = all_at_once["total"] / 1e9
        rows.append(row)
  by = {(r["gpus"], r["T"], r["mode"]): r for r in rows}
  for r in rows:
    if r["mode"] == "replay":
      r["speedup_vs_naive"] = by[(r["gpus"], r["T"], "naive")]["step_s"] / r["step_s"]
  return rows


def markdown(fits: dict, points: list[dict], preds: list[dict], mem_points=()) -> str:
  out = [
    "### Fit (per machine; s = seconds per FLOP, rates = 1/s)",
    "",
    "| machine | points | parameters | max abs err | median abs err | within 30% |",
    "|---|---|---|---|---|---|",
  ]
  for m, f in fits.items():
    params = ", ".join(
      f"{k} = {1e-9 / v:.3g} GFLOP/s" if k != "overhead_s" and v > 0 else f"{k} = {v:.3g}"
      for k, v in f["params"].items()
    )
    out.append(
      f"| {m} | {f['n_points']} | {params} | {f['max_abs_rel_err']:.0%} | "
      f"{f['median_abs_rel_err']:.0%} | {f['within_30pct']}/{f['n_points']} |"
    )
  out += [
    "",
    "### Every measured point",
    "",
    "| file:line | machine | regime | mode | P | T | R | measured s | model s | error | "
    "leave-one-out error |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  pct = lambda x: "-" if x is None else f"{x:+.0%}"
  for p in points:
    out.append(
      f"| {p['file']}:{p['line']} | {p['machine']} | {p['regime']} | {p['mode']} | "
      f"{p['P']} | {p['T']} | {p['R']} | {p['measured_s']:.3g} | "
      f"{p['predicted_s']:.3g} | {pct(p['rel_err'])} | {pct(p['loo_rel_err'])} |"
    )
  if mem_points:
    errs = [abs(m["rel_err"]) for m in mem_points]
    out += [
      "",
      f"### Memory model vs compiled footprint (not fitted): max abs error "
      f"{max(errs):.0%}, median {float(np.median(errs)):.0%}, {len(errs)} points",
      "",
      "| file:line | mode | preset | P | T | R | compiled MB | model MB | error |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    out += [
      f"| {m['file']}:{m['line']} | {m['mode']} | {m['preset']} | {m['P']} | {m['T']} | "
      f"{m['R']} | {m['measured_mb']:.0f} | {m['model_mb']:.0f} | {m['rel_err']:+.0%} |"
      for m in mem_points
    ]
  out += [
    "",
    "### Predictions: Llama-3-8B, B=1, R=16, P=131,072, context:8 + FSDP, flash, "
    "remat, bf16 (not measured)",
    "",
    "| GPUs | T | mode | PFLOP | step s (range) | matmul s | attention s | comm s | "
    "memory GB/device | fits | replay speedup |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in preds:
    rng = f"{r['step_s']:.3g} ({r['step_s_range'][0]:.3g}-{r['step_s_range'][1]:.3g})"
    mem = f"{r['memory_gb']:.1f}"
    if r["mode"] == "naive":
      mem += f" (all {r['R']} at once: {r['naive_all_at_once_gb']:.0f})"
    out.append(
      f"| {r['gpus']} | {r['T']} | {r['mode']} | {r['total_pflop']:.1f} | {rng} | "
      f"{r['matmul_s']:.3g} | {r['attention_s']:.3g} | {r['comm_s']:.2g} | {mem} | "
      f"{'yes' if r['fits'] else 'no'} | "
      f"{r.get('speedup_vs_naive', float('nan')):.1f} |".replace("| nan |", "| - |")
    )
  return "\n".join(out)


def main(argv):
  from absl import flags

  FLAGS = flags.FLAGS
  from experiments import provenance

  paths = FLAGS.points or [os.path.join(RESULTS, p) for p in DEFAULT_POINTS]
  points = load_points(paths)
  fits = fit(points)
  mem_points = memory_points(paths)
  preds = predictions(
    fits,
    FLAGS.tail_len,
    FLAGS.flash_efficiency,
    (FLAGS.flash_efficiency_low, FLAGS.flash_efficiency_high),
    FLAGS.matmul_efficiency or None,
  )
  writer = provenance.ResultsWriter(FLAGS.out, "cost_model", with_jax=False, echo=False)
  for m, f in fits.items():
    writer.write({"kind": "fit", "machine": m, **f})
  for p in points:
    writer.write({"kind": "fit_point", **p})
  for m in mem_points:
    writer.write({"kind": "memory_point", **m})
  for r in preds:
    writer.write(r)
  md = markdown(fits, points, preds, mem_points)
  print(md)
  if FLAGS.markdown:
    with open(FLAGS.markdown, "w") as f:
      f.write(md + "\n")


if __name__ == "__main__":
  from absl import app, flags

  flags.DEFINE_multi_string(
    "points",
    [],
    "bench_replay results files to calibrate on (default: the CPU sweep and the H200 rows)",
  )
  flags.DEFINE_multi_integer("tail_len", [512, 4096], "T of the predictions (repeatable)")
  flags.DEFINE_float(
    "flash_efficiency",
    0.35,
    "assumed achieved fraction of bf16 peak of flash attention (forward + backward)",
  )
  flags.DEFINE_float("flash_efficiency_low", 0.2, "the range's pessimistic end")
  flags.DEFINE_float("flash_efficiency_high", 0.55, "the range's optimistic end")
  flags.DEFINE_float(
    "matmul_efficiency",
    0.0,
    "achieved fraction of bf16 peak of the matmuls (0: the H200 bf16 fit's)",
  )
  flags.DEFINE_string("out", "", "append the JSON lines here")
  flags.DEFINE_string("markdown", "", "write the markdown tables here")
  app.run(main)
