"""LoRA on trees (float64, 1e-10, the loss, every aux sum and every adapter leaf): tree replay
over the adapters == its naive twin == the full gradient at the merged weights projected
through each adapter (dA = s dW B^T, dB = s A^T dW: no params_fn in that oracle) at depth 2
with a trunk, on the dense tiny model and the Qwen3.5 hybrid (its q adapter over query and
gate); at depth 1 also == the flat oracle (tests/oracles.py, no tree code); and on a
mesh of the 8 fake CPU devices, the trainer's sharded LoRA step == one device."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, sharding, tree
from branch_replay.train import steps
from branch_replay.config import Config, apply_overrides
from models import lora
from models import transformer as tfm
from helpers import assert_equal_f64, cache_per_x64, make_tree, max_rel_err, tiny_model
from oracles import flat_naive_loss_and_grad

LORA = lora.LoraConfig(rank=3, alpha=6.0)  # every target
LOSS = losses.LossConfig(epsilon=0.1, epsilon_high=0.3, kl_coef=0.05)  # clipped ratios, KL


@cache_per_x64
def hybrid():
  """The Qwen3.5 layout at two layers (one Gated DeltaNet, one gated attention), perturbed."""
  cfg = tfm.preset(
    "hybrid_tiny",
    n_layers=2,
    layer_types=("linear_attention", "full_attention"),
    dtype="float64",
    param_dtype="float64",
  )
  leaves, treedef = jax.tree.flatten(
    jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  )
  rng = np.random.default_rng(0)
  # norm_offset 1: every norm scale's identity is 0, so N(0, 0.2) on every leaf
  return cfg, jax.tree.unflatten(
    treedef, [jnp.asarray(rng.normal(0, 0.2, x.shape), jnp.float64) for x in leaves]
  )


def adapters_for(cfg, seed=2):
  """Nonzero A and B on every target (B = 0 would zero every A gradient)."""
  rng = np.random.default_rng(seed)
  return {
    layer: {
      t: {k: jnp.asarray(rng.normal(0.0, 0.3, s), jnp.float64) for k, s in ab.items()}
      for t, ab in targets.items()
    }
    for layer, targets in lora.adapter_shapes(cfg, LORA).items()
  }


def projected(cfg, base, adapters, batch):
  """The oracle: jax.grad of the tree's naive loss over the full merged weights, then
  projected through each adapter by hand (a gated q: dW is [dq | dq_gate] per head)."""
  merged = lora.merge(base, adapters, LORA)
  (loss, aux), g = jax.value_and_grad(
    lambda p: engine.naive_loss(p, batch, cfg, LOSS), has_aux=True
  )(merged)
  s, out = LORA.scale, {}
  for layer, targets in adapters.items():
    out[layer] = {}
    for t, ad in targets.items():
      dW = g[layer][t]
      if t == "q" and "q_gate" in g[layer]:
        dW = jnp.stack([dW, g[layer]["q_gate"]], 2)  # [D, N, 2, H]: q_proj's row order
      dW = dW.reshape(ad["a"].shape[0], ad["b"].shape[1])
      out[layer][t] = {"a": s * dW @ ad["b"].T, "b": s * ad["a"].T @ dW}
  return loss, aux, out


# The hybrid cell (~47 s on this loaded 2-core machine, mostly compiling the DeltaNet tree)
# runs under -m slow; by default the fused q's layout is checked against peft's logits
# (lora_peft_test) and the dense cell checks the same tree path.
@pytest.mark.parametrize(
  "model, fanouts, W",
  [("dense", (2, 2), 2), pytest.param("hybrid", (1, 3), 1, marks=pytest.mark.slow)],
)
def test_tree_replay_equals_naive_and_the_projected_gradient_float64(model, fanouts, W, x64):
  cfg, base = tiny_model() if model == "dense" else hybrid()
  adapters = adapters_for(cfg)
  batch = make_tree(
    7, fanouts, B=2, P=6, T=(3, 3), W=W, logps=True, node_advantages=True, vocab=cfg.vocab_size
  )
  tree.validate(batch, cfg.vocab_size)
  params_fn = lambda a: lora.merge(base, a, LORA)

  @jax.jit
  def runs(a):
    return (
      engine.loss_and_grad(a, batch, cfg, LOSS, "replay", params_fn=params_fn),
      engine.loss_and_grad(a, batch, cfg, LOSS, "naive", params_fn=params_fn),
      projected(cfg, base, a, batch),
    )

  fast, slow, oracle = runs(adapters)
  assert jax.tree.structure(fast[2]) == jax.tree.structure(adapters)  # adapters only
  assert_equal_f64(fast, slow)
  assert_equal_f64(fast, oracle)
  assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(slow[2])) > 1e-6  # every leaf
  assert float(slow[1]["clip_sum"].sum()) > 0  # the ratio clip binds
  print(
    model,
    fanouts,
    "replay vs naive",
    max_rel_err(fast[2], slow[2]),
    "vs projected",
    max_rel_err(fast[2], oracle[2]),
  )


def test_depth1_tree_equals_the_flat_oracle_float64(x64):
  """A flat batch with a trunk through the tree engine == the flat naive twin over the
  adapters (tests/oracles.py: every branch its own sequence, the base attached)."""
  cfg, base = tiny_model()
  adapters = adapters_for(cfg, seed=3)
  batch = make_tree(8, (3,), B=2, P=7, T=(4,), W=2, logps=True)
  tree.validate(batch, cfg.vocab_size)
  params_fn = lambda a: lora.merge(base, a, LORA)
  fast, slow, flat = jax.jit(
    lambda a: (
      engine.loss_and_grad(a, batch, cfg, LOSS, "replay", params_fn=params_fn),
      engine.loss_and_grad(a, batch, cfg, LOSS, "naive", params_fn=params_fn),
      flat_naive_loss_and_grad(a, batch, cfg, LOSS, lambda a: lora.attach(base, a, LORA)),
    )
  )(adapters)
  assert_equal_f64(fast, slow)
  assert_equal_f64(fast, flat)
  print(
    "depth 1: replay vs tree naive",
    max_rel_err(fast[2], slow[2]),
    "vs flat",
    max_rel_err(fast[2], flat[2]),
  )


def test_sharded_lora_tree_step_equals_one_device_float64(x64):
  """steps.loss_and_grad (the trainer's call) with LoRA on a depth-2 tree with a trunk on
  data:2,fsdp:2,context:2 (base sharded like the parameters, adapters replicated) == the
  same call without a mesh: values compared, not only traced."""
  cfg, base = tiny_model()
  adapters = adapters_for(cfg, seed=4)
  batch = make_tree(1, (3, 2), B=4, P=8, T=(2, 3), W=1, logps=True, node_advantages=True)
  spec = "data:2,fsdp:2,context:2"
  mesh = sharding.make_mesh(spec)
  tree.validate(batch, cfg.vocab_size, leaf_shards=mesh.shape["context"])
  run_cfg = apply_overrides(Config(model=cfg), ["lora.rank=3", "lora.alpha=6.0"])
  assert run_cfg.lora == LORA
  one = dataclasses.replace(run_cfg, mesh="")
  on_mesh = dataclasses.replace(run_cfg, mesh=spec)
  fn = lambda c, base: steps.lora_params_fn(c, types.SimpleNamespace(base=base))
  ref = jax.jit(lambda a, b: steps.loss_and_grad(one, a, b, LOSS, None, fn(one, base)))(
    adapters, batch
  )
  placed_base = sharding.put(base, sharding.param_shardings(mesh, cfg))
  placed = sharding.put(batch, sharding.batch_shardings(mesh, batch))
  placed_adapters = sharding.put(
    adapters, jax.tree.map(lambda _: sharding.replicated(mesh), adapters)
  )
  got = jax.jit(
    lambda a, b, base: steps.loss_and_grad(on_mesh, a, b, LOSS, None, fn(on_mesh, base), mesh=mesh)
  )(placed_adapters, placed, placed_base)
  assert_equal_f64(got, ref)
  assert jax.tree.structure(got[2]) == jax.tree.structure(adapters)
  assert placed.levels[-1].tokens_BRT.sharding.spec[1] == "context"
  print(
    "mesh vs one device: loss",
    abs(float(got[0]) - float(ref[0])) / abs(float(ref[0])),
    "grads",
    max_rel_err(got[2], ref[2]),
  )
