"""LoRA: replay == naive over the adapters (float64), the adapter gradient is the full
gradient projected through the adapter, PEFT files in and out (peft loads ours: same logits),
--merge, bad input."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy

from branch_replay.core import engine, losses, tree
from models import hf
from models import lora
from models import transformer as tfm
from helpers import make_batch, max_rel_err
from oracles import flat_naive_loss_and_grad

LORA = lora.LoraConfig(rank=4, alpha=8.0)


def lora_loss_and_grad(base, adapters, batch, cfg, loss_cfg, lora_cfg, mode="replay"):
  """Over the adapters, the base frozen (merged inside each layer): replay through the one
  engine, or the flat oracle (every branch its own sequence, tests/oracles.py)."""
  params_fn = lambda a: lora.attach(base, a, lora_cfg)
  if mode == "naive":
    return flat_naive_loss_and_grad(adapters, batch, cfg, loss_cfg, params_fn)
  return engine.loss_and_grad(adapters, batch, cfg, loss_cfg, mode, params_fn=params_fn)


def model_and_adapters(dtype="float64", lora_cfg=LORA, **overrides):
  cfg = tfm.preset("tiny", dtype=dtype, param_dtype=dtype, **overrides)
  base = tfm.init_params(cfg, jax.random.key(0))
  adapters = lora.init_adapters(cfg, lora_cfg, jax.random.key(1))
  # B = 0 at init would make every A gradient zero: give B values so both halves matter.
  keys = iter(jax.random.split(jax.random.key(2), 64))
  adapters = jax.tree.map(
    lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
  )
  return cfg, base, adapters


@pytest.mark.parametrize("loss_name, W, logps", [("grpo", 0, False), ("ppo", 2, True)])
def test_lora_replay_equals_naive_float64(loss_name, W, logps):
  with jax.enable_x64(True):
    cfg, base, adapters = model_and_adapters(qkv_bias=True)
    batch = make_batch(5, B=2, R=3, P=7, T=4, W=W, logps=logps, dtype=jnp.float64)
    tree.validate(batch, cfg.vocab_size)
    loss_cfg = losses.LossConfig(name=loss_name, kl_coef=0.1 if logps else 0.0)
    run = lambda mode: jax.jit(
      lambda a, b: lora_loss_and_grad(base, a, b, cfg, loss_cfg, LORA, mode)
    )(adapters, batch)
    (l1, aux1, g1), (l2, aux2, g2) = run("replay"), run("naive")
    assert abs(float(l1) - float(l2)) <= 1e-10 * max(abs(float(l2)), 1e-3)
    assert jax.tree.structure(g1) == jax.tree.structure(adapters)  # adapters only, no base
    assert max_rel_err(g1, g2) < 1e-10
    for name in aux1:
      np.testing.assert_allclose(aux1[name], aux2[name], rtol=1e-10, atol=1e-10)
    assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g2)) > 1e-6  # every leaf


def test_lora_replay_equals_naive_with_the_one_gpu_plans_options():
  """experiments/plan_1gpu.py's step at a tiny shape: full remat, scanned layers, chunked MLP
  and row-chunked log-probs, the base frozen; replay == the naive twin with the default
  options (float64, every adapter leaf)."""
  with jax.enable_x64(True):
    cfg, base, adapters = model_and_adapters(
      remat="full", scan_layers=True, mlp_chunk=4, logits_chunk=5, logits_chunk_rows=True
    )
    plain = dataclasses.replace(cfg, remat="none", mlp_chunk=None, logits_chunk_rows=False)
    batch = make_batch(7, B=1, R=4, P=10, T=3, dtype=jnp.float64)
    loss_cfg = losses.LossConfig(name="grpo")
    l1, _, g1 = jax.jit(
      lambda a: lora_loss_and_grad(base, a, batch, cfg, loss_cfg, LORA, "replay")
    )(adapters)
    l2, _, g2 = jax.jit(
      lambda a: lora_loss_and_grad(base, a, batch, plain, loss_cfg, LORA, "naive")
    )(adapters)
    assert abs(float(l1) - float(l2)) <= 1e-10 * max(abs(float(l2)), 1e-3)
    assert max_rel_err(g1, g2) < 1e-10


def _mixed(dtype):
  """Float32 adapters over a bf16 base (the one-GPU layout), compute in `dtype`; the adapters
  as model_and_adapters draws them."""
  cfg = tfm.preset("tiny", dtype=dtype, param_dtype="bfloat16")
  base = tfm.init_params(cfg, jax.random.key(0))
  adapters = lora.init_adapters(cfg, LORA, jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 64))
  adapters = jax.tree.map(
    lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), adapters
  )
  return cfg, base, adapters


def test_mixed_precision_layout_replay_equals_naive():
  """Float32 adapters (and so their gradients and AdamW state) over a frozen bf16 base.

  Float32 compute: the bf16 base is a constant of the differentiated function, the merged
  weights are float32 (transformer.merge_adapters), so replay == the flat oracle at float32's
  tolerance, rtol 1e-5 / atol 1e-6 (measured: 2.3e-6 relative on the worst adapter leaf, the
  loss 1e-6 relative). bf16 compute (the one-GPU run): the two paths round in different
  places; measured, every leaf within 2.1% of the naive twin's scale (bound: 5%), the loss
  within 0.3% (bound 1%), and replay is no further from the float32-compute gradient than the
  naive twin is (2.9% vs 3.4%; asserted: at most 1.5x the naive twin's)."""
  batch = make_batch(5, B=2, R=3, P=7, T=4, logps=True)
  loss_cfg = losses.LossConfig(name="ppo", kl_coef=0.1)

  def both(dtype):
    cfg, base, adapters = _mixed(dtype)
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    run = lambda mode: jax.jit(
      lambda a: lora_loss_and_grad(base, a, batch, cfg, loss_cfg, LORA, mode)
    )(adapters)
    return run("replay"), run("naive")

  (l1, aux1, g1), (l2, aux2, g2) = both("float32")
  assert {x.dtype for x in jax.tree.leaves(g1)} == {jnp.dtype(jnp.float32)}
  np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5, atol=1e-6)
  assert max_rel_err(g1, g2) < 1e-5
  for name in aux1:
    np.testing.assert_allclose(aux1[name], aux2[name], rtol=1e-5, atol=1e-5, err_msg=name)
  assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g2)) > 1e-6
  (b1, _, h1), (b2, _, h2) = both("bfloat16")
  assert {x.dtype for x in jax.tree.leaves(h1)} == {jnp.dtype(jnp.float32)}
  assert abs(float(b1) - float(b2)) <= 1e-2 * abs(float(b2))
  assert max_rel_err(h1, h2) < 5e-2
  assert max_rel_err(h1, g2) <= 1.5 * max_rel_err(h2, g2)


def test_adapter_gradient_is_the_full_gradient_projected():
  """dA = s dW B^T, dB = s A^T dW with dW = jax.grad of the loss at the merged weights."""
  with jax.enable_x64(True):
    cfg, base, adapters = model_and_adapters()
    batch = make_batch(6, B=2, R=2, P=6, T=3, dtype=jnp.float64)
    loss_cfg = losses.LossConfig(name="grpo")
    _, _, g_adapters = jax.jit(
      lambda a: lora_loss_and_grad(base, a, batch, cfg, loss_cfg, LORA, "replay")
    )(adapters)
    merged = lora.merge(base, adapters, LORA)
    g_full = jax.jit(jax.grad(lambda p: engine.naive_loss(p, batch, cfg, loss_cfg)[0]))(merged)
    s = LORA.scale
    for layer, targets in adapters.items():
      for t, ad in targets.items():
        dW = g_full[layer][t].reshape(ad["a"].shape[0], ad["b"].shape[1])
        want = {"a": s * dW @ ad["b"].T, "b": s * ad["a"].T @ dW}
        for k in ("a", "b"):
          assert max_rel_err(g_adapters[layer][t][k], want[k]) < 1e-10, (layer, t, k)


def test_zero_b_starts_at_the_base_and_merge_changes_only_targets():
  cfg = tfm.preset("tiny")
  base = tfm.init_params(cfg, jax.random.key(0))
  only_q = lora.LoraConfig(rank=2, alpha=4.0, targets=("q", "down"))
  adapters = lora.init_adapters(cfg, only_q, jax.random.key(1))
  jax.tree.map(np.testing.assert_array_equal, lora.merge(base, adapters, only_q), base)
  adapters = jax.tree.map(lambda x: x + 1.0, adapters)
  merged = lora.merge(base, adapters, only_q)
  for layer in ("layer_0", "layer_1"):
    for name in base[layer]:
      same = np.array_equal(np.asarray(merged[layer][name]), np.asarray(base[layer][name]))
      assert same == (name not in ("q", "down")), (layer, name)
  np.testing.assert_array_equal(merged["embed"]["embedding"], base["embed"]["embedding"])


def test_bad_lora_options_name_the_field():
  with pytest.raises(ValueError, match=r"lora.targets=\('c_attn',\).*names no layer"):
    lora.LoraConfig(rank=4, targets=("c_attn",))
  with pytest.raises(ValueError, match=r"lora.targets.*embed"):
    lora.LoraConfig(rank=4, targets=("q", "embed"))
  with pytest.raises(ValueError, match="lora.dropout=0.1"):
    lora.LoraConfig(rank=4, dropout=0.1)
  with pytest.raises(ValueError, match="lora.rank=-1"):
    lora.LoraConfig(rank=-1)
  cfg = tfm.preset("tiny")
  with pytest.raises(ValueError, match="--merge: lora.rank=0"):
    lora.save_merged("/nonexistent", cfg, None, None, lora.LoraConfig())


# ----------------------------------------------------------------------------- PEFT files


def test_peft_round_trip_and_bad_adapters(tmp_path):
  cfg, base, adapters = model_and_adapters(dtype="float32", qkv_bias=True)
  lora.save_peft(str(tmp_path / "a"), cfg, LORA, adapters, family="qwen2")
  got_cfg, got = lora.load_peft(str(tmp_path / "a"), cfg, LORA, family="qwen2")
  assert got_cfg == LORA
  jax.tree.map(np.testing.assert_array_equal, got, adapters)
  names = set(safetensors.numpy.load_file(str(tmp_path / "a" / lora.WEIGHTS_FILE)))
  assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in names
  with pytest.raises(ValueError, match=r"adapter_config.json: r=4 but lora.rank=8"):
    lora.load_peft(str(tmp_path / "a"), cfg, lora.LoraConfig(rank=8, alpha=8.0))
  # the same adapter on a wider model: a tensor's shape names the mismatch
  wide = tfm.preset("tiny", d_model=48, qkv_bias=True)
  with pytest.raises(
    ValueError,
    match=r"q_proj.lora_A.weight has shape \(4, 32\), expected "
    r"\(4, 48\)",
  ):
    lora.load_peft(str(tmp_path / "a"), wide)
  # a GPT-2 adapter: module names of another architecture
  config = json.load(open(tmp_path / "a" / lora.CONFIG_FILE))
  config["target_modules"] = ["c_attn"]
  os.makedirs(tmp_path / "gpt2")
  json.dump(config, open(tmp_path / "gpt2" / lora.CONFIG_FILE, "w"))
  with pytest.raises(
    ValueError,
    match=r"adapter_config.json: target_modules \['c_attn'\] "
    "name no layer",
  ):
    lora.load_peft(str(tmp_path / "gpt2"), cfg)
  tensors = safetensors.numpy.load_file(str(tmp_path / "a" / lora.WEIGHTS_FILE))
  tensors["base_model.model.transformer.h.0.attn.c_attn.lora_A.weight"] = np.zeros((4, 32))
  safetensors.numpy.save_file(tensors, str(tmp_path / "a" / lora.WEIGHTS_FILE))
  with pytest.raises(ValueError, match="adapter_model.safetensors: unexpected tensors"):
    lora.load_peft(str(tmp_path / "a"), cfg)
  with pytest.raises(ValueError, match="adapter_config.json: missing"):
    lora.load_peft(str(tmp_path / "nothing"), cfg)


torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_peft_loads_our_adapter_same_logits(tmp_path, family):
  """Our adapter on transformers' model through peft == our merged model (float32); and
  `--merge`'s full checkpoint gives the same logits in transformers."""
  cfg, base, adapters = model_and_adapters(
    dtype="float32",
    qkv_bias=family == "qwen2",
    lora_cfg=lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down")),
  )
  lora_cfg = lora.LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "o", "up", "down"))
  hf.save(str(tmp_path / "base"), cfg, base, family=family)
  lora.save_peft(str(tmp_path / "adapter"), cfg, lora_cfg, adapters, family=family)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "base"), attn_implementation="eager"
  )
  model = peft.PeftModel.from_pretrained(model, str(tmp_path / "adapter")).eval()
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    plain = model.get_base_model()
    with model.disable_adapter():
      base_ref = plain(input_ids=torch.tensor(tokens)).logits.numpy()
  logits = lambda p: np.asarray(
    jax.jit(lambda p, t: tfm.logits(p, cfg, tfm.forward(p, cfg, t, jnp.ones(t.shape, bool))))(
      p, jnp.asarray(tokens)
    )
  )
  ours = logits(lora.merge(base, adapters, lora_cfg))
  assert np.abs(ours - logits(base)).max() > 1e-2  # the adapter changes the logits
  np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(logits(base), base_ref, rtol=1e-4, atol=1e-4)
  # --merge: full weights that transformers loads as the adapted model
  lora.save_merged(str(tmp_path / "merged"), cfg, base, adapters, lora_cfg, family=family)
  merged = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "merged"), attn_implementation="eager"
  )
  with torch.no_grad():
    np.testing.assert_allclose(
      merged(input_ids=torch.tensor(tokens)).logits.numpy(), ref, rtol=1e-4, atol=1e-4
    )


def test_import_a_peft_adapter_to_continue_training(tmp_path):
  """An adapter peft wrote (its own init, its own names) loads as ours; a step trains it."""
  cfg = tfm.preset("tiny")
  base = tfm.init_params(cfg, jax.random.key(0))
  hf.save(str(tmp_path / "base"), cfg, base, family="llama")
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
  peft_cfg = peft.LoraConfig(
    r=4, lora_alpha=16, target_modules=["q_proj", "k_proj", "gate_proj"], init_lora_weights=False
  )  # random B: not the base
  pm = peft.get_peft_model(model, peft_cfg)
  pm.save_pretrained(str(tmp_path / "adapter"))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 7))
  with torch.no_grad():
    ref = pm.eval()(input_ids=torch.tensor(tokens)).logits.numpy()
  lora_cfg, adapters = lora.load_peft(str(tmp_path / "adapter"), cfg)
  assert (lora_cfg.rank, lora_cfg.alpha, lora_cfg.targets) == (4, 16.0, ("q", "k", "gate"))
  merged = lora.merge(base, adapters, lora_cfg)
  ours = tfm.logits(
    merged, cfg, tfm.forward(merged, cfg, jnp.asarray(tokens), jnp.ones(tokens.shape, bool))
  )
  np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4)
  batch = make_batch(1, B=1, R=2, P=5, T=3)
  loss, _, grads = jax.jit(
    lambda a: lora_loss_and_grad(base, a, batch, cfg, losses.LossConfig(name="grpo"), lora_cfg)
  )(adapters)
  assert np.isfinite(float(loss)) and optax.tree.norm(grads) > 0


def test_merge_command(tmp_path):
  cfg, base, adapters = model_and_adapters(dtype="float32")
  hf.save(
    str(tmp_path / "base"),
    cfg,
    base,
    family="llama",
    extra_config=dict(eos_token_id=2, bos_token_id=1),
  )
  lora.save_peft(str(tmp_path / "adapter"), cfg, LORA, adapters, family="llama")
  lora.main(
    [
      f"--base={tmp_path / 'base'}",
      f"--adapter={tmp_path / 'adapter'}",
      "--merge",
      f"--out={tmp_path / 'merged'}",
    ]
  )
  merged_cfg, merged = hf.load(str(tmp_path / "merged"))
  want = lora.merge(base, adapters, LORA)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), merged, want)
  assert hf.read_config(str(tmp_path / "merged"))["eos_token_id"] == 2
  with pytest.raises(ValueError, match="--merge: lora.rank=0"):
    lora.main([f"--base={tmp_path / 'base'}", "--merge", f"--out={tmp_path / 'x'}"])


def test_memory_table_takes_a_later_inputs_row_and_the_speedups(tmp_path):
  """experiments/lora_memory.py --what=table: a row measured again replaces the earlier one;
  the speedup is naive / replay per method."""
  import json as json_lib
  import subprocess
  import sys

  mem = lambda method, total, **kw: dict(
    experiment="lora_memory",
    preset="large",
    P=32768,
    R=16,
    T=128,
    B=1,
    method=method,
    mode="replay",
    rank=16,
    n_params=10,
    trainable_params=10,
    frozen_base_bytes=0,
    trainable_bytes=40,
    optimizer_bytes=80,
    trainable_state_bytes=kw.get("state", 160),
    argument_bytes=0,
    temp_bytes=total,
    output_bytes=0,
    alias_bytes=0,
    compiled_total_bytes=total,
  )
  speed = lambda method, mode, cpu: dict(
    experiment="lora_speed",
    preset="small",
    P=2048,
    R=16,
    T=128,
    method=method,
    mode=mode,
    cpu_s=cpu,
    wall_s=cpu,
  )
  old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
  old.write_text(json_lib.dumps(mem("full", 2**20)) + "\n")
  new.write_text(
    "\n".join(
      json_lib.dumps(r)
      for r in [
        mem("full", 3 * 2**20),
        mem("lora", 2**20, state=16),
        speed("full", "replay", 2.0),
        speed("full", "naive", 20.0),
        speed("lora", "replay", 2.0),
        speed("lora", "naive", 18.0),
      ]
    )
    + "\n"
  )
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  table = subprocess.run(  # a subprocess: the experiments' absl flags share names
    [
      sys.executable,
      os.path.join(root, "experiments", "lora_memory.py"),
      "--what=table",
      f"--inputs={old},{new}",
    ],
    capture_output=True,
    text=True,
    check=True,
    cwd=root,
  ).stdout
  rows = [line for line in table.splitlines() if line.startswith("| large")]
  assert len(rows) == 2 and "| 3.0 |" in rows[0] and "| 10.00% |" in rows[1]
  assert "| 10.00x |" in table and "| 9.00x |" in table
