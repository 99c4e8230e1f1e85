"""The one training loop: sample R branches per prompt from a shared prefix, reward them,
and take a GRPO step through branch replay (or its naive twin, `replay.mode=naive`).

  TrainState                  params, optimiser state, step, rng (+ frozen reference params)
  make_train_step(cfg)        pure train_step(state, batch) -> (state, metrics)
  run(cfg, workdir)           jits the steps once (with donation), checkpoints, logs, resumes

An optional supervised warm-up (`train.sft_steps`) runs through the same engine: prefix =
the long prompt, tails = the reference answers, objective = -log p (pg with advantage 1).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any, NamedTuple

import chex
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

from branch_replay import checkpoint, losses, metrics, policy, sampler, sharding, tasks
from branch_replay.batch import ReplayBatch, validate
from branch_replay.config import Config
from branch_replay.tasks import TaskConfig
from branch_replay.tokenizer import TOKENIZER
from models import transformer as tfm

SFT_LOSS = losses.LossConfig(name="pg", aggregation="token_mean")  # -mean log p(answer)


@flax.struct.dataclass
class TrainState:
  params: Any
  opt_state: Any
  step: jax.Array  # int32: steps taken (warm-up included)
  rng: jax.Array  # uint32 raw key data (checkpointable)
  ref_params: Any = None  # the frozen reference policy (only with loss.kl_coef > 0)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  t = cfg.train
  lr = t.learning_rate
  if t.sft_steps:
    lr = optax.join_schedules([optax.constant_schedule(t.sft_learning_rate),
                               optax.constant_schedule(t.learning_rate)], [t.sft_steps])
  return optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=t.weight_decay))


def shardings(tree, kind: str, cfg: Config):
  """Where arrays live, kind 'state' or 'batch': the one placement decision of the trainer.
  With cfg.mesh, the mesh's (sharding.py: FSDP/tensor params and optimizer state, batches
  by prompt and branch); else the first device, whole arrays."""
  if cfg.mesh:
    mesh = sharding.make_mesh(cfg.mesh)
    if kind == "state":
      params = sharding.param_shardings(mesh, cfg.model)
      return tree.replace(
          params=params, step=sharding.replicated(mesh), rng=sharding.replicated(mesh),
          opt_state=sharding.opt_state_shardings(mesh, make_optimizer(cfg), tree.opt_state,
                                                 params),
          ref_params=None if tree.ref_params is None else params)
    if isinstance(tree, ReplayBatch):
      return sharding.batch_shardings(mesh, tree)
    return sharding.prompt_shardings(mesh, tree)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda _: device, tree)


def place(tree, kind: str, cfg: Config):
  if cfg.mesh:  # host data -> global arrays, on one process or several
    return sharding.put(tree, shardings(tree, kind, cfg))
  return jax.device_put(tree, shardings(tree, kind, cfg))


def init_state(cfg: Config, init_params=None) -> TrainState:
  """Shapes first (eval_shape), then placement, then the arrays (created where they live).
  init_params (e.g. an imported checkpoint, `models.hf.load`) replace the random init."""

  def init(init_params):
    init_key, rng = jax.random.split(jax.random.key(cfg.train.seed))
    params = tfm.init_params(cfg.model, init_key) if init_params is None else init_params
    ref = jax.tree.map(jnp.copy, params) if cfg.loss.kl_coef else None
    return TrainState(params, make_optimizer(cfg).init(params), jnp.zeros((), jnp.int32),
                      jax.random.key_data(rng), ref)

  if init_params is not None:
    expected = jax.eval_shape(lambda: tfm.init_params(cfg.model, jax.random.key(0)))
    got = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), init_params)
    if jax.tree.structure(got) != jax.tree.structure(expected) or got != expected:
      raise ValueError("init_params: the parameter tree does not match model config "
                       f"{cfg.model} (shapes/dtypes differ)")
  shapes = jax.eval_shape(init, init_params)
  return jax.jit(init, out_shardings=shardings(shapes, "state", cfg))(init_params)


def make_train_step(cfg: Config, phase: str = "rl"):
  """Pure `train_step(state, batch) -> (state, metrics)`; phase 'sft' uses -log p."""
  tx = make_optimizer(cfg)
  loss_cfg = cfg.loss if phase == "rl" else SFT_LOSS
  branch_chunk = cfg.replay.branch_chunk if phase == "rl" else None

  def train_step(state: TrainState, batch: ReplayBatch):
    if cfg.mesh and cfg.replay.mode == "replay":
      loss, aux_BR, grads = sharding.sharded_loss_and_grad(
          sharding.make_mesh(cfg.mesh), state.params, batch, cfg.model, loss_cfg, branch_chunk)
    else:
      loss, aux_BR, grads = policy.loss_and_grad(state.params, batch, cfg.model, loss_cfg,
                                                 mode=cfg.replay.mode, branch_chunk=branch_chunk)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.maximum(aux_BR["tokens"].sum(), 1)
    out = {"loss/policy": loss, "kl": aux_BR["kl_sum"].sum() / n,
           "entropy": aux_BR["entropy_sum"].sum() / n, "grad/norm": optax.tree.norm(grads),
           "logp/mean": aux_BR["logp_sum"].sum() / n}
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), out

  return train_step


# ----------------------------------------------------------------------------- batches


def sft_batch(task, rng: np.random.Generator, cfg: Config, tok=TOKENIZER) -> ReplayBatch:
  """Warm-up batch: the task's long prefix shared by its reference answers (one per tail)."""
  items = [task.supervised(rng) for _ in range(cfg.train.sft_batch_size)]
  prefix_BP, prefix_valid_BP = tasks.encode_prompts([p for p, _ in items], task.sft_prompt_len,
                                                    tok)
  T = task.sft_tail_len  # the task's longest warm-up tail, EOS included
  tails = [tasks.encode_right(t, T, tok) for _, t in items]
  tails_BRT = np.stack([t for t, _ in tails])
  valid_BRT = np.stack([v for _, v in tails])
  B, R = tails_BRT.shape[:2]
  chex.assert_shape([tails_BRT, valid_BRT], (B, R, T))
  chex.assert_shape([prefix_BP, prefix_valid_BP], (B, task.sft_prompt_len))
  return ReplayBatch(prefix_BP=prefix_BP, prefix_valid_BP=prefix_valid_BP, tails_BRT=tails_BRT,
                     tail_valid_BRT=valid_BRT,
                     advantages_BR=np.ones(tails_BRT.shape[:2], np.float32))


def completions(samples: sampler.Samples, tok=TOKENIZER) -> list[list[str]]:
  """Decoded trunk + branch text (up to EOS) for every prompt and branch."""
  trunk_BW = np.asarray(samples.trunk_BW)
  tokens_BRT = np.asarray(samples.tokens_BRT)
  return [[tok.decode(np.concatenate([trunk_BW[b], row]), strict=False) for row in tokens_BRT[b]]
          for b in range(tokens_BRT.shape[0])]


def rewards_of(task, examples, texts) -> np.ndarray:
  """[B, R] rewards, the whole batch in one call (`task.rewards`, branch_replay/rewards.py)."""
  return task.rewards(examples, texts)


def rl_batch(fns, state: TrainState, task, cfg: Config, step: int, tok=TOKENIZER):
  """Sample R branches of B fresh prompts, reward them, and assemble the GRPO batch:
  prefix = prompt (+ trunk), tails = branches, old log-probs = the sampler's."""
  t0 = time.time()
  examples = _examples(task, cfg.train.seed, step, cfg.train.batch_size)
  prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
  placed_BP, placed_valid_BP = place((prompt_BP, valid_BP), "batch", cfg)
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
  samples = jax.block_until_ready(fns.sample(state.params, prompt_BP=placed_BP,
                                             prompt_valid_BP=placed_valid_BP, key=key))
  if cfg.mesh:  # every process decodes and rewards all samples (they may span hosts)
    samples = sharding.to_host(samples)
  sample_s = time.time() - t0
  B, R, W = len(examples), cfg.train.n_branches, cfg.sampler.trunk_len
  chex.assert_shape([samples.tokens_BRT, samples.valid_BRT, samples.logp_BRT],
                    (B, R, cfg.sampler.max_new_tokens))
  chex.assert_shape([samples.trunk_BW, samples.trunk_logp_BW], (B, W))
  chex.assert_type([samples.tokens_BRT, samples.logp_BRT], [int, float])
  rewards_BR = rewards_of(task, examples, completions(samples, tok))
  advantages_BR = losses.group_advantages(jnp.asarray(rewards_BR),
                                          use_std=cfg.train.advantage_std)
  batch = sampler.to_batch(prompt_BP, valid_BP, samples, advantages_BR)
  if state.ref_params is not None:  # k3 KL: reference log-probs, one shared-prefix forward
    scored = fns.score(state.ref_params, batch=place(batch, "batch", cfg))
    ref_BRT, ref_trunk_BW = sharding.to_host(scored) if cfg.mesh else scored
    batch = batch.replace(ref_logp_BRT=ref_BRT,
                          trunk_ref_logp_BW=ref_trunk_BW if batch.trunk_len else None)
  validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  return batch, {"reward/mean": float(rewards_BR.mean()), "reward/std": float(rewards_BR.std()),
                 "time/sample_s": sample_s}


# ----------------------------------------------------------------------------- the loop


def _state_dict(state: TrainState) -> dict:
  d = dict(params=state.params, opt_state=state.opt_state, step=state.step, rng=state.rng)
  if state.ref_params is not None:
    d["ref_params"] = state.ref_params
  return d


def _examples(task, seed: int, stream: int, n: int):
  rng = np.random.default_rng([seed, stream])  # data depends only on (seed, step): resumable
  return [task.sample(rng) for _ in range(n)]


def _finite_or_stop(values: dict, step: int, ckpt: checkpoint.Checkpointer):
  for name in ("loss/policy", "grad/norm"):
    if not np.isfinite(values[name]):
      last = ckpt.latest_step()
      where = (f"the last good checkpoint is step {last} in {ckpt.directory}"
               if last is not None else "no checkpoint was written yet")
      raise FloatingPointError(f"{name} is {values[name]} at step {step}: stopping; {where}")


class _Fns(NamedTuple):
  rl_step: Any
  sft_step: Any
  sample: Any
  greedy: Any
  score: Any


def _compile_key(cfg: Config) -> Config:
  """The config with the fields that cannot change a compiled function reset."""
  train = dataclasses.replace(cfg.train, seed=0, rl_steps=0, checkpoint_every=1,
                              keep_checkpoints=1, eval_size=0, progress=False, plot=False,
                              tensorboard=False)
  return dataclasses.replace(cfg, train=train, task=TaskConfig())


@functools.lru_cache(maxsize=8)
def _compiled(cfg: Config, eos_id: int = TOKENIZER.eos_id) -> _Fns:
  """The jitted functions of a config, kept across `run` calls in one process (a notebook,
  the tests), so a second run of the same model does not compile again."""
  greedy = sampler.SamplerConfig(max_new_tokens=cfg.sampler.max_new_tokens, temperature=0.0,
                                 trunk_len=cfg.sampler.trunk_len)
  sample = functools.partial(sampler.sample, model_cfg=cfg.model, n_branches=cfg.train.n_branches,
                             stop_tokens=(eos_id,))
  return _Fns(
      rl_step=jax.jit(make_train_step(cfg, "rl"), donate_argnums=0),
      sft_step=jax.jit(make_train_step(cfg, "sft"), donate_argnums=0),
      sample=jax.jit(functools.partial(sample, cfg=cfg.sampler)),
      greedy=jax.jit(functools.partial(sampler.sample, model_cfg=cfg.model, cfg=greedy,
                                       n_branches=1, stop_tokens=(eos_id,))),
      score=jax.jit(functools.partial(sampler.score, model_cfg=cfg.model)))


def run(cfg: Config, workdir: str, *, init_params=None, tokenizer=None) -> dict:
  """Train (resuming from `workdir` if it holds a checkpoint); returns the summary.

  init_params: start from these (an imported checkpoint) instead of a random init; a
  checkpoint in `workdir` still takes precedence (resume). tokenizer: the text <-> ids map of
  the tasks (default: the shipped character tokenizer; `tokenizer.from_model_dir` for an
  imported checkpoint's tokenizer.json)."""
  if cfg.tree.fanouts:  # trees: the tree trainer (tree_train.py) runs the same loop
    from branch_replay import tree_train
    return tree_train.run(cfg, workdir, init_params=init_params, tokenizer=tokenizer)
  tok = TOKENIZER if tokenizer is None else tokenizer
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: expected >= the tokenizer's "
                     f"{tok.vocab_size}")
  t_start = time.time()
  workdir = checkpoint.check_workdir(workdir)  # before any compute
  task = tasks.make(cfg.task, tok)  # a task that reads files checks them here
  task.check(cfg)
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  ckpt.check_config()
  state = init_state(cfg, init_params)
  start = 0
  if ckpt.latest_step() is not None:
    start = ckpt.latest_step()
    state = TrainState(**ckpt.restore(start, _state_dict(state)))
  # Several processes (multi-host) run this loop alike; only process 0 writes metrics.
  chief = jax.process_index() == 0
  writer = metrics.MetricsWriter(os.path.join(workdir, "metrics.jsonl") if chief else os.devnull,
                                 tensorboard=cfg.train.tensorboard and chief)
  t = cfg.train

  fns = _compiled(_compile_key(cfg), tok.eos_id)
  eval_examples = task.eval_examples(t.seed, t.eval_size) if t.eval_size else []

  def evaluate(state, step):
    prompt_BP, valid_BP = tasks.encode_prompts(eval_examples, task.max_prompt_len, tok)
    s = fns.greedy(state.params, prompt_BP=prompt_BP, prompt_valid_BP=valid_BP,
                  key=jax.random.key(0))
    s = sharding.to_host(s) if cfg.mesh else s
    reward = float(rewards_of(task, eval_examples, completions(s, tok)).mean())
    writer.write({"step": step, "kind": "eval", "eval/greedy_reward": reward})
    return reward

  from tqdm import tqdm
  bar = tqdm(total=t.total_steps, initial=start, disable=not (t.progress and chief),
             dynamic_ncols=True,
             desc="train")
  for step in range(start, t.total_steps):
    t0 = time.time()
    rec = {"step": step, "kind": "train"}
    if step < t.sft_steps:
      rec["phase"] = "sft"
      batch = sft_batch(task, np.random.default_rng([t.seed, step]), cfg, tok)
      validate(batch, cfg.model.vocab_size)
      step_fn = fns.sft_step
      rec["time/sample_s"] = 0.0
    else:
      rec["phase"] = "rl"
      if step == t.sft_steps:
        if eval_examples:
          rec_eval = evaluate(state, step)
          bar.write(f"step {step}: greedy eval reward before RL {rec_eval:.3f}")
        if state.ref_params is not None:  # the reference policy: the policy as RL begins
          state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
      batch, sampled = rl_batch(fns, state, task, cfg, step, tok)
      rec.update(sampled)
      step_fn = fns.rl_step
    batch = place(batch, "batch", cfg)
    t1 = time.time()
    state, out = step_fn(state, batch)
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    rec["time/train_s"] = time.time() - t1
    _finite_or_stop(out, step, ckpt)
    prefix, tails, naive = batch.token_counts()
    rec.update(out)
    rec.update({"replay/prefix_tokens": prefix, "replay/tail_tokens": tails,
                "replay/naive_equiv_tokens": naive,
                "replay/computed_tokens": naive if cfg.replay.mode == "naive" else prefix + tails,
                "time/step_s": time.time() - t0})
    writer.write(rec)
    if (step + 1) % t.checkpoint_every == 0 or step + 1 == t.total_steps:
      ckpt.save(step + 1, _state_dict(state))
    bar.update(1)
    bar.set_postfix({k: f"{rec[k]:.3f}" for k in ("reward/mean", "loss/policy") if k in rec})
  bar.close()
  records = metrics.read(writer.path)
  if eval_examples and t.rl_steps and _final_eval_missing(records, t.total_steps):
    evaluate(state, t.total_steps)
    records = metrics.read(writer.path)
  writer.close()
  ckpt.close()
  plot_path = (metrics.plot(records, os.path.join(workdir, "metrics.png"))
               if t.plot and chief else None)
  summary = summarize(records, cfg)
  summary.update(workdir=workdir, checkpoint=ckpt.directory, metrics=writer.path,
                 plot=plot_path, wall_s=time.time() - t_start,
                 final_params=state.params)
  return summary


def _final_eval_missing(records, step: int) -> bool:
  """Whether the final greedy evaluation still has to run. Only process 0 writes (and so can
  read) metrics.jsonl, and the evaluation is a collective every process must enter alike:
  process 0 decides and every process receives its decision."""
  missing = not any(r.get("kind") == "eval" and r["step"] == step for r in records)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    missing = bool(multihost_utils.broadcast_one_to_all(np.int32(missing)))
  return missing


def summarize(records, cfg: Config) -> dict:
  train = [r for r in records if r.get("kind", "train") == "train"]
  rl = [r for r in train if r.get("reward/mean") is not None]
  k = max(1, min(10, len(rl) // 4))
  evals = {r["step"]: r["eval/greedy_reward"] for r in records if r.get("kind") == "eval"}
  mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
  return {
      "reward_before": mean([r["reward/mean"] for r in rl[:k]]),
      "reward_after": mean([r["reward/mean"] for r in rl[-k:]]),
      "reward_window": k,
      "eval_before": evals.get(cfg.train.sft_steps),
      "eval_after": evals.get(cfg.train.total_steps),
      "computed_tokens": int(sum(r["replay/computed_tokens"] for r in train)),
      "rl_computed_tokens": int(sum(r["replay/computed_tokens"] for r in rl)),
      "rl_naive_equiv_tokens": int(sum(r["replay/naive_equiv_tokens"] for r in rl)),
      "naive_equiv_tokens": int(sum(r["replay/naive_equiv_tokens"] for r in train)),
      "train_time_s": float(sum(r["time/step_s"] for r in train)),
      "steps": len(train),
  }


def _shown(path):
  """A path relative to the working directory when it lies under it (as it was given)."""
  if not path:
    return path
  rel = os.path.relpath(path)
  return path if rel.startswith("..") else rel


def format_summary(s: dict) -> str:
  ratio = s["naive_equiv_tokens"] / max(s["computed_tokens"], 1)
  fmt = lambda x: "n/a" if x is None or x != x else f"{x:.3f}"
  return "\n".join([
      f"reward/mean (sampled, mean of first/last {s['reward_window']} RL steps): "
      f"{fmt(s['reward_before'])} -> {fmt(s['reward_after'])}",
      f"greedy eval reward before/after RL: {fmt(s['eval_before'])} -> {fmt(s['eval_after'])}",
      f"token positions computed: {s['computed_tokens']:,} vs naive equivalent "
      f"{s['naive_equiv_tokens']:,} ({ratio:.1f}x fewer; RL steps alone "
      f"{s['rl_computed_tokens']:,} vs {s['rl_naive_equiv_tokens']:,}, "
      f"{s['rl_naive_equiv_tokens'] / max(s['rl_computed_tokens'], 1):.1f}x)",
      f"time: {s['wall_s']:.0f} s wall ({s['train_time_s']:.0f} s in {s['steps']} steps)",
      f"checkpoints: {_shown(s['checkpoint'])}",
      f"metrics: {_shown(s['metrics'])}",
      f"plot: {_shown(s['plot'])}",
  ])
