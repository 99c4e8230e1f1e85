"""The one training loop: warm-up then the algorithm's phase, by step; checkpoints, metrics and
TensorBoard (process 0), progress, greedy evaluation (the final decision broadcast), resume
(metrics.jsonl repaired to the checkpoint resumed from), the NaN stop, preemption (SIGTERM /
SIGINT: the step in progress finishes and is checkpointed; preemption.py) and the reward
time limit. What a step trains is the algorithm's (algorithms/: compile, start, batch,
update); this module imports none of them."""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

from branch_replay import registry
from branch_replay.train import checkpoint, metrics, preemption, runtime, verify
from branch_replay.train import summary as summary_lib
from branch_replay.data import rewards, tasks
from branch_replay.train import state as train_state
from branch_replay.config import Config
from branch_replay.data.tokenizer import TOKENIZER
from models import lora as lora_lib


def run(
  cfg: Config, workdir: str, algorithm=None, *, init_params=None, tokenizer=None, init_adapters=None
) -> dict:
  """Train (resuming from `workdir` if it holds a checkpoint); returns the summary.

  algorithm: an `algorithms.base.Algorithm` class (default: the one the config selects,
  `registry.for_config`). init_params: start from these (an imported checkpoint) instead
  of a random init; a checkpoint in `workdir` still takes precedence (resume). tokenizer: the
  text <-> ids map of the tasks (default: the shipped character tokenizer;
  `tokenizer.from_model_dir` for an imported checkpoint's tokenizer.json). With LoRA
  (lora.rank > 0) init_params are the frozen base, init_adapters (`models.lora.load_peft`)
  the adapters to start from, and the run ends by writing workdir/adapter in PEFT's format;
  the summary's final_params are the adapters and base_params the base
  (`models.lora.save_merged` for --merge).

  SIGTERM or SIGINT (from the main thread's handlers, installed for the call): the step in
  progress finishes, its metrics line and a checkpoint of it are written, and
  `preemption.Preempted` is raised (run.py exits 128 + the signal); the same call resumes."""
  guard = preemption.Guard(
    cfg.train.preemption_grace_s,
    on_timeout=lambda: f"the same command resumes from the newest checkpoint in {workdir}",
  )
  with guard, rewards.time_limit(cfg.train.reward_timeout_s):
    return _train(cfg, workdir, algorithm, init_params, tokenizer, init_adapters, guard)


def _train(cfg, workdir, algorithm, init_params, tokenizer, init_adapters, guard):
  tok = TOKENIZER if tokenizer is None else tokenizer
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(
      f"model.vocab_size={cfg.model.vocab_size}: expected >= the tokenizer's {tok.vocab_size}"
    )
  if algorithm is None:
    algorithm = registry.for_config(cfg)  # imports the algorithm's module by name
  t_start = time.time()
  workdir = checkpoint.check_workdir(workdir)  # before any compute
  task = tasks.make(cfg.task, tok)  # the run's tokenizer; a task that reads files checks them
  task.check(cfg)
  rt = runtime.Runtime(cfg, tok)  # the mesh, placement and compiled functions, built once
  algo = algorithm(cfg, task, tok, workdir=workdir, runtime=rt)  # compiles its steps (cached)
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  ckpt.check_config()
  state = rt.init_state(init_params, init_adapters)
  # The newest checkpoint that restores (a damaged newer one is named and set aside).
  start, restored = ckpt.restore_latest(lambda step: algo.restore_template(state, step))
  if start:  # the checkpointed fields (LoRA: not the base, which init rebuilt)
    state = state.replace(**restored)
  chief = jax.process_index() == 0  # several processes run this loop alike; one writes
  t = cfg.train
  total = algo.total_steps  # a file's epochs may end a run sooner
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if chief:  # each record once: a torn last line and the steps to redo are dropped
    repaired = metrics.repair(metrics_path, start, total)
    if repaired:
      print(repaired, file=sys.stderr, flush=True)
  writer = metrics.MetricsWriter(
    metrics_path if chief else os.devnull, tensorboard=cfg.train.tensorboard and chief
  )
  warmup = algo.warmup_steps  # supervised steps before the phase
  eval_examples = algo.eval_examples() if t.eval_size else []
  # The first-step self-check (replay.verify): replay == naive on the first batch with signal.
  verify_pending = verify.enabled(cfg.replay.verify, init_params is not None) and not cfg.mesh

  def evaluate(state, step):
    rewards = algo.evaluate(state, eval_examples)  # one per prompt
    if t.eval_batch or t.eval_shared_prefix:  # per prompt: n, and 0/1 rewards' interval
      rec = metrics.eval_record(rewards)
    else:
      rec = {"eval/greedy_reward": float(rewards.mean())}
    writer.write({"step": step, "kind": "eval", **rec})
    if "eval/ci95_low" in rec:
      bar.write(
        f"step {step}: greedy accuracy {rec['eval/correct']}/{rec['eval/n']} = "
        f"{rec['eval/greedy_reward']:.3f} (95% interval {rec['eval/ci95_low']:.3f}-"
        f"{rec['eval/ci95_high']:.3f})"
      )
    return rec["eval/greedy_reward"]

  from tqdm import tqdm

  bar = tqdm(
    total=total, initial=start, disable=not (t.progress and chief), dynamic_ncols=True, desc="train"
  )

  def stop(step: int, saved: bool):
    ckpt.wait()  # the preemption checkpoint committed before we exit
    bar.close()
    writer.close()
    ckpt.close()
    raise preemption.Preempted(step, guard.signum, workdir, saved)

  if start < total and guard.agreed():  # a signal during compilation or restore
    stop(start, False)
  try:
    for step in range(start, total):
      t0 = time.time()
      rec = {"step": step, "kind": "train"}
      if step < warmup:
        rec.update(phase="sft", **{"time/sample_s": 0.0})
        batch = algo.warmup_batch(step)
        t1 = time.time()
        state, out = algo.warmup_update(state, batch)
      else:
        rec["phase"] = algo.phase
        if step == warmup:
          if eval_examples and t.eval_before:
            bar.write(
              f"step {step}: greedy eval reward before {algo.phase} {evaluate(state, step):.3f}"
            )
            t0 = time.time()  # the evaluation is no part of the step's time/step_s
          state = algo.start(state)
        batch, sampled = algo.batch(state, step)
        rec.update(sampled)
        if verify_pending and verify.has_signal(batch):  # a gradient of noise proves nothing
          rec.update(algo.verify(state, batch))
          verify_pending = False
        elif verify_pending:
          rec["verify/deferred"] = 1  # every advantage zero: the next batch is checked
        t1 = time.time()
        state, out = algo.update(state, batch, step)
        rec["time/update_s"] = time.time() - t1
      rec["time/train_s"] = time.time() - t1
      train_state.finite_or_stop(out, step, ckpt)
      prefix, tails, naive = algo.token_counts(batch, rec["phase"])
      rec.update(out)
      rec.update(
        {
          "replay/prefix_tokens": prefix,
          "replay/tail_tokens": tails,
          "replay/naive_equiv_tokens": naive,
          "replay/computed_tokens": naive if cfg.replay.mode == "naive" else prefix + tails,
          "time/step_s": time.time() - t0,
        }
      )
      writer.write(rec)
      preempted = guard.agreed()  # several processes: all of them, after the same step
      if (step + 1) % t.checkpoint_every == 0 or step + 1 == total or preempted:
        ckpt.save(step + 1, train_state.state_dict(state))
      bar.update(1)
      bar.set_postfix({k: f"{rec[k]:.3f}" for k in algo.progress_keys if k in rec})
      if preempted:
        stop(step + 1, True)
  except BaseException:  # an error (or a stop) leaves the run: no save of it outlives it
    ckpt.settle()
    raise
  bar.close()
  if eval_examples and total > warmup and final_eval_missing(writer.records(), total):
    evaluate(state, total)
  records = writer.records()  # the whole run's, a resumed run's earlier steps included
  writer.close()
  ckpt.close()
  adapter_dir = None
  if cfg.lora.enabled:  # the adapters in PEFT's format (models/lora.py)
    adapter_dir = os.path.join(workdir, "adapter")
    adapters = rt.to_host(state.params)
    if chief:
      lora_lib.save_peft(adapter_dir, cfg.model, cfg.lora, adapters)
  plot_path = (
    metrics.plot(records, os.path.join(workdir, "metrics.png")) if t.plot and chief else None
  )
  summary = summary_lib.summarize(records, algo.phase, algo.summary_metrics)
  summary.update(
    workdir=workdir,
    checkpoint=ckpt.directory,
    metrics=writer.path,
    plot=plot_path,
    wall_s=time.time() - t_start,
    final_params=state.params,
    adapter=adapter_dir,
    base_params=state.base,
  )
  return summary


def final_eval_missing(records, step: int) -> bool:
  """Whether the final greedy evaluation still has to run. Only process 0 writes metrics.jsonl
  (and so holds a resumed run's earlier records), and the evaluation is a collective every
  process must enter alike: process 0 decides and every process receives its decision."""
  missing = not any(r.get("kind") == "eval" and r["step"] == step for r in records)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    missing = bool(multihost_utils.broadcast_one_to_all(np.int32(missing)))
  return missing
