"""Training on a rollouts file (task.name=rollouts): epochs over the file, B lines a step,
each step's lines one TreeBatch (their shared openings found by trie.py), GRPO/PPO-style
clipped updates (`train.ppo_epochs` passes over each batch), checkpoints and resume
mid-file, the first-step self-check (verify.py) and the step's time by phase (phases.py).

Lines without `logprobs` are scored by the policy before their first update (ratio 1 on
the first pass); those log-probs are recorded in workdir/recorded_logprobs.jsonl and are the
behaviour policy of every later epoch (and of a resumed run).
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from branch_replay import (advantages, checkpoint, metrics, phases, tasks, tree, tree_replay,
                           trie, verify)
from branch_replay import state as train_lib
from branch_replay.tokenizer import TOKENIZER


def make_step(cfg, loss_cfg):
  """Pure `step(state, batch: TreeBatch) -> (state, metrics)`."""
  tx = train_lib.make_optimizer(cfg)

  def step(state, batch):
    loss, aux_BR, grads = tree_replay.loss_and_grad(state.params, batch, cfg.model, loss_cfg,
                                                    cfg.replay.mode, cfg.replay.branch_chunk)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    n = jnp.maximum(aux_BR["tokens"].sum(), 1)
    out = {"loss/policy": loss, "kl": aux_BR["kl_sum"].sum() / n,
           "entropy": aux_BR["entropy_sum"].sum() / n, "grad/norm": optax.tree.norm(grads),
           "logp/mean": aux_BR["logp_sum"].sum() / n}
    return state.replace(params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state, step=state.step + 1), out

  return step


class Recorded:
  """Our own scoring of lines without logprobs, kept across epochs and runs (JSON lines)."""

  def __init__(self, path):
    self.path, self.logps = path, {}
    if os.path.exists(path):
      with open(path) as f:
        for line in f:
          rec = json.loads(line)
          self.logps[rec["source"]] = [np.asarray(x, np.float64) for x in rec["logprobs"]]

  def add(self, source, logps):
    self.logps[source] = logps
    with open(self.path, "a") as f:
      f.write(json.dumps({"source": source, "logprobs": [x.tolist() for x in logps]}) + "\n")


def old_logps(lines, recorded: Recorded, score_fn, params, cfg, adv_BR, pad_id):
  """Behaviour log-probs per line: the file's, else recorded, else scored now on the tree."""
  missing = [l for l in lines if l.logprobs is None and l.source not in recorded.logps]
  if missing:
    probe, stats = trie.layout([l.prompt_ids for l in lines], [list(l.responses) for l in lines],
                               adv_BR, max_depth=cfg.task.max_depth,
                               min_shared=cfg.task.min_shared, pad_id=pad_id)
    per_level, trunk_BW = jax.device_get(score_fn(params, probe))
    scored = trie.unroll(probe, stats["order"], per_level, trunk_BW)
    for b, l in enumerate(lines):
      if l.logprobs is None and l.source not in recorded.logps:
        recorded.add(l.source, scored[b])
  return [list(l.logprobs) if l.logprobs is not None else recorded.logps[l.source]
          for l in lines]


def run(cfg, workdir: str, *, init_params=None, tokenizer=None) -> dict:
  """Train on cfg.task.path (resuming from `workdir`); returns the summary."""
  tok = TOKENIZER if tokenizer is None else tokenizer
  t_start = time.time()
  workdir = checkpoint.check_workdir(workdir)
  task = tasks.make(cfg.task, tok)  # the whole file is checked here, before any compute
  task.check(cfg)
  do_verify = verify.enabled(cfg.replay.verify, init_params is not None)
  t = cfg.train
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  ckpt.check_config()
  state = train_lib.init_state(cfg, init_params)
  start = ckpt.latest_step() or 0
  if start:
    state = train_lib.TrainState(**ckpt.restore(start, train_lib.state_dict(state)))
  chief = jax.process_index() == 0  # several processes run this loop alike; one writes
  writer = metrics.MetricsWriter(os.path.join(workdir, "metrics.jsonl") if chief else os.devnull,
                                 tensorboard=t.tensorboard and chief)
  recorded = Recorded(os.path.join(workdir, "recorded_logprobs.jsonl"))
  loss_cfg = cfg.loss
  step_fn = jax.jit(make_step(cfg, loss_cfg), donate_argnums=0)
  score_fn = jax.jit(functools.partial(tree_replay.logps, model_cfg=cfg.model))
  if state.ref_params is None and loss_cfg.needs_ref:
    raise ValueError(f"loss.kl_coef={loss_cfg.kl_coef}: the reference policy is missing")
  # train.rl_steps caps the steps (resumable: a run stopped early continues mid-file)
  total = min(t.rl_steps, task.cfg.epochs * task.steps_per_epoch(t.batch_size))
  for step in range(start, total):
    timer, t0 = phases.Timer(), time.time()
    lines = task.batch_lines(step, t.batch_size)
    rewards_BR = np.stack([l.rewards for l in lines])
    adv_BR = advantages.compute(t.advantage, rewards_BR, t)
    with timer("old_logp"):
      old = old_logps(lines, recorded, score_fn, state.params, cfg, adv_BR, tok.pad_id)
    batch, stats = task_batch(task, lines, adv_BR, old, tok.pad_id)
    tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
    if state.ref_params is not None:
      with timer("ref_logp"):
        ref_levels, ref_trunk = jax.block_until_ready(score_fn(state.ref_params, batch))
      batch = batch.replace(
          levels=tuple(l.replace(ref_logp_BRT=r) for l, r in zip(batch.levels, ref_levels)),
          trunk_ref_logp_BW=ref_trunk if batch.trunk_len else None)
    rec = {"step": step, "kind": "train", "phase": "rl",
           "epoch": step // task.steps_per_epoch(t.batch_size),
           "reward/mean": float(rewards_BR.mean()), "reward/std": float(rewards_BR.std())}
    if do_verify and step == start:
      rec.update(verify.check(state.params, batch, cfg.model, loss_cfg,
                              branch_chunk=cfg.replay.branch_chunk))
      do_verify = False
    outs = []
    with timer("update"):
      for _ in range(t.ppo_epochs):
        state, out = step_fn(state, batch)
        outs.append(jax.device_get(out))
    out = {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}
    train_lib.finite_or_stop(out, step, ckpt)
    prefix, below, naive = batch.token_counts()
    rec.update(out)
    rec.update(timer.metrics())
    rec.update({"replay/prefix_tokens": prefix, "replay/tail_tokens": below,
                "replay/naive_equiv_tokens": stats["flat_positions"],
                "replay/tree_token_ratio": stats["tree_token_ratio"],
                "replay/trie_token_ratio": stats["trie_token_ratio"],
                "replay/trunk_len": stats["trunk_len"],
                "replay/fanouts": "x".join(map(str, stats["fanouts"])),
                "time/step_s": time.time() - t0})
    writer.write(rec)
    if (step + 1) % t.checkpoint_every == 0 or step + 1 == total:
      ckpt.save(step + 1, train_lib.state_dict(state))
  records = metrics.read(writer.path)
  writer.close()
  ckpt.close()
  return dict(workdir=workdir, metrics=writer.path, steps=total, records=records,
              wall_s=time.time() - t_start, final_params=state.params,
              checkpoint=ckpt.directory)


def task_batch(task, lines, adv_BR, old, pad_id):
  from branch_replay import rollouts
  return rollouts.make_batch(lines, adv_BR, task.cfg, old_logps=old, pad_id=pad_id)
