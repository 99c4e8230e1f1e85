"""The flat engine's pieces: staged jits equal the fused step, prefill + tail equals the full
forward, causality, tail padding, bad input. Replay == naive over shapes and objectives is
tests/core/equivalence_test.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, replay, tree
from helpers import assert_equal_f64, make_batch, max_rel_err, tiny_model
from models import transformer as tfm


def test_staged_jits_equal_fused_and_prefix_compiles_once():
  """The prefix stage is jitted once; its vjp function is a pytree held across jit calls."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    lc = losses.LossConfig()
    traces = []

    def stages(batch):  # the engine's depth-1 functions: root, (no inner levels), leaves
      root_fn, _, leaf_loss_fn, leaves_R = engine.replay_fns(
        batch, cfg, engine.policy_head(batch, cfg, lc)
      )
      return root_fn, leaf_loss_fn, leaves_R

    @jax.jit
    def prefix_stage(params, batch):
      traces.append(1)
      root_fn, _, _ = stages(batch)
      return replay.prefix_forward(lambda p, _: root_fn(p), params, None)

    @jax.jit
    def tail_stage(params, cache, batch):
      _, leaf_loss_fn, leaves_R = stages(batch)
      return replay.tails_value_and_grad(leaf_loss_fn, params, (cache,), leaves_R, batched=True)

    @jax.jit
    def prefix_backward(prefix_vjp, dcache):
      return prefix_vjp(dcache)[0]

    for seed in (1, 2):
      batch = make_batch(seed, B=2, R=3, P=8, T=4, W=1, dtype=jnp.float64)
      cache, prefix_vjp = prefix_stage(params, batch)
      loss, _, dparams_tail, dcache = tail_stage(params, cache, batch)
      grads = jax.tree.map(jnp.add, dparams_tail, prefix_backward(prefix_vjp, dcache[0]))
      fused_loss, _, fused = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, lc))(
        params, batch
      )
      assert abs(float(loss - fused_loss)) < 1e-12
      assert max_rel_err(grads, fused) < 1e-12
    assert len(traces) == 1  # same shapes: one trace, one compile of the prefix


def test_prefill_plus_tail_equals_full_forward():
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    batch = make_batch(4, B=2, R=1, P=9, T=5, ragged=False, dtype=jnp.float64)
    tails_BT = batch.leaves.tokens_BRT[:, 0]
    tail_valid_BT = batch.leaves.valid_BRT[:, 0]

    @jax.jit
    def split_and_full(params):
      cache = tfm.prefill(params, cfg, batch.root_BP, batch.root_valid_BP)
      h_tail = tfm.tail(params, cfg, cache, batch.root_valid_BP, tails_BT, tail_valid_BT)
      h_full = tfm.forward(
        params,
        cfg,
        jnp.concatenate([batch.root_BP, tails_BT], 1),
        jnp.concatenate([batch.root_valid_BP, tail_valid_BT], 1),
      )
      return tfm.logits(params, cfg, h_tail), tfm.logits(params, cfg, h_full[:, 9:])

    split, full = split_and_full(params)
    np.testing.assert_allclose(split, full, rtol=1e-12, atol=1e-12)


def test_causality_by_gradient():
  """A position's logits have zero gradient w.r.t. the embeddings of later and padded tokens."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    # Tokens 0..9 come first, 50..59 later, 100.. are padding: disjoint embedding rows.
    tokens = jnp.asarray([[100, 101, 0, 1, 2, 3, 4, 50, 51, 52]], jnp.int32)
    valid = jnp.asarray([[False, False] + [True] * 8])
    t = 6  # last of the early tokens

    def logit_sum(embedding, params):
      params = {**params, "embed": {"embedding": embedding}}
      h = tfm.forward(params, cfg, tokens, valid)
      return jnp.sum(tfm.logits(params, cfg, h)[:, t] ** 2)

    g = jax.jit(jax.grad(logit_sum))(params["embed"]["embedding"], params)
    assert float(jnp.abs(g[:5]).max()) > 0  # earlier tokens matter
    assert float(jnp.abs(g[50:53]).max()) == 0.0  # later tokens never do
    assert float(jnp.abs(g[100:102]).max()) == 0.0  # padding is never attended


def test_tail_padding_does_not_change_loss():
  """Whatever sits in a padded tail slot, the loss and gradients are the same."""
  with jax.enable_x64(True):
    cfg, params = tiny_model()
    batch = make_batch(8, B=2, R=3, P=6, T=5, dtype=jnp.float64)
    l = batch.leaves
    other = batch.with_leaves(
      tokens_BRT=jnp.where(l.valid_BRT, l.tokens_BRT, (l.tokens_BRT + 17) % cfg.vocab_size)
    )
    f = jax.jit(lambda b: engine.loss_and_grad(params, b, cfg, losses.LossConfig()))
    assert_equal_f64(f(other), f(batch), tol=1e-13)


L = "tree.levels\\[0\\] \\(level 1, fan-out 3\\)"  # the leaves of a flat batch, in messages


@pytest.mark.parametrize(
  "mutate, match",
  [
    (
      lambda b: b.with_leaves(
        tokens_BRT=b.leaves.tokens_BRT[:, :, :0], valid_BRT=b.leaves.valid_BRT[..., :0]
      ),
      L + r"\.tokens_BRT: shape \(2, 3, 0\): expected \[B=2, R=3 .*T >= 1\]",
    ),
    (
      lambda b: b.replace(root_BP=b.root_BP[:, :0], root_valid_BP=b.root_valid_BP[:, :0]),
      r"tree.root_BP: shape \(2, 0\): expected \[B >= 1, P >= 1\]",
    ),
    (
      lambda b: b.replace(root_BP=b.root_BP[:0], root_valid_BP=b.root_valid_BP[:0]),
      r"tree.root_BP: shape \(0, 9\): expected \[B >= 1, P >= 1\]",
    ),
    (
      lambda b: tree.flat(
        b.root_BP,
        b.root_valid_BP,
        b.leaves.tokens_BRT[:, :0],
        b.leaves.valid_BRT[:, :0],
        b.leaves.advantages_BR[:, :0],
      ),
      r"tree.fanouts=\(0,\): expected .*ints >= 1 \(leaf tokens_BRT shape \(2, 0, 4\)\)",
    ),
    (
      lambda b: b.with_leaves(tokens_BRT=b.leaves.tokens_BRT.at[0, 0, 0].set(128)),
      L + r"\.tokens_BRT: shape \(2, 3, 4\): expected token ids in \[0, 128\)",
    ),
    (
      lambda b: b.with_leaves(tokens_BRT=b.leaves.tokens_BRT.astype(jnp.float32)),
      L + r"\.tokens_BRT: shape \(2, 3, 4\): expected integer token ids, got dtype float32",
    ),
    (lambda b: b.replace(root_BP=b.root_BP.at[0, 0].set(-1)), r"root_BP.*\[0, 128\)"),
    (
      lambda b: b.with_leaves(advantages_BR=b.leaves.advantages_BR.at[1, 2].set(jnp.nan)),
      L + r"\.advantages_BR: shape \(2, 3\): expected finite",
    ),
    (lambda b: b.with_leaves(advantages_BR=b.leaves.advantages_BR.at[0, 0].set(jnp.inf)), "finite"),
    (
      lambda b: b.with_leaves(advantages_BR=b.leaves.advantages_BR[:, :2]),
      L + r"\.advantages_BR: shape \(2, 2\): expected shape \(2, 3\)",
    ),
    (
      lambda b: b.with_leaves(old_logp_BRT=jnp.full((2, 3, 4), jnp.nan)),
      L + r"\.old_logp_BRT: shape \(2, 3, 4\): expected finite",
    ),
    (
      lambda b: b.with_leaves(ref_logp_BRT=jnp.zeros((2, 3, 5))),
      L + r"\.ref_logp_BRT: shape \(2, 3, 5\): expected shape \(2, 3, 4\)",
    ),
    (
      lambda b: b.with_leaves(tokens_BRT=b.leaves.tokens_BRT[:1]),
      L + r"\.tokens_BRT: shape \(1, 3, 4\): expected \[B=2",
    ),
    (
      lambda b: b.with_leaves(valid_BRT=b.leaves.valid_BRT.at[0, 1, :].set(False)),
      "node 1 of prompt 0 is empty",
    ),
    (
      lambda b: b.with_leaves(valid_BRT=b.leaves.valid_BRT.at[0, 1, 1].set(False)),
      L + r"\.valid_BRT: shape \(2, 3, 4\): expected right padding",
    ),
    (lambda b: b.replace(root_valid_BP=b.root_valid_BP.at[0, -1].set(False)), "left padding"),
    (lambda b: b.replace(root_valid_BP=b.root_valid_BP.at[0, 3].set(False)), "left padding"),
    (lambda b: b.replace(trunk_len=9), r"trunk_len=9: expected 0 <= trunk_len < P=9"),
    (
      lambda b: b.replace(trunk_len=2, root_valid_BP=b.root_valid_BP.at[1, :7].set(False)),
      r"root_valid_BP: shape \(2, 9\): expected every prompt longer than trunk_len=2",
    ),
    (
      lambda b: b.replace(trunk_len=2, trunk_old_logp_BW=jnp.zeros((2, 2))),
      r"old_logp_BRT \(and trunk_old_logp_BW with a trunk\) must be given on every level",
    ),
    (
      lambda b: b.replace(trunk_len=2).with_leaves(advantages_BRT=jnp.zeros((2, 3, 4))),
      r"trunk_advantages_BRW: give it exactly when the leaves' advantages_BRT are given",
    ),
    (
      lambda b: b.replace(trunk_advantages_BRW=jnp.zeros((2, 3, 1))),
      r"tree.trunk_advantages_BRW: shape \(2, 3, 1\): expected shape \(2, 3, 0\)",
    ),
  ],
)
def test_bad_input_raises_before_compilation(mutate, match):
  batch = make_batch(0, B=2, R=3, P=9, T=4, ragged=False)
  with pytest.raises(ValueError, match=match):
    tree.validate(mutate(batch), vocab_size=128)


def test_chunk_must_divide_branches():
  batch = make_batch(0, B=2, R=3, P=9, T=4)
  with pytest.raises(
    ValueError,
    match=r"branch_chunk=2: expected a divisor of the last fan-out "
    r"R_1=3",
  ):
    tree.validate(batch, vocab_size=128, branch_chunk=2)


def test_config_errors_name_the_field():
  with pytest.raises(ValueError, match="model.n_heads=3"):
    tfm.ModelConfig(n_heads=3, n_kv_heads=2)
  with pytest.raises(ValueError, match="loss.aggregation='mean'"):
    losses.LossConfig(aggregation="mean")
  with pytest.raises(ValueError, match="loss.name='sft'"):
    losses.LossConfig(name="sft")
