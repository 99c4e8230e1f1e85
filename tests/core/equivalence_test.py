"""The equivalence grid: tree replay equals its naive twin (every root-to-leaf path as its own
sequence) for every objective on every tree shape, depth 1 (a flat batch) included; at depth
1 also the flat oracle (tests/oracles.py, every branch its own [P+T] sequence, sharing no
tree code). float64: the loss, every aux sum and every gradient leaf at 1e-10; float32: rtol
1e-5. One tiny model; one compile per cell (replay and the twins in one jit)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import critic, engine, losses, tree
from helpers import assert_equal_f64, make_batch, make_tree, tiny_model
from oracles import flat_naive_loss_and_grad

# Tree shapes: every one ragged (nodes of 1..T tokens) with a left-padded prompt 1.
SHAPES = {
  "flat": dict(fanouts=(4,), W=2),  # depth 1 with a scored root tail (a trunk)
  "trunk": dict(fanouts=(1, 4), T=(3, 4)),  # a fan-out-1 level: a shared response trunk
  "depth2": dict(fanouts=(2, 3), W=1, holes=True, node_advantages=True),  # unscored holes
  "depth3": dict(fanouts=(2, 1, 2), T=(1, 2, 3), P=5),  # single-token nodes, short prompts
}

# Objectives: (loss config, off-policy/reference log-probs given, per-token advantages).
OBJECTIVES = {
  # GRPO: off-policy ratios clipped on both sides, KL to the reference
  "grpo": (losses.LossConfig(epsilon=0.1, epsilon_high=0.3, kl_coef=0.05), True, False),
  # PPO-clip with GAE-style per-token (per-path) advantages, KL, at the sampler's temperature
  "ppo": (
    losses.LossConfig(name="ppo", kl_coef=0.1, temperature=0.7, aggregation="seq_mean"),
    True,
    True,
  ),
  "pg": (losses.LossConfig(name="pg", aggregation="sum"), False, False),  # on-policy
  "gspo": (
    losses.LossConfig(name="gspo", epsilon=0.01, kl_coef=0.1, aggregation="seq_mean"),
    True,
    False,
  ),  # sequence-level: the path's ratio, clipped per path
  "dpo": (losses.LossConfig(name="dpo", beta=0.3), True, False),  # last fan-out 2
  "critic": (None, False, False),  # PPO's value head on the engine
}
CRITIC = critic.CriticConfig(value_clip=0.2)

# Streaming over the last fan-out (branch_chunk) in half the cells: the additive objectives,
# a chunk dividing the last fan-out (DPO combines its pair, the critic does not stream).
CHUNK = {
  ("flat", "grpo"): 2,
  ("flat", "gspo"): 1,
  ("trunk", "ppo"): 2,
  ("trunk", "pg"): 1,
  ("depth2", "grpo"): 3,
  ("depth2", "gspo"): 1,
  ("depth3", "pg"): 1,
  ("depth3", "ppo"): 2,
}


def grid_batch(shape: str, objective: str, dtype=jnp.float64) -> tree.TreeBatch:
  """The shape's random tree for the objective: DPO's with a last fan-out of 2 (its pair),
  log-probs where the objective reads them, per-token advantages for PPO."""
  kw = dict(SHAPES[shape])
  loss_cfg, logps, per_token = OBJECTIVES[objective]
  if objective == "dpo":
    kw["fanouts"] = kw["fanouts"][:-1] + (2,)
  seed = list(SHAPES).index(shape)
  batch = make_tree(seed, logps=logps, dtype=dtype, **kw)
  if per_token:
    batch = with_per_token_advantages(batch, seed + 10)
  return batch


def with_per_token_advantages(batch: tree.TreeBatch, seed: int) -> tree.TreeBatch:
  """Advantages per token and per path (GAE on a tree): the leaves' advantages_BRT, each
  inner level's path_advantages_BLT, the trunk's trunk_advantages_BRW."""
  rng = np.random.default_rng(seed)
  B, L, dt = batch.root_BP.shape[0], batch.n_leaves, batch.leaves.advantages_BR.dtype
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dt)
  levels = [
    l.replace(path_advantages_BLT=normal(B, L, l.tokens_BRT.shape[2])) for l in batch.levels[:-1]
  ]
  leaf = batch.leaves
  levels.append(leaf.replace(advantages_BRT=normal(*leaf.tokens_BRT.shape)))
  return batch.replace(levels=tuple(levels), trunk_advantages_BRW=normal(B, L, batch.trunk_len))


def critic_inputs(cfg, params, batch: tree.TreeBatch, seed: int):
  """A separate value model (the policy's transformer, a random head) and random targets on
  every path's scored positions (old values near 0: the value clip binds on both sides)."""
  head = {
    "w_D": jax.random.normal(
      jax.random.key(seed), (cfg.d_model,), params["embed"]["embedding"].dtype
    ),
    "b": jnp.asarray(0.1, params["embed"]["embedding"].dtype),
  }
  mask = critic.scored_mask(batch)
  rng = np.random.default_rng(seed)
  dt = head["b"].dtype
  targets = lambda scale: jnp.asarray(
    np.where(mask, rng.normal(scale=scale, size=mask.shape), 0.0), dt
  )
  cb = critic.CriticBatch(batch, targets(1.0), targets(0.1))
  critic.validate(cb)
  return {"model": params, "head": head}, cb


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def policy_runs(params, batch, cfg, loss_cfg, chunk):
  """(replay, the tree's naive twin, the flat naive twin at depth 1 else None)."""
  flat = flat_naive_loss_and_grad(params, batch, cfg, loss_cfg) if batch.depth == 1 else None
  return (
    engine.loss_and_grad(params, batch, cfg, loss_cfg, "replay", chunk),
    engine.loss_and_grad(params, batch, cfg, loss_cfg, "naive"),
    flat,
  )


@functools.partial(jax.jit, static_argnums=(2,))
def critic_runs(cparams, cb, cfg):
  return (
    critic.loss_and_grad(cparams, cb, cfg, CRITIC, "replay"),
    critic.loss_and_grad(cparams, cb, cfg, CRITIC, "naive"),
    None,
  )


def run_cell(shape, objective, dtype):
  cfg, params = tiny_model(dtype=dtype)
  batch = grid_batch(shape, objective, jnp.dtype(dtype))
  chunk = CHUNK.get((shape, objective))
  tree.validate(batch, cfg.vocab_size, chunk)
  if objective == "critic":
    cparams, cb = critic_inputs(cfg, params, batch, seed=3)
    return critic_runs(cparams, cb, cfg)
  return policy_runs(params, batch, cfg, OBJECTIVES[objective][0], chunk)


# The default suite runs seven cells (every objective and every shape at least once, three of
# them streamed: GSPO on a depth-2 tree among them, the place of issue 16's bug 2); `-m slow`
# runs the other seventeen, i.e. every objective on every shape.
DEFAULT = {
  "flat": ("grpo", "dpo"),
  "trunk": ("ppo", "critic"),
  "depth2": ("gspo", "pg"),
  "depth3": ("grpo",),
}


def cells(pairs, default):
  return [
    pytest.param(s, o, marks=() if o in default.get(s, ()) else pytest.mark.slow) for s, o in pairs
  ]


@pytest.mark.parametrize(
  "shape, objective", cells([(s, o) for s in SHAPES for o in OBJECTIVES], DEFAULT)
)
def test_replay_equals_naive_float64(shape, objective, x64):
  fast, slow, flat = run_cell(shape, objective, "float64")
  assert set(fast[1]) == set(slow[1])  # replay reports every per-path sum the twin does
  assert_equal_f64(fast, slow)
  if flat is not None:  # depth 1: the flat twin's loss, gradient and every aux sum
    assert set(fast[1]) == set(flat[1])
    assert_equal_f64(fast, flat)
  # the grid's data exercises what the objective can do
  if objective in ("grpo", "ppo"):
    assert float(slow[1]["clip_sum"].sum()) > 0  # the ratio clip binds
  if objective == "critic":
    assert int(slow[1]["clip_sum"].sum()) > 0  # the value clip binds


@pytest.mark.parametrize("B, R, P", [(1, 1, 1), (2, 16, 64)])
def test_flat_edge_shapes_float64(B, R, P, x64):
  """One prompt of one token with one branch; sixteen branches against a long prompt."""
  cfg, params = tiny_model()
  batch = make_batch(B * 100 + R * 10 + P, B, R, P, T=5, dtype=jnp.float64)
  tree.validate(batch, cfg.vocab_size)
  fast, slow, flat = policy_runs(params, batch, cfg, losses.LossConfig(), None)
  assert_equal_f64(fast, slow)
  assert_equal_f64(fast, flat)


# float32: every objective once, every shape at least once (two in the default suite).
F32_CELLS = [
  ("flat", "dpo"),
  ("flat", "pg"),
  ("trunk", "ppo"),
  ("depth2", "grpo"),
  ("depth2", "critic"),
  ("depth3", "gspo"),
]
F32_DEFAULT = {"trunk": ("ppo",), "depth2": ("grpo",)}


@pytest.mark.parametrize("shape, objective", cells(F32_CELLS, F32_DEFAULT))
def test_replay_equals_naive_float32(shape, objective):
  """The loss at rtol 1e-5; the gradient normwise: each entry within 1e-5 of itself plus 1e-5
  of the gradient's largest entry (over every leaf). Rounding errors flow back with the
  cotangents, so an entry's error scales with the magnitudes summed into it, not with its own
  value: a sum that cancels to near 0 (the value head's bias: sum of w (V - R) over tokens)
  carries the error of its terms, and rtol alone would ask more of it than float32 holds."""
  fast, slow, flat = run_cell(shape, objective, "float32")
  for want in (slow,) if flat is None else (slow, flat):
    np.testing.assert_allclose(fast[0], want[0], rtol=1e-5)
    scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want[2]))
    assert scale > 1e-3
    for (path, g), ref in zip(
      jax.tree_util.tree_leaves_with_path(fast[2]), jax.tree.leaves(want[2])
    ):
      np.testing.assert_allclose(
        g, ref, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path)
      )


def test_objectives_the_shape_cannot_serve_raise_before_compilation(x64):
  cfg, params = tiny_model()
  dpo = OBJECTIVES["dpo"][0]
  batch = grid_batch("depth2", "dpo")
  wide = grid_batch("depth2", "grpo")  # last fan-out 3
  with pytest.raises(
    ValueError,
    match=r"levels\[1\]\.tokens_BRT: shape \(2, 6, 3\): loss.name="
    r"'dpo' expects a last fan-out of 2",
  ):
    jax.eval_shape(lambda p: engine.loss_and_grad(p, wide, cfg, dpo), params)
  with pytest.raises(ValueError, match="branch_chunk"):  # DPO combines its pair: no stream
    jax.eval_shape(lambda p: engine.loss_and_grad(p, batch, cfg, dpo, "replay", 1), params)
  with pytest.raises(
    ValueError,
    match=r"branch_chunk=2: expected a divisor of the last "
    r"fan-out R_2=3",
  ):
    jax.eval_shape(
      lambda p: engine.loss_and_grad(p, wide, cfg, OBJECTIVES["grpo"][0], "replay", 2), params
    )
