"""PEFT adapters on every imported family, the Qwen3.5 hybrid included (its q_proj holds each
head's query and output gate: our q adapter covers both halves, as peft's does): ours ->
peft loads it -> the same logits; peft writes a random adapter (gate rows nonzero) -> we load
it -> the same logits, and write back peft's very tensors. Every import error names the
module, the expected and the found shape and the side (adapter or base) that disagrees."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from models import hf
from models import lora
from models import transformer as tfm
from helpers import FAMILIES, TINY

LORA = lora.LoraConfig(rank=4, alpha=8.0)  # every target: q, k, v, o, gate, up, down
HYBRID = "qwen3_5"


def hybrid_config():
  return tfm.preset("hybrid_tiny", n_layers=2, layer_types=("linear_attention", "full_attention"))


def model(family, perturb=0.2):
  """(cfg, base) in float32: a family's tiny model, or a two-layer Qwen3.5 hybrid (one Gated
  DeltaNet layer, one gated full attention). Numpy draws on the init's shapes (no compiled
  init): N(0, perturb) everywhere, norm scales around their identity."""
  cfg = hybrid_config() if family == HYBRID else tfm.ModelConfig(**{**TINY, **FAMILIES[family]})
  shapes = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  identity = 1.0 - cfg.norm_offset

  def draw(path, leaf):
    x = rng.normal(0.0, perturb, leaf.shape)
    return jnp.asarray(x + (identity if path[-1].key == "scale" else 0.0), jnp.float32)

  return cfg, jax.tree_util.tree_map_with_path(draw, shapes)


def random_adapters(cfg, seed=2):
  """Nonzero A and B on every target (B = 0 would make the adapter the base); numpy draws."""
  rng = np.random.default_rng(seed)
  shapes = lora.adapter_shapes(cfg, LORA)
  return {
    layer: {
      t: {k: jnp.asarray(rng.normal(0.0, 0.2, s), jnp.float32) for k, s in ab.items()}
      for t, ab in targets.items()
    }
    for layer, targets in shapes.items()
  }


def q_modules(cfg):
  """PEFT names of the gated q_proj modules (the hybrid's full-attention layers)."""
  return [
    f"{lora.PEFT_PREFIX}model.layers.{i}.self_attn.q_proj"
    for i in range(cfg.n_layers)
    if cfg.attn_output_gate and cfg.layer_type(i) == "full_attention"
  ]


# ----------------------------------------------------------------------------- bad adapters


def write(tmp_path, name, cfg, adapters, edit=None, family=None):
  folder = str(tmp_path / name)
  lora.save_peft(folder, cfg, LORA, adapters, family=family)
  if edit is not None:
    path = os.path.join(folder, lora.WEIGHTS_FILE)
    tensors = safetensors.numpy.load_file(path)
    edit(tensors)
    safetensors.numpy.save_file(tensors, path)
  return folder


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
GATE1 = "base_model.model.model.layers.1.mlp.gate_proj"


def test_import_errors_name_module_shapes_and_side(tmp_path):
  cfg = tfm.ModelConfig(**TINY, **FAMILIES["llama3"])
  adapters = random_adapters(cfg)

  def expect(folder, match, on=cfg):
    with pytest.raises(ValueError, match=match):
      lora.load_peft(folder, on)

  def put(name, shape):
    return lambda t: t.__setitem__(name, np.zeros(shape, np.float32))

  # the adapter disagrees with its own adapter_config.json (r=4): lora_A's and lora_B's rank
  expect(
    write(tmp_path, "a_rank", cfg, adapters, put(f"{Q0}.lora_A.weight", (3, 32))),
    rf"module {Q0}: tensor {Q0}.lora_A.weight has shape \(3, 32\), expected \(4, 32\) "
    r"\(\[r, in\]\): the adapter disagrees: its rank axis is not r=4",
  )
  expect(
    write(tmp_path, "b_rank", cfg, adapters, put(f"{GATE1}.lora_B.weight", (48, 5))),
    rf"module {GATE1}: .*lora_B.weight has shape \(48, 5\), expected \(48, 4\) "
    r"\(\[out, r\]\): the adapter disagrees",
  )
  expect(
    write(tmp_path, "a_3d", cfg, adapters, put(f"{Q0}.lora_A.weight", (4, 32, 1))),
    r"has shape \(4, 32, 1\), expected \(4, 32\) .*the adapter disagrees",
  )
  # the base disagrees: its input features (d_model 48) and output features (mlp 64)
  ok = write(tmp_path, "ok", cfg, adapters)
  wide = dataclasses.replace(cfg, d_model=48)
  expect(
    ok,
    rf"module {Q0}: tensor {Q0}.lora_A.weight has shape \(4, 32\), expected "
    r"\(4, 48\) \(\[r, in\]\): the base disagrees: its q_proj of layer_0 has 48 input "
    r"features, the adapter's 32",
    wide,
  )
  big_mlp = dataclasses.replace(cfg, mlp_hidden=64)
  expect(
    ok,
    r"module .*layers.0.mlp.gate_proj: .*lora_B.weight has shape \(48, 4\), expected "
    r"\(64, 4\) \(\[out, r\]\): the base disagrees: its gate_proj of layer_0 has 64 "
    r"output features, the adapter's 48",
    big_mlp,
  )
  # the adapter lacks a module the base has (found none) / has one the base lacks
  expect(
    write(tmp_path, "missing", cfg, adapters, lambda t: t.pop(f"{GATE1}.lora_B.weight")),
    rf"module {GATE1}: missing tensor {GATE1}.lora_B.weight \(expected shape \(48, 4\), "
    r"found none\): the adapter disagrees",
  )
  extra = "base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight"
  expect(
    write(tmp_path, "extra", cfg, adapters, put(extra, (4, 32))),
    rf"unexpected tensors {extra} \(4, 32\) \(1 in all; expected none\): the base "
    "disagrees: it has no such module",
  )
  # Qwen3.5: an adapter over the query half of q_proj alone (this project's export before
  # the fused adapter) is not peft's layout: the base's 2*N*H outputs are named
  hcfg = hybrid_config()
  (q,) = q_modules(hcfg)
  half = lambda t: t.__setitem__(f"{q}.lora_B.weight", t[f"{q}.lora_B.weight"][:32].copy())
  linear = write(tmp_path, "linear", hcfg, random_adapters(hcfg))
  config_path = os.path.join(linear, lora.CONFIG_FILE)
  config = json.load(open(config_path))
  json.dump({**config, "target_modules": ["q_proj", "in_proj_qkv"]}, open(config_path, "w"))
  expect(linear, r"target_modules \['in_proj_qkv'\]: Qwen3.5's Gated DeltaNet projections", hcfg)
  expect(
    write(tmp_path, "half_q", hcfg, random_adapters(hcfg), half),
    rf"module {q}: .*lora_B.weight has shape \(32, 4\), expected \(64, 4\) .*the base "
    r"disagrees: its q_proj of layer_1 has 64 output features, the adapter's 32; this "
    r"gated attention's q_proj holds each head's query and output gate, 2\*N\*H = 64 "
    r"outputs \(an adapter over the query half alone has 32 rows: not peft.s layout\)",
    hcfg,
  )


def test_gated_q_adapter_covers_query_and_gate():
  """On a gated attention the q adapter's B is [r, N*2*H] in q_proj's row order: its query
  columns move `q`, its gate columns move `q_gate`, nothing else."""
  cfg, base = model(HYBRID)
  only_q = lora.LoraConfig(rank=2, alpha=4.0, targets=("q",))
  assert lora.adapter_shapes(cfg, only_q) == {
    "layer_0": {},
    "layer_1": {"q": {"a": (32, 2), "b": (2, 64)}},
  }
  adapters = jax.tree.map(jnp.ones_like, lora.init_adapters(cfg, only_q, jax.random.key(0)))
  b_rNSH = np.zeros((2, 4, 2, 8), np.float32)
  b_rNSH[:, :, 1] = 1.0  # the gate half only
  adapters["layer_1"]["q"]["b"] = jnp.asarray(b_rNSH.reshape(2, 64))
  merged = lora.merge(base, adapters, only_q)
  np.testing.assert_array_equal(merged["layer_1"]["q"], base["layer_1"]["q"])
  np.testing.assert_allclose(
    merged["layer_1"]["q_gate"] - base["layer_1"]["q_gate"], np.full((32, 4, 8), 2 * 2.0), rtol=1e-6
  )  # scale 2 x (1 @ 1) r=2
  for name in base["layer_1"]:
    if name not in ("q", "q_gate"):
      np.testing.assert_array_equal(merged["layer_1"][name], base["layer_1"][name])
  # the merged weights through hf's export: q_proj's rows are [N, 2, H], the delta on the gate
  w = hf.tensors_from_params(cfg, merged)["model.layers.1.self_attn.q_proj.weight"]
  w0 = hf.tensors_from_params(cfg, base)["model.layers.1.self_attn.q_proj.weight"]
  np.testing.assert_allclose((w - w0).reshape(4, 2, 8, 32)[:, 1], 4.0, rtol=1e-6)
  np.testing.assert_array_equal((w - w0).reshape(4, 2, 8, 32)[:, 0], 0.0)


# ----------------------------------------------------------------------------- through peft


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize("family", sorted(FAMILIES) + [HYBRID])
def test_adapter_through_peft_both_ways(tmp_path, family):
  cfg, base = model(family)
  fam = hf.family_for(cfg)
  hf.save(str(tmp_path / "base"), cfg, base, family=fam)
  load = lambda: transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "base"), attn_implementation="eager", dtype=torch.float32
  )
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  logits_fn = jax.jit(
    lambda p, t: tfm.logits(p, cfg, tfm.forward(p, cfg, t, jnp.ones(t.shape, bool)))
  )
  ours = lambda p: np.asarray(logits_fn(p, jnp.asarray(tokens)))
  torch_logits = lambda m: m(input_ids=torch.tensor(tokens)).logits.detach().numpy()
  errors = {}

  # 1. ours -> peft: every target, A and B nonzero (the gate half of q_proj too)
  adapters = random_adapters(cfg)
  lora.save_peft(str(tmp_path / "ours"), cfg, LORA, adapters, family=fam)
  written = safetensors.numpy.load_file(str(tmp_path / "ours" / lora.WEIGHTS_FILE))
  for q in q_modules(cfg):
    b = written[f"{q}.lora_B.weight"].reshape(cfg.n_heads, 2, cfg.head_dim, LORA.rank)
    assert np.abs(b[:, 1]).min() > 0
  pm = peft.PeftModel.from_pretrained(load(), str(tmp_path / "ours")).eval()
  with torch.no_grad():
    ref = torch_logits(pm)
    with pm.disable_adapter():
      base_ref = torch_logits(pm)
  got = ours(lora.merge(base, adapters, LORA))
  assert np.abs(ref - base_ref).max() > 1e-2  # the adapter changes the logits
  np.testing.assert_allclose(ours(base), base_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
  errors["ours->peft"] = float(np.abs(got - ref).max() / np.abs(ref).max())
  if q_modules(cfg):  # the gate half matters: without it the logits differ
    no_gate = jax.tree.map(lambda x: x, adapters)
    for layer in no_gate:
      if "q" in no_gate[layer] and "q_gate" in base[layer]:
        b_rN2H = no_gate[layer]["q"]["b"].reshape(LORA.rank, cfg.n_heads, 2, cfg.head_dim)
        no_gate[layer]["q"]["b"] = b_rN2H.at[:, :, 1].set(0).reshape(LORA.rank, -1)
    assert np.abs(ours(lora.merge(base, no_gate, LORA)) - ref).max() > 1e-3

  # 2. peft -> ours: peft's own random init (init_lora_weights=False: B nonzero everywhere,
  # the gate rows of q_proj too)
  pm = peft.get_peft_model(
    load(),
    peft.LoraConfig(
      r=4, lora_alpha=16, target_modules=sorted(lora.PEFT_MODULES.values()), init_lora_weights=False
    ),
  ).eval()
  pm.save_pretrained(str(tmp_path / "theirs"))
  with torch.no_grad():
    ref = torch_logits(pm)
  theirs = safetensors.numpy.load_file(str(tmp_path / "theirs" / lora.WEIGHTS_FILE))
  for q in q_modules(cfg):
    b = theirs[f"{q}.lora_B.weight"].reshape(cfg.n_heads, 2, cfg.head_dim, 4)
    assert np.abs(b[:, 1]).max() > 1e-2
  lora_cfg, loaded = lora.load_peft(str(tmp_path / "theirs"), cfg, family=fam)
  assert (lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets) == (4, 16.0, lora.TARGETS)
  got = ours(lora.merge(base, loaded, lora_cfg))
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
  errors["peft->ours"] = float(np.abs(got - ref).max() / np.abs(ref).max())
  # and back out: peft's own tensors, bitwise, under peft's names
  lora.save_peft(str(tmp_path / "again"), cfg, lora_cfg, loaded, family=fam)
  again = safetensors.numpy.load_file(str(tmp_path / "again" / lora.WEIGHTS_FILE))
  assert set(again) == set(theirs)
  for name, x in theirs.items():
    np.testing.assert_array_equal(again[name], x.astype(np.float32), err_msg=name)
  print(family, errors)
