"""train/state.py: the optimizers are clip-by-global-norm then AdamW (b1 0.9, b2 0.99) at the
configured rates, the warm-up's rate for train.sft_steps updates; init_state builds what
abstract_state says, from train.seed or the given weights, and refuses weights or adapters
that do not fit the config by field; the mesh object must agree with the config's `mesh`;
the weights sampling runs are those the LoRA step trains; the KL reference, the checkpointed
dict, where state and batches live, the resumable data stream and the NaN stop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import sharding
from branch_replay.core.tree import TreeBatch
from branch_replay.train import runtime, steps
from branch_replay.train import state as train_state
from helpers import make_batch, tiny_run
from models import lora as lora_lib
from models import transformer as tfm

LORA = ("lora.rank=4", "lora.targets=q,v")


def _shapes(tree):
  return jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)


# ----------------------------------------------------------------------------- optimizers


def _adamw_numpy(params, grads_seq, lrs, clip, weight_decay, b1=0.9, b2=0.99, eps=1e-8):
  """Clip by the global norm, then AdamW (bias-corrected moments, decoupled decay), in
  float64 numpy: the parameters after each update."""
  p = {k: np.array(v, np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v = {k: np.zeros_like(x) for k, x in p.items()}
  out = []
  for t, (g, lr) in enumerate(zip(grads_seq, lrs), 1):
    norm = np.sqrt(sum(float(np.sum(np.square(x))) for x in g.values()))
    g = {k: x * min(1.0, clip / norm) for k, x in g.items()}
    for k in p:
      m[k] = b1 * m[k] + (1 - b1) * g[k]
      v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
      step = m[k] / (1 - b1**t) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
      p[k] = p[k] - lr * (step + weight_decay * p[k])
    out.append({k: x.copy() for k, x in p.items()})
  return out


@pytest.mark.parametrize(
  "which",
  [
    "policy",
    "critic",
    "critic_default",  # critic.weight_decay's default 1e-4: the decay it always had
  ],
)
def test_optimizers_clip_then_adamw_at_the_configured_rates(x64, which):
  """Five updates of a two-leaf tree, the gradients' norm above grad_clip on some steps and
  below on others: the policy's optimizer at sft_learning_rate for train.sft_steps=2
  updates, then learning_rate, with train.weight_decay; the critic's at critic.learning_rate
  with critic.weight_decay (1e-4 by default, explicit: the decay it always had)."""
  cfg = tiny_run(
    "train.sft_steps=2",
    "train.sft_learning_rate=0.05",
    "train.learning_rate=0.01",
    "train.weight_decay=0.1",
    "train.grad_clip=0.5",
    *(
      ("algo.name=ppo", "loss.name=ppo", "critic.learning_rate=0.002") if which != "policy" else ()
    ),
    *(("critic.weight_decay=0.05",) if which == "critic" else ()),
  )
  if which == "policy":
    tx, lrs, decay = train_state.make_optimizer(cfg), [0.05, 0.05, 0.01, 0.01, 0.01], 0.1
  else:
    decay = 0.05 if which == "critic" else 1e-4
    tx, lrs = train_state.make_critic_optimizer(cfg), [0.002] * 5
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(3, 2)), "b": rng.normal(size=(2,))}
  grads_seq = [
    {k: s * rng.normal(size=x.shape) for k, x in params.items()} for s in (3, 0.1, 2, 0.05, 1)
  ]
  norms = [np.sqrt(sum(np.sum(x**2) for x in g.values())) for g in grads_seq]
  assert min(norms) < 0.5 < max(norms)  # the clip binds on some steps only
  want = _adamw_numpy(params, grads_seq, lrs, 0.5, decay)
  p = jax.tree.map(jnp.asarray, params)
  opt_state = tx.init(p)
  for g, w in zip(grads_seq, want):
    updates, opt_state = tx.update(jax.tree.map(jnp.asarray, g), opt_state, p)
    p = jax.tree.map(lambda a, u: a + u, p, updates)
    for k in w:
      np.testing.assert_allclose(np.asarray(p[k]), w[k], rtol=1e-12, atol=1e-12, err_msg=k)


# ----------------------------------------------------------------------------- the mesh


def test_a_config_with_a_mesh_and_no_mesh_object_is_refused_by_name():
  """(Moved from runtime_test.py.) Functions given a config with a mesh but no mesh object
  refuse it naming themselves, before any compilation; and the other way round."""
  cfg = tiny_run("mesh=data:2,fsdp:4")
  with pytest.raises(ValueError, match=r"init_state: mesh='data:2,fsdp:4' in the config but no"):
    train_state.init_state(cfg)
  with pytest.raises(ValueError, match=r"make_train_step: mesh='data:2,fsdp:4'.*Runtime"):
    steps.make_train_step(cfg)
  with pytest.raises(ValueError, match=r"shardings: mesh='' in the config but a mesh"):
    train_state.shardings(np.zeros(2), "batch", tiny_run(), runtime.mesh_of("data:8"))


def test_check_mesh_names_the_caller_the_config_and_what_it_was_given():
  mesh = runtime.mesh_of("data:2,fsdp:4")
  with pytest.raises(
    ValueError,
    match=r"^here: mesh='' in the config but a mesh \{'data': 2, 'fsdp': 4, 'tensor': 1, 'context': 1\} "
    r"given; "
    r"expected the run's Runtime\(cfg, tok\).mesh",
  ):
    train_state.check_mesh(tiny_run(), mesh, "here")
  with pytest.raises(ValueError, match=r"^there: mesh='data:2,fsdp:4' in the config but no mesh"):
    train_state.check_mesh(tiny_run("mesh=data:2,fsdp:4"), None, "there")
  train_state.check_mesh(tiny_run(), None, "fine")  # agreeing: silent
  train_state.check_mesh(tiny_run("mesh=data:2,fsdp:4"), mesh, "fine")


def test_shardings_put_lora_adapters_replicated_and_batches_by_prompt():
  """On a mesh the state's params follow param_shardings (the LoRA base too), adapters,
  step and rng are replicated, the KL reference is LoRA's base (no copy to place); a tree
  batch is placed by batch_shardings, any other batch by prompt. Without a mesh: the first
  device, whole."""
  cfg = tiny_run("mesh=data:2,fsdp:4", *LORA, "loss.kl_coef=0.05")
  mesh = runtime.mesh_of(cfg.mesh)
  abstract = train_state.abstract_state(cfg)
  placed = train_state.shardings(abstract, "state", cfg, mesh)
  assert placed.base == sharding.param_shardings(mesh, cfg.model)
  replicated = sharding.replicated(mesh)
  assert set(jax.tree.leaves(placed.params)) == {replicated}
  assert placed.step == placed.rng == replicated and placed.ref_params is None
  full = tiny_run("mesh=data:2,fsdp:4", "loss.kl_coef=0.05")
  placed = train_state.shardings(train_state.abstract_state(full), "state", full, mesh)
  assert placed.params == placed.ref_params == sharding.param_shardings(mesh, full.model)
  assert placed.base is None and placed.critic is None
  batch = make_batch(0, B=8, R=2, P=4, T=3)
  assert isinstance(batch, TreeBatch)
  assert train_state.shardings(batch, "batch", cfg, mesh) == sharding.batch_shardings(mesh, batch)
  prompts = np.zeros((8, 4), np.int32)
  assert train_state.shardings(prompts, "batch", cfg, mesh) == sharding.prompt_shardings(
    mesh, prompts
  )
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  assert set(jax.tree.leaves(train_state.shardings(abstract, "state", tiny_run(*LORA)))) == {one}


# ----------------------------------------------------------------------------- init


@pytest.mark.parametrize(
  "overrides, parts",
  [
    ((), ()),
    (("loss.kl_coef=0.05",), ("ref_params",)),
    ((*LORA, "loss.kl_coef=0.05"), ("base",)),  # the KL reference is the base: no copy
    (("algo.name=ppo", "loss.name=ppo"), ("critic",)),
  ],
  ids=["plain", "kl", "lora_kl", "ppo"],
)
def test_init_state_builds_what_abstract_state_says(overrides, parts):
  """The same tree, shapes and dtypes (what an ahead-of-time compile takes is what the run
  allocates); the optional parts exactly where the config asks for them."""
  cfg = tiny_run(*overrides)
  state = train_state.init_state(cfg)
  abstract = train_state.abstract_state(cfg)
  assert jax.tree.structure(state) == jax.tree.structure(abstract)
  assert _shapes(state) == _shapes(abstract)
  for part in ("ref_params", "base", "critic"):
    assert (getattr(state, part) is not None) == (part in parts), part
  assert int(state.step) == 0
  assert jax.tree.structure(state.opt_state) == jax.tree.structure(
    train_state.make_optimizer(cfg).init(state.params)
  )  # the optimizer's state is that of the trained leaves (LoRA: the adapters alone)


def test_init_state_is_the_seeds_and_takes_given_weights_bitwise():
  """The random init is the model's init at train.seed's first key, the rng the second
  (another seed: other weights); given weights are used as they are; with KL the reference
  starts as the policy, a copy."""
  cfg = tiny_run("train.seed=3", "loss.kl_coef=0.05")
  state = train_state.init_state(cfg)
  init_key, rng = jax.random.split(jax.random.key(3))
  init = jax.jit(lambda: tfm.init_params(cfg.model, init_key))()  # (jitted, as init_state)
  jax.tree.map(np.testing.assert_array_equal, state.params, init)
  np.testing.assert_array_equal(state.rng, jax.random.key_data(rng))
  jax.tree.map(np.testing.assert_array_equal, state.ref_params, state.params)
  other = train_state.init_state(tiny_run("train.seed=4"))
  assert not np.array_equal(*(jax.tree.leaves(s.params)[0] for s in (state, other)))
  given = jax.tree.map(lambda x: x + 1, state.params)
  again = train_state.init_state(cfg, given)
  jax.tree.map(np.testing.assert_array_equal, again.params, given)
  jax.tree.map(np.testing.assert_array_equal, again.ref_params, given)
  lora = train_state.init_state(tiny_run("train.seed=3", *LORA), given)
  jax.tree.map(np.testing.assert_array_equal, lora.base, given)  # the frozen base


def test_init_refuses_weights_and_adapters_that_do_not_fit_by_field():
  cfg = tiny_run()
  good = jax.eval_shape(lambda: tfm.init_params(cfg.model, jax.random.key(0)))
  wider = jax.eval_shape(
    lambda: tfm.init_params(tiny_run("model.d_model=64").model, jax.random.key(0))
  )
  f16 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float16), good)
  fewer = {k: v for k, v in good.items() if k != "lm_head"}
  assert len(fewer) == len(good) - 1
  for bad, dtypes in ((wider, "float32"), (f16, "float16"), (fewer, "float32")):
    for build in (train_state.abstract_state, train_state.init_state):
      with pytest.raises(
        ValueError,
        match=r"^init_params: the parameter tree does not match model config .*"
        rf"the params' dtypes \['{dtypes}'\], expected model.param_dtype='float32'",
      ):
        build(cfg, bad)
  assert _shapes(train_state.abstract_state(cfg, good).params) == _shapes(good)
  adapters = lora_lib.init_adapters(tiny_run(*LORA).model, tiny_run(*LORA).lora, jax.random.key(0))
  with pytest.raises(ValueError, match=r"^init_adapters: lora.rank=0 \(LoRA off\)"):
    train_state.abstract_state(cfg, None, adapters)
  with pytest.raises(
    ValueError,
    match=r"^init_adapters: layer_0/q/a has shape \(32, 4\), expected \(32, 8\) \(lora.rank=8",
  ):
    train_state.abstract_state(tiny_run(*LORA, "lora.rank=8"), None, adapters)


# ----------------------------------------------------------------------------- weights


def test_weights_are_the_params_or_the_base_with_the_adapters_the_step_trains(x64):
  """Without LoRA the params themselves; with LoRA the merged weights run the same model as
  the base with the adapters attached (what the train step differentiates,
  steps.lora_params_fn); at init (B = 0) they are the base."""
  cfg = tiny_run(*LORA, dtype="float64", param_dtype="float64")
  state = train_state.init_state(cfg)
  jax.tree.map(np.testing.assert_array_equal, train_state.weights(state, cfg.lora), state.base)
  keys = iter(jax.random.split(jax.random.key(7), 64))
  adapters = jax.tree.map(
    lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), state.params
  )
  state = state.replace(params=adapters)
  merged = train_state.weights(state, cfg.lora)
  assert {x.dtype for x in jax.tree.leaves(merged)} == {jnp.dtype(jnp.float64)}
  tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.model.vocab_size)
  valid = jnp.ones((2, 6), bool)
  h = lambda p: np.asarray(tfm.forward(p, cfg.model, tokens, valid))
  trained = h(steps.lora_params_fn(cfg, state)(adapters))
  np.testing.assert_allclose(h(merged), trained, rtol=1e-10, atol=1e-10)
  assert np.abs(h(state.base) - trained).max() > 1e-3  # the adapters do move the model
  plain = train_state.abstract_state(tiny_run())
  assert train_state.weights(plain, tiny_run().lora) is plain.params


def test_reference_is_the_copy_or_loras_base_and_none_without_kl():
  kl = train_state.abstract_state(tiny_run("loss.kl_coef=0.05"))
  assert train_state.reference(kl, tiny_run("loss.kl_coef=0.05")) is kl.ref_params
  lora_kl = train_state.abstract_state(tiny_run(*LORA, "loss.kl_coef=0.05"))
  assert lora_kl.ref_params is None
  assert train_state.reference(lora_kl, tiny_run(*LORA, "loss.kl_coef=0.05")) is lora_kl.base
  lora = train_state.abstract_state(tiny_run(*LORA))
  assert train_state.reference(lora, tiny_run(*LORA)) is None
  assert train_state.reference(train_state.abstract_state(tiny_run()), tiny_run()) is None


@pytest.mark.parametrize(
  "overrides, keys",
  [
    ((), set()),
    (("loss.kl_coef=0.05",), {"ref_params"}),
    (("algo.name=ppo", "loss.name=ppo"), {"critic"}),
    ((*LORA, "loss.kl_coef=0.05"), set()),
  ],
  ids=["plain", "kl", "ppo", "lora"],
)
def test_state_dict_holds_what_a_resume_cannot_rebuild(overrides, keys):
  """The trained leaves, their optimizer state, step and rng; the KL copy and the critic
  when present; never LoRA's base (it comes from init / --model_dir again)."""
  state = train_state.abstract_state(tiny_run(*overrides))
  d = train_state.state_dict(state)
  assert set(d) == {"params", "opt_state", "step", "rng"} | keys
  for k in d:
    assert d[k] is getattr(state, "critic" if k == "critic" else k)


# ----------------------------------------------------------------------------- data, NaN


class _DrawTask:
  def sample(self, rng):
    return int(rng.integers(1 << 30))


def test_sample_examples_depend_on_the_seed_and_stream_only():
  """A resumed run draws step s's examples again from (seed, s[, round]) alone: the same
  call gives the same examples; another seed, step or round others; n examples are one
  stream's first n."""
  task = _DrawTask()
  draw = train_state.sample_examples
  assert draw(task, 0, 5, 4) == draw(task, 0, 5, 4)
  assert draw(task, 0, 5, 2) == draw(task, 0, 5, 4)[:2]
  others = [draw(task, 1, 5, 4), draw(task, 0, 6, 4), draw(task, 0, (5, 1), 4)]
  assert draw(task, 0, (5, 0), 4) not in others and len({tuple(o) for o in others}) == 3


class _AsyncCheckpointer:
  """A Checkpointer whose save of step 4 is in flight: latest_step says 4 only once waited."""

  directory = "/w/checkpoints"

  def __init__(self, latest):
    self.latest, self.waited = latest, False

  def wait(self):
    self.waited = True

  def latest_step(self):
    return 4 if self.waited and self.latest is not None else self.latest


def test_finite_or_stop_names_the_value_the_step_and_the_last_committed_checkpoint():
  ckpt = _AsyncCheckpointer(2)
  train_state.finite_or_stop({"loss/policy": 1.0, "grad/norm": 3.0, "kl": np.nan}, 5, ckpt)
  assert not ckpt.waited  # finite: nothing to wait for (the kl is not checked)
  with pytest.raises(
    FloatingPointError,
    match=r"^loss/policy is nan at step 5: stopping; the last good checkpoint is step 4 "
    r"in /w/checkpoints$",
  ):
    train_state.finite_or_stop({"loss/policy": np.nan, "grad/norm": 1.0}, 5, ckpt)
  with pytest.raises(
    FloatingPointError, match=r"^grad/norm is inf at step 0: stopping; no checkpoint was written"
  ):
    train_state.finite_or_stop(
      {"loss/policy": 1.0, "grad/norm": np.inf}, 0, _AsyncCheckpointer(None)
    )
