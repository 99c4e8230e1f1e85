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

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6,
            linear_conv_kernel_dim=3, rms_norm_eps=1e-6, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                 partial_rotary_factor=0.5),
            layer_types=["linear_attention", "full_attention", "linear_attention",
                         "full_attention"])


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
    theirs = model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(valid.astype(int)),
                   position_ids=torch.tensor(position_ids)).logits.numpy()
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


@pytest.mark.parametrize("change, field", [
    (dict(layer_types=["linear_attention", "mamba", "full_attention", "full_attention"]),
     "layer_types"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=6), "linear_key_heads"),
    (dict(sliding_window=4), None),
])
def test_bad_checkpoints_name_the_field(tmp_path, change, field):
  config = {**TINY, **change, "architectures": ["Qwen3_5ForCausalLM"],
            "model_type": "qwen3_5_text"}
  if field is None:  # a window on a hybrid's layers: only full-attention windows exist
    config["layer_types"] = ["sliding_attention"] * 4
    field = "layer_types"
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(config, f)
  with pytest.raises(ValueError, match=field):
    hf.config_from_hf(config)
