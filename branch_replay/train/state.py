"""The train state and where it lives: TrainState, the optimizers, init (shapes -> shardings
-> arrays), placement of state and batches, the checkpointed dict, the data stream, the NaN
stop. Public names shared by the trainer and every algorithm."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from branch_replay.train import checkpoint
from branch_replay.core import critic, sharding
from branch_replay.core.tree import TreeBatch
from branch_replay.config import Config
from models import lora as lora_lib
from models import transformer as tfm


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: jax.Array  # int32: steps taken (warm-up included)
  rng: jax.Array  # uint32 raw key data (checkpointable)
  ref_params: Any = None  # the frozen reference policy (only with loss.kl_coef > 0)
  critic: Any = None  # PPO's value model: dict(params, opt_state) (algo.name=ppo);
  # params {'model', 'head'}, or {'head'} alone with critic.share (the body is `params`)
  base: Any = None  # LoRA (lora.rank > 0): the frozen base weights, not checkpointed; then
  # `params` are the adapters, the only trained (and optimized) leaves


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  t = cfg.train
  lr = t.learning_rate
  if t.sft_steps:
    lr = optax.join_schedules(
      [optax.constant_schedule(t.sft_learning_rate), optax.constant_schedule(t.learning_rate)],
      [t.sft_steps],
    )
  return optax.chain(
    optax.clip_by_global_norm(t.grad_clip),
    optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=t.weight_decay),
  )


def make_critic_optimizer(cfg: Config) -> optax.GradientTransformation:
  return optax.chain(
    optax.clip_by_global_norm(cfg.train.grad_clip),
    optax.adamw(cfg.critic.learning_rate, b1=0.9, b2=0.99, weight_decay=cfg.critic.weight_decay),
  )


def check_mesh(cfg: Config, mesh, where: str) -> None:
  """The mesh object a function was given agrees with the config's `mesh` string (a Mesh for a
  non-empty spec, None for ''); the run's is `runtime.Runtime(cfg, tok).mesh`."""
  if bool(cfg.mesh) != (mesh is not None):
    got = "no mesh" if mesh is None else f"a mesh {dict(mesh.shape)}"
    raise ValueError(
      f"{where}: mesh={cfg.mesh!r} in the config but {got} given; expected the run's "
      "Runtime(cfg, tok).mesh (train/runtime.py), None when mesh=''"
    )


def shardings(tree, kind: str, cfg: Config, mesh=None):
  """Where arrays live, kind 'state' or 'batch': the one placement decision of the trainer.
  With a mesh (the run's, `runtime.mesh_of(cfg.mesh)`): FSDP/tensor params and optimizer
  state, batches by prompt and branch (sharding.py); else the first device, whole arrays."""
  check_mesh(cfg, mesh, "shardings")
  if mesh is not None:
    if kind == "state":
      params = sharding.param_shardings(mesh, cfg.model)
      trained = (
        params
        if tree.base is None
        else jax.tree.map(  # LoRA: adapters replicated
          lambda _: sharding.replicated(mesh), tree.params
        )
      )
      return tree.replace(
        params=trained,
        step=sharding.replicated(mesh),
        rng=sharding.replicated(mesh),
        opt_state=sharding.opt_state_shardings(mesh, make_optimizer(cfg), tree.opt_state, trained),
        ref_params=None if tree.ref_params is None else params,
        base=None if tree.base is None else params,
        critic=None if tree.critic is None else _critic_shardings(mesh, tree.critic, cfg),
      )
    if isinstance(tree, critic.CriticBatch):
      return critic.batch_shardings(mesh, tree)
    if isinstance(tree, TreeBatch):
      return sharding.batch_shardings(mesh, tree)
    return sharding.prompt_shardings(mesh, tree)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda _: device, tree)


def _critic_shardings(mesh, value_model, cfg: Config):
  """PPO's value model on the mesh: its transformer and Adam moments like the policy's, the
  head replicated."""
  params = critic.param_shardings(mesh, cfg.model, value_model["params"])
  return dict(
    params=params,
    opt_state=sharding.opt_state_shardings(
      mesh, make_critic_optimizer(cfg), value_model["opt_state"], params
    ),
  )


def place(tree, kind: str, cfg: Config, mesh=None):
  """`tree` where `shardings` puts it (`runtime.Runtime.put` with the run's mesh)."""
  if mesh is not None:  # host data -> global arrays, on one process or several
    return sharding.put(tree, shardings(tree, kind, cfg, mesh))
  return jax.device_put(tree, shardings(tree, kind, cfg))


def init_state(cfg: Config, init_params=None, init_adapters=None, mesh=None) -> TrainState:
  """Shapes first (eval_shape), then placement, then the arrays (created where they live).
  init_params (e.g. an imported checkpoint, `models.hf.load`) replace the random init. With
  LoRA they are the frozen base (in model.param_dtype: bf16 for a bf16 base); the adapters
  start as PEFT's init (B = 0: the base), or as init_adapters (an imported PEFT adapter,
  `models.lora.load_peft`), in `lora.adapter_dtype` (float32 over a bf16 base). mesh: the
  run's (`runtime.Runtime`), None without cfg.mesh."""
  check_mesh(cfg, mesh, "init_state")
  init = _check_init(cfg, init_params, init_adapters)
  shapes = jax.eval_shape(init, init_params, init_adapters)
  return jax.jit(init, out_shardings=shardings(shapes, "state", cfg, mesh))(
    init_params, init_adapters
  )


def abstract_state(cfg: Config, init_params=None, init_adapters=None) -> TrainState:
  """The TrainState init_state builds, as ShapeDtypeStructs (jax.eval_shape: nothing
  allocated; init_params may themselves be ShapeDtypeStructs): what an ahead-of-time compile
  of the train step takes (experiments/plan_1gpu.py)."""
  return jax.eval_shape(_check_init(cfg, init_params, init_adapters), init_params, init_adapters)


def _check_init(cfg: Config, init_params, init_adapters):
  """init_state's pure init function, after checking init_params and init_adapters against
  the config (ValueError naming what differs)."""

  def init(init_params, init_adapters):
    init_key, rng = jax.random.split(jax.random.key(cfg.train.seed))
    params = tfm.init_params(cfg.model, init_key) if init_params is None else init_params
    base = None
    if cfg.lora.enabled:  # the reference for KL is the base itself (no copy)
      base, params = (
        params,
        (
          lora_lib.init_adapters(cfg.model, cfg.lora, jax.random.fold_in(init_key, 1))
          if init_adapters is None
          else init_adapters
        ),
      )
    ref = jax.tree.map(jnp.copy, params) if cfg.loss.kl_coef and base is None else None
    value = None
    if cfg.uses_critic:  # the value model starts as the policy (copied again at RL start)
      critic_params = critic.init_params(cfg.model, init_key, params, share=cfg.critic.share)
      value = dict(params=critic_params, opt_state=make_critic_optimizer(cfg).init(critic_params))
    return TrainState(
      params,
      make_optimizer(cfg).init(params),
      jnp.zeros((), jnp.int32),
      jax.random.key_data(rng),
      ref,
      value,
      base,
    )

  if init_params is not None:
    expected = jax.eval_shape(lambda: tfm.init_params(cfg.model, jax.random.key(0)))
    got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_params)
    if jax.tree.structure(got) != jax.tree.structure(expected) or got != expected:
      dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(init_params)})
      raise ValueError(
        "init_params: the parameter tree does not match model config "
        f"{cfg.model} (shapes/dtypes differ; the params' dtypes {dtypes}, expected "
        f"model.param_dtype={cfg.model.param_dtype!r})"
      )
  if init_adapters is not None:
    if not cfg.lora.enabled:
      raise ValueError("init_adapters: lora.rank=0 (LoRA off); expected lora.rank > 0")
    lora_lib.check_adapters(cfg.model, cfg.lora, init_adapters, "init_adapters")
    want = lora_lib.adapter_dtype(cfg.model)
    bad = [x.dtype for x in jax.tree.leaves(init_adapters) if x.dtype != want]
    if bad:
      raise ValueError(
        f"init_adapters: dtype {bad[0]}, expected {want} (lora.adapter_dtype of "
        f"model.param_dtype={cfg.model.param_dtype!r})"
      )
  return init


def weights(state: TrainState, lora: lora_lib.LoraConfig, dtype=None):
  """The weights the model runs (sampling, evaluation): the params, or with LoRA the base
  merged with the adapters (a transient copy; dtype: the compute dtype, merged as the train
  step merges them, lora.merge)."""
  return (
    state.params
    if state.base is None
    else _merged(state.base, state.params, lora, None if dtype is None else jnp.dtype(dtype))
  )


_merged = jax.jit(lora_lib.merge, static_argnums=(2, 3))


def reference(state: TrainState, cfg: Config):
  """The reference policy of the KL term (loss.kl_coef > 0): the frozen copy, or with LoRA
  the base itself (adapters off); None without KL."""
  if state.ref_params is not None:
    return state.ref_params
  return state.base if cfg.loss.kl_coef and state.base is not None else None


def state_dict(state: TrainState) -> dict:
  """What a checkpoint holds (LoRA: the adapters and their optimizer state; the frozen base
  comes from init / --model_dir again at resume)."""
  d = dict(params=state.params, opt_state=state.opt_state, step=state.step, rng=state.rng)
  if state.ref_params is not None:
    d["ref_params"] = state.ref_params
  if state.critic is not None:
    d["critic"] = state.critic
  return d


def sample_examples(task, seed: int, stream, n: int):
  # data depends only on (seed, step[, round]): resumable
  rng = np.random.default_rng([seed, *np.atleast_1d(stream).tolist()])
  return [task.sample(rng) for _ in range(n)]


def finite_or_stop(values: dict, step: int, ckpt: checkpoint.Checkpointer):
  for name in ("loss/policy", "grad/norm"):
    if not np.isfinite(values[name]):
      ckpt.wait()  # the save in flight (asynchronous) is committed before we name the last
      last = ckpt.latest_step()
      where = (
        f"the last good checkpoint is step {last} in {ckpt.directory}"
        if last is not None
        else "no checkpoint was written yet"
      )
      raise FloatingPointError(f"{name} is {values[name]} at step {step}: stopping; {where}")
