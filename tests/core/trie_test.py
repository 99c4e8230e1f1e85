"""The automatic prefix tree: the trie of hand-made responses, and the exactness of its
layout: the tree batch's loss and every gradient leaf equal the flat batch's (float64)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, tree, trie
from helpers import max_rel_err, tiny_model, trie_rollouts
from oracles import flat_naive_loss_and_grad

RESPONSES = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6, 7], [8, 9]]


def shape(node):
  return (node.start, node.stop, [shape(c) for c in node.children])


def test_trie_of_hand_made_responses():
  root = trie.build(RESPONSES)
  assert shape(root) == (0, 0, [(0, 2, [(2, 3, [(3, 4, []), (3, 4, [])]), (2, 4, [])]), (0, 2, [])])
  assert root.positions() == 2 + 1 + 1 + 1 + 2 + 2
  assert trie.order(root) == [0, 1, 2, 3]
  # min_shared=2: the one-token node [3] is not a node; its token stays with its leaves.
  assert shape(trie.build(RESPONSES, min_shared=2)) == (
    0,
    0,
    [(0, 2, [(2, 4, []), (2, 4, []), (2, 4, [])]), (0, 2, [])],
  )
  # max_depth=1: nodes below the first level are not split.
  assert shape(trie.build(RESPONSES, max_depth=1)) == (
    0,
    0,
    [(0, 2, [(2, 4, []), (2, 4, []), (2, 4, [])]), (0, 2, [])],
  )
  # A shared opening of everyone is the root; a response never loses its last token.
  assert shape(trie.build([[5, 6, 7], [5, 6]])) == (0, 1, [(1, 3, []), (1, 2, [])])


def run_tree(params, cfg, batch, loss_cfg, mode="replay"):
  tree.validate(batch, cfg.vocab_size)
  return jax.jit(
    functools.partial(engine.loss_and_grad, model_cfg=cfg, loss_cfg=loss_cfg, mode=mode)
  )(params, batch)


def run_flat(params, cfg, batch, loss_cfg, mode="naive"):
  """A flat batch by replay, or by the flat oracle (every branch its own sequence)."""
  fn = flat_naive_loss_and_grad if mode == "naive" else functools.partial(engine.loss_and_grad)
  return jax.jit(functools.partial(fn, model_cfg=cfg, loss_cfg=loss_cfg))(params, batch)


def assert_same(a, b, tol=1e-10):
  assert abs(float(a[0]) - float(b[0])) <= tol * max(abs(float(b[0])), 1e-3), (a[0], b[0])
  assert max_rel_err(a[2], b[2]) < tol
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(b[2])) > 1e-6


@pytest.mark.parametrize(
  "max_depth,aggregation,name",
  [
    (2, "token_mean", "grpo"),
    pytest.param(2, "seq_mean", "ppo", marks=pytest.mark.slow),
    pytest.param(1, "sum", "pg", marks=pytest.mark.slow),
  ],
)
def test_trie_batch_equals_flat_batch_float64(max_depth, aggregation, name):
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    loss_cfg = losses.LossConfig(name=name, aggregation=aggregation)
    prompts, responses, adv, old = trie_rollouts(0)
    batch, stats = trie.layout(prompts, responses, adv, old_logps=old, max_depth=max_depth)
    assert stats["trunk_len"] == 3 and stats["tree_token_ratio"] > 1
    assert stats["fanouts"] == ((2, 2) if max_depth == 2 else (4,))
    flat = trie.flat_batch(prompts, responses, adv, old_logps=old)
    assert_same(run_tree(params, cfg, batch, loss_cfg), run_flat(params, cfg, flat, loss_cfg))


def test_unscored_turn_tokens_float64():
  """Tool/observation tokens (unscored) inside the shared nodes: the tree equals the same
  responses laid out flat (depth 1, no sharing) through the naive twin."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    loss_cfg = losses.LossConfig(aggregation="token_mean")
    prompts, responses, adv, old = trie_rollouts(1)
    scored = [[(np.arange(len(r)) % 3) != 1 for r in rs] for rs in responses]
    batch, stats = trie.layout(prompts, responses, adv, scored=scored, old_logps=old)
    assert stats["fanouts"] == (2, 2) and stats["trunk_len"] == 1  # token 2 is unscored
    flat, _ = trie.layout(
      prompts, responses, adv, scored=scored, old_logps=old, max_depth=1, min_shared=10**6
    )
    assert flat.fanouts == (4,) and flat.trunk_len == 0
    assert_same(
      run_tree(params, cfg, batch, loss_cfg), run_tree(params, cfg, flat, loss_cfg, mode="naive")
    )


def test_auto_tree_of_a_sampled_batch_float64():
  """The trainer's batch (prefix + trunk, tails): auto_tree finds the tails' shared openings."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    loss_cfg = losses.LossConfig(kl_coef=0.1)
    prompts, responses, adv, old = trie_rollouts(2, opening=4)
    ref = [[o - 0.25 for o in rs] for rs in old]
    # Put the first two tokens of every response into the sampled batch's trunk.
    flat = trie.flat_batch(
      prompts,
      [[r[2:] for r in rs] for rs in responses],
      adv,
      old_logps=[[o[2:] for o in rs] for rs in old],
      ref_logps=[[o[2:] for o in rs] for rs in ref],
    )
    P = flat.root_BP.shape[1]
    head = jnp.asarray(np.stack([rs[0][:2] for rs in responses]))
    flat = flat.replace(
      root_BP=jnp.concatenate([flat.root_BP, head], 1).astype(jnp.int32),
      root_valid_BP=jnp.concatenate([flat.root_valid_BP, jnp.ones((2, 2), bool)], 1),
      trunk_old_logp_BW=jnp.asarray(np.stack([rs[0][:2] for rs in old])),
      trunk_ref_logp_BW=jnp.asarray(np.stack([rs[0][:2] for rs in ref])),
      trunk_len=2,
    )
    assert flat.root_BP.shape[1] == P + 2
    batch, stats = trie.auto_tree(flat)
    assert stats["trunk_len"] == 4 and stats["fanouts"] == (2, 2)
    assert_same(run_tree(params, cfg, batch, loss_cfg), run_flat(params, cfg, flat, loss_cfg))


def test_target_shape_ratio():
  """P=1024 prompt, R=16 responses sharing a 64-token opening, T=128: the trunk takes the
  opening; the ratio is flat positions over tree positions (host only, no compute)."""
  rng = np.random.default_rng(0)
  opening = list(rng.integers(1, 1000, 64))
  responses = [[np.array(opening + list(rng.integers(1, 1000, 64))) for _ in range(16)]]
  batch, stats = trie.layout([rng.integers(1, 1000, 1024)], responses, np.zeros((1, 16)))
  assert batch.trunk_len == 64 and batch.fanouts == (16,)
  assert stats["tree_positions"] == 1024 + 64 + 16 * 64
  assert stats["tree_token_ratio"] == pytest.approx(16 * (1024 + 128) / (1024 + 64 + 16 * 64))
