"""train/steps.py: the RL objective scores at the sampler's temperature; the train step's loss,
metrics, gradients and update are those of jax.value_and_grad of the flat naive loss
(tests/oracles.py) followed by the configured optimizer, in float64 (RL and the warm-up's
-log p); compile_key resets exactly the fields no compiled function reads, so two runs that
differ only there share their functions and any other field parts them; build_fns' greedy
decoder is the sampler at temperature 0 with one branch."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from branch_replay.core import engine, losses, sampler
from branch_replay.data import supervised, tasks
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.train import steps
from branch_replay.train import state as train_state
from helpers import make_batch, short_tree_run, tiny_model, tiny_run
from oracles import flat_naive_loss_and_grad


class _Stop(Exception):
  pass


# ----------------------------------------------------------------------------- the objective


def test_tree_step_scores_at_the_sampler_temperature(monkeypatch):
  """(Moved from trainer_test.py.)"""
  cfg = short_tree_run("sampler.temperature=0.7")
  seen = []

  def spy(params, batch, model_cfg, loss_cfg, *args, **kwargs):
    seen.append(loss_cfg)
    raise _Stop

  monkeypatch.setattr(engine, "loss_and_grad", spy)
  task = tasks.make(cfg.task)
  batch = supervised.warmup_batch(
    task, np.random.default_rng(0), cfg.train.sft_batch_size, TOKENIZER
  )
  state = jax.eval_shape(lambda: train_state.init_state(cfg))
  with pytest.raises(_Stop):
    jax.eval_shape(steps.make_train_step(cfg, "rl"), state, batch)
  assert seen[0] == steps.rl_loss_config(cfg) and seen[0].temperature == 0.7


def test_rl_loss_config_is_the_configs_loss_at_the_sampler_temperature():
  cfg = tiny_run(
    "loss.name=grpo",
    "loss.kl_coef=0.05",
    "loss.epsilon=0.3",
    "loss.aggregation=seq_mean",
    "sampler.temperature=0.6",
  )
  got = steps.rl_loss_config(cfg)
  assert got == losses.LossConfig(
    name="grpo", aggregation="seq_mean", epsilon=0.3, kl_coef=0.05, temperature=0.6
  )
  assert cfg.loss.temperature == 1.0  # the config itself is left as it is
  assert steps.SFT_LOSS == losses.LossConfig(name="pg", aggregation="token_mean", temperature=1.0)


# ----------------------------------------------------------------------------- the step


@pytest.mark.parametrize("phase", ["rl", "sft"])
def test_train_step_is_value_and_grad_of_the_naive_loss_then_the_optimizer_float64(x64, phase):
  """One step on a tiny float64 model and a flat batch with off-policy and reference
  log-probs, a trunk and ragged tails: the loss and every metric equal the oracle's (each
  branch its own sequence) at 1e-10; the optimizer state and the parameters after the step
  are the configured optimizer's update with the oracle's gradients (AdamW's first moment
  is 0.1 x the clipped gradient: the gradients themselves, to 1e-10). RL scores at the
  sampler's temperature with the configured objective and streams branch chunks; the
  warm-up is -mean log p at temperature 1."""
  cfg = tiny_run(
    "sampler.temperature=0.7",
    "loss.kl_coef=0.05",
    "loss.epsilon=0.1",
    "replay.branch_chunk=2",
    "train.learning_rate=0.01",
    "train.sft_learning_rate=0.02",
    "train.weight_decay=0.1",
    dtype="float64",
    param_dtype="float64",
  )
  model_cfg, params = tiny_model()
  assert model_cfg == cfg.model
  loss_cfg = (
    losses.LossConfig(name="grpo", kl_coef=0.05, epsilon=0.1, temperature=0.7)
    if phase == "rl"
    else losses.LossConfig(name="pg", aggregation="token_mean")
  )
  batch = make_batch(3, B=2, R=4, P=6, T=4, W=1, vocab=128, logps=True, dtype=jnp.float64)
  tx = train_state.make_optimizer(cfg)
  key = jax.random.key_data(jax.random.key(0))
  state = train_state.TrainState(params, tx.init(params), jnp.asarray(3, jnp.int32), key)
  new, metrics = jax.jit(steps.make_train_step(cfg, phase))(state, batch)

  loss, aux, grads = jax.jit(lambda p, b: flat_naive_loss_and_grad(p, b, cfg.model, loss_cfg))(
    params, batch
  )
  updates, opt_state = tx.update(grads, tx.init(params), params)
  tokens, scored = aux["tokens"].sum(), aux["scored_tokens"].sum()
  want = {
    "loss/policy": loss,
    "grad/norm": optax.tree.norm(grads),
    "kl": aux["kl_sum"].sum() / tokens,
    "entropy": aux["entropy_sum"].sum() / tokens,
    "logp/mean": aux["logp_sum"].sum() / tokens,
    "clip_frac": aux["clip_sum"].sum() / scored,
    "approx_kl": aux["approx_kl_sum"].sum() / scored,
    "ratio/max": aux["ratio_max"].max(),
  }
  assert set(metrics) == set(want)
  for name, value in want.items():
    np.testing.assert_allclose(metrics[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
  if phase == "rl":  # the off-policy batch exercises the clip and the KL
    assert 0 < float(metrics["clip_frac"]) < 1 and float(metrics["kl"]) > 0
  assert float(metrics["grad/norm"]) > 1.0  # the clip (grad_clip=1) binds
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
  jax.tree.map(close, new.opt_state, opt_state)
  jax.tree.map(close, new.params, optax.apply_updates(params, updates))
  assert int(new.step) == int(state.step) + 1
  np.testing.assert_array_equal(new.rng, state.rng)


# ----------------------------------------------------------------------------- compile_key

# Fields that no compiled function reads (compile_key resets them), each with another value.
UNREAD = {
  "train.seed": "train.seed=7",
  "train.rl_steps": "train.rl_steps=9",
  "train.checkpoint_every": "train.checkpoint_every=3",
  "train.keep_checkpoints": "train.keep_checkpoints=5",
  "train.eval_size": "train.eval_size=4",
  "train.progress": "train.progress=true",
  "train.plot": "train.plot=true",
  "train.tensorboard": "train.tensorboard=true",
  "replay.auto_tree": "replay.auto_tree=true",
}
# Fields that shape a compiled function (the optimizer, the objective, the sampler, the model).
READ = [
  "train.learning_rate=0.02",
  "train.sft_learning_rate=0.02",
  "train.sft_steps=3",  # when the warm-up's rate ends
  "train.grad_clip=0.5",
  "train.weight_decay=0.1",
  "train.n_branches=4",
  "sampler.temperature=0.5",
  "sampler.max_new_tokens=3",
  "loss.kl_coef=0.05",
  "replay.mode=naive",
  "replay.branch_chunk=2",
  "model.d_model=64",
]


BASE = ("train.n_branches=8", "train.tensorboard=false")  # (QUIET turns progress, plot off)


def test_compile_key_resets_the_fields_no_compiled_function_reads():
  """Two configs that differ only in those fields share one key (one set of compiled
  functions, runtime.Runtime.fns); every other field is kept."""
  base = tiny_run(*BASE)
  key = steps.compile_key(base)
  hash(key)  # a cache key
  assert steps.compile_key(key) == key
  changed = tiny_run(*BASE, *UNREAD.values())
  for field, override in UNREAD.items():
    section, name = field.split(".")
    assert getattr(getattr(changed, section), name) != getattr(getattr(base, section), name), field
    assert steps.compile_key(tiny_run(*BASE, override)) == key, field
  assert steps.compile_key(changed) == key
  # what compile_key resets: the fields above and nothing else
  differ = lambda a, b: {
    f"{s}.{f.name}"
    for s in ("train", "replay")
    for f in dataclasses.fields(getattr(a, s))
    if getattr(getattr(a, s), f.name) != getattr(getattr(b, s), f.name)
  }
  assert differ(changed, steps.compile_key(changed)) == set(UNREAD)
  assert {s: getattr(key, s) for s in ("model", "loss", "sampler", "task", "algo", "tree")} == {
    s: getattr(base, s) for s in ("model", "loss", "sampler", "task", "algo", "tree")
  }
  for override in READ:
    assert steps.compile_key(tiny_run(*BASE, override)) != key, override


def test_the_fields_compile_key_resets_leave_the_train_steps_unchanged():
  """The traced RL and warm-up steps of a config and of the same config with every field
  compile_key resets changed are the same program (were the optimizer to read rl_steps, say,
  a cached step would train another run with this one's schedule)."""
  batch = make_batch(0, B=2, R=2, P=5, T=3)
  traced = {}
  for name, cfg in (
    ("base", tiny_run("train.sft_steps=2")),
    ("changed", tiny_run("train.sft_steps=2", *UNREAD.values())),
    ("other", tiny_run("train.sft_steps=3")),  # a field that is read: the check can fail
  ):
    state = train_state.abstract_state(cfg)
    traced[name] = [
      str(jax.make_jaxpr(steps.make_train_step(cfg, phase))(state, batch))
      for phase in ("rl", "sft")
    ]
  assert traced["changed"] == traced["base"]
  assert traced["other"] != traced["base"]


# ----------------------------------------------------------------------------- build_fns


def _partial(fn):
  return fn.__wrapped__  # jax.jit keeps the function it wraps


def test_build_fns_greedy_is_the_sampler_at_temperature_zero_with_one_branch():
  """Flat: the sampler with the run's sampler config and n_branches, the greedy decoder at
  temperature 0 with one branch, the same length and trunk; the stop id as a tuple. Trees:
  one greedy path down the fan-outs. Built per call (runtime.Runtime.fns caches them)."""
  cfg = tiny_run("sampler.temperature=0.7", "sampler.trunk_len=2", "train.n_branches=4")
  fns = steps.build_fns(cfg, 5)
  sample, greedy = _partial(fns.sample), _partial(fns.greedy)
  assert sample.func is greedy.func is sampler.sample
  assert sample.keywords == dict(
    model_cfg=cfg.model, stop_tokens=(5,), cfg=cfg.sampler, n_branches=4
  )
  assert greedy.keywords == dict(
    model_cfg=cfg.model,
    stop_tokens=(5,),
    cfg=sampler.SamplerConfig(
      max_new_tokens=cfg.sampler.max_new_tokens, temperature=0.0, trunk_len=2
    ),
    n_branches=1,
  )
  assert _partial(steps.build_fns(cfg, [5, 6]).sample).keywords["stop_tokens"] == (5, 6)
  assert steps.build_fns(cfg, 5).sample is not fns.sample
  tree_cfg = short_tree_run("sampler.temperature=0.7")
  fns = steps.build_fns(tree_cfg, ((5,), (6,)), (3, 4))
  sample, greedy = _partial(fns.sample), _partial(fns.greedy)
  assert sample.func is greedy.func is sampler.sample_tree
  assert sample.keywords["fanouts"] == (2, 2) and sample.keywords["cfg"] == tree_cfg.sampler
  assert greedy.keywords["fanouts"] == (1, 1)
  assert greedy.keywords["cfg"] == sampler.SamplerConfig(temperature=0.0)
  assert sample.keywords["lengths"] == greedy.keywords["lengths"] == (3, 4)
  assert greedy.keywords["stop_tokens"] == ((5,), (6,))
