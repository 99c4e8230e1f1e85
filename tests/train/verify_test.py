"""The first-step self-check passes a right engine (flat and tree batches) and stops a
deliberately wrong one, naming the worst gradient leaf and both values."""

import jax
import jax.numpy as jnp
import pytest

from branch_replay.core import engine, losses
from branch_replay.train import verify
from models import lora as lora_lib
from models import transformer as tfm
from helpers import make_batch, make_tree, tiny_model


def test_verify_passes_a_right_engine_and_catches_a_wrong_one(monkeypatch):
  cfg, params = tiny_model(dtype="float32")
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  batch = make_batch(0, B=2, R=3, P=6, T=4, W=1, logps=True, dtype=jnp.float32)
  loss_cfg = losses.LossConfig()
  stats = verify.check(params, batch, cfg, loss_cfg)
  assert stats["verify/max_rel_err"] < verify.tolerance(cfg) and stats["time/verify_s"] > 0
  deep = make_tree(1, (2, 3), W=1, logps=True, dtype=jnp.float32)
  stats = verify.check(params, deep, cfg, loss_cfg)  # the tree engine and its naive twin
  assert stats["verify/max_rel_err"] < verify.tolerance(cfg)

  right = engine._replay

  def wrong(*args, **kwargs):  # a bug in one leaf: the prefix half of its gradient lost
    loss, aux, grads = right(*args, **kwargs)
    grads = {**grads, "layer_0": {**grads["layer_0"], "q": grads["layer_0"]["q"] * 0.9}}
    return loss, aux, grads

  monkeypatch.setattr(engine, "_replay", wrong)
  with pytest.raises(verify.MismatchError) as e:
    verify.check(params, batch, cfg, loss_cfg)
  message = str(e.value)
  assert "['layer_0']['q']" in message and "through replay" in message
  assert "naive twin" in message and "tolerance 0.002" in message


def test_tolerance_follows_the_dtype():
  assert verify.tolerance(tfm.preset("tiny", dtype="float64", param_dtype="float64")) == 1e-8
  # a half-precision run is checked in float32 over its stored weights, at float32's tolerance
  bf16 = tfm.preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
  assert verify.tolerance(bf16) == 2e-3 and verify.check_config(bf16).dtype == "float32"
  assert verify.check_config(bf16).param_dtype == "bfloat16"
  f32 = tfm.preset("tiny", dtype="float32")
  assert verify.check_config(f32) is f32 and verify.tolerance(f32) == 2e-3
  assert verify.enabled("auto", imported=True) and not verify.enabled("auto", imported=False)
  assert verify.enabled("first", imported=False) and not verify.enabled("off", imported=True)
  with pytest.raises(ValueError, match="replay.verify='sometimes'"):
    verify.enabled("sometimes", imported=False)


def test_loss_error_is_absolute_near_zero_and_relative_above_one():
  """A GRPO loss sits near 0 (group-centred advantages): float32 rounding there is no mismatch,
  while a real gap is caught at any size, and a non-finite loss always is."""
  assert verify.loss_error(1.1e-7, 2.4e-7) == pytest.approx(1.3e-7)  # 0.54 relative: passes
  assert verify.loss_error(0.0, 0.1) == pytest.approx(0.1)
  assert verify.loss_error(10.02, 10.0) == pytest.approx(2e-3)
  assert verify.loss_error(float("nan"), 1.0) == float("inf")


def test_a_near_zero_loss_passes_and_a_wrong_loss_stops_the_run(monkeypatch):
  cfg, params = tiny_model(dtype="float32")
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  batch = make_batch(0, B=2, R=3, P=6, T=4, W=1, logps=True, dtype=jnp.float32)
  right = engine._replay
  shift = {"by": 0.0}

  def shifted(*args, **kwargs):  # the loss moved, the gradients right
    loss, aux, grads = right(*args, **kwargs)
    return loss + shift["by"], aux, grads

  monkeypatch.setattr(engine, "_replay", shifted)
  shift["by"] = 1e-6  # float32 rounding's size at a loss of ~0: not a mismatch
  stats = verify.check(params, batch, cfg, losses.LossConfig())
  assert stats["verify/loss_rel_err"] < verify.tolerance(cfg)
  assert stats["verify/loss_replay"] != stats["verify/loss_naive"]
  shift["by"] = 0.05
  with pytest.raises(verify.MismatchError, match="the loss is .* through replay"):
    verify.check(params, batch, cfg, losses.LossConfig())


def test_a_batch_whose_advantages_are_all_zero_has_no_signal():
  """Every advantage zero (equal rewards in every group): the gradient is zero by construction,
  so the trainer defers the check to the next batch; one nonzero advantage is signal, and a
  batch without advantages (DPO pairs) always is."""
  batch = make_batch(0, B=2, R=3, P=6, T=4, W=1, logps=True, dtype=jnp.float32)
  assert verify.has_signal(batch)
  flat = jax.tree.map(jnp.zeros_like, batch)
  assert not verify.has_signal(flat)
  deep = make_tree(1, (2, 3), W=1, logps=True, dtype=jnp.float32)
  assert verify.has_signal(deep) and not verify.has_signal(jax.tree.map(jnp.zeros_like, deep))
  assert verify.has_signal({"chosen_tokens": jnp.zeros((2, 3))})


def test_lora_verify_compares_the_adapters_gradients_over_a_bf16_base(monkeypatch):
  """With LoRA the check differentiates what the train step does (float32 adapters attached to
  a frozen bf16 base): its leaves are the adapters' (a frozen norm's gradient is never judged),
  computed in float32 over the stored bf16 base (the run computes in bf16), where they agree
  within float32's tolerance, and a wrong adapter gradient still stops the run."""
  from branch_replay.config import Config, apply_overrides
  from branch_replay.data.tokenizer import TOKENIZER
  from branch_replay.train import state as train_state
  from branch_replay.train import steps

  cfg = apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size, dtype="bfloat16")),
    ["lora.rank=4", "lora.targets=q,v,o,down", "model.param_dtype=bfloat16", "loss.kl_coef=0.05"],
  )
  state = train_state.init_state(cfg)
  assert {x.dtype for x in jax.tree.leaves(state.base)} == {jnp.dtype(jnp.bfloat16)}
  keys = iter(jax.random.split(jax.random.key(3), 64))
  adapters = jax.tree.map(  # B = 0 at init: give every leaf values so both halves have signal
    lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), state.params
  )
  batch = make_batch(4, B=2, R=3, P=6, T=4, vocab=cfg.model.vocab_size, logps=True)
  loss_cfg = steps.rl_loss_config(cfg)
  stats = verify.check(adapters, batch, cfg.model, loss_cfg, base=state.base, lora=cfg.lora)
  assert stats["verify/max_rel_err"] < verify.tolerance(cfg.model) == 2e-3
  assert stats["verify/worst_leaf"].endswith(("['a']", "['b']"))  # an adapter leaf
  assert stats["verify/dtype"] == "float32"

  # the check computed in float32 over the same bf16 weights: its loss is that engine's (to
  # float32 rounding), not the bf16 engine's
  def naive_loss(model_cfg):
    attach = lambda a: lora_lib.attach(state.base, a, cfg.lora)
    fn = lambda a: engine.loss_and_grad(a, batch, model_cfg, loss_cfg, "naive", params_fn=attach)
    return float(jax.jit(fn)(adapters)[0])

  loss32, loss16 = naive_loss(verify.check_config(cfg.model)), naive_loss(cfg.model)
  assert abs(stats["verify/loss_naive"] - loss32) <= 1e-6 * max(1.0, abs(loss32))
  assert abs(loss16 - loss32) > 10 * abs(stats["verify/loss_naive"] - loss32)

  right = engine._replay

  def wrong(*args, **kwargs):  # half of one adapter's gradient lost
    loss, aux, grads = right(*args, **kwargs)
    q = grads["layer_0"]["q"]
    grads = {**grads, "layer_0": {**grads["layer_0"], "q": {**q, "b": q["b"] * 0.5}}}
    return loss, aux, grads

  monkeypatch.setattr(engine, "_replay", wrong)
  with pytest.raises(
    verify.MismatchError, match=r"\['layer_0'\]\['q'\]\['b'\].*float32 \(the check"
  ):
    verify.check(adapters, batch, cfg.model, loss_cfg, base=state.base, lora=cfg.lora)
  with pytest.raises(ValueError, match="base and lora go together"):
    verify.check(adapters, batch, cfg.model, loss_cfg, base=state.base)
