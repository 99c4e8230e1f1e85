"""Qwen3.5 text checkpoints (hybrid: Gated DeltaNet + gated attention): import/export round
trip, logits equal to transformers' torch reference on left-padded prompts, bad configs."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import hf
from models import transformer as tfm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=4,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
  linear_num_key_heads=2,
  linear_num_value_heads=4,
  linear_key_head_dim=8,
  linear_value_head_dim=6,
  linear_conv_kernel_dim=3,
  rms_norm_eps=1e-6,
  tie_word_embeddings=False,
  rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
  layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)


def torch_model(seed=0, **overrides):
  torch.manual_seed(seed)
  config = transformers.Qwen3_5TextConfig(**{**TINY, **overrides})
  model = transformers.Qwen3_5ForCausalLM(config).eval()
  with torch.no_grad():  # norms, dt_bias and A_log away from their init
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.3 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("qwen3_5"))
  model = torch_model()
  model.save_pretrained(path)
  return path, model


def prompts(B=3, S=11, vocab=96, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (B, S))
  valid = np.ones((B, S), bool)
  valid[1, :4] = False  # left padding
  valid[2, :7] = False
  return tokens, valid


def test_logits_equal_transformers_with_left_padding(checkpoint):
  path, model = checkpoint
  cfg, params = hf.load(path)
  assert cfg.layer_types == tuple(TINY["layer_types"]) and cfg.attn_output_gate
  tokens, valid = prompts()
  h = tfm.forward(params, cfg, jnp.asarray(tokens), jnp.asarray(valid))
  ours = np.asarray(tfm.logits(params, cfg, h))
  position_ids = np.maximum(np.cumsum(valid, 1) - 1, 0)
  with torch.no_grad():
    theirs = model(
      input_ids=torch.tensor(tokens),
      attention_mask=torch.tensor(valid.astype(int)),
      position_ids=torch.tensor(position_ids),
    ).logits.numpy()
  np.testing.assert_allclose(ours[valid], theirs[valid], rtol=1e-4, atol=1e-4)
  assert np.abs(theirs[valid]).max() > 0.1


def test_save_round_trip_loads_in_transformers(checkpoint, tmp_path):
  path, model = checkpoint
  cfg, params = hf.load(path)
  hf.save(str(tmp_path), cfg, params)
  cfg2, params2 = hf.load(str(tmp_path))
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params, params2)
  back = transformers.Qwen3_5ForCausalLM.from_pretrained(str(tmp_path)).eval()
  ref = dict(model.state_dict())
  for name, x in back.state_dict().items():
    np.testing.assert_array_equal(x.numpy(), ref[name].numpy(), err_msg=name)


@pytest.mark.parametrize(
  "change, field",
  [
    (
      dict(layer_types=["linear_attention", "mamba", "full_attention", "full_attention"]),
      "layer_types",
    ),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6), "linear_key_heads"),
    (dict(sliding_window=4), None),
  ],
)
def test_bad_checkpoints_name_the_field(tmp_path, change, field):
  config = {**TINY, **change, "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text"}
  if field is None:  # a window on a hybrid's layers: only full-attention windows exist
    config["layer_types"] = ["sliding_attention"] * 4
    field = "layer_types"
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=field):
    hf.config_from_hf(config)


def test_replay_grpo_gradient_matches_torch_autograd(checkpoint):
  """Branch replay on a hybrid (the prefix's linear layers hand their recurrent and conv
  states to the tails; left-padded prompts, ragged tails, a scored trunk) against torch
  autograd of the same GRPO loss over every full sequence (transformers' torch reference
  path, which runs its delta rule, norms and RoPE in float32 whatever the model dtype)."""
  from branch_replay.core import engine, losses, tree
  from helpers import full_sequences, hf_batch

  path, model = checkpoint
  batch = hf_batch(B=2, R=3, P=9, T=5, W=2, vocab=TINY["vocab_size"])
  ours = {}
  for dtype in ("float32", "float64"):
    with jax.enable_x64(dtype == "float64"):
      cfg, params = hf.load(path, dtype=dtype, param_dtype=dtype)
      b = batch.with_leaves(advantages_BR=batch.leaves.advantages_BR.astype(dtype))
      tree.validate(b, cfg.vocab_size)
      loss, _, grads = jax.jit(
        lambda p, b: engine.loss_and_grad(p, b, cfg, losses.LossConfig("grpo"), "replay")
      )(params, b)
      ours[dtype] = float(loss), hf.tensors_from_params(cfg, grads)

  # The same loss written out in torch: the token mean over every scored token (the W trunk
  # tokens and the valid tail tokens) of -A * exp(logp - sg(logp)).
  B, R, T = batch.leaves.tokens_BRT.shape
  P, W = batch.root_BP.shape[1], batch.trunk_len
  tokens, valid, positions = full_sequences(batch)
  model.zero_grad()
  logits = model(
    input_ids=torch.tensor(tokens),
    attention_mask=torch.tensor(valid.astype(np.int64)),
    position_ids=torch.tensor(positions),
  ).logits
  logp_NSV = torch.log_softmax(logits, -1)
  logp_NS = torch.gather(logp_NSV[:, :-1], -1, torch.tensor(tokens[:, 1:, None]))[..., 0]
  scored = np.zeros((B * R, P + T - 1), bool)  # logit s predicts token s+1
  scored[:, P - W - 1 : P - 1] = True
  scored[:, P - 1 :] = np.asarray(batch.leaves.valid_BRT).reshape(B * R, T)
  advantage_N1 = torch.tensor(np.asarray(batch.leaves.advantages_BR).reshape(B * R, 1))
  per_token = (-advantage_N1 * torch.exp(logp_NS - logp_NS.detach()))[torch.tensor(scored)]
  torch_loss = per_token.sum() / scored.sum()
  torch_loss.backward()
  theirs = {name: p.grad.numpy() for name, p in model.named_parameters()}

  np.testing.assert_allclose(ours["float32"][0], float(torch_loss.detach()), rtol=1e-5)
  np.testing.assert_allclose(ours["float64"][0], float(torch_loss.detach()), rtol=1e-5)
  exact, f32 = ours["float64"][1], ours["float32"][1]
  assert set(exact) == set(theirs) == set(f32)
  # float32 1e-4 of each leaf's largest entry, against our float64 replay. A few decay leaves
  # (A_log, dt_bias of a late linear layer: ~5e-8 here) are sums that cancel to ~1e-5 of
  # their terms, so float32 rounding alone moves them by ~1e-2 of their size: there the
  # bound is 10x our own float32 replay's distance from float64 (torch's float32 is no
  # better, and a wrong formula would be off by the leaf's size, not by its rounding).
  for name, g in theirs.items():
    scale = np.abs(exact[name]).max()
    assert scale > 1e-9, f"{name}: zero gradient"
    rounding = np.abs(f32[name] - exact[name]).max()
    np.testing.assert_allclose(
      g, exact[name], rtol=1e-4, atol=max(1e-4 * scale, 10 * rounding), err_msg=name
    )
    assert np.abs(g - exact[name]).max() < 0.1 * scale, name
