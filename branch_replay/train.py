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

from branch_replay import (advantages, checkpoint, critic, dapo, losses, metrics, phases,
                           policy, sampler, sharding, tasks, verify)
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
  critic: Any = None  # PPO's value model: dict(params, opt_state) (train.advantage=gae);
  # params {'model', 'head'}, or {'head'} alone with critic.share (the body is `params`)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
  t = cfg.train
  lr = t.learning_rate
  if t.sft_steps:
    lr = optax.join_schedules([optax.constant_schedule(t.sft_learning_rate),
                               optax.constant_schedule(t.learning_rate)], [t.sft_steps])
  return optax.chain(optax.clip_by_global_norm(t.grad_clip),
                     optax.adamw(lr, b1=0.9, b2=0.99, weight_decay=t.weight_decay))


def make_critic_optimizer(cfg: Config) -> optax.GradientTransformation:
  return optax.chain(optax.clip_by_global_norm(cfg.train.grad_clip),
                     optax.adamw(cfg.critic.learning_rate, b1=0.9, b2=0.99))


def rl_loss_config(cfg: Config) -> losses.LossConfig:
  """The RL objective scores log-probs at the sampler's temperature (the ratio's
  denominator is the distribution the tokens were drawn from)."""
  return dataclasses.replace(cfg.loss, temperature=cfg.sampler.temperature)


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
    value = None
    if cfg.uses_critic:  # the value model starts as the policy (copied again at RL start)
      critic_params = critic.init_params(cfg.model, init_key, params, share=cfg.critic.share)
      value = dict(params=critic_params, opt_state=make_critic_optimizer(cfg).init(critic_params))
    return TrainState(params, make_optimizer(cfg).init(params), jnp.zeros((), jnp.int32),
                      jax.random.key_data(rng), ref, value)

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
  loss_cfg = rl_loss_config(cfg) if phase == "rl" else SFT_LOSS
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
    scored = jnp.maximum(aux_BR["scored_tokens"].sum(), 1)
    out.update({"clip_frac": aux_BR["clip_sum"].sum() / scored,
                "approx_kl": aux_BR["approx_kl_sum"].sum() / scored,
                "ratio/max": aux_BR["ratio_max"].max()})
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), out

  return train_step


def make_critic_step(cfg: Config):
  """Pure `critic_step(state, critic_batch) -> (state, metrics)`: one value-model update
  through branch replay (or its naive twin). With critic.share the head alone is updated,
  reading the policy's current transformer (`state.params`, not differentiated)."""
  tx = make_critic_optimizer(cfg)

  def critic_step(state: TrainState, cb: critic.CriticBatch):
    params, opt_state = state.critic["params"], state.critic["opt_state"]
    loss, aux_BR, grads = critic.loss_and_grad(params, cb, cfg.model, cfg.critic,
                                               mode=cfg.replay.mode,
                                               body_params=_critic_body(state, cfg))
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    n = jnp.maximum(aux_BR["tokens"].sum(), 1)
    out = {"loss/value": loss, "value/clip_frac": aux_BR["clip_sum"].sum() / n,
           "value/grad_norm": optax.tree.norm(grads)}
    return state.replace(critic=dict(params=params, opt_state=opt_state)), out

  return critic_step


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
  """Sample R branches of B fresh prompts, reward them, and assemble the RL batch:
  prefix = prompt (+ trunk), tails = branches, old log-probs = the sampler's; advantages
  from `train.advantage` (a group estimator, or GAE from the critic's values). With
  `train.dynamic_sampling` (DAPO) groups whose rewards are all equal are replaced by
  groups of fresh prompts, up to `train.max_sample_rounds` sampling rounds."""
  t = cfg.train
  stats = {}
  timer = phases.Timer()  # [rollouts] time by phase

  def draw(round_):
    examples = _examples(task, t.seed, step if round_ == 0 else (step, round_), t.batch_size)
    prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
    placed_BP, placed_valid_BP = place((prompt_BP, valid_BP), "batch", cfg)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    if round_:
      key = jax.random.fold_in(key, round_)
    with timer("sample"):
      samples = jax.block_until_ready(fns.sample(state.params, prompt_BP=placed_BP,
                                                 prompt_valid_BP=placed_valid_BP, key=key))
    if cfg.mesh:  # every process decodes and rewards all samples (they may span hosts)
      samples = sharding.to_host(samples)
    samples = jax.tree.map(np.asarray, samples)
    B, R, W = len(examples), t.n_branches, cfg.sampler.trunk_len
    chex.assert_shape([samples.tokens_BRT, samples.valid_BRT, samples.logp_BRT],
                      (B, R, cfg.sampler.max_new_tokens))
    chex.assert_shape([samples.trunk_BW, samples.trunk_logp_BW], (B, W))
    with timer("reward"):
      raw_BR = rewards_of(task, examples, completions(samples, tok))
    rows = dict(prompt_BP=prompt_BP, valid_BP=valid_BP, raw_BR=raw_BR,
                **samples._asdict())
    return rows, raw_BR + _overlong(samples, cfg)

  if t.dynamic_sampling:
    rows, rewards_BR, stats = dapo.dynamic_sample(draw, t.batch_size, t.max_sample_rounds)
  else:
    rows, rewards_BR = draw(0)
  samples = sampler.Samples(**{k: rows[k] for k in sampler.Samples._fields})
  prompt_BP, valid_BP = rows["prompt_BP"], rows["valid_BP"]
  B, R = rewards_BR.shape
  adv_BR = (np.zeros((B, R), np.float32) if t.advantage in advantages.NEEDS_CRITIC
            else advantages.compute(t.advantage, rewards_BR, t))
  batch = sampler.to_batch(prompt_BP, valid_BP, samples, jnp.asarray(adv_BR))
  if state.ref_params is not None:  # k3 KL: reference log-probs, one shared-prefix forward
    with timer("ref_logp"):
      scored = jax.block_until_ready(fns.score(state.ref_params, batch=place(batch, "batch", cfg)))
    ref_BRT, ref_trunk_BW = sharding.to_host(scored) if cfg.mesh else scored
    batch = batch.replace(ref_logp_BRT=ref_BRT,
                          trunk_ref_logp_BW=ref_trunk_BW if batch.trunk_len else None)
  cb = None
  if cfg.uses_critic:
    batch, cb, critic_stats = _gae_batch(fns, state, batch, rewards_BR, cfg)
    stats.update(critic_stats)
  validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  raw = rows["raw_BR"]
  return batch, cb, {"reward/mean": float(raw.mean()), "reward/std": float(raw.std()),
                     "reward/shaped_mean": float(rewards_BR.mean()),
                     **timer.metrics(), **stats}  # old_logp_s 0: the sampler's log-probs


def _overlong(samples, cfg: Config):
  t = cfg.train
  if not t.overlong_buffer:
    return 0.0
  W = np.asarray(samples.trunk_BW).shape[1]
  lengths_BR = np.asarray(samples.valid_BRT).sum(-1) + W
  return dapo.overlong_penalty(lengths_BR, cfg.sampler.max_new_tokens + W, t.overlong_buffer,
                               t.overlong_penalty).astype(np.float32)


def _critic_body(state: TrainState, cfg: Config):
  """The transformer a shared critic's head reads (the policy's); None for a separate one."""
  return state.params if cfg.critic.share else None


def _gae_batch(fns, state, batch: ReplayBatch, rewards_BR, cfg: Config):
  """PPO: the critic's values of every scored token (one shared-prefix forward), GAE per
  branch, per-token advantages for the policy and returns for the critic."""
  c = cfg.critic
  old_values_BRX = np.asarray(fns.values(state.critic["params"], batch=batch,
                                         body_params=_critic_body(state, cfg)), np.float64)
  valid_BRX = critic.scored_mask(batch)
  adv_BRX, returns_BRX = critic.gae(rewards_BR, old_values_BRX, valid_BRX, c.gamma, c.lam)
  ret, v = returns_BRX[valid_BRX], old_values_BRX[valid_BRX]
  stats = {"value/explained_variance": critic.explained_variance(old_values_BRX, returns_BRX,
                                                                  valid_BRX),
           "value/mean": float(v.mean()),
           # per-step sums for an explained variance pooled over steps
           # (critic.pooled_explained_variance; the summary's value_ev_before/after)
           "value/sq_err": float(np.mean((ret - v) ** 2)), "value/return_var": float(ret.var()),
           "value/return_mean": float(ret.mean()), "value/tokens": int(valid_BRX.sum())}
  policy_adv = critic.whiten(adv_BRX, valid_BRX) if c.whiten else adv_BRX
  W = batch.trunk_len
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  batch = batch.replace(advantages_BR=f32(np.zeros(rewards_BR.shape)),
                        advantages_BRT=f32(policy_adv[..., W:]),
                        trunk_advantages_BRW=f32(policy_adv[..., :W]))
  cb = critic.CriticBatch(batch, f32(returns_BRX), f32(old_values_BRX))
  return batch, cb, stats


def minibatches(tree, cfg: Config, step: int, epoch: int):
  """The sampled batch split by prompt into train.minibatches parts, in a per-epoch order."""
  B = cfg.train.batch_size
  M = cfg.train.minibatches
  if M == 1 and epoch == 0:
    return [tree]
  order = np.random.default_rng([cfg.train.seed, step, epoch, 7]).permutation(B)
  parts = np.split(order, M)
  return [jax.tree.map(lambda x, idx=np.sort(idx): np.asarray(x)[idx], tree) for idx in parts]


# ----------------------------------------------------------------------------- the loop


def _state_dict(state: TrainState) -> dict:
  d = dict(params=state.params, opt_state=state.opt_state, step=state.step, rng=state.rng)
  if state.ref_params is not None:
    d["ref_params"] = state.ref_params
  if state.critic is not None:
    d["critic"] = state.critic
  return d


def _examples(task, seed: int, stream, n: int):
  # data depends only on (seed, step[, round]): resumable
  rng = np.random.default_rng([seed, *np.atleast_1d(stream).tolist()])
  return [task.sample(rng) for _ in range(n)]


def _finite_or_stop(values: dict, step: int, ckpt: checkpoint.Checkpointer):
  for name in ("loss/policy", "grad/norm"):
    if not np.isfinite(values[name]):
      last = ckpt.latest_step()
      where = (f"the last good checkpoint is step {last} in {ckpt.directory}"
               if last is not None else "no checkpoint was written yet")
      raise FloatingPointError(f"{name} is {values[name]} at step {step}: stopping; {where}")


def _rl_update(fns, state, batch, cb, cfg: Config, step: int):
  """train.ppo_epochs passes of train.minibatches replay steps over one sampled batch (the
  value model steps alongside on the same minibatch); metrics averaged over the steps, the
  ratio's maximum over all of them."""
  outs = []
  for epoch in range(cfg.train.ppo_epochs):
    parts = minibatches(batch, cfg, step, epoch)
    critic_parts = minibatches(cb, cfg, step, epoch) if cb is not None else [None] * len(parts)
    for mb, cmb in zip(parts, critic_parts):
      state, out = fns.rl_step(state, place(mb, "batch", cfg))
      if cmb is not None:
        state, critic_out = fns.critic_step(state, cmb)
        out = {**out, **critic_out}
      outs.append({k: float(v) for k, v in jax.device_get(out).items()})
  avg = {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}
  avg["ratio/max"] = max(o["ratio/max"] for o in outs)
  avg["clip_frac/last"] = outs[-1]["clip_frac"]
  return state, avg


class _Fns(NamedTuple):
  rl_step: Any
  sft_step: Any
  sample: Any
  greedy: Any
  score: Any
  critic_step: Any
  values: Any


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
      score=jax.jit(functools.partial(sampler.score, model_cfg=cfg.model,
                                      temperature=cfg.sampler.temperature)),
      critic_step=jax.jit(make_critic_step(cfg), donate_argnums=0),
      values=jax.jit(functools.partial(critic.values, model_cfg=cfg.model)))


def run(cfg: Config, workdir: str, *, init_params=None, tokenizer=None) -> dict:
  """Train (resuming from `workdir` if it holds a checkpoint); returns the summary.

  init_params: start from these (an imported checkpoint) instead of a random init; a
  checkpoint in `workdir` still takes precedence (resume). tokenizer: the text <-> ids map of
  the tasks (default: the shipped character tokenizer; `tokenizer.from_model_dir` for an
  imported checkpoint's tokenizer.json)."""
  if cfg.tree.fanouts:  # trees: the tree trainer (tree_train.py) runs the same loop
    from branch_replay import tree_train
    return tree_train.run(cfg, workdir, init_params=init_params, tokenizer=tokenizer)
  if cfg.task.name == "rollouts":  # [rollouts] completions from a file, not our sampler
    from branch_replay import rollouts_train
    return rollouts_train.run(cfg, workdir, init_params=init_params, tokenizer=tokenizer)
  if cfg.loss.name == "dpo":  # preference pairs, not sampled groups
    from branch_replay import dpo
    return dpo.run(cfg, workdir, init_params=init_params, tokenizer=tokenizer)
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
  do_verify = verify.enabled(cfg.replay.verify, init_params is not None)  # [rollouts]
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
        if state.critic is not None and not cfg.critic.share:  # the value model starts
          # from the policy too (a shared critic's body IS the policy)
          state = state.replace(critic=dict(
              params={**state.critic["params"],
                      "model": jax.tree.map(jnp.copy, state.params)},
              opt_state=state.critic["opt_state"]))
      batch, cb, sampled = rl_batch(fns, state, task, cfg, step, tok)
      rec.update(sampled)
      step_fn = fns.rl_step
    if rec["phase"] == "rl" and do_verify and not cfg.mesh:  # [rollouts] self-check, once
      rec.update(verify.check(state.params, batch, cfg.model, rl_loss_config(cfg),
                              branch_chunk=cfg.replay.branch_chunk))
      do_verify = False
    t1 = time.time()
    if rec["phase"] == "rl":
      state, out = _rl_update(fns, state, batch, cb, cfg, step)
      rec["time/update_s"] = time.time() - t1  # [rollouts]
    else:
      batch = place(batch, "batch", cfg)
      state, out = step_fn(state, batch)
      out = {k: float(v) for k, v in jax.device_get(out).items()}
    rec["time/train_s"] = time.time() - t1
    _finite_or_stop(out, step, ckpt)
    passes = t.ppo_epochs if rec["phase"] == "rl" else 1  # each pass replays the batch
    prefix, tails, naive = (passes * n for n in batch.token_counts())
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
  has_critic = any("value/tokens" in r for r in rl)
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
      # PPO's critic: explained variance of the old values, pooled over the same windows
      "value_ev_before": critic.pooled_explained_variance(rl[:k]) if has_critic else None,
      "value_ev_after": critic.pooled_explained_variance(rl[-k:]) if has_critic else None,
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
      *([f"value/explained_variance (pooled, first/last {s['reward_window']} RL steps): "
         f"{fmt(s['value_ev_before'])} -> {fmt(s['value_ev_after'])}"]
        if s.get("value_ev_before") is not None else []),
      f"time: {s['wall_s']:.0f} s wall ({s['train_time_s']:.0f} s in {s['steps']} steps)",
      f"checkpoints: {_shown(s['checkpoint'])}",
      f"metrics: {_shown(s['metrics'])}",
      f"plot: {_shown(s['plot'])}",
  ])
