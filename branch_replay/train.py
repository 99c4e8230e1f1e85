"""Flat RL's pieces (the loop is trainer.py, the algorithm algorithms/grpo.py): sample R
branches per prompt from a shared prefix, reward them, and take GRPO/PPO steps through branch
replay (or its naive twin, `replay.mode=naive`).

  make_train_step(cfg)        pure train_step(state, batch) -> (state, metrics)
  rl_batch / rl_update        the rollout (sample, reward, advantages) and epochs x minibatches
                              (PPO's critic and GAE: algorithms/ppo.py)
  compiled(compile_key(cfg))  the jitted steps of a config (cached across runs)

An optional supervised warm-up (`train.sft_steps`) runs through the same engine: prefix =
the long prompt, tails = the reference answers, objective = -log p (pg with advantage 1).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax

from branch_replay import (advantages, dapo, engine, losses, metrics, phases, policy, sampler,
                           sharding, tasks, tree)
from branch_replay.config import Config
from branch_replay.state import (TrainState, make_optimizer, place, reference, sample_examples,
                                 weights)
from branch_replay.tasks import TaskConfig
from branch_replay.tokenizer import TOKENIZER
from models import lora as lora_lib

SFT_LOSS = losses.LossConfig(name="pg", aggregation="token_mean")  # -mean log p(answer)


def rl_loss_config(cfg: Config) -> losses.LossConfig:
  """The RL objective scores log-probs at the sampler's temperature (the ratio's
  denominator is the distribution the tokens were drawn from)."""
  return dataclasses.replace(cfg.loss, temperature=cfg.sampler.temperature)


def loss_and_grad(cfg: Config, params, batch, loss_cfg, branch_chunk=None, params_fn=None):
  """(loss, aux_BR, grads) of a flat batch or a tree (TreeBatch): replay or the naive twin
  (`replay.mode`), on one device or, with `mesh`, sharded (the naive twin by the partitioner
  alone, from the sharded inputs). params_fn(params) -> the model's weights (LoRA:
  `lora_params_fn`; params are the adapters and grads theirs)."""
  if cfg.mesh and cfg.replay.mode == "replay":
    mesh = sharding.make_mesh(cfg.mesh)
    return sharding.sharded_loss_and_grad(mesh, params, batch, cfg.model, loss_cfg, branch_chunk,
                                          params_fn)
  engine_ = policy if policy.is_flat(batch) else engine
  return engine_.loss_and_grad(params, batch, cfg.model, loss_cfg, mode=cfg.replay.mode,
                               branch_chunk=branch_chunk, params_fn=params_fn)


def lora_params_fn(cfg: Config, state: TrainState):
  """LoRA: adapters -> the merged weights, the frozen base a constant of the differentiated
  function (no gradient); None for full fine-tuning."""
  if state.base is None:
    return None
  return lambda adapters: lora_lib.merge(state.base, adapters, cfg.lora)


def make_train_step(cfg: Config, phase: str = "rl", loss_cfg=None):
  """Pure `train_step(state, batch) -> (state, metrics)` for flat and tree batches; phase
  'sft' uses -log p; loss_cfg replaces the RL objective (default `rl_loss_config`)."""
  tx = make_optimizer(cfg)
  if loss_cfg is None:
    loss_cfg = rl_loss_config(cfg) if phase == "rl" else SFT_LOSS
  branch_chunk = cfg.replay.branch_chunk if phase == "rl" else None

  def train_step(state: TrainState, batch):
    loss, aux_BR, grads = loss_and_grad(cfg, state.params, batch, loss_cfg, branch_chunk,
                                        lora_params_fn(cfg, state))
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


# ----------------------------------------------------------------------------- batches


def sft_batch(task, rng: np.random.Generator, cfg: Config, tok=TOKENIZER) -> tree.TreeBatch:
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
  return tree.flat(prefix_BP=prefix_BP, prefix_valid_BP=prefix_valid_BP, tails_BRT=tails_BRT,
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
  from `algo.advantage` (a group estimator; for GAE zeros, which PPO replaces from its
  critic's values and the returned rewards, algorithms/ppo.py). With
  `algo.dynamic_sampling` (DAPO) groups whose rewards are all equal are replaced by
  groups of fresh prompts, up to `algo.max_sample_rounds` sampling rounds. Stats include
  the seconds of each phase (phases.py; every sampling round included): time/sample_s =
  data_s (prompts drawn, encoded) + generate_s; reward_s; old_logp_s = 0 (the sampler returns
  the behaviour log-probs with the tokens: part of sampling); ref_logp_s; assemble_s."""
  t, a = cfg.train, cfg.algo
  stats = {}
  phase_s = dict.fromkeys(("data", "generate", "reward"), 0.0)
  model_weights = weights(state, cfg.lora)  # LoRA: the merged weights

  def draw(round_):
    d0 = time.perf_counter()
    examples = sample_examples(task, t.seed, step if round_ == 0 else (step, round_),
                               t.batch_size)
    prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
    placed_BP, placed_valid_BP = place((prompt_BP, valid_BP), "batch", cfg)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    if round_:
      key = jax.random.fold_in(key, round_)
    d1 = time.perf_counter()
    samples = jax.block_until_ready(fns.sample(model_weights, prompt_BP=placed_BP,
                                               prompt_valid_BP=placed_valid_BP, key=key))
    samples = sharding.to_host(samples)  # every process decodes and rewards all samples
    d2 = time.perf_counter()
    B, R, W = len(examples), t.n_branches, cfg.sampler.trunk_len
    chex.assert_shape([samples.tokens_BRT, samples.valid_BRT, samples.logp_BRT],
                      (B, R, cfg.sampler.max_new_tokens))
    chex.assert_shape([samples.trunk_BW, samples.trunk_logp_BW], (B, W))
    raw_BR = rewards_of(task, examples, completions(samples, tok))
    rows = dict(prompt_BP=prompt_BP, valid_BP=valid_BP, raw_BR=raw_BR,
                **samples._asdict())
    for name, seconds in (("data", d1 - d0), ("generate", d2 - d1),
                          ("reward", time.perf_counter() - d2)):
      phase_s[name] += seconds
    return rows, raw_BR + _overlong(samples, cfg)

  if a.dynamic_sampling:
    rows, rewards_BR, stats = dapo.dynamic_sample(draw, t.batch_size, a.max_sample_rounds)
  else:
    rows, rewards_BR = draw(0)
  samples = sampler.Samples(**{k: rows[k] for k in sampler.Samples._fields})
  t1 = time.perf_counter()
  prompt_BP, valid_BP = rows["prompt_BP"], rows["valid_BP"]
  B, R = rewards_BR.shape
  adv_BR = (np.zeros((B, R), np.float32) if a.advantage in advantages.NEEDS_CRITIC
            else advantages.compute(a.advantage, rewards_BR, a))
  batch = sampler.to_batch(prompt_BP, valid_BP, samples, jnp.asarray(adv_BR))
  ref = reference(state, cfg)  # LoRA: the base, adapters off
  if ref is not None:  # k3 KL: reference log-probs, one shared-prefix forward
    r0 = time.perf_counter()
    scored = jax.block_until_ready(fns.score(ref, batch=place(batch, "batch", cfg)))
    stats["time/ref_logp_s"] = time.perf_counter() - r0
    ref_BRT, ref_trunk_BW = sharding.to_host(scored)
    batch = batch.with_leaves(ref_logp_BRT=ref_BRT).replace(
        trunk_ref_logp_BW=ref_trunk_BW if batch.trunk_len else None)
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  raw = rows["raw_BR"]
  return batch, rewards_BR, {"reward/mean": float(raw.mean()), "reward/std": float(raw.std()),
                     "reward/shaped_mean": float(rewards_BR.mean()),
                     **{f"time/{name}_s": seconds for name, seconds in phase_s.items()},
                     "time/sample_s": phase_s["data"] + phase_s["generate"],
                     "time/old_logp_s": 0.0, "time/ref_logp_s": 0.0,
                     "time/assemble_s": time.perf_counter() - t1, **stats}


def _overlong(samples, cfg: Config):
  a = cfg.algo
  if not a.overlong_buffer:
    return 0.0
  W = np.asarray(samples.trunk_BW).shape[1]
  lengths_BR = np.asarray(samples.valid_BRT).sum(-1) + W
  return dapo.overlong_penalty(lengths_BR, cfg.sampler.max_new_tokens + W, a.overlong_buffer,
                               a.overlong_penalty).astype(np.float32)


def minibatches(tree, cfg: Config, step: int, epoch: int):
  """The sampled batch split by prompt into algo.minibatches parts, in a per-epoch order."""
  B = cfg.train.batch_size
  M = cfg.algo.minibatches
  if M == 1 and epoch == 0:
    return [tree]
  order = np.random.default_rng([cfg.train.seed, step, epoch, 7]).permutation(B)
  parts = np.split(order, M)
  return [jax.tree.map(lambda x, idx=np.sort(idx): np.asarray(x)[idx], tree) for idx in parts]


# ----------------------------------------------------------------------------- the loop


def rl_update(fns, state, batch, cfg: Config, step: int, step_fn=None):
  """algo.ppo_epochs passes of algo.minibatches replay steps over one sampled batch (any
  pytree of prompt-major arrays: PPO's is (policy batch, critic batch)); metrics averaged
  over the steps, the ratio's maximum over all of them. step_fn(state, minibatch) ->
  (state, metrics): default the policy's step on the placed minibatch."""
  if step_fn is None:
    step_fn = lambda state, mb: fns.rl_step(state, place(mb, "batch", cfg))
  outs = []
  for epoch in range(cfg.algo.ppo_epochs):
    for mb in minibatches(batch, cfg, step, epoch):
      state, out = step_fn(state, mb)
      outs.append({k: float(v) for k, v in jax.device_get(out).items()})
  avg = {k: float(np.mean([o[k] for o in outs])) for k in outs[0]}
  avg["ratio/max"] = max(o["ratio/max"] for o in outs)
  avg["clip_frac/last"] = outs[-1]["clip_frac"]
  return state, avg


class Fns(NamedTuple):
  rl_step: Any
  sft_step: Any
  sample: Any
  greedy: Any
  score: Any


def compile_key(cfg: Config) -> Config:
  """The config with the fields that cannot change a compiled function reset."""
  train = dataclasses.replace(cfg.train, seed=0, rl_steps=0, checkpoint_every=1,
                              keep_checkpoints=1, eval_size=0, progress=False, plot=False,
                              tensorboard=False)
  replay = dataclasses.replace(cfg.replay, auto_tree=False)  # trees dispatch at trace time
  return dataclasses.replace(cfg, train=train, task=TaskConfig(), replay=replay)


@functools.lru_cache(maxsize=8)
def compiled(cfg: Config, eos_id=TOKENIZER.eos_id) -> Fns:
  """The jitted functions of a config, kept across `run` calls in one process (a notebook,
  the tests), so a second run of the same model does not compile again. eos_id: the stop
  token, or a tuple of them (the tokenizer's stop_ids)."""
  stops = (eos_id,) if isinstance(eos_id, int) else tuple(eos_id)
  greedy = sampler.SamplerConfig(max_new_tokens=cfg.sampler.max_new_tokens, temperature=0.0,
                                 trunk_len=cfg.sampler.trunk_len)
  sample = functools.partial(sampler.sample, model_cfg=cfg.model, n_branches=cfg.train.n_branches,
                             stop_tokens=stops)
  return Fns(
      rl_step=jax.jit(make_train_step(cfg, "rl"), donate_argnums=0),
      sft_step=jax.jit(make_train_step(cfg, "sft"), donate_argnums=0),
      sample=jax.jit(functools.partial(sample, cfg=cfg.sampler)),
      greedy=jax.jit(functools.partial(sampler.sample, model_cfg=cfg.model, cfg=greedy,
                                       n_branches=1, stop_tokens=stops)),
      score=jax.jit(functools.partial(sampler.score, model_cfg=cfg.model,
                                      temperature=cfg.sampler.temperature)))


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
      "time_by_phase": phases.totals(records),
  }


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
      *([phases.format_totals(s["time_by_phase"])] if s.get("time_by_phase") else []),
      f"checkpoints: {metrics.shown(s['checkpoint'])}",
      f"metrics: {metrics.shown(s['metrics'])}",
      f"plot: {metrics.shown(s['plot'])}",
  ])
