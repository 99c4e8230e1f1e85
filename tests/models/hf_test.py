"""Imported Hugging Face checkpoints against the reference implementation (`transformers` on
CPU torch): logits, the branch-replay GRPO gradient vs torch autograd, bit-exact export ->
re-import, transformers loading our export, sharded folders, and bad input."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import full_sequences, hf_batch, slow_where

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import safetensors.numpy  # noqa: E402

from branch_replay.core import engine, losses, tree  # noqa: E402
from models import hf  # noqa: E402
from models import transformer as tfm  # noqa: E402

V = 64
COMMON = dict(
  vocab_size=V,
  hidden_size=32,
  intermediate_size=48,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=8,
)
# Windows of 4 < the 8-token prefix; soft-caps small enough to bite; llama3 RoPE with a short
# original context so all three frequency bands (kept, ramped, divided) occur.
HF_CONFIGS = {
  "llama": lambda: transformers.LlamaConfig(
    **COMMON,
    rope_theta=500000.0,
    rope_scaling=dict(
      rope_type="llama3",
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=16,
    ),
  ),
  "qwen2": lambda: transformers.Qwen2Config(
    **{k: v for k, v in COMMON.items() if k != "head_dim"},
    use_sliding_window=True,
    sliding_window=4,
    max_window_layers=1,
    tie_word_embeddings=True,
  ),
  "qwen3": lambda: transformers.Qwen3Config(**COMMON),
  "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=4),
  "gemma2": lambda: transformers.Gemma2Config(
    **COMMON,
    sliding_window=4,
    attn_logit_softcapping=2.0,
    final_logit_softcapping=3.0,
    query_pre_attn_scalar=12,
  ),
  "gemma3": lambda: transformers.Gemma3TextConfig(
    **COMMON,
    sliding_window=4,
    sliding_window_pattern=2,
    rope_local_base_freq=100.0,
    rope_scaling=dict(rope_type="linear", factor=2.0),
  ),
}
FAMILIES = sorted(HF_CONFIGS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  """family -> (folder, torch model): tiny random models saved with save_pretrained."""
  out = {}
  for family in FAMILIES:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
      HF_CONFIGS[family](), attn_implementation="eager"
    )
    with torch.no_grad():  # weights big enough that every part matters (norms, biases...)
      for p in model.parameters():
        p.normal_(0.0, 0.3)
    folder = str(tmp_path_factory.mktemp(family))
    model.save_pretrained(folder)
    out[family] = (folder, model.eval())
  return out


def torch_logits(model, tokens, valid=None, positions=None):
  kwargs = {}
  if valid is not None:
    kwargs = dict(
      attention_mask=torch.tensor(valid.astype(np.int64)), position_ids=torch.tensor(positions)
    )
  return model(input_ids=torch.tensor(tokens), **kwargs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(checkpoints, family):
  folder, model = checkpoints[family]
  cfg, params = hf.load(folder)
  tokens = np.random.default_rng(1).integers(0, V, (2, 12))  # 12 > window: windows bite
  with torch.no_grad():
    ref = torch_logits(model, tokens).numpy()
  ours = jax.jit(lambda p, t: tfm.logits(p, cfg, tfm.forward(p, cfg, t, jnp.ones(t.shape, bool))))(
    params, jnp.asarray(tokens)
  )
  assert np.abs(ref).max() > 1.0  # not trivially small
  assert np.abs(np.asarray(ours) - ref).max() <= 1e-4


# torch autograd agreement: mistral, gemma3, qwen2 under -m slow (16-18 s each; kept: llama,
# qwen3, gemma2)
@pytest.mark.parametrize("family", slow_where(FAMILIES, {"mistral", "gemma3", "qwen2"}))
def test_replay_grpo_gradient_matches_torch_autograd(checkpoints, family):
  """Branch replay (prefix once, tails against its cache, windowed caches sliced) against
  torch autograd of the same loss on every full sequence, float32, left-padded prompts."""
  folder, model = checkpoints[family]
  cfg, params = hf.load(folder)
  batch = hf_batch()
  tree.validate(batch, cfg.vocab_size)
  loss, _, grads = jax.jit(
    lambda p, b: engine.loss_and_grad(p, b, cfg, losses.LossConfig("grpo"), "replay")
  )(params, batch)

  # The torch side, written out: token-mean over every scored token (the W trunk tokens of
  # each branch and its valid tail tokens) of -A * ratio, ratio = exp(logp - sg(logp)) = 1:
  # GRPO's value on-policy, and the gradient of -A * logp.
  B, R, T = batch.leaves.tokens_BRT.shape
  P, W = batch.root_BP.shape[1], batch.trunk_len
  tokens, valid, positions = full_sequences(batch)
  model.zero_grad()
  logp_NSV = torch.log_softmax(torch_logits(model, tokens, valid, positions), -1)
  logp_NS = torch.gather(logp_NSV[:, :-1], -1, torch.tensor(tokens[:, 1:, None]))[..., 0]
  scored = np.zeros((B * R, P + T - 1), bool)  # logit s predicts token s+1
  scored[:, P - W - 1 : P - 1] = True
  scored[:, P - 1 :] = np.asarray(batch.leaves.valid_BRT).reshape(B * R, T)
  advantage_N1 = torch.tensor(np.asarray(batch.leaves.advantages_BR).reshape(B * R, 1))
  ratio = torch.exp(logp_NS - logp_NS.detach())
  per_token = (-advantage_N1 * ratio)[torch.tensor(scored)]
  torch_loss = per_token.sum() / scored.sum()
  torch_loss.backward()

  np.testing.assert_allclose(float(loss), float(torch_loss.detach()), rtol=1e-5)
  ours = hf.tensors_from_params(cfg, grads)
  theirs = {name: p.grad.numpy() for name, p in model.named_parameters()}
  assert set(ours) == set(theirs)
  for name, g in theirs.items():
    scale = np.abs(g).max()
    assert scale > 1e-6, f"{name}: zero gradient"
    np.testing.assert_allclose(ours[name], g, rtol=1e-3, atol=2e-5 * scale, err_msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_reimport_is_bit_exact_and_transformers_loads_it(checkpoints, family, tmp_path):
  folder, model = checkpoints[family]
  cfg, params = hf.load(folder)
  # As a trained policy is exported: the imported config.json's other keys kept.
  hf.save(str(tmp_path), cfg, params, extra_config=hf.read_config(folder))
  cfg2, params2 = hf.load(str(tmp_path))
  assert cfg2 == cfg
  same = jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), params, params2)
  assert all(jax.tree.leaves(same))
  # The exported tensors are the checkpoint's own, bit for bit.
  original = safetensors.numpy.load_file(os.path.join(folder, "model.safetensors"))
  exported = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
  assert set(exported) <= set(original)
  for name, x in exported.items():
    assert x.dtype == original[name].dtype and np.array_equal(x, original[name]), name
  # transformers reads our config.json and tensors back into the same model.
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path), attn_implementation="eager"
  )
  assert type(reloaded) is type(model)
  tokens = np.random.default_rng(2).integers(0, V, (1, 10))
  with torch.no_grad():
    np.testing.assert_array_equal(
      torch_logits(reloaded, tokens).numpy(), torch_logits(model, tokens).numpy()
    )


def test_bfloat16_import_export_round_trip(checkpoints, tmp_path):
  folder, _ = checkpoints["gemma2"]  # a float32 checkpoint
  cfg, params = hf.load(folder, dtype="bfloat16")
  # bfloat16 compute on float32 master weights: the checkpoint's values, unrounded.
  assert (cfg.dtype, cfg.param_dtype) == ("bfloat16", "float32")
  _, f32 = hf.load(folder)
  assert all(
    jax.tree.leaves(
      jax.tree.map(lambda a, b: a.dtype == jnp.float32 and np.array_equal(a, b), params, f32)
    )
  )
  # Export writes the compute dtype; bf16 -> f32 masters -> bf16 is then bit-exact.
  hf.save(str(tmp_path / "a"), cfg, params, extra_config=hf.read_config(folder))
  assert json.load(open(tmp_path / "a" / "config.json"))["torch_dtype"] == "bfloat16"
  _, params_a = hf.load(str(tmp_path / "a"), dtype="bfloat16")
  assert all(
    jax.tree.leaves(
      jax.tree.map(
        lambda a, b: np.array_equal(a, b.astype(jnp.bfloat16).astype(jnp.float32)), params_a, params
      )
    )
  )
  hf.save(str(tmp_path), cfg, params_a, extra_config=hf.read_config(folder))
  _, params2 = hf.load(str(tmp_path), dtype="bfloat16")
  assert all(
    jax.tree.leaves(
      jax.tree.map(lambda a, b: a.dtype == b.dtype and np.array_equal(a, b), params_a, params2)
    )
  )
  params = params_a
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert reloaded.dtype == torch.bfloat16
  theirs = {n: p.detach().float().numpy() for n, p in reloaded.named_parameters()}
  ours = hf.tensors_from_params(cfg, jax.tree.map(lambda x: x.astype(jnp.float32), params))
  assert set(theirs) == set(ours)
  for name, x in ours.items():
    np.testing.assert_array_equal(theirs[name], x, err_msg=name)


def test_sharded_checkpoints(checkpoints, tmp_path):
  """Sharded folders (model.safetensors.index.json) both ways: transformers' and ours."""
  folder, model = checkpoints["llama"]
  cfg, params = hf.load(folder)
  model.save_pretrained(str(tmp_path / "theirs"), max_shard_size="20KB")
  assert os.path.exists(tmp_path / "theirs" / "model.safetensors.index.json")
  assert len(list((tmp_path / "theirs").glob("*.safetensors"))) > 1
  hf.save(str(tmp_path / "ours"), cfg, params, max_shard_bytes=20_000)
  assert len(list((tmp_path / "ours").glob("*.safetensors"))) > 1
  for sub in ("theirs", "ours"):
    _, p = hf.load(str(tmp_path / sub))
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, params, p))), sub
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "ours"), attn_implementation="eager"
  )
  tokens = np.arange(10)[None]
  with torch.no_grad():
    np.testing.assert_array_equal(
      torch_logits(reloaded, tokens).numpy(), torch_logits(model, tokens).numpy()
    )


def legacy(hf_config: dict) -> dict:
  """The transformers-4 spelling of a config.json (as most published checkpoints have it)."""
  c = {k: v for k, v in hf_config.items() if k not in ("rope_parameters", "layer_types")}
  rope = hf_config["rope_parameters"]
  if "full_attention" in rope:  # Gemma 3
    c["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    rope = rope["full_attention"]
  c["rope_theta"] = rope["rope_theta"]
  scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
  c["rope_scaling"] = None if scaling.get("rope_type") == "default" else scaling
  return c


@pytest.mark.parametrize("family", FAMILIES)
def test_transformers_4_config_spelling_reads_the_same(checkpoints, family):
  """Without rope_parameters and layer_types: rope_theta/rope_scaling/rope_local_base_freq,
  Qwen's use_sliding_window/max_window_layers, Gemma's alternation patterns."""
  new = hf.read_config(checkpoints[family][0])
  assert hf.config_from_hf(legacy(new)) == hf.config_from_hf(new)


# ----------------------------------------------------------------------------- bad input


def copy_checkpoint(checkpoints, family, tmp_path, edit_config=None):
  folder, _ = checkpoints[family]
  dst = tmp_path / "ckpt"
  shutil.copytree(folder, dst)
  if edit_config:
    cfg = json.load(open(dst / "config.json"))
    edit_config(cfg)
    json.dump(cfg, open(dst / "config.json", "w"))
  return dst


def edit_tensors(folder, edit):
  path = folder / "model.safetensors"
  tensors = dict(safetensors.numpy.load_file(str(path)))
  edit(tensors)
  safetensors.numpy.save_file(tensors, str(path), metadata={"format": "pt"})


def test_unsupported_architecture_lists_the_supported_ones(checkpoints, tmp_path):
  def gpt2(cfg):
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")

  folder = copy_checkpoint(checkpoints, "llama", tmp_path, gpt2)
  with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
    hf.load(str(folder))
  for arch in hf.ARCHITECTURES:
    assert arch in str(e.value)


def test_missing_tensor_is_named_with_its_shape(checkpoints, tmp_path):
  folder = copy_checkpoint(checkpoints, "qwen2", tmp_path)
  edit_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
  with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*\(16,\)"):
    hf.load(str(folder))


def test_shape_mismatch_names_the_tensor_and_both_shapes(checkpoints, tmp_path):
  folder = copy_checkpoint(checkpoints, "mistral", tmp_path)

  def shrink(t):
    t["model.layers.0.mlp.up_proj.weight"] = t["model.layers.0.mlp.up_proj.weight"][:40]

  edit_tensors(folder, shrink)
  with pytest.raises(
    ValueError,
    match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape "
    r"\(40, 32\), expected \(48, 32\)",
  ):
    hf.load(str(folder))


def test_unexpected_tensor_is_an_error(checkpoints, tmp_path):
  folder = copy_checkpoint(checkpoints, "llama", tmp_path)

  def add_bias(t):
    t["model.layers.0.self_attn.o_proj.bias"] = np.zeros(32, np.float32)

  edit_tensors(folder, add_bias)
  with pytest.raises(ValueError, match=r"o_proj\.bias"):
    hf.load(str(folder))


@pytest.mark.parametrize(
  "family, edit, match",
  [
    (
      "llama",
      lambda c: c.update(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)),
      "'yarn'",
    ),
    (
      "llama",
      lambda c: (
        c.pop("rope_parameters"),
        c.update(rope_theta=1e4, rope_scaling=dict(type="dynamic", factor=2.0)),
      ),
      "'dynamic'",
    ),
    ("llama", lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu'"),
    ("llama", lambda c: c.update(attention_bias=True), "attention_bias=True"),
    ("llama", lambda c: c.update(mlp_bias=True), "mlp_bias=True"),
    (
      "qwen3",
      lambda c: c.update(
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)
      ),
      "partial_rotary_factor=0.5",
    ),
    (
      "gemma2",
      lambda c: c.update(layer_types=["chunked_attention", "full_attention"]),
      "chunked_attention",
    ),
  ],
)
def test_unsupported_config_values_are_named(checkpoints, tmp_path, family, edit, match):
  folder = copy_checkpoint(checkpoints, family, tmp_path, edit)
  with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
    hf.load(str(folder))


def test_inexpressible_export_is_an_error(tmp_path):
  cfg = tfm.ModelConfig(
    vocab_size=V,
    d_model=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    mlp_hidden=48,
    final_logit_softcap=5.0,
  )
  params = jax.jit(lambda k: tfm.init_params(cfg, k))(jax.random.key(0))
  with pytest.raises(ValueError, match="final_logit_softcap"):
    hf.save(str(tmp_path), cfg, params)
  with pytest.raises(ValueError, match="family='gpt2'"):
    hf.save(
      str(tmp_path),
      tfm.ModelConfig(
        vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48
      ),
      params,
      family="gpt2",
    )


def test_tokenizer_json_is_used_when_present(checkpoints, tmp_path):
  tokenizers = pytest.importorskip("tokenizers")
  folder = copy_checkpoint(checkpoints, "llama", tmp_path)
  assert hf.load_tokenizer(str(folder)) is None  # no tokenizer.json: None, no error
  vocab = {"<unk>": 0, "hello": 1, "world": 2}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.save(str(folder / "tokenizer.json"))
  loaded = hf.load_tokenizer(str(folder))
  assert loaded.encode("hello world again").ids == [1, 2, 0]
