"""Ablation helpers for notebooks/ablations.ipynb: one loss+gradient step of a random batch,
timed (median of reps after a compiling call) with the compiled step's memory (argument +
output + temp bytes from XLA's memory analysis: deterministic, unlike RSS on a shared CPU).

  from experiments import ablations
  row = ablations.measure(tfm.preset("tiny"), B=1, R=4, P=64, T=8, mode="replay")
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import engine, losses, tree
from models import transformer as tfm


def small() -> bool:
  """The notebooks' size switch: BRANCH_REPLAY_SMALL=1 (the tests set it) shrinks sweeps."""
  return os.environ.get("BRANCH_REPLAY_SMALL", "0") not in ("", "0", "false")


def random_batch(
  cfg: tfm.ModelConfig, B: int, R: int, P: int, T: int, W: int = 0, seed: int = 0
) -> tree.TreeBatch:
  """Random tokens, all valid; W trunk tokens at the prefix's end scored by every branch."""
  rng = np.random.default_rng(seed)
  dt = cfg.compute_dtype
  batch = tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P)), jnp.int32),
    prefix_valid_BP=jnp.ones((B, P), bool),
    tails_BRT=jnp.asarray(rng.integers(0, cfg.vocab_size, (B, R, T)), jnp.int32),
    tail_valid_BRT=jnp.ones((B, R, T), bool),
    advantages_BR=jnp.asarray(rng.normal(size=(B, R)), dt),
    old_logp_BRT=jnp.asarray(-rng.exponential(size=(B, R, T)), jnp.float32),
    trunk_old_logp_BW=(jnp.asarray(-rng.exponential(size=(B, W)), jnp.float32) if W else None),
    trunk_len=W,
  )
  return batch


def measure(
  cfg: tfm.ModelConfig,
  B: int,
  R: int,
  P: int,
  T: int,
  mode: str = "replay",
  W: int = 0,
  branch_chunk: int | None = None,
  remat: bool | None = None,
  reps: int = 3,
  loss: str = "grpo",
) -> dict:
  """Seconds (median) and compiled MB of one loss+gradient step."""
  if remat is not None:
    cfg = dataclasses.replace(cfg, remat=remat)
  batch = random_batch(cfg, B, R, P, T, W)
  tree.validate(batch, cfg.vocab_size, branch_chunk)
  params = tfm.init_params(cfg, jax.random.key(0))
  loss_cfg = losses.LossConfig(name=loss)
  fn = jax.jit(
    lambda p, b: engine.loss_and_grad(
      p, b, cfg, loss_cfg, mode, branch_chunk if mode == "replay" else None
    )[::2]
  )
  compiled = fn.lower(params, batch).compile()
  mem = compiled.memory_analysis()
  mb = (
    None
    if mem is None
    else (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) / 2**20
  )
  temp_mb = None if mem is None else mem.temp_size_in_bytes / 2**20
  jax.block_until_ready(compiled(params, batch))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(params, batch))
    times.append(time.perf_counter() - t0)
  return dict(
    mode=mode,
    B=B,
    R=R,
    P=P,
    T=T,
    W=W,
    branch_chunk=branch_chunk or R,
    remat=cfg.remat,
    seconds=float(np.median(times)),
    compiled_mb=mb,
    temp_mb=temp_mb,
  )
