"""Asynchronous vs synchronous checkpoints (train.async_checkpoints): what a save costs the
training loop, side by side in one process.

  python experiments/bench_checkpoint.py --out=experiments/results/checkpoint_async_cpu_2026-12-03.jsonl

1. The default run's RL step (experiments/configs/grpo_haystack.py: 8 prompts x 8 branches,
   256-token prompts, the 2-layer d=64 model; no warm-up, no evaluation) with a checkpoint
   after every step (train.checkpoint_every=1, the worst case; the default run saves every
   50), sync and async alternated --repeats times: the loop's seconds per step (between
   consecutive metrics lines, which include the save's stall), the median over the steps
   after the first two (compilation), and the time the save call blocks the loop.
2. A save of a state the size of the large preset's (models/config.py "large": d=2048, 16
   layers, vocab 32000): no model, no compilation; float32 arrays of its parameter shapes,
   times --large_copies (1: the parameters alone; 3: with AdamW's two moments, the whole
   train state), random values (nothing compresses). Sync: save() until committed. Async:
   the blocking part (the device->host copy; the loop waits this long) and then the rest in
   the background until committed. One save each, sync first, then async.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile
import time

if __name__ == "__main__" and not (glob.glob("/dev/nvidia*") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_integer("rl_steps", 12, "RL steps per run (the first two compile)")
  flags.DEFINE_integer("repeats", 2, "sync/async pairs of runs, alternated")
  flags.DEFINE_integer(
    "large_copies",
    1,
    "the large preset's parameters x this many (3: the whole AdamW train state); 0 skips part 2",
  )
  flags.DEFINE_string("scratch", "", "where the checkpoints go (default: a temporary directory)")
  flags.DEFINE_string("out", "", "append JSON lines here")


def step_times(asynchronous: bool, scratch: str) -> dict:
  from branch_replay.train import checkpoint, metrics, trainer
  from branch_replay.config import apply_overrides
  from experiments.configs import grpo_haystack

  cfg = apply_overrides(
    grpo_haystack.get_config(),
    [
      "train.sft_steps=0",
      f"train.rl_steps={FLAGS.rl_steps}",
      "train.checkpoint_every=1",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "train.tensorboard=false",
      f"train.async_checkpoints={str(asynchronous).lower()}",
    ],
  )
  stamps, blocked = [], []
  write, save = metrics.MetricsWriter.write, checkpoint.Checkpointer.save

  def timed_write(self, record):
    write(self, record)
    stamps.append(time.perf_counter())

  def timed_save(self, step, state):
    t0 = time.perf_counter()
    save(self, step, state)
    blocked.append(time.perf_counter() - t0)

  metrics.MetricsWriter.write, checkpoint.Checkpointer.save = timed_write, timed_save
  workdir = tempfile.mkdtemp(dir=scratch)
  try:
    t0 = time.perf_counter()
    trainer.run(cfg, workdir)
    wall = time.perf_counter() - t0
  finally:
    metrics.MetricsWriter.write, checkpoint.Checkpointer.save = write, save
    shutil.rmtree(workdir, ignore_errors=True)
  loop_s = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # steps 2.. (after compiling)
  return {
    "loop_step_s_median": statistics.median(loop_s),
    "loop_step_s": loop_s,
    "save_blocks_s_median": statistics.median(blocked[2:]),
    "run_wall_s": wall,
  }


def large_state(copies: int):
  import jax
  import jax.numpy as jnp
  from models import config as model_config
  from models import transformer as tfm

  cfg = model_config.preset("large")
  shapes = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  leaves = jax.tree.leaves(shapes)
  key = jax.random.key(0)
  state = {}
  for c in range(copies):
    arrays = []
    for i, s in enumerate(leaves):
      arrays.append(jax.random.normal(jax.random.fold_in(key, c * 1000 + i), s.shape, jnp.float32))
    state[f"copy{c}"] = arrays
  jax.block_until_ready(state)
  n = sum(x.size for x in jax.tree.leaves(state))
  return state, n


def large_save(asynchronous: bool, state, scratch: str) -> dict:
  import orbax.checkpoint as ocp

  directory = tempfile.mkdtemp(dir=scratch)
  manager = ocp.CheckpointManager(
    directory,
    options=ocp.CheckpointManagerOptions(
      max_to_keep=1, create=True, enable_async_checkpointing=asynchronous
    ),
  )
  try:
    t0 = time.perf_counter()
    manager.save(1, args=ocp.args.StandardSave(state), force=True)
    t1 = time.perf_counter()
    manager.wait_until_finished()
    t2 = time.perf_counter()
  finally:
    manager.close()
    shutil.rmtree(directory, ignore_errors=True)
  return {"save_blocks_s": t1 - t0, "committed_s": t2 - t0}


def main(argv):
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, "checkpoint_async")
  scratch = FLAGS.scratch or tempfile.mkdtemp(prefix="bench_checkpoint_")
  os.makedirs(scratch, exist_ok=True)
  try:
    rows = {True: [], False: []}
    for repeat in range(FLAGS.repeats):
      for asynchronous in (False, True):
        row = step_times(asynchronous, scratch)
        rows[asynchronous].append(row)
        writer.write(
          {
            "kind": "default_run_step",
            "async": asynchronous,
            "repeat": repeat,
            "rl_steps": FLAGS.rl_steps,
            "checkpoint_every": 1,
            **row,
          }
        )
    med = {a: statistics.median(r["loop_step_s_median"] for r in rows[a]) for a in rows}
    blocks = {a: statistics.median(r["save_blocks_s_median"] for r in rows[a]) for a in rows}
    writer.write(
      {
        "kind": "default_run_summary",
        "sync_loop_step_s": med[False],
        "async_loop_step_s": med[True],
        "sync_over_async": med[False] / med[True],
        "sync_save_blocks_s": blocks[False],
        "async_save_blocks_s": blocks[True],
      }
    )
    if FLAGS.large_copies:
      state, n = large_state(FLAGS.large_copies)
      for asynchronous in (False, True):
        row = large_save(asynchronous, state, scratch)
        writer.write(
          {
            "kind": "large_state_save",
            "async": asynchronous,
            "copies_of_large_params": FLAGS.large_copies,
            "elements": n,
            "bytes": 4 * n,
            **row,
          }
        )
  finally:
    if not FLAGS.scratch:
      shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
