"""Sharded branch replay equals one device: branch-parallel tails, FSDP, tensor and
context-parallel prefix on 8 fake CPU devices; the context-parallel prefix holds 1/c of its
residuals per device; bad meshes fail with both numbers."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from branch_replay.core import engine, sharding, tree
from models import transformer as tfm

from helpers import SHARDING_LOSS, logp_batch, tiny_model, tiny_run


def model():
  return tiny_model(dtype="float32", perturb=0.0)


BATCH = dict(B=4, R=8, P=16, T=3)


@functools.lru_cache(maxsize=None)
def single_device():
  cfg, params = model()
  batch = logp_batch(0, **BATCH)
  tree.validate(batch, cfg.vocab_size)
  out = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, SHARDING_LOSS))(params, batch)
  return jax.tree.map(np.asarray, out)


def sharded(spec, devices=None, branch_chunk=None):
  cfg, params = model()
  batch = logp_batch(0, **BATCH)
  mesh = sharding.make_mesh(spec, devices)
  params = sharding.put(params, sharding.param_shardings(mesh, cfg))
  batch = sharding.put(batch, sharding.batch_shardings(mesh, batch))
  step = jax.jit(
    lambda p, b: engine.loss_and_grad(p, b, cfg, SHARDING_LOSS, "replay", branch_chunk, mesh=mesh)
  )
  return mesh, step(params, batch)


@pytest.mark.parametrize(
  "spec, branch_chunk",
  [
    ("context:8", None),  # branch-parallel tails (R over 8), context-parallel prefix
    ("data:4,context:2", None),  # prompts x branches
    ("fsdp:4,tensor:2", None),  # FSDP + tensor-parallel heads/mlp/vocab, no branch sharding
    ("data:2,fsdp:2,context:2", 4),  # mixed, tails streamed in 2 chunks of 4 branches
  ],
)
def test_sharded_equals_single_device(spec, branch_chunk):
  mesh, (loss, aux, grads) = sharded(spec, branch_chunk=branch_chunk)
  ref_loss, ref_aux, ref_grads = single_device()
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  for name in ref_aux:
    np.testing.assert_allclose(aux[name], ref_aux[name], rtol=1e-5, atol=1e-5)
  assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
  for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))
  # The test can fail: gradients are not trivially zero.
  assert max(float(np.abs(g).max()) for g in jax.tree.leaves(ref_grads)) > 1e-3
  # Grads come out sharded like the parameters (FSDP: each device holds 1/fsdp of them).
  cfg, _ = model()
  expected = sharding.param_shardings(mesh, cfg)
  for g, s in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
    assert g.sharding.is_equivalent_to(s, g.ndim), (g.sharding, s)
  # The tails ran sharded over prompts and branches (aux_BR comes out that way).
  aux_sharding = jax.sharding.NamedSharding(mesh, sharding.logical_spec(("batch", "branch")))
  assert aux["logp_sum"].sharding.is_equivalent_to(aux_sharding, 2), aux["logp_sum"].sharding


def test_branch_parallel_step_splits_the_work():
  """On context:8 each device computes about 1/8 of the step (its branches, its slice of the
  prefix), from the compiled step's per-device FLOPs: the output layout alone would not show
  a partitioner that runs every branch on every device and slices at the end (the flat mesh
  path before the one engine did: 0.69 of one device's FLOPs; the engine: 0.26)."""
  cfg, params = model()
  batch = logp_batch(0, **BATCH)
  mesh = sharding.make_mesh("context:8")
  placed = (
    sharding.put(params, sharding.param_shardings(mesh, cfg)),
    sharding.put(batch, sharding.batch_shardings(mesh, batch)),
  )
  flops = lambda fn, *args: _first(jax.jit(fn).lower(*args).compile().cost_analysis())["flops"]
  one = flops(lambda p, b: engine.loss_and_grad(p, b, cfg, SHARDING_LOSS), params, batch)
  per_device = flops(
    lambda p, b: engine.loss_and_grad(p, b, cfg, SHARDING_LOSS, "replay", mesh=mesh), *placed
  )
  assert per_device <= 0.35 * one, (per_device, one)


def _first(analysis):
  return analysis[0] if isinstance(analysis, (list, tuple)) else analysis


def test_every_param_leaf_gets_a_spec_and_fsdp_shards_it():
  cfg, params = model()
  mesh = sharding.make_mesh("fsdp:4,tensor:2")
  shardings = sharding.param_shardings(mesh, cfg)
  assert jax.tree.structure(shardings) == jax.tree.structure(params)
  assert shardings["layer_0"]["q"].spec == P("fsdp", "tensor", None)  # D, N, H
  assert shardings["embed"]["embedding"].spec == P("tensor", "fsdp")  # V, D
  # AdamW moments follow the parameters; the step count is replicated.
  optimizer = optax.adamw(1e-3)
  state = jax.eval_shape(optimizer.init, params)
  state_shardings = sharding.opt_state_shardings(mesh, optimizer, state, shardings)
  mu = state_shardings[0].mu
  assert jax.tree.leaves(mu)[0].spec == jax.tree.leaves(shardings)[0].spec
  assert state_shardings[0].count.spec == P()


def prefix_residual_leaves(cfg, params, batch, mesh, compile_step=True):
  p = sharding.put(params, sharding.param_shardings(mesh, cfg))
  b = sharding.put(batch, sharding.batch_shardings(mesh, batch))
  vjp = jax.jit(lambda p, b: engine.prefix_residuals(mesh, p, b, cfg, SHARDING_LOSS)[1])(p, b)
  if not compile_step:
    return jax.tree.leaves(vjp), None
  step = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, SHARDING_LOSS, "replay", mesh=mesh))
  return jax.tree.leaves(vjp), sharding.memory_report(step.lower(p, b).compile())


def test_context_parallel_prefix_residuals_shrink():
  """Per-device bytes of the prefix residuals (what prefix_vjp keeps alive) and of the
  compiled step's temporaries shrink with the context size."""
  cfg, params = model()
  batch = logp_batch(1, B=1, R=4, P=128, T=2)  # a long prefix: its residuals dominate
  residual_bytes, temp_bytes = {}, {}
  for c in (1, 4):
    mesh = sharding.make_mesh(f"context:{c}", jax.devices()[:c])
    residuals, report = prefix_residual_leaves(cfg, params, batch, mesh)
    residual_bytes[c] = sharding.per_device_bytes(residuals)
    temp_bytes[c] = report["temp_bytes"]
  assert residual_bytes[4] < 0.6 * residual_bytes[1], residual_bytes
  assert temp_bytes[4] < 0.5 * temp_bytes[1], temp_bytes


def test_context_parallel_prefix_with_remat_holds_no_whole_sequence():
  """With model.remat each layer keeps only its (sequence-sharded) input, so no residual
  holds the whole prefix; without remat each layer's all-gathered K/V is a residual too."""
  cfg = tfm.preset("tiny", remat=True)
  params = tfm.init_params(cfg, jax.random.key(0))
  batch = logp_batch(1, B=1, R=4, P=64, T=2)
  mesh = sharding.make_mesh("context:4", jax.devices()[:4])
  residuals, _ = prefix_residual_leaves(cfg, params, batch, mesh, compile_step=False)
  seq_residuals = [x for x in residuals if x.shape[:2] == (1, 64)]  # [B, P, ...]
  assert len(seq_residuals) >= cfg.n_layers
  for x in seq_residuals:  # split over `context` (alone, or with size-1 axes beside it)
    entry = (tuple(x.sharding.spec) + (None, None))[1]
    axes = entry if isinstance(entry, tuple) else (entry,)
    assert "context" in axes and all(mesh.shape[a] == 1 for a in axes if a != "context"), (
      x.shape,
      x.sharding,
    )


def test_memory_report_keys():
  f = jax.jit(lambda x: jnp.tanh(x @ x.T)).lower(jnp.ones((64, 32))).compile()
  report = sharding.memory_report(f)
  assert report["argument_bytes"] == 64 * 32 * 4
  assert report["output_bytes"] == 64 * 64 * 4
  assert report["total_bytes"] >= report["argument_bytes"] + report["output_bytes"]


def test_mesh_spec_parsing():
  assert sharding.parse_mesh_spec("data:2,fsdp:2,context:2", 8) == dict(
    data=2, fsdp=2, tensor=1, context=2
  )
  assert sharding.parse_mesh_spec("fsdp:-1,tensor:2", 8)["fsdp"] == 4
  mesh = sharding.make_mesh("data:2,context:4")
  assert dict(mesh.shape) == dict(data=2, fsdp=1, tensor=1, context=4)
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@pytest.mark.parametrize(
  "spec, message",
  [
    ("data:2,fsdp:2", "multiply to 4, but there are 8 devices"),
    ("data:3,fsdp:-1", "multiply to 3, which does not divide the 8 devices"),
    ("data:2,pipeline:4", "bad entry 'pipeline:4'"),
    ("data:2,data:4", "'data' given twice"),
    ("data:two", "expected an int"),
    ("data:-1,fsdp:-1", "at most one axis may be -1"),
  ],
)
def test_bad_mesh_spec(spec, message):
  with pytest.raises(ValueError, match=message):
    sharding.make_mesh(spec)


def test_dimension_not_dividing_its_axis():
  cfg, _ = model()
  batch = logp_batch(0, **BATCH)  # B=4 prompts
  with pytest.raises(
    ValueError,
    match=r"tree.root_BP: dimension 0 has size 4, not "
    r"divisible by the 8 devices of mesh axes \('data', 'fsdp'\)",
  ):
    sharding.batch_shardings(sharding.make_mesh("data:8"), batch)
  few_branches = logp_batch(0, B=4, R=4, P=16, T=3)  # R=4 branches over an 8-way context
  with pytest.raises(
    ValueError,
    match=r"tree.levels\[0\] \(level 1\).tokens_BRT: dimension 1 "
    r"has size 4, not divisible by the 8 devices of mesh axes context",
  ):
    sharding.batch_shardings(sharding.make_mesh("context:8"), few_branches)
  # kv_heads=2 cannot split 4 ways over `tensor`: the error names the parameter leaf.
  with pytest.raises(
    ValueError,
    match=r"params\['layer_0'\]\['k'\]: dimension 1 has size 2, "
    r"not divisible by the 4 devices of mesh axes tensor",
  ):
    sharding.param_shardings(sharding.make_mesh("fsdp:2,tensor:4"), cfg)


# ----------------------------------------------------------------------------- the trainer


def tiny_config(tmp_path, mesh, *extra):
  return tiny_run(
    "train.sft_steps=1",
    "train.rl_steps=1",
    "train.batch_size=4",
    "train.n_branches=4",
    "train.sft_batch_size=4",
    "sampler.max_new_tokens=2",
    "train.checkpoint_every=1",
    f"mesh={mesh}",
    *extra,
  )


@pytest.mark.slow
def test_trainer_on_a_mesh_matches_one_device(tmp_path, monkeypatch):
  """trainer.run with mesh=data:2,fsdp:2,tensor:2 (the Runtime's put / make_train_step path)
  takes the same SFT and RL steps as one device, leaves FSDP-sharded parameters and a
  checkpoint; the mesh is built from the config once in the whole run (train/runtime.py), not
  at every placement nor inside the traced step."""
  from branch_replay.train import metrics, runtime
  from branch_replay.train import trainer

  built = []
  make_mesh = sharding.make_mesh
  monkeypatch.setattr(sharding, "make_mesh", lambda *a, **k: built.append(a) or make_mesh(*a, **k))
  runtime.mesh_of.cache_clear()
  runs = {}
  for mesh in ("", "data:2,fsdp:2,tensor:2"):
    workdir = str(tmp_path / (mesh.replace(":", "").replace(",", "_") or "one"))
    summary = trainer.run(tiny_config(tmp_path, mesh), workdir)
    runs[mesh] = summary, [r for r in metrics.read(summary["metrics"]) if r["kind"] == "train"]
  (_, one_records), (sharded, sharded_records) = runs[""], runs["data:2,fsdp:2,tensor:2"]
  assert [r["step"] for r in sharded_records] == [r["step"] for r in one_records] == [0, 1]
  assert built == [("data:2,fsdp:2,tensor:2",)]
  # step 0: the same SFT batch; step 1: the same sampled rollouts (threefry bits do not depend
  # on the sharding), rewards equal, the RL step's loss and gradient norm as one device's
  assert sharded_records[1]["reward/mean"] == one_records[1]["reward/mean"]
  for a, b in zip(sharded_records, one_records):
    for name in ("loss/policy", "grad/norm", "entropy"):
      np.testing.assert_allclose(
        a[name], b[name], rtol=1e-4, atol=1e-6, err_msg=f"step {a['step']}: {name}"
      )
  mesh = sharding.make_mesh("data:2,fsdp:2,tensor:2")
  expected = sharding.param_shardings(mesh, tfm.preset("tiny"))
  for p, s in zip(jax.tree.leaves(sharded["final_params"]), jax.tree.leaves(expected)):
    assert p.sharding.is_equivalent_to(s, p.ndim), (p.sharding, s)
  assert os.path.isdir(sharded["checkpoint"]) and os.listdir(sharded["checkpoint"])
