"""Training on trees (`tree.fanouts` set): train.run hands over to `run` here.

The same loop as train.py (state, optimiser, checkpoints, metrics, resume), with tree batches:
  RL    sample a tree per prompt (tree_sampler: prompt prefilled once, R_1 first turns, R_2
        second turns of each), reward the leaves, tree-aware advantages (tree.tree_advantages),
        one jitted step through tree replay;
  SFT   warm-up trees from the task's reference turns (objective -log p), same engine.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax

from branch_replay import checkpoint, metrics, tasks, tree, tree_replay, tree_sampler, train
from branch_replay import tree_task  # noqa: F401  (registers the tree tasks)
from branch_replay.config import Config
from branch_replay.sampler import SamplerConfig
from branch_replay.tokenizer import TOKENIZER
from branch_replay.train import TrainState


def make_tree_train_step(cfg: Config, phase: str = "rl"):
  """Pure `train_step(state, batch: TreeBatch) -> (state, metrics)`."""
  tx = train.make_optimizer(cfg)
  loss_cfg = train.rl_loss_config(cfg) if phase == "rl" else train.SFT_LOSS
  branch_chunk = cfg.replay.branch_chunk if phase == "rl" else None

  def train_step(state: TrainState, batch: tree.TreeBatch):
    loss, aux_BR, grads = tree_replay.loss_and_grad(state.params, batch, cfg.model, loss_cfg,
                                                    cfg.replay.mode, branch_chunk)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    n = jnp.maximum(aux_BR["tokens"].sum(), 1)
    out = {"loss/policy": loss, "kl": aux_BR["kl_sum"].sum() / n,
           "entropy": aux_BR["entropy_sum"].sum() / n, "grad/norm": optax.tree.norm(grads),
           "logp/mean": aux_BR["logp_sum"].sum() / n}
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), out

  return train_step


def _encode_nodes(texts, length, tok, eos):
  ids = np.zeros((len(texts), length), np.int32)
  valid = np.zeros((len(texts), length), bool)
  for i, text in enumerate(texts):
    row = tok.encode(text, eos=eos)
    ids[i, :len(row)], valid[i, :len(row)] = row, True
  return ids, valid


def sft_batch(task, rng: np.random.Generator, cfg: Config, tok=TOKENIZER) -> tree.TreeBatch:
  """Warm-up trees: root = haystack, one opening per key `?kK` (the question unscored), one
  second turn `v<eos>` each; advantage 1 everywhere (objective -log p)."""
  items = [task.supervised(rng) for _ in range(cfg.train.sft_batch_size)]
  B, R = len(items), len(items[0][1])
  root_BP, root_valid_BP = tasks.encode_left([h for h, _ in items], task.sft_prompt_len, tok)
  T1 = 2 + task.turn_lengths[0]
  query = [q + a for _, turns in items for q, a, _ in turns]
  tokens1, valid1 = _encode_nodes(query, T1, tok, eos=False)
  scored1 = valid1 & (np.arange(T1) >= 2)  # `?k` is the question, not the policy's turn
  tokens2, valid2 = _encode_nodes([v for _, turns in items for _, _, v in turns],
                                  task.turn_lengths[1], tok, eos=True)
  shape = lambda x: x.reshape(B, R, -1)
  ones = np.ones((B, R), np.float32)
  levels = (tree.TreeLevel(shape(tokens1), shape(valid1), shape(scored1), ones),
            tree.TreeLevel(shape(tokens2), shape(valid2), None, ones))
  return tree.TreeBatch(root_BP, root_valid_BP, levels, fanouts=(R, 1))


def rl_batch(fns, state: TrainState, task, cfg: Config, step: int, tok=TOKENIZER):
  """Sample a tree per prompt, reward the leaves, tree-aware advantages -> TreeBatch."""
  t0 = time.time()
  fanouts = cfg.tree.fanout_tuple
  examples = train._examples(task, cfg.train.seed, step, cfg.train.batch_size)
  prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
  samples = jax.block_until_ready(fns.sample(state.params, prompt_BP=prompt_BP,
                                             prompt_valid_BP=valid_BP, key=key))
  sample_s = time.time() - t0
  rewards_BR = rewards_of(task, examples, samples, fanouts, tok)
  use_std = cfg.train.advantage_std and cfg.train.advantage != "dr_grpo"  # config-checked
  advantages = tree.tree_advantages(rewards_BR, fanouts, use_std=use_std)
  if not cfg.tree.node_advantages:
    advantages = [None] * (len(fanouts) - 1) + advantages[-1:]
  batch = tree_sampler.to_tree_batch(prompt_BP, valid_BP, jax.device_get(samples), fanouts,
                                     advantages)
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  turn1_ok = np.mean([[task.first_turn_right(e, t) for t in row]
                      for e, row in zip(examples, _texts(samples.tokens[0], tok))])
  return batch, {"reward/mean": float(rewards_BR.mean()), "reward/std": float(rewards_BR.std()),
                 "reward/turn1": float(turn1_ok), "time/sample_s": sample_s}


def _texts(tokens_BRT, tok):
  return [[tok.decode(row, strict=False) for row in rows] for rows in np.asarray(tokens_BRT)]


def rewards_of(task, examples, samples, fanouts, tok=TOKENIZER) -> np.ndarray:
  """[B, leaves]: each leaf's reward from its path's two turns."""
  turn1, turn2 = _texts(samples.tokens[0], tok), _texts(samples.tokens[-1], tok)
  per = len(turn2[0]) // len(turn1[0])
  return np.asarray([[task.reward(ex, t1[leaf // per], t2[leaf]) for leaf in range(len(t2))]
                     for ex, t1, t2 in zip(examples, turn1, turn2)], np.float32)


@functools.lru_cache(maxsize=4)
def _compiled(cfg: Config, turn_lengths: tuple, stop_tokens: tuple):
  """The jitted functions of a config (kept across runs in one process)."""
  sample = functools.partial(tree_sampler.sample_tree, model_cfg=cfg.model,
                             fanouts=cfg.tree.fanout_tuple, lengths=turn_lengths,
                             stop_tokens=stop_tokens)
  greedy_cfg = SamplerConfig(temperature=0.0)
  return dict(rl_step=jax.jit(make_tree_train_step(cfg, "rl"), donate_argnums=0),
              sft_step=jax.jit(make_tree_train_step(cfg, "sft"), donate_argnums=0),
              sample=jax.jit(functools.partial(sample, cfg=cfg.sampler)),
              greedy=jax.jit(functools.partial(sample, cfg=greedy_cfg, fanouts=(1, 1))))


def run(cfg: Config, workdir: str, *, init_params=None, tokenizer=None) -> dict:
  """train.run for tree tasks: (resumable) SFT warm-up trees, then tree GRPO."""
  # Options the tree trainer cannot serve (mesh, KL, epochs, DAPO, ...) are refused by
  # Config._check_tree, by field.
  tok = TOKENIZER if tokenizer is None else tokenizer
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: expected >= the tokenizer's "
                     f"{tok.vocab_size}")
  t_start = time.time()
  workdir = checkpoint.check_workdir(workdir)
  task = tasks.make(cfg.task, tok)  # the run's tokenizer; a task that reads files checks them
  task.check(cfg)
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  ckpt.check_config()
  state = train.init_state(cfg, init_params)
  start = ckpt.latest_step() or 0
  if start:
    state = TrainState(**ckpt.restore(start, train._state_dict(state)))
  chief = jax.process_index() == 0  # only process 0 writes metrics (multi-host)
  writer = metrics.MetricsWriter(os.path.join(workdir, "metrics.jsonl") if chief else os.devnull,
                                 tensorboard=cfg.train.tensorboard and chief)
  t = cfg.train
  key_cfg = dataclasses.replace(train._compile_key(cfg), task=cfg.task)
  fns = types.SimpleNamespace(**_compiled(key_cfg, task.turn_lengths, task.stop_tokens(tok)))
  eval_examples = train._examples(task, t.seed, 2**31, t.eval_size) if t.eval_size else []

  def evaluate(state, step):
    prompt_BP, valid_BP = tasks.encode_prompts(eval_examples, task.max_prompt_len, tok)
    s = fns.greedy(state.params, prompt_BP=prompt_BP, prompt_valid_BP=valid_BP,
                   key=jax.random.key(0))
    reward = float(rewards_of(task, eval_examples, s, (1, 1), tok).mean())
    writer.write({"step": step, "kind": "eval", "eval/greedy_reward": reward})
    return reward

  from tqdm import tqdm
  bar = tqdm(total=t.total_steps, initial=start, disable=not (t.progress and chief),
             dynamic_ncols=True, desc="train")
  for step in range(start, t.total_steps):
    t0 = time.time()
    rec = {"step": step, "kind": "train"}
    if step < t.sft_steps:
      rec.update(phase="sft", **{"time/sample_s": 0.0})
      batch = sft_batch(task, np.random.default_rng([t.seed, step]), cfg, tok)
      tree.validate(batch, cfg.model.vocab_size)
      step_fn = fns.sft_step
    else:
      rec["phase"] = "rl"
      if step == t.sft_steps and eval_examples:
        evaluate(state, step)
      batch, sampled = rl_batch(fns, state, task, cfg, step, tok)
      rec.update(sampled)
      step_fn = fns.rl_step
    t1 = time.time()
    state, out = step_fn(state, batch)
    out = {k: float(v) for k, v in jax.device_get(out).items()}
    rec["time/train_s"] = time.time() - t1
    train._finite_or_stop(out, step, ckpt)
    root, below, naive = batch.token_counts()
    rec.update(out)
    rec.update({"replay/prefix_tokens": root, "replay/tail_tokens": below,
                "replay/naive_equiv_tokens": naive,
                "replay/computed_tokens": naive if cfg.replay.mode == "naive" else root + below,
                "time/step_s": time.time() - t0})
    writer.write(rec)
    if (step + 1) % t.checkpoint_every == 0 or step + 1 == t.total_steps:
      ckpt.save(step + 1, train._state_dict(state))
    bar.update(1)
    bar.set_postfix({k: f"{rec[k]:.3f}" for k in ("reward/mean", "reward/turn1", "loss/policy")
                     if k in rec})
  bar.close()
  records = metrics.read(writer.path)
  if eval_examples and t.rl_steps and train.final_eval_missing(records, t.total_steps):
    evaluate(state, t.total_steps)
    records = metrics.read(writer.path)
  writer.close()
  ckpt.close()
  plot_path = (metrics.plot(records, os.path.join(workdir, "metrics.png"))
               if t.plot and chief else None)
  summary = train.summarize(records, cfg)
  summary.update(workdir=workdir, checkpoint=ckpt.directory, metrics=writer.path,
                 plot=plot_path, wall_s=time.time() - t_start, final_params=state.params)
  return summary
