"""Per-family options (Qwen2/3, Mistral, Gemma 2/3, Llama 3 RoPE): branch replay equals the
naive path, sliding windows hold in every path (prefill, tail, full forward, decoding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, tree
from models import transformer as tfm

import helpers
from helpers import FAMILIES, TINY, WINDOW, max_rel_err as rel_err, tiny_model
from helpers import slow_where


def make_batch(seed):
  """A flat batch of the families' vocabulary, P=10 above the window (ragged, a trunk)."""
  return helpers.make_batch(
    seed, B=2, R=3, P=10, T=5, W=2, vocab=TINY["vocab_size"], dtype=jnp.float64
  )


def model(family, dtype="float64"):
  return tiny_model(family, dtype, perturb=0.2)


# mistral, qwen2, gemma3 under -m slow (38-49 s each; kept: llama3, qwen3, gemma2: plain,
# q/k-norm, soft-cap and norm offset)
@pytest.mark.parametrize("family", slow_where(sorted(FAMILIES), {"mistral", "qwen2", "gemma3"}))
def test_replay_equals_naive_float64(family):
  with jax.enable_x64(True):
    cfg, params = model(family)
    batch = make_batch(0)
    tree.validate(batch, cfg.vocab_size)
    loss_cfg = losses.LossConfig("grpo")
    run = jax.jit(
      lambda p, b, mode: engine.loss_and_grad(p, b, cfg, loss_cfg, mode), static_argnums=2
    )
    (l1, aux1, g1), (l2, aux2, g2) = run(params, batch, "replay"), run(params, batch, "naive")
    assert abs(float(l1) - float(l2)) <= 1e-10 * abs(float(l2))
    assert jax.tree.structure(g1) == jax.tree.structure(g2)
    for path, x, y in zip(
      jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g1), jax.tree.leaves(g2)
    ):
      assert float(jnp.max(jnp.abs(y))) > 1e-8, f"{path[0]}: zero gradient"
      assert rel_err(x, y) < 1e-10, (path[0], rel_err(x, y))
    np.testing.assert_allclose(aux1["logp_sum"], aux2["logp_sum"], rtol=1e-10)


@pytest.mark.parametrize("family", slow_where(["mistral", "gemma2"], {"gemma2"}))  # mistral kept
def test_sliding_layers_cache_only_their_window(family):
  cfg, params = model(family, "float32")
  batch = make_batch(1)
  cache = jax.jit(lambda p: tfm.prefill(p, cfg, batch.root_BP, batch.root_valid_BP))(params)
  P = batch.root_BP.shape[1]
  for i, kv in enumerate(cache.kv):
    S = WINDOW if cfg.layer_window(i) else P
    assert kv.k_BSKH.shape[1] == kv.v_BSKH.shape[1] == S, (i, kv.k_BSKH.shape)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_decoding_equals_full_forward_float64(family):
  """Token-by-token decoding against the (window-sliced) prefix cache plus the growing
  generated K/V, as a sampler does, gives the logits of one full forward."""
  with jax.enable_x64(True):
    cfg, params = model(family)
    batch = make_batch(2)
    prefix_BP, prefix_valid_BP = batch.root_BP, batch.root_valid_BP
    gen_BT = batch.leaves.tokens_BRT[:, 0]
    B, T = gen_BT.shape

    @jax.jit
    def both(params):
      module = tfm.Transformer(cfg)
      cache = tfm.prefill(params, cfg, prefix_BP, prefix_valid_BP)
      n_B1 = prefix_valid_BP.sum(1, keepdims=True)
      kv_L, step_logits = None, []
      for t in range(T):
        context = [(cache.kv, prefix_valid_BP)]
        if t:
          context.append((kv_L, jnp.ones((B, t), bool)))
        h_B1D, own = module.apply(
          {"params": params}, gen_BT[:, t : t + 1], n_B1 + t, jnp.ones((B, 1), bool), context
        )
        step_logits.append(tfm.logits(params, cfg, h_B1D))
        kv_L = (
          own
          if t == 0
          else tuple(
            tfm.KV(
              jnp.concatenate([a.k_BSKH, b.k_BSKH], 1), jnp.concatenate([a.v_BSKH, b.v_BSKH], 1)
            )
            for a, b in zip(kv_L, own)
          )
        )
      tokens = jnp.concatenate([prefix_BP, gen_BT], 1)
      valid = jnp.concatenate([prefix_valid_BP, jnp.ones((B, T), bool)], 1)
      h_full = tfm.forward(params, cfg, tokens, valid)
      return jnp.concatenate(step_logits, 1), tfm.logits(params, cfg, h_full[:, -T:])

    decoded, full = both(params)
    assert rel_err(decoded, full) < 1e-10


def test_window_bounds_the_receptive_field():
  """Causality by gradient: with every layer windowed (Mistral, 2 layers), the last logit
  depends on exactly the last 2*(window-1)+1 positions."""
  cfg, params = model("mistral", "float32")
  S = 12
  tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (1, S)), jnp.int32)
  valid = jnp.ones((1, S), bool)
  embedding = params["embed"]["embedding"]

  @jax.jit
  def grad_by_position(x_SD):
    def last_logit(x_SD):
      p = dict(params, embed={"embedding": embedding.at[tokens[0]].set(x_SD)})
      h = tfm.forward(p, cfg, tokens, valid)
      return jnp.sum(tfm.logits(p, cfg, h)[0, -1] ** 2)

    return jnp.abs(jax.grad(last_logit)(x_SD)).sum(-1)

  # Distinct rows for every position (a repeated token would share its row).
  g_S = np.asarray(grad_by_position(embedding[tokens[0]]))
  reach = 2 * (WINDOW - 1)
  assert np.all(g_S[: S - 1 - reach] == 0), g_S
  assert np.all(g_S[S - 1 - reach :] > 0), g_S


def test_default_config_keeps_the_llama_parameter_tree():
  cfg = tfm.preset("tiny")
  params = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  assert sorted(params) == ["embed", "final_norm", "layer_0", "layer_1", "lm_head"]
  assert sorted(params["layer_0"]) == [
    "attn_norm",
    "down",
    "gate",
    "k",
    "mlp_norm",
    "o",
    "q",
    "up",
    "v",
  ]
  full = jax.eval_shape(
    lambda: tfm.init_params(tfm.ModelConfig(**TINY, **FAMILIES["gemma3"]), jax.random.key(0))
  )
  assert set(full["layer_0"]) == set(params["layer_0"]) | {
    "k_norm",
    "q_norm",
    "post_attn_norm",
    "post_mlp_norm",
  }
  assert "lm_head" not in full  # tied
  axes = tfm.param_axes(tfm.ModelConfig(**TINY, **FAMILIES["qwen2"]))
  assert tuple(axes["layer_0"]["q_bias"]) == ("heads", "head_dim")
  assert tuple(axes["layer_0"]["k_bias"]) == ("kv_heads", "head_dim")


@pytest.mark.parametrize(
  "overrides, match",
  [
    (dict(rope_scaling=dict(type="yarn", factor=4.0)), "rope_scaling.type='yarn'"),
    (dict(local_layers=(0,)), "local_layers"),
    (dict(sliding_window=4, local_layers=(2,)), "local_layers"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(activation="relu"), "activation"),
    (dict(attn_logit_softcap=-1.0), "attn_logit_softcap"),
  ],
)
def test_config_errors_name_the_field(overrides, match):
  with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(".", r"\.")):
    tfm.ModelConfig(**TINY, **overrides)
