"""The cost model: FLOP counts against a hand count, parameter counts against the model,
the fit's reported errors recomputed from the results files, and predictions' structure."""

import json
import os

import jax
import numpy as np
import pytest

from experiments import cost_model as cm, flops
from models import transformer as tfm

# D=4, N=2 query heads, K=1 kv head, H=2, F=3, V=5, L=1.
TINY = tfm.ModelConfig(
  vocab_size=5, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, mlp_hidden=3
)
SHAPE = cm.Shape(B=1, R=2, P=3, T=2)


def test_flops_of_a_tiny_shape_equal_a_hand_count():
  # Per position, MACs of one layer: q 4*2*2=16, k 4*1*2=8, v 8, o 2*2*4=16, MLP 3*4*3=36.
  assert flops.layer_macs(TINY) == 16 + 8 + 8 + 16 + 36 == 84
  # Causal pairs: prefix of 3: 3+2+1 = 6 (dense 9); a tail of 2 after 3: 2*3 + (1+2) = 9
  # (dense 2*5 = 10); the naive sequence of 5: 15 (dense 25).
  useful = cm.Execution(attention="flash")
  dense = cm.Execution(attention="dense")
  rep = cm.step_counts(TINY, SHAPE, "replay", dense)
  # matmuls: (3 prefix + 2*2 tail) positions * 84 MACs * 2 FLOP * 3 passes
  #          + head at 2*2 scored positions: 4 * 4*5 MACs * 2 * 3
  assert rep["matmul_flops"] == 7 * 84 * 2 * 3 + 4 * 20 * 2 * 3 == 4008
  # attention (dense, as executed): pairs 9 + 2*10 = 29, each N*H = 4 MACs for QK and 4 for
  # PV -> 8 MACs = 16 FLOPs forward; backward 2x.
  assert rep["attention_flops"] == 29 * 16 * 3 == 1392
  # useful (causal once): pairs 6 + 2*9 = 24, fwd + 2x bwd.
  assert rep["useful_attention_flops"] == 24 * 16 * 3 == 1152
  nai = cm.step_counts(TINY, SHAPE, "naive", dense)
  assert nai["matmul_flops"] == 2 * 5 * 84 * 2 * 3 + 4 * 20 * 2 * 3 == 5520
  assert nai["attention_flops"] == 2 * 25 * 16 * 3 and nai["useful_attention_flops"] == 2 * 15 * 48
  # flash: causal pairs once, backward 2.5x; remat adds one forward of the layers (not the head).
  fl = cm.step_counts(TINY, SHAPE, "replay", cm.Execution(attention="flash", remat=True))
  assert fl["attention_flops"] == 24 * 16 * (2 + 2.5)
  assert fl["matmul_flops"] == 7 * 84 * 2 * 4 + 4 * 20 * 2 * 3
  del useful


@pytest.mark.parametrize(
  "preset,P,T,R,B", [("small", 512, 64, 8, 1), ("large", 2048, 512, 16, 2), ("tiny", 7, 3, 5, 3)]
)
def test_useful_counts_equal_the_benchmarks_count(preset, P, T, R, B):
  """The benchmarks count *useful* FLOPs (flops.step_flops: causal pairs once, no remat);
  the cost model's split by kind sums to them."""
  cfg = tfm.preset(preset)
  for mode in ("naive", "replay"):
    ours = cm.step_counts(cfg, cm.Shape(B, R, P, T), mode, cm.Execution("flash"))
    useful = ours["matmul_flops"] + ours["useful_attention_flops"]
    assert useful == flops.step_flops(cfg, flops.flat(B, R, P, T, mode))


def test_param_count_equals_the_model_and_llama3_8b():
  cfg = tfm.preset("tiny")
  shapes = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  assert cm.param_count(cfg) == sum(int(np.prod(x.shape)) for x in jax.tree.leaves(shapes))
  assert cm.param_count(cm.LLAMA3_8B) == 8_030_261_248  # Meta-Llama-3-8B's published count


def test_memory_of_8b_states_and_cache_by_hand():
  ex = cm.Execution(attention="flash", remat=True, compute_bytes=2, context=8, shard=8)
  shape = cm.Shape(1, 16, 131072, 512)
  mem = cm.memory(cm.LLAMA3_8B, shape, "replay", ex)
  # fp32 master + fp32 grads + AdamW m, v = 16 bytes per parameter, over 8 devices
  assert mem["params_grads_optimizer"] == 8_030_261_248 * 16 / 8
  # gathered bf16 prefix cache: 32 layers x K,V x 131072 x 8 kv heads x 128 x 2 bytes (+ the
  # sequence shards it was gathered from)
  cache = 32 * 2 * 131072 * 8 * 128 * 2
  assert mem["prefix_cache"] == cache * (1 + 1 / 8) and mem["prefix_cache_cotangent"] == cache
  # remat keeps each layer's input, sequence-sharded: 32 x 131072/8 x 4096 x 2 bytes, plus
  # the tails' (2 branches per device x 512 positions)
  assert mem["saved_residuals"] == 32 * (131072 / 8 + 2 * 512) * 4096 * 2
  sharded = cm.memory(
    cm.LLAMA3_8B,
    shape,
    "replay",
    cm.Execution(
      attention="flash", remat=True, compute_bytes=2, context=8, shard=8, cache="sharded"
    ),
  )
  assert sharded["prefix_cache_cotangent"] == cache / 8


def test_fit_errors_are_computed_from_the_results_files():
  paths = [os.path.join(cm.RESULTS, p) for p in cm.DEFAULT_POINTS]
  points = cm.load_points(paths)
  fits = cm.fit(points)
  # every measured time in the files is a point, with its file and line
  expected = []
  for path in paths:
    for i, line in enumerate(open(path)):
      row = json.loads(line)
      if row.get("loss") == "value":
        continue
      for m in ("naive", "replay"):
        # on a CPU the step's own CPU seconds when recorded, else its wall seconds
        device = row.get("device") or row.get("provenance", {}).get("device_kind")
        t = row.get(f"{m}_cpu_s") if device == "cpu" else None
        t = t if isinstance(t, float) else row.get(f"{m}_s")
        if isinstance(t, float):
          expected.append((os.path.basename(path), i + 1, m, t))
  assert [(p["file"], p["line"], p["mode"], p["measured_s"]) for p in points] == expected
  assert {p["machine"] for p in points} == {"cpu core-s", "h200"}
  for p in points:  # prediction = features . parameters, error = (prediction - measured) / measured
    params = fits[p["machine"]]["params"]
    pred = (
      p["matmul_flops"] * params[f"s_mm[{p['regime']}]"]
      + p["attention_flops"] * params["s_attn"]
      + params["overhead_s"]
    )
    assert p["predicted_s"] == pytest.approx(pred, rel=1e-12)
    assert p["rel_err"] == pytest.approx((pred - p["measured_s"]) / p["measured_s"], rel=1e-12)
  for m, f in fits.items():
    errs = [abs(p["rel_err"]) for p in points if p["machine"] == m]
    assert f["max_abs_rel_err"] == max(errs) and f["n_points"] == len(errs)
    assert f["within_30pct"] == sum(e <= 0.3 for e in errs)


def test_the_committed_cost_model_file_is_reproduced():
  """Every line of cost_model_blockwise_2026-11-30.jsonl but its provenance (fits, points'
  FLOP counts, memory points, predictions) and its .md from today's counting, with its
  command's defaults (--tail_len=512 --tail_len=4096, flash efficiency 0.35 in 0.2..0.55)."""
  paths = [os.path.join(cm.RESULTS, p) for p in cm.DEFAULT_POINTS]
  points = cm.load_points(paths)
  fits = cm.fit(points)
  got = (
    [{"kind": "fit", "machine": m, **f} for m, f in fits.items()]
    + [{"kind": "fit_point", **p} for p in points]
    + [{"kind": "memory_point", **m} for m in cm.memory_points(paths)]
    + cm.predictions(fits, [512, 4096], 0.35, (0.2, 0.55), None)
  )
  with open(os.path.join(cm.RESULTS, "cost_model_blockwise_2026-11-30.jsonl")) as f:
    want = [json.loads(line) for line in f]
  for row in want:
    del row["provenance"], row["experiment"]
  assert len(got) == len(want) == 95
  for g, w in zip(json.loads(json.dumps(got)), want):
    assert g.keys() == w.keys(), set(g) ^ set(w)
    # Names, ints and counts (integral floats: FLOPs, bytes) exactly; other floats to 1e-12
    # relative: a least-squares solve's last bits differ between CPUs (LAPACK's kernels:
    # loo_rel_err 0.11431871152143254 on one machine, 0.11431871152143266 committed), while
    # any change of counting or fitting moves a value by far more.
    fitted = lambda a, b: (
      isinstance(a, float)
      and isinstance(b, float)
      and not b.is_integer()
      and abs(a - b) <= 1e-12 * max(abs(a), abs(b))
    )
    differ = {k: (g[k], w[k]) for k in g if g[k] != w[k] and not fitted(g[k], w[k])}
    assert not differ, differ
  preds = got[-len([r for r in want if r["kind"] == "prediction"]) :]
  md = cm.markdown(fits, points, preds, cm.memory_points(paths))
  with open(os.path.join(cm.RESULTS, "cost_model_blockwise_2026-11-30.md")) as f:
    assert md + "\n" == f.read()  # and its markdown tables


def test_fit_recovers_known_rates_and_reports_a_perturbed_point():
  rng = np.random.default_rng(0)
  points = []
  for i in range(12):
    mm, attn = rng.uniform(1e9, 1e11), rng.uniform(1e9, 1e11)
    points.append(
      dict(
        machine="m",
        regime="float32",
        matmul_flops=mm,
        attention_flops=attn,
        measured_s=mm / 50e9 + attn / 10e9 + 0.01,
      )
    )
  fits = cm.fit([dict(p) for p in points])
  params = fits["m"]["params"]
  assert params["s_mm[float32]"] == pytest.approx(1 / 50e9, rel=1e-6)
  assert params["s_attn"] == pytest.approx(1 / 10e9, rel=1e-6)
  assert fits["m"]["max_abs_rel_err"] < 1e-6
  points[3]["measured_s"] *= 1.5  # one bad measurement shows up in its own error
  pts = [dict(p) for p in points]
  fits = cm.fit(pts)
  worst = max(pts, key=lambda p: abs(p["rel_err"]))
  assert worst is pts[3] and worst["rel_err"] < -0.2 and abs(worst["loo_rel_err"]) > 0.3


def test_predictions_cover_every_gpu_and_both_paths():
  paths = [os.path.join(cm.RESULTS, p) for p in cm.DEFAULT_POINTS]
  preds = cm.predictions(cm.fit(cm.load_points(paths)), [512], 0.35, (0.2, 0.55))
  assert {(r["gpus"], r["mode"]) for r in preds} == {
    (g.name, m) for g in cm.GPUS for m in ("replay", "naive")
  }
  for r in preds:
    assert r["step_s_range"][0] <= r["step_s"] <= r["step_s_range"][1]
    assert r["step_s"] == pytest.approx(
      r["matmul_s"] + r["attention_s"] + r["elementwise_s"] + r["comm_s"]
    )
  h20 = {r["mode"]: r for r in preds if r["gpus"] == "8 x H20"}
  # replay's work ratio at T=512: between the token ratio's neighbourhood and R
  assert 8 < h20["naive"]["total_pflop"] / h20["replay"]["total_pflop"] < 16
  with pytest.raises(ValueError, match="H200 bfloat16"):
    cm.predictions({}, [512], 0.35, (0.2, 0.55))
