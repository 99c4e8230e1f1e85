"""One whole RL step taken apart by phase, from train.py's own pieces (the Q1 and Q2
experiments and the notebooks use it): sample -> reward -> assemble -> (reference score) ->
update, each phase timed with its results ready.

  cfg = config_for("grpo_haystack", ["task.prompt_len=1024"], mode="naive")
  stepper = Stepper(cfg)            # jits once; state from init_state
  phases, metrics = stepper.step(0) # seconds per phase, the train step's metrics
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay import config as config_lib
from branch_replay import losses, policy, sampler, sharding, tasks, train
from branch_replay.batch import validate


def config_for(experiment: str, overrides=(), mode: str | None = None, seed: int | None = None,
               rl_steps: int | None = None):
  """An experiment's get_config() with --set style overrides (the same parser as run.py)."""
  cfg = importlib.import_module(f"experiments.{experiment}").get_config()
  extra = [f"replay.mode={mode}"] if mode else []
  extra += [f"train.seed={seed}"] if seed is not None else []
  extra += [f"train.rl_steps={rl_steps}"] if rl_steps is not None else []
  return config_lib.apply_overrides(cfg, list(overrides) + extra)


class Stepper:
  """Holds a TrainState and the jitted functions of one config; `step(k)` takes RL step k."""

  def __init__(self, cfg, state=None):
    self.cfg = cfg
    self.task = tasks.make(cfg.task)
    self.fns = train._compiled(train._compile_key(cfg))
    self.state = train.init_state(cfg) if state is None else state

  def batch(self, step: int):
    """(batch, phase seconds, reward/mean): sampling and rewards exactly as train.rl_batch."""
    cfg, t = self.cfg, {}
    t0 = time.perf_counter()
    examples = train._examples(self.task, cfg.train.seed, step, cfg.train.batch_size)
    prompt_BP, valid_BP = tasks.encode_left([e.prompt for e in examples],
                                            self.task.max_prompt_len)
    placed = train.place((prompt_BP, valid_BP), "batch", cfg)
    key = jax.random.fold_in(jax.random.wrap_key_data(self.state.rng), step)
    t1 = time.perf_counter()
    samples = jax.block_until_ready(self.fns.sample(self.state.params, prompt_BP=placed[0],
                                                    prompt_valid_BP=placed[1], key=key))
    if cfg.mesh:  # as train.rl_batch: every process decodes and rewards all samples
      samples = sharding.to_host(samples)
    t2 = time.perf_counter()
    rewards_BR = train.rewards_of(self.task, examples, train.completions(samples))
    t3 = time.perf_counter()
    adv_BR = losses.group_advantages(jnp.asarray(rewards_BR), use_std=cfg.train.advantage_std)
    batch = sampler.to_batch(prompt_BP, valid_BP, samples, adv_BR)
    if self.state.ref_params is not None:
      scored = jax.block_until_ready(
          self.fns.score(self.state.ref_params, batch=train.place(batch, "batch", cfg)))
      ref_BRT, ref_trunk_BW = sharding.to_host(scored) if cfg.mesh else scored
      batch = batch.replace(ref_logp_BRT=ref_BRT,
                            trunk_ref_logp_BW=ref_trunk_BW if batch.trunk_len else None)
    validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
    batch = jax.block_until_ready(train.place(batch, "batch", cfg))
    t4 = time.perf_counter()
    t.update(data_s=t1 - t0, sample_s=t2 - t1, reward_s=t3 - t2, assemble_s=t4 - t3)
    return batch, t, float(rewards_BR.mean())

  def update(self, batch):
    t0 = time.perf_counter()
    self.state, out = self.fns.rl_step(self.state, batch)
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    return out, time.perf_counter() - t0

  def step(self, step: int):
    batch, phases, reward = self.batch(step)
    out, update_s = self.update(batch)
    phases["update_s"] = update_s
    phases["step_s"] = sum(phases.values())
    return phases, {"reward/mean": reward, **out}


@functools.lru_cache(maxsize=8)
def _loss_and_grad(cfg, mode):
  chunk = cfg.replay.branch_chunk if mode == "replay" else None
  return jax.jit(lambda p, b: policy.loss_and_grad(p, b, cfg.model, cfg.loss, mode, chunk))


def grads_both_modes(params, batch, cfg):
  """(loss, flat grads) of replay and naive on one batch: the identical-batch comparison."""
  out = {}
  for mode in ("replay", "naive"):
    loss, _, grads = _loss_and_grad(cfg, mode)(params, batch)
    out[mode] = (float(loss), np.concatenate([np.asarray(g, np.float64).ravel()
                                              for g in jax.tree.leaves(grads)]))
  return out


def compare_grads(both) -> dict:
  """Cosine and relative difference of the two gradients; None where a gradient is zero
  (e.g. every branch of every prompt got the same reward, so every advantage is 0)."""
  (lr, gr), (ln, gn) = both["replay"], both["naive"]
  nr, nn_ = float(np.linalg.norm(gr)), float(np.linalg.norm(gn))
  zero = nr == 0.0 or nn_ == 0.0
  return {"grad_cosine": None if zero else float(gr @ gn / (nr * nn_)),
          "grad_rel_diff": None if nn_ == 0.0 else float(np.linalg.norm(gr - gn) / nn_),
          "grad_norm_replay": nr, "grad_norm_naive": nn_, "loss_replay": lr, "loss_naive": ln}


def replace_train(cfg, **kw):
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **kw))
