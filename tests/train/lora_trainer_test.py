"""LoRA in the trainer (lora.rank > 0): the step's adapter gradients equal the naive twin
(tests/oracles.py over the adapters) in float64; a run trains the adapters alone (base bitwise unchanged,
optimizer state and checkpoints adapters-only), samples from the merged weights, scores the KL
reference with the base, resumes bitwise, and exports a PEFT adapter that peft loads."""

import dataclasses

import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl import app

import run
from branch_replay.core import losses, sampler, sharding
from branch_replay.train import runtime, steps, trainer
from branch_replay.data import tasks
from branch_replay import rollout
from branch_replay.train import state as train_state
from branch_replay.config import Config, apply_overrides
from branch_replay.data.tokenizer import TOKENIZER
from models import hf
from models import lora as lora_lib
from models import transformer as tfm
from helpers import make_batch, max_rel_err
from oracles import flat_naive_loss_and_grad


def lora_cfg(*overrides, **model):
  return apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size, **model)),
    [
      "task.prompt_len=16",
      "task.n_keys=2",
      "train.sft_steps=0",
      "train.rl_steps=2",
      "train.batch_size=2",
      "train.n_branches=2",
      "sampler.max_new_tokens=4",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "train.tensorboard=false",
      "train.checkpoint_every=1",
      "lora.rank=4",
      "lora.targets=q,v,o,down",
      "loss.kl_coef=0.05",
      *overrides,
    ],
  )


def _randomized(adapters, seed=2, scale=0.2):
  """B = 0 at init makes the adapted model the base: give every leaf values."""
  keys = iter(jax.random.split(jax.random.key(seed), 64))
  return jax.tree.map(
    lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), adapters
  )


@pytest.mark.parametrize("mode", ["replay", pytest.param("naive", marks=pytest.mark.slow)])
def test_trainer_lora_grads_equal_the_naive_twin_float64(mode):
  with jax.enable_x64(True):
    cfg = lora_cfg(f"replay.mode={mode}", "loss.kl_coef=0", dtype="float64", param_dtype="float64")
    state = train_state.init_state(cfg)
    assert state.ref_params is None and state.base is not None
    assert jax.tree.structure(state.params) == jax.tree.structure(
      jax.tree.map(
        lambda _: 0,
        lora_lib.adapter_shapes(cfg.model, cfg.lora),
        is_leaf=lambda x: isinstance(x, tuple),
      )
    )
    adapters = _randomized(state.params)
    batch = make_batch(3, B=2, R=2, P=6, T=4, vocab=cfg.model.vocab_size, dtype=jnp.float64)
    loss_cfg = steps.rl_loss_config(cfg)
    step = jax.jit(
      lambda a, b: steps.loss_and_grad(cfg, a, b, loss_cfg, None, steps.lora_params_fn(cfg, state))
    )
    loss, _, grads = step(adapters, batch)
    want_loss, _, want = jax.jit(
      lambda a, b: flat_naive_loss_and_grad(
        a, b, cfg.model, loss_cfg, steps.lora_params_fn(cfg, state)
      )
    )(adapters, batch)
    assert abs(float(loss) - float(want_loss)) <= 1e-10 * max(abs(float(want_loss)), 1e-3)
    assert jax.tree.structure(grads) == jax.tree.structure(adapters)
    assert max_rel_err(grads, want) < 1e-10
    assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want)) > 1e-6


def test_lora_run_trains_adapters_resumes_and_exports_peft(tmp_path):
  # one warm-up step: its gradient reaches every adapter whatever the sampled rewards (two
  # RL steps of 2 x 2 branches can draw all-equal rewards, hence zero advantages)
  cfg = lora_cfg("train.sft_steps=1", "train.sft_batch_size=2")
  base0 = jax.tree.map(np.asarray, train_state.init_state(cfg).base)  # what the run starts from
  full = trainer.run(cfg, str(tmp_path / "full"))
  # the base is bitwise the init; the adapters moved (B left 0)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, full["base_params"]), base0)
  adapters = jax.tree.map(np.asarray, full["final_params"])
  assert all(np.abs(t["b"]).max() > 0 for layer in adapters.values() for t in layer.values())
  # checkpoints: adapters, their optimizer state, step and rng; no base, no reference copy
  restored = ocp.StandardCheckpointer().restore(
    str(tmp_path / "full" / "checkpoints" / "2" / "default")
  )
  assert sorted(restored) == ["opt_state", "params", "rng", "step"]
  adapter_shapes = {x.shape for x in jax.tree.leaves(adapters)}
  big = [x.shape for x in jax.tree.leaves(restored["opt_state"]) if np.ndim(x)]
  assert big and set(big) <= adapter_shapes  # AdamW moments of adapter leaves only
  assert len(big) == 2 * len(jax.tree.leaves(adapters))
  # resume: 1 step, then the same command to 2 steps == the uninterrupted run, bitwise
  part = str(tmp_path / "part")
  trainer.run(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, rl_steps=1)), part)
  resumed = trainer.run(cfg, part)
  jax.tree.map(
    np.testing.assert_array_equal, jax.tree.map(np.asarray, resumed["final_params"]), adapters
  )
  # the PEFT export: our loader gives back the adapters; peft on transformers' model gives
  # the merged model's logits
  _, loaded = lora_lib.load_peft(full["adapter"], cfg.model, cfg.lora)
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), adapters)
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft")
  import torch

  hf.save(str(tmp_path / "base"), cfg.model, base0)
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(tmp_path / "base"), attn_implementation="eager"
  )
  model = peft.PeftModel.from_pretrained(model, full["adapter"]).eval()
  tokens = np.random.default_rng(0).integers(0, TOKENIZER.vocab_size, (2, 9))
  with torch.no_grad():
    ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
  merged = lora_lib.merge(base0, loaded, cfg.lora)
  ours = tfm.logits(
    merged,
    cfg.model,
    tfm.forward(merged, cfg.model, jnp.asarray(tokens), jnp.ones(tokens.shape, bool)),
  )
  np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4)


def test_lora_samples_merged_weights_and_scores_kl_against_the_base():
  """rl_batch samples from base + adapters and takes the reference log-probs from the base
  (no copy of the weights in the state)."""
  cfg = lora_cfg()
  state = train_state.init_state(cfg)
  assert state.ref_params is None
  state = state.replace(params=_randomized(state.params, scale=0.5))
  merged = lora_lib.merge(state.base, state.params, cfg.lora)
  rt = runtime.Runtime(cfg, TOKENIZER)
  fns = rt.fns(TOKENIZER.eos_id)
  sampled_with = []
  sample = fns.sample

  def spy(params, **kwargs):
    sampled_with.append(params)
    return sample(params, **kwargs)

  score_fn = fns.score

  def slow_score(params, **kwargs):  # the reference's forward, 2 s longer
    time.sleep(2.0)
    return score_fn(params, **kwargs)

  fns = fns._replace(sample=spy, score=slow_score)
  task = tasks.make(cfg.task, TOKENIZER)
  batch, _, stats = rollout.rl_batch(fns, state, task, rt, 0)
  # the reference's forward is timed as ref_logp_s alone, not again inside assemble_s
  assert stats["time/ref_logp_s"] >= 2.0 and stats["time/assemble_s"] < 2.0
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), sampled_with[0], merged
  )
  score = lambda p: np.asarray(
    sampler.score(p, cfg.model, batch, temperature=cfg.sampler.temperature)[0]
  )
  np.testing.assert_allclose(
    np.asarray(batch.leaves.ref_logp_BRT), score(state.base), rtol=1e-5, atol=1e-5
  )
  assert np.abs(score(merged) - score(state.base)).max() > 1e-3  # the policy differs


def test_lora_config_and_flags_refuse_bad_input(tmp_path):
  assert lora_cfg("lora.targets=q, gate").lora.targets == ("q", "gate")
  with pytest.raises(ValueError, match=r"lora.rank=-1: expected an int >= 0"):
    lora_cfg("lora.rank=-1")
  with pytest.raises(ValueError, match=r"lora.targets=\('qkv',\)"):
    lora_cfg("lora.targets=qkv")
  with pytest.raises(
    ValueError,
    match=r"lora.targets=.*: \['q', 'v', 'o'\] names no "
    r"layer of this model \(family qwen3_5_text",
  ):
    lora_cfg(layer_types=("linear_attention",) * 2, n_layers=2)
  with pytest.raises(ValueError, match=r"lora.rank=4 with algo.name='ppo'"):
    lora_cfg("algo.name=ppo")
  with pytest.raises(ValueError, match=r"lora.rank=4 with loss.name='dpo'"):
    lora_cfg("algo.name=dpo", "loss.name=dpo")
  assert lora_cfg("lora.rank=0", "algo.name=ppo").lora.enabled is False
  fv, cfg, _, _ = run.parse(["run.py", "--experiment=grpo_arithmetic", "--merge"])
  with pytest.raises(app.UsageError, match=r"--merge: lora.rank=0 \(LoRA off\)"):
    run.lora_options(fv, cfg)
  fv, cfg, _, _ = run.parse(
    ["run.py", "--experiment=grpo_arithmetic", "--set=lora.rank=4", f"--adapter_dir={tmp_path}"]
  )
  with pytest.raises(app.UsageError, match=r"adapter_config.json: missing"):
    run.lora_options(fv, cfg)


@pytest.mark.parametrize(
  "fanouts, mesh", [("", "data:2,context:4"), ("2x4", "data:2,context:4"), ("2x4", "")]
)
def test_lora_step_shapes_on_trees_and_a_mesh(fanouts, mesh):
  """The tree and mesh paths take params_fn: traced, the step returns adapter-shaped params
  and optimizer state; on a mesh the base keeps the parameter shardings (compile-free). The
  values on trees and a mesh: tests/core/lora_tree_test.py."""
  extra = (
    [
      "train.n_branches=8",
      f"tree.fanouts={fanouts}",
      "task.name=tree_haystack",
      "task.sft_prompt_len=12",
    ]
    if fanouts
    else ["train.n_branches=4"]
  )
  cfg = lora_cfg(f"mesh={mesh}", *extra)
  rt = runtime.Runtime(cfg, TOKENIZER)
  state = jax.eval_shape(rt.init_state)
  if mesh:
    shardings = rt.shardings(state, "state")
    assert shardings.base == sharding.param_shardings(rt.mesh, cfg.model)
    assert all(s == sharding.replicated(rt.mesh) for s in jax.tree.leaves(shardings.params))
  if fanouts:
    from helpers import make_tree

    batch = make_tree(4, (2, 4), B=2, P=8, T=(4, 4), vocab=cfg.model.vocab_size, dtype=jnp.float32)
  else:
    batch = make_batch(4, B=2, R=4, P=8, T=4, vocab=cfg.model.vocab_size)
  new_state, out = jax.eval_shape(
    steps.make_train_step(cfg, "rl", losses.LossConfig("pg"), rt.mesh), state, batch
  )
  same = lambda a, b: jax.tree.map(lambda x, y: (x.shape, x.dtype) == (y.shape, y.dtype), a, b)
  assert all(jax.tree.leaves(same(new_state.params, state.params)))
  assert all(jax.tree.leaves(same(new_state.base, state.base)))
  assert set(out) >= {"loss/policy", "grad/norm"}


def test_adapter_dir_starts_the_run_from_a_peft_adapter(tmp_path):
  import types

  cfg = lora_cfg()
  start = _randomized(lora_lib.init_adapters(cfg.model, cfg.lora, jax.random.key(5)))
  lora_lib.save_peft(str(tmp_path / "a"), cfg.model, cfg.lora, start)
  fv = types.SimpleNamespace(merge=False, adapter_dir=str(tmp_path / "a"), model_dir=None)
  adapters, _ = run.lora_options(fv, cfg)
  state = train_state.init_state(cfg, init_adapters=adapters)
  jax.tree.map(
    np.testing.assert_array_equal,
    jax.tree.map(np.asarray, state.params),
    jax.tree.map(np.asarray, start),
  )
  with pytest.raises(app.UsageError, match=r"r=4 but lora.rank=8"):
    run.lora_options(fv, dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=8)))


def test_bf16_base_step_matches_the_float32_base_within_bf16_rounding():
  """The trainer's RL step (GRPO with KL: old and reference log-probs, advantages) over a
  frozen bf16 base (model.param_dtype=bfloat16: float32 adapters and AdamW state) against the
  same step over the float32 base it was rounded from, both computing in bf16: the loss and
  metrics within 1%, every adapter gradient leaf within 5% of its scale (bf16 compute rounding
  the base's 2^-9 differences), the updated adapters within 5% of the learning rate where the
  gradient is not ~0 (AdamW's first step moves each element by ~lr * sign(g))."""
  cfg32 = lora_cfg(dtype="bfloat16")
  cfg16 = lora_cfg("model.param_dtype=bfloat16", dtype="bfloat16")
  state32 = train_state.init_state(cfg32)
  base16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state32.base)
  state16 = train_state.init_state(cfg16, base16)
  for state in (state32, state16):
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in jax.tree.leaves(state.opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(state16.base)} == {jnp.dtype(jnp.bfloat16)}
  adapters = _randomized(state32.params)
  batch = make_batch(4, B=2, R=2, P=6, T=4, vocab=cfg32.model.vocab_size, logps=True)
  outs = {}
  for name, cfg, state in (("f32", cfg32, state32), ("bf16", cfg16, state16)):
    state = state.replace(params=adapters)
    _, _, grads = jax.jit(
      lambda a, b: steps.loss_and_grad(
        cfg, a, b, steps.rl_loss_config(cfg), None, steps.lora_params_fn(cfg, state)
      )
    )(adapters, batch)
    new, metrics = jax.jit(steps.make_train_step(cfg))(state, batch)
    outs[name] = grads, new.params, metrics
  (g32, p32, m32), (g16, p16, m16) = outs["f32"], outs["bf16"]
  for key in ("loss/policy", "kl", "grad/norm", "logp/mean"):
    np.testing.assert_allclose(float(m16[key]), float(m32[key]), rtol=1e-2, err_msg=key)
  assert max_rel_err(g16, g32) < 5e-2
  lr = cfg32.train.learning_rate
  moved = max(
    jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), p32, adapters))
  )
  assert moved > 0.5 * lr
  # AdamW's first step moves each element by ~lr * sign(g): where the gradient is not
  # ~0 (>= 10% of its leaf's scale; near 0 its sign is rounding's) both steps agree
  diff = jax.tree.map(
    lambda a, b, g: float(jnp.where(jnp.abs(g) >= 0.1 * jnp.abs(g).max(), a - b, 0).max()),
    p16,
    p32,
    g32,
  )
  assert max(jax.tree.leaves(diff)) < 5e-2 * lr


def test_bf16_masters_without_lora_are_refused_by_name():
  with pytest.raises(ValueError, match=r"model.param_dtype='bfloat16' with lora.rank=0"):
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size, param_dtype="bfloat16"))
  with pytest.raises(ValueError, match=r"model.param_dtype='bfloat16' with lora.rank=0"):
    lora_cfg("lora.rank=0", "model.param_dtype=bfloat16")
  assert lora_cfg("model.param_dtype=bfloat16").model.param_dtype == "bfloat16"
  cfg = lora_cfg("model.param_dtype=bfloat16")
  f16 = jax.tree.map(
    lambda x: jnp.zeros(x, jnp.float16),
    lora_lib.adapter_shapes(cfg.model, cfg.lora),
    is_leaf=lambda x: isinstance(x, tuple),
  )
  with pytest.raises(ValueError, match=r"init_adapters: dtype float16, expected float32"):
    train_state.init_state(cfg, init_adapters=f16)
