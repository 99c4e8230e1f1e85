"""Context-parallel prefix attention (models/attention/context_parallel.py) on 8 fake CPU devices: replay
on a mesh == single-device replay == the naive twin (float64, 1e-10, loss and every gradient
leaf), flat and depth-2 tree; the compiled prefix step moves only K/V (all-gather, and the
reduce-scatter of dK/dV); bad input fails before compilation naming the field and sizes."""

import math
import re
from unittest import mock

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from branch_replay.core import engine, losses, sharding, tree
from models import attention
from models.attention import context_parallel
from models import transformer as tfm
import attention_cases
from helpers import assert_equal_f64, cache_per_x64, make_batch, make_tree, max_rel_err, tiny_model

LOSS = losses.LossConfig(name="grpo", kl_coef=0.05, epsilon=0.1)
# Gemma 2 (tests/models/families_test.py): layer 0 slides with window 4, soft-capped scores, GQA
# (4 query heads on 2 kv heads). P=48 left-padded prefixes: a device's slice on context:8 is
# 6 positions, longer than the window; a trunk of 2 scored prefix tokens; ragged tails.
FAMILY = "gemma2"
BATCH = dict(B=2, R=8, P=48, T=3, W=2)


@cache_per_x64
def setup():
  """The model, the batch, and the single-device references (replay and naive)."""
  cfg, params = tiny_model(FAMILY)
  batch = make_batch(0, **BATCH, vocab=cfg.vocab_size, logps=True, dtype=jnp.float64)
  tree.validate(batch, cfg.vocab_size)
  ref = {
    mode: jax.jit(lambda p, b, mode=mode: engine.loss_and_grad(p, b, cfg, LOSS, mode))(
      params, batch
    )
    for mode in engine.MODES
  }
  return cfg, params, batch, ref


def on_mesh(mesh, cfg, params, batch):
  placed = (
    sharding.put(params, sharding.param_shardings(mesh, cfg)),
    sharding.put(batch, sharding.batch_shardings(mesh, batch)),
  )
  return jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, LOSS, "replay", mesh=mesh))(*placed)


@pytest.mark.parametrize(
  "spec",
  [
    "context:4",
    "fsdp:2,context:4",
    pytest.param("context:2", marks=pytest.mark.slow),
    pytest.param("context:8", marks=pytest.mark.slow),
    pytest.param("data:2,context:4", marks=pytest.mark.slow),
  ],
)
def test_context_parallel_replay_equals_single_device_and_naive(spec):
  with jax.enable_x64(True):
    cfg, params, batch, ref = setup()
    assert cfg.layer_window(0) < BATCH["P"] // 8 and cfg.attn_logit_softcap is not None
    assert_equal_f64(ref["replay"], ref["naive"])
    n = math.prod(int(item.split(":")[1]) for item in spec.split(","))
    mesh = sharding.make_mesh(spec, jax.devices()[:n])
    # The default on a context mesh: parameters over fsdp x context (param_rules).
    assert all(
      "context" in str(s.spec)
      for s in jax.tree.leaves(sharding.param_shardings(mesh, cfg))
      if "fsdp" in str(s.spec)
    )
    got = on_mesh(mesh, cfg, params, batch)
    assert_equal_f64(got, ref["replay"])
    assert_equal_f64(got, ref["naive"])


@pytest.mark.slow
def test_context_parallel_tree_equals_single_device():
  """A depth-2 tree (2 children, 4 grandchildren each) on context:4: the root prefix runs
  context-parallel, the 8 leaves split over the 4 devices."""
  with jax.enable_x64(True):
    cfg, params, _, _ = setup()
    batch = make_tree(
      1, (2, 4), B=2, P=16, T=(3, 3), W=1, logps=True, node_advantages=True, vocab=cfg.vocab_size
    )
    mesh = sharding.make_mesh("context:4", jax.devices()[:4])
    tree.validate(batch, cfg.vocab_size, None, leaf_shards=4)
    ref = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, LOSS))(params, batch)
    placed = (
      sharding.put(params, sharding.param_shardings(mesh, cfg)),
      sharding.put(batch, sharding.batch_shardings(mesh, batch)),
    )
    got = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, LOSS, "replay", mesh=mesh))(*placed)
    assert abs(float(got[0]) - float(ref[0])) <= 1e-10 * abs(float(ref[0]))
    assert max_rel_err(got[2], ref[2]) < 1e-10
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(ref[2])) > 1e-6


@pytest.mark.parametrize(
  "name", list(attention_cases.PREFIX_CASES) + list(attention_cases.TAIL_CASES)
)
def test_key_major_backward_matches_dense_float64(name, monkeypatch):
  """The blockwise backward the context-parallel paths use (key_major_bwd: key blocks
  outside, each block's dK/dV finished and stored in the keys' dtype) on attention_cases'
  cases (windows below/above a block, soft-cap, GQA 1/2/4, odd blocks, padding, rows with
  no allowed key, three segments): output and every gradient == dense at 1e-10, and ==
  the query-major backward at 1e-13."""
  monkeypatch.setattr(attention, "MIN_TILE", 0)
  at = attention_cases
  prefix = name in at.PREFIX_CASES
  case_kw, kw = (at.PREFIX_CASES if prefix else at.TAIL_CASES)[name]
  make = at.prefix_case if prefix else at.tail_case
  with jax.enable_x64(True):
    case = make(np.random.default_rng(0 if prefix else 1), jnp.float64, **case_kw)
    at.assert_match(case, 1e-10, key_major_bwd=True, **kw)
    key_major = at.value_and_grads("blockwise", case, key_major_bwd=True, **kw)
    query_major = at.value_and_grads("blockwise", case, **kw)
    for a, b in zip(jax.tree.leaves(key_major), jax.tree.leaves(query_major)):
      a, b = np.asarray(a), np.asarray(b)
      assert np.max(np.abs(a - b), initial=0.0) <= 1e-13 * np.max(np.abs(b), initial=1.0)


# ----------------------------------------------------------------------------- communication

COLLECTIVE = re.compile(
  r"=\s*(\w+)\[([\d,]*)\]\S*\s+(all-gather|reduce-scatter|all-reduce|"
  r"collective-permute|all-to-all)(?:-start)?\("
)


def prefix_collectives(scheme, B=2, P=256, C=4):
  """(kind, dtype, shape) of every collective in the compiled prefix step (the prefix forward
  and its one backward from a cache cotangent) on context:C, tiny model, 16-wide tiles.
  Parameters over fsdp only (RULES, not param_rules' fsdp x context), so that no weight or
  embedding traffic mixes with the attention's."""
  cfg = tfm.preset("tiny", context_parallel=scheme, attention_block_q=16, attention_block_k=16)
  params = tfm.init_params(cfg, jax.random.key(0))
  batch = make_batch(0, B=B, R=8, P=P, T=3, W=2)
  mesh = sharding.make_mesh(f"context:{C}", jax.devices()[:C])

  def prefix_step(p, b):
    cache, prefix_vjp = engine.prefix_residuals(mesh, p, b, cfg, LOSS)
    return prefix_vjp(jax.tree.map(jnp.ones_like, cache))

  with mock.patch.object(sharding, "param_rules", lambda mesh: sharding.RULES):
    placed = (
      sharding.put(params, sharding.param_shardings(mesh, cfg)),
      sharding.put(batch, sharding.batch_shardings(mesh, batch)),
    )
    hlo = jax.jit(prefix_step).lower(*placed).compile().as_text()
  found = [
    (kind, dtype, tuple(int(d) for d in dims.split(",") if d))
    for dtype, dims, kind in COLLECTIVE.findall(hlo)
  ]
  return cfg, found


def kv_only_violations(cfg, found, B=2, P=256, C=4):
  """Collectives that are not K/V traffic: all-gathers other than [B, P, K, H] keys/values
  and their [B, P] positions/validity, reduce-scatters other than [B, P/C, K, H] (dK/dV),
  and any other collective carrying a sequence-long axis (queries [.., P*G, H] in the
  kernel's layout, hidden states [B, P, D], scores)."""
  K, H = cfg.n_kv_heads, cfg.head_dim
  bad = []
  for kind, dtype, shape in found:
    if kind == "all-gather":
      ok = shape == (B, P, K, H) or (shape == (B, P) and dtype in ("s32", "pred"))
    elif kind == "reduce-scatter":
      ok = shape == (B, P // C, K, H)
    else:  # the trunk's and last position's hidden states, loop bounds: no sequence axis
      ok = all(d < P // C for d in shape)
    if not ok:
      bad.append((kind, dtype, shape))
  return bad


def test_compiled_prefix_attention_sends_only_kv():
  cfg, found = prefix_collectives("all_gather")
  assert kv_only_violations(cfg, found) == [], found
  kinds = {(kind, shape) for kind, _, shape in found}
  K, H = cfg.n_kv_heads, cfg.head_dim
  assert ("all-gather", (2, 256, K, H)) in kinds and ("reduce-scatter", (2, 64, K, H)) in kinds


@pytest.mark.slow
def test_gspmd_prefix_attention_gathers_queries():
  """The check can fail: the partitioner's path (model.context_parallel='gspmd', the path
  before shard_map) all-gathers the kernel's queries [B, K, P*G, H] and their row stats."""
  cfg, found = prefix_collectives("gspmd")
  G = cfg.n_heads // cfg.n_kv_heads
  assert ("all-gather", "f32", (2, cfg.n_kv_heads, 256 * G, cfg.head_dim)) in found, found
  assert kv_only_violations(cfg, found)


# ----------------------------------------------------------------------------- bad input


def test_prefix_the_context_axis_cannot_split():
  cfg, params = tiny_model()
  batch = make_batch(0, B=2, R=8, P=18, T=3, logps=True)  # 18 positions over context:4
  mesh = sharding.make_mesh("context:4", jax.devices()[:4])
  step = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, LOSS, "replay", mesh=mesh))
  with pytest.raises(
    ValueError,
    match=r"tree.root_BP: dimension 1 has size 18, not "
    r"divisible by the 4 devices of mesh axes context",
  ):
    step.lower(params, batch)
  # The attention's own check (a caller that skips the batch shardings): names P and C.
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    with pytest.raises(
      ValueError,
      match=r"prefix length P=18 is not divisible by the "
      r"context-parallel mesh axes \('context',\) of size 4",
    ):
      context_parallel.check_prefix(18, ("context",))


def test_schemes_not_built_are_refused():
  for scheme in ("ring", "zigzag"):
    with pytest.raises(
      ValueError,
      match=rf"model.context_parallel='{scheme}': expected one "
      r"of \('all_gather', 'gspmd'\)",
    ):
      tfm.preset("tiny", context_parallel=scheme)


def test_parameters_split_over_context_only_on_a_context_mesh():
  """param_rules: d_model over fsdp x context where the mesh has a context axis; meshes
  without one (one device, data or fsdp parallel) keep RULES' specs."""
  cfg = tfm.preset("tiny")
  q_spec = lambda spec: sharding.param_shardings(sharding.make_mesh(spec), cfg)["layer_0"]["q"].spec
  assert q_spec("fsdp:2,context:4") == PartitionSpec(("fsdp", "context"), "tensor", None)
  assert q_spec("context:8") == PartitionSpec(("fsdp", "context"), "tensor", None)
  for spec in ("data:8", "fsdp:4,tensor:2", "data:2,fsdp:2,tensor:2"):
    assert q_spec(spec) == PartitionSpec("fsdp", "tensor", None), spec
  assert sharding.param_rules(sharding.make_mesh("fsdp:8")) is sharding.RULES


def test_no_mesh_is_todays_path():
  """Without a mesh (or with context:1) the prefix never enters shard_map."""
  assert context_parallel.seq_axes() is None
  mesh = sharding.make_mesh("data:8")
  with nn.logical_axis_rules(sharding.RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert context_parallel.seq_axes() is None
  mesh = sharding.make_mesh("data:2,context:4")
  with nn.logical_axis_rules(sharding.RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    assert context_parallel.seq_axes() == ("context",)
