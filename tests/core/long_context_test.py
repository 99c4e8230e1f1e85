"""The long-context machinery beside attention: chunked log-probs, scanned layers, remat
policies, float32 master weights under bfloat16 compute, the tails' memory, bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay import config as config_lib
from branch_replay.core import engine, losses
from branch_replay.train import steps
from branch_replay.train import state as train_state
from models import transformer as tfm
from helpers import assert_equal_f64, make_batch, max_rel_err
from helpers import slow_where

GEMMA2 = dict(
  post_norms=True,
  scale_embeddings=True,
  norm_offset=1.0,
  activation="gelu_tanh",
  query_pre_attn_scalar=8.0,
  attn_logit_softcap=5.0,
  final_logit_softcap=3.0,
  tie_embeddings=True,
  sliding_window=4,
  local_layers=(0, 2),
)


@pytest.fixture
def x64():
  with jax.enable_x64(True):
    yield


def tiny(dtype="float64", **overrides):
  cfg = tfm.preset("tiny", dtype=dtype, param_dtype=dtype, **overrides)
  return cfg, tfm.init_params(cfg, jax.random.key(1))


def replay_grad(cfg, params, batch, loss_cfg=losses.LossConfig()):
  return jax.jit(lambda p: engine.loss_and_grad(p, batch, cfg, loss_cfg, "replay"))(params)


def test_chunked_logps_equal_unchunked(x64):
  """Chunks of 3 over T=10 (ragged last chunk): log-probs, entropies and their gradients."""
  cfg, params = tiny(logits_chunk=3)
  full = dataclasses.replace(cfg, logits_chunk=None)
  h_BTD = jax.random.normal(jax.random.key(2), (2, 10, cfg.d_model), jnp.float64)
  targets_BT = jax.random.randint(jax.random.key(3), (2, 10), 0, cfg.vocab_size)

  def f(c):
    def loss(p, h):
      logp, ent = tfm.token_logps(p, c, h, targets_BT)
      return jnp.sum(logp * jnp.arange(10)) + jnp.sum(ent**2), (logp, ent)

    return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, h_BTD)

  (l1, (lp1, e1)), g1 = f(cfg)
  (l2, (lp2, e2)), g2 = f(full)
  np.testing.assert_allclose(lp1, lp2, rtol=1e-12)
  np.testing.assert_allclose(e1, e2, rtol=1e-12)
  assert max_rel_err(g1, g2) < 1e-10


def test_row_chunked_logps_equal_unchunked(x64):
  """logits_chunk_rows: 3 rows x 4 positions as 12 tokens in chunks of 5 (T <= C < B*T;
  a ragged last chunk): log-probs, entropies and their gradients, float64."""
  cfg, params = tiny(logits_chunk=5, logits_chunk_rows=True)
  full = dataclasses.replace(cfg, logits_chunk=None)
  h_BTD = jax.random.normal(jax.random.key(4), (3, 4, cfg.d_model), jnp.float64)
  targets_BT = jax.random.randint(jax.random.key(5), (3, 4), 0, cfg.vocab_size)

  def f(c):
    def loss(p, h):
      logp, ent = tfm.token_logps(p, c, h, targets_BT)
      return jnp.sum(logp * jnp.arange(12.0).reshape(3, 4)) + jnp.sum(ent**2), (logp, ent)

    return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, h_BTD)

  (l1, (lp1, e1)), g1 = f(cfg)
  (l2, (lp2, e2)), g2 = f(full)
  np.testing.assert_allclose(lp1, lp2, rtol=1e-12)
  np.testing.assert_allclose(e1, e2, rtol=1e-12)
  assert max_rel_err(g1, g2) < 1e-10


def test_chunked_mlp_equals_whole_in_replay_and_naive(x64):
  """mlp_chunk=4 (P=9: a ragged last chunk; the tails' T=3 stay whole) with remat and
  row-chunked log-probs == the defaults: replay's loss and every gradient leaf, float64, and
  the chunked replay == the chunked naive twin."""
  cfg, params = tiny(mlp_chunk=4, logits_chunk=5, logits_chunk_rows=True, remat="full")
  batch = make_batch(6, 2, 3, 9, 3, W=1, dtype=jnp.float64)
  whole = dataclasses.replace(cfg, mlp_chunk=None, logits_chunk_rows=False)
  assert_equal_f64(replay_grad(cfg, params, batch), replay_grad(whole, params, batch))
  naive = jax.jit(lambda p: engine.loss_and_grad(p, batch, cfg, losses.LossConfig(), "naive"))
  assert_equal_f64(replay_grad(cfg, params, batch), naive(params))


@pytest.mark.parametrize("family", slow_where(["llama", "gemma2"], {"gemma2"}))  # llama kept
def test_scanned_layers_equal_unrolled(family, x64):
  """scan over periods of identical layers (Gemma 2 alternates local/global: period 2) ==
  the unrolled loop: replay's loss and every gradient leaf, float64."""
  extra = GEMMA2 if family == "gemma2" else {}
  cfg, params = tiny(n_layers=4, scan_layers=True, **extra)
  assert cfg.layer_period() == (2 if family == "gemma2" else 1)
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  batch = make_batch(0, 2, 3, 9, 4, W=1, dtype=jnp.float64)
  assert_equal_f64(replay_grad(cfg, params, batch), replay_grad(unrolled, params, batch))


@pytest.mark.parametrize("remat", slow_where(["full", "dots"], {"full"}))  # dots kept
def test_remat_policies_equal_none(remat, x64):
  cfg, params = tiny(remat=remat)
  batch = make_batch(1, 2, 3, 9, 4, dtype=jnp.float64)
  assert_equal_f64(
    replay_grad(cfg, params, batch),
    replay_grad(dataclasses.replace(cfg, remat="none"), params, batch),
  )


def test_bfloat16_compute_moves_float32_masters_at_small_lr():
  """bf16 compute, float32 parameters and AdamW state: an update at lr 1e-6 changes the
  parameters (in bf16 most such updates round to nothing: |update| << bf16 spacing)."""
  cfg = config_lib.Config(
    model=tfm.preset("tiny", dtype="bfloat16", param_dtype="float32"),
    train=config_lib.TrainConfig(learning_rate=1e-6, rl_steps=1),
  )
  state = train_state.init_state(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
  assert all(
    x.dtype == jnp.float32
    for x in jax.tree.leaves(state.opt_state)
    if jnp.issubdtype(x.dtype, jnp.floating)
  )
  batch = make_batch(2, 2, 4, 12, 5, vocab=cfg.model.vocab_size)
  new, metrics = jax.jit(steps.make_train_step(cfg))(state, batch)
  assert np.isfinite(float(metrics["loss/policy"]))
  moved = jax.tree.map(lambda a, b: float(jnp.mean(a != b)), new.params, state.params)
  embed = moved.pop("embed")["embedding"]  # only the rows of tokens in the batch
  assert min(jax.tree.leaves(moved)) > 0.5, moved  # (nearly) every entry of every leaf moved
  assert embed > 0.1
  # The same update applied to bf16 parameters would vanish for most entries.
  w = state.params["layer_0"]["q"]
  step = new.params["layer_0"]["q"] - w
  in_bf16 = (w.astype(jnp.bfloat16) + step.astype(jnp.bfloat16)) != w.astype(jnp.bfloat16)
  assert float(jnp.mean(in_bf16)) < 0.1


@pytest.mark.parametrize(
  "attention", slow_where(["blockwise", "dense"], {"dense"})
)  # blockwise kept
def test_tail_memory_does_not_grow_with_branches(attention):
  """At fixed R*T, the tails' compiled temporary memory is flat in R: the prefix K/V
  cotangent is one [S, K, H] per layer, summed inside the attention contraction, never an
  [R, S, K, H] per-branch copy (which at R=32 here would add ~2x the whole temp)."""
  cfg, params = tiny(
    "float32",
    attention=attention,
    attention_block_q=64,
    attention_block_k=64,
    n_kv_heads=4,
    head_dim=16,
    n_heads=4,
  )
  P = 1024

  def temp_bytes(R, T):
    batch = make_batch(3, 1, R, P, T, ragged=False, vocab=cfg.vocab_size)
    step = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, losses.LossConfig())[2])
    return step.lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  few, many = temp_bytes(2, 32), temp_bytes(32, 2)
  per_branch_cotangent = 32 * P * 4 * 16 * 4 * 2  # R x [S, K, H] for K and V, float32
  assert many < few + per_branch_cotangent / 4, (few, many)


def test_bad_model_options_name_the_field():
  for overrides, field in [
    (dict(attention="flash"), "model.attention"),
    (dict(attention_block_q=0), "model.attention_block_q"),
    (dict(attention_block_k=-4), "model.attention_block_k"),
    (dict(logits_chunk=0), "model.logits_chunk"),
    (dict(mlp_chunk=0), "model.mlp_chunk"),
    (dict(logits_chunk_rows=1), "model.logits_chunk_rows"),
    (dict(remat="sometimes"), "model.remat"),
  ]:
    with pytest.raises(ValueError, match=field):
      tfm.preset("tiny", **overrides)


def test_offload_remat_is_refused_on_cpu_before_compiling():
  cfg, params = tiny("float32", remat="offload")
  batch = make_batch(4, 1, 2, 5, 3, vocab=cfg.vocab_size)
  with pytest.raises(ValueError, match="model.remat='offload'"):
    jax.eval_shape(lambda p: engine.loss_and_grad(p, batch, cfg, losses.LossConfig()), params)
