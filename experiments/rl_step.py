"""One whole RL step taken apart by phase, through the public rollout (branch_replay/rollout.py;
the Q1 and Q2 experiments and the notebooks use it): sample -> reward -> assemble -> (reference score) ->
update, each phase timed with its results ready.

  cfg = config_for("grpo_haystack", ["task.prompt_len=1024"], mode="naive")
  stepper = Stepper(cfg)            # jits once; state from init_state
  phases, metrics = stepper.step(0) # seconds per phase, the train step's metrics
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from branch_replay import config as config_lib
from branch_replay.core import engine
from branch_replay.train import runtime, steps
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.data import tasks
from branch_replay import rollout
from experiments import registry


def config_for(
  experiment: str,
  overrides=(),
  mode: str | None = None,
  seed: int | None = None,
  rl_steps: int | None = None,
):
  """An experiment's get_config() with --set style overrides (the same parser as run.py)."""
  cfg = registry.get_config(experiment)
  extra = [f"replay.mode={mode}"] if mode else []
  extra += [f"train.seed={seed}"] if seed is not None else []
  extra += [f"train.rl_steps={rl_steps}"] if rl_steps is not None else []
  return config_lib.apply_overrides(cfg, list(overrides) + extra)


class Stepper:
  """Holds a TrainState and the jitted functions of one config; `step(k)` takes RL step k."""

  def __init__(self, cfg, state=None, tok=None):
    self.cfg = cfg
    self.tok = TOKENIZER if tok is None else tok  # an imported model's (run.parse) or ours
    self.rt = runtime.Runtime(cfg, self.tok)  # the trainer's mesh, placement and functions
    self.task = tasks.make(cfg.task, self.tok)
    self.fns = rollout.compiled(self.rt, self.task)
    self.state = self.rt.init_state() if state is None else state
    self.last_batch = None

  def batch(self, step: int):
    """(batch, phase seconds, reward/mean) from the trainer's own rollout (rollout.rl_batch:
    sample, reward, advantages, reference scores), placed as the trainer places it."""
    batch, _, stats = rollout.rl_batch(self.fns, self.state, self.task, self.rt, step)
    t0 = time.perf_counter()
    batch = jax.block_until_ready(self.rt.put(batch, "batch"))
    self.last_batch = batch
    t = {f"{name}_s": stats[f"time/{name}_s"] for name in ("data", "reward", "assemble")}
    t["sample_s"] = stats["time/generate_s"]
    t["assemble_s"] += time.perf_counter() - t0
    return batch, t, stats["reward/mean"]

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
  loss_cfg = steps.rl_loss_config(cfg)  # at the sampler's temperature, as the trainer
  return jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg.model, loss_cfg, mode, chunk))


def grads_both_modes(params, batch, cfg):
  """(loss, flat grads) of replay and naive on one batch: the identical-batch comparison."""
  out = {}
  for mode in ("replay", "naive"):
    loss, _, grads = _loss_and_grad(cfg, mode)(params, batch)
    out[mode] = (
      float(loss),
      np.concatenate([np.asarray(g, np.float64).ravel() for g in jax.tree.leaves(grads)]),
    )
  return out


def compare_grads(both) -> dict:
  """Cosine and relative difference of the two gradients; None where a gradient is zero
  (e.g. every branch of every prompt got the same reward, so every advantage is 0)."""
  (lr, gr), (ln, gn) = both["replay"], both["naive"]
  nr, nn_ = float(np.linalg.norm(gr)), float(np.linalg.norm(gn))
  zero = nr == 0.0 or nn_ == 0.0
  return {
    "grad_cosine": None if zero else float(gr @ gn / (nr * nn_)),
    "grad_rel_diff": None if nn_ == 0.0 else float(np.linalg.norm(gr - gn) / nn_),
    "grad_norm_replay": nr,
    "grad_norm_naive": nn_,
    "loss_replay": lr,
    "loss_naive": ln,
  }


def replace_train(cfg, **kw):
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **kw))
