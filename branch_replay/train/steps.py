"""The policy's pure train step (flat or tree batch; replay or the naive twin, `replay.mode`;
one device or the run's mesh) and the policy's jitted functions of a config: step, sampler,
greedy decoder, scorer (`build_fns`; runtime.Runtime.fns caches them once per config and mesh).

  make_train_step(cfg, mesh=...)   pure train_step(state, batch) -> (state, metrics)
  build_fns(compile_key(cfg), stop_tokens, turn_lengths, mesh)   the jitted functions

The supervised warm-up runs through the same engine (phase 'sft': objective -log p, pg with
advantage 1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from branch_replay.core import engine, losses
from branch_replay.config import Config
from branch_replay.data import tasks
from branch_replay.train.state import TrainState, check_mesh, make_optimizer
from models import lora as lora_lib

SFT_LOSS = losses.LossConfig(name="pg", aggregation="token_mean")  # -mean log p(answer)


def rl_loss_config(cfg: Config) -> losses.LossConfig:
  """The RL objective scores log-probs at the sampler's temperature (the ratio's
  denominator is the distribution the tokens were drawn from)."""
  return dataclasses.replace(cfg.loss, temperature=cfg.sampler.temperature)


def loss_and_grad(
  cfg: Config, params, batch, loss_cfg, branch_chunk=None, params_fn=None, mesh=None
):
  """engine.loss_and_grad with the config's `replay.mode` on the run's mesh object (a flat
  batch or a tree; the naive twin on a mesh by the partitioner alone, from the sharded inputs;
  None without cfg.mesh). params_fn: `lora_params_fn` (params are the adapters and grads
  theirs)."""
  check_mesh(cfg, mesh, "loss_and_grad")
  return engine.loss_and_grad(
    params,
    batch,
    cfg.model,
    loss_cfg,
    cfg.replay.mode,
    branch_chunk,
    mesh=mesh,
    params_fn=params_fn,
  )


def lora_params_fn(cfg: Config, state: TrainState):
  """LoRA: adapters -> the base with the adapters attached (merged inside each layer), the
  frozen base a constant of the differentiated function (no gradient); None for full
  fine-tuning."""
  if state.base is None:
    return None
  return lambda adapters: lora_lib.attach(state.base, adapters, cfg.lora)


def make_train_step(cfg: Config, phase: str = "rl", loss_cfg=None, mesh=None):
  """Pure `train_step(state, batch) -> (state, metrics)` for flat and tree batches; phase
  'sft' uses -log p; loss_cfg replaces the RL objective (default `rl_loss_config`); mesh:
  the run's Mesh object (`runtime.Runtime.mesh`; None without cfg.mesh), closed over."""
  check_mesh(cfg, mesh, "make_train_step")
  tx = make_optimizer(cfg)
  if loss_cfg is None:
    loss_cfg = rl_loss_config(cfg) if phase == "rl" else SFT_LOSS
  branch_chunk = cfg.replay.branch_chunk if phase == "rl" else None

  def train_step(state: TrainState, batch):
    loss, aux_BR, grads = loss_and_grad(
      cfg, state.params, batch, loss_cfg, branch_chunk, lora_params_fn(cfg, state), mesh
    )
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.maximum(aux_BR["tokens"].sum(), 1)
    out = {
      "loss/policy": loss,
      "kl": aux_BR["kl_sum"].sum() / n,
      "entropy": aux_BR["entropy_sum"].sum() / n,
      "grad/norm": optax.tree.norm(grads),
      "logp/mean": aux_BR["logp_sum"].sum() / n,
    }
    scored = jnp.maximum(aux_BR["scored_tokens"].sum(), 1)
    out.update(
      {
        "clip_frac": aux_BR["clip_sum"].sum() / scored,
        "approx_kl": aux_BR["approx_kl_sum"].sum() / scored,
        "ratio/max": aux_BR["ratio_max"].max(),
      }
    )
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), out

  return train_step


class Fns(NamedTuple):
  rl_step: Any
  sft_step: Any
  sample: Any
  greedy: Any
  score: Any


def compile_key(cfg: Config) -> Config:
  """The config with the train loop's fields that cannot change a compiled function reset. The
  task stays: it is valid only with its algorithm (a rollouts file's run refuses another task),
  and its prompt lengths shape the compiled programs anyway."""
  train = dataclasses.replace(
    cfg.train,
    seed=0,
    rl_steps=0,
    checkpoint_every=1,
    keep_checkpoints=1,
    eval_size=0,
    progress=False,
    plot=False,
    tensorboard=False,
  )
  replay = dataclasses.replace(cfg.replay, auto_tree=False)  # trees dispatch at trace time
  return dataclasses.replace(cfg, train=train, replay=replay)


def build_fns(cfg: Config, stop_tokens, turn_lengths: tuple = (), mesh=None) -> Fns:
  """The jitted functions of a config (`compile_key(cfg)`) on the run's mesh (built, not
  cached: `runtime.Runtime.fns` keeps them across runs in one process, so a second run of the
  same model does not compile again). stop_tokens: the stop id or ids (flat: the tokenizer's
  stop_ids), or one tuple per turn (trees, with the task's turn_lengths)."""
  steps = dict(
    rl_step=jax.jit(make_train_step(cfg, "rl", mesh=mesh), donate_argnums=0),
    sft_step=jax.jit(make_train_step(cfg, "sft", mesh=mesh), donate_argnums=0),
    # log-probs of every node at the sampler's temperature (reference, DPO metrics)
    score=jax.jit(
      functools.partial(engine.forward, model_cfg=cfg.model, temperature=cfg.sampler.temperature)
    ),
  )
  sample, greedy = tasks.rollout_shape(cfg).samplers(
    cfg.model, cfg.sampler, stop_tokens, turn_lengths
  )
  return Fns(**steps, sample=jax.jit(sample), greedy=jax.jit(greedy))
