"""Tree rollouts' pieces (`tree.fanouts` set; the loop is trainer.py, the algorithm
algorithms/grpo.py, on trees):
  RL    sample a tree per prompt (sampler.sample_tree: prompt prefilled once, R_1 first turns, R_2
        second turns of each), reward the leaves, tree-aware advantages (tree.tree_advantages),
        the flat GRPO/PPO step (train.make_train_step: the engine takes trees), epochs x
        minibatches, the KL reference, one device or a mesh (sharding.sharded_loss_and_grad);
  SFT   warm-up trees from the task's reference turns (objective -log p), same engine.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import types

import jax
import numpy as np

from branch_replay import advantages as advantages_lib
from branch_replay import dapo, engine, sampler, sharding, tasks, tree, train
from branch_replay.config import Config
from branch_replay.sampler import SamplerConfig
from branch_replay.tokenizer import TOKENIZER
from branch_replay import state as train_state


def _encode_nodes(texts, length, tok, eos):
  ids = np.zeros((len(texts), length), np.int32)
  valid = np.zeros((len(texts), length), bool)
  for i, text in enumerate(texts):
    row = tok.encode(text, eos=eos)
    ids[i, :len(row)], valid[i, :len(row)] = row, True
  return ids, valid


def turn_tree(task, items, children, tok=TOKENIZER) -> tree.TreeBatch:
  """A tree of the task's turns: root = each item's haystack, level 1 = its openings `?kK` (the
  question unscored), level 2 = each opening's children (`children(b, r, value)` -> second
  turns; `<eos>` appended); advantage 1 everywhere (the warm-up's -log p; DPO ignores it)."""
  B, R = len(items), len(items[0][1])
  root_BP, root_valid_BP = tasks.encode_left([h for h, _ in items], task.sft_prompt_len, tok)
  T1 = 2 + task.turn_lengths[0]
  query = [q + a for _, turns in items for q, a, _ in turns]
  tokens1, valid1 = _encode_nodes(query, T1, tok, eos=False)
  scored1 = valid1 & (np.arange(T1) >= 2)  # `?k` is the question, not the policy's turn
  seconds = [c for b, (_, turns) in enumerate(items)
             for r, (_, _, v) in enumerate(turns) for c in children(b, r, v)]
  R2 = len(seconds) // (B * R)
  tokens2, valid2 = _encode_nodes(seconds, task.turn_lengths[1], tok, eos=True)
  shape = lambda x, n: x.reshape(B, n, -1)
  levels = (tree.TreeLevel(shape(tokens1, R), shape(valid1, R), shape(scored1, R),
                           np.ones((B, R), np.float32)),
            tree.TreeLevel(shape(tokens2, R * R2), shape(valid2, R * R2), None,
                           np.ones((B, R * R2), np.float32)))
  return tree.TreeBatch(root_BP, root_valid_BP, levels, fanouts=(R, R2))


def sft_batch(task, rng: np.random.Generator, cfg: Config, tok=TOKENIZER) -> tree.TreeBatch:
  """Warm-up trees: root = haystack, one opening per key `?kK` (the question unscored), one
  second turn `v<eos>` each; advantage 1 everywhere (objective -log p)."""
  items = [task.supervised(rng) for _ in range(cfg.train.sft_batch_size)]
  return turn_tree(task, items, lambda b, r, value: [value], tok)


def rl_batch(fns, state: train_state.TrainState, task, cfg: Config, step: int, tok=TOKENIZER,
             with_rewards: bool = False):
  """Sample a tree per prompt, reward the leaves, tree-aware advantages -> TreeBatch. With
  `algo.dynamic_sampling` (DAPO) prompts whose leaves all got the same reward are replaced
  by fresh prompts' trees (dapo.dynamic_sample, as for flat groups); `algo.overlong_buffer`
  shapes each leaf's reward by its path's length (every turn's tokens). with_rewards: return
  (batch, shaped rewards [B, leaves], stats) (PPO's GAE, algorithms/ppo.py, which replaces
  the advantages: zeros with algo.name=ppo)."""
  t, a = cfg.train, cfg.algo
  fanouts = cfg.tree.fanout_tuple
  weights = train_state.weights(state, cfg.lora)
  phase_s = dict(sample=0.0, reward=0.0)
  structure = {}  # the samples' pytree, rebuilt from the rows dynamic_sample keeps

  def draw(round_):
    d0 = time.time()
    examples = train_state.sample_examples(task, t.seed, step if round_ == 0 else (step, round_),
                                           t.batch_size)
    prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
    placed_BP, placed_valid_BP = train_state.place((prompt_BP, valid_BP), "batch", cfg)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    if round_:
      key = jax.random.fold_in(key, round_)
    samples = jax.block_until_ready(fns.sample(weights, prompt_BP=placed_BP,
                                               prompt_valid_BP=placed_valid_BP, key=key))
    samples = sharding.to_host(samples)  # every process decodes and rewards all samples
    d1 = time.time()
    raw_BR = rewards_of(task, examples, samples, fanouts, tok)
    turn1_B = np.asarray([np.mean([task.first_turn_right(e, x) for x in row])
                          for e, row in zip(examples, _texts(samples.tokens[0], tok))])
    leaves, structure["samples"] = jax.tree.flatten(samples)  # [B, ...]: kept by prompt
    rows = dict(prompt_BP=prompt_BP, valid_BP=valid_BP, raw_BR=raw_BR, turn1_B=turn1_B,
                **{f"samples_{i}": x for i, x in enumerate(leaves)})
    phase_s["sample"] += d1 - d0
    phase_s["reward"] += time.time() - d1
    return rows, raw_BR + overlong(samples, task.turn_lengths, a.overlong_buffer,
                                   a.overlong_penalty)

  stats = {}
  if a.dynamic_sampling:
    rows, rewards_BR, stats = dapo.dynamic_sample(draw, t.batch_size, a.max_sample_rounds)
  else:
    rows, rewards_BR = draw(0)
  treedef = structure["samples"]
  samples = jax.tree.unflatten(treedef, [rows[f"samples_{i}"] for i in range(treedef.num_leaves)])
  prompt_BP, valid_BP = rows["prompt_BP"], rows["valid_BP"]
  if a.advantage in advantages_lib.NEEDS_CRITIC:  # PPO's critic gives per-token advantages
    node_adv = [np.zeros_like(rewards_BR)]
  elif a.advantage in ("grpo", "dr_grpo"):  # normalised among siblings (dr_grpo: centred)
    node_adv = tree.tree_advantages(rewards_BR, fanouts,
                                    use_std=a.advantage_std and a.advantage != "dr_grpo")
  else:  # another group estimator over each set of siblings
    node_adv = tree.tree_advantages(rewards_BR, fanouts, estimator=functools.partial(
        advantages_lib.compute, a.advantage, train_cfg=a))
  if not cfg.tree.node_advantages or len(node_adv) < len(fanouts):
    node_adv = [None] * (len(fanouts) - 1) + node_adv[-1:]
  batch = sampler.to_tree_batch(prompt_BP, valid_BP, samples, fanouts, node_adv)
  # the phases (phases.py), every sampling round included; the sampler returns the behaviour
  # log-probs (old_logp: sampling's)
  stats.update({"time/reward_s": phase_s["reward"], "time/old_logp_s": 0.0,
                "time/ref_logp_s": 0.0})
  ref = train_state.reference(state, cfg)  # LoRA: the base, adapters off
  if ref is not None:  # k3 KL: reference log-probs of every node, one forward
    r0 = time.time()
    ref_levels, _ = sharding.to_host(jax.block_until_ready(
        fns.score(ref, train_state.place(batch, "batch", cfg))))
    batch = batch.replace(levels=tuple(level.replace(ref_logp_BRT=ref)
                                       for level, ref in zip(batch.levels, ref_levels)))
    stats["time/ref_logp_s"] = time.time() - r0
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  raw = rows["raw_BR"]
  stats = {"reward/mean": float(raw.mean()), "reward/std": float(raw.std()),
           "reward/shaped_mean": float(rewards_BR.mean()),
           "reward/turn1": float(rows["turn1_B"].mean()), "time/sample_s": phase_s["sample"],
           **stats}
  return (batch, rewards_BR, stats) if with_rewards else (batch, stats)


def overlong(samples, turn_lengths, buffer: int, penalty: float) -> np.ndarray | float:
  """DAPO's overlong shaping of every leaf [B, leaves] by its path's length: the valid
  tokens of its ancestors' turns and its own, against the turns' total budget."""
  if not buffer:
    return 0.0
  valid = [np.asarray(v) for v in samples.valid]
  leaves = valid[-1].shape[1]
  lengths_BR = sum(np.repeat(v.sum(-1), leaves // v.shape[1], axis=1) for v in valid)
  return dapo.overlong_penalty(lengths_BR, sum(turn_lengths), buffer,
                               penalty).astype(np.float32)


def _texts(tokens_BRT, tok):
  return [[tok.decode(row, strict=False) for row in rows] for rows in np.asarray(tokens_BRT)]


def rewards_of(task, examples, samples, fanouts, tok=TOKENIZER) -> np.ndarray:
  """[B, leaves]: each leaf's reward from its path's two turns."""
  turn1, turn2 = _texts(samples.tokens[0], tok), _texts(samples.tokens[-1], tok)
  per = len(turn2[0]) // len(turn1[0])
  return np.asarray([[task.reward(ex, t1[leaf // per], t2[leaf]) for leaf in range(len(t2))]
                     for ex, t1, t2 in zip(examples, turn1, turn2)], np.float32)


def compile_key(cfg: Config) -> Config:
  """train.compile_key, keeping the task (its turn lengths shape the sampler)."""
  return dataclasses.replace(train.compile_key(cfg), task=cfg.task)


@functools.lru_cache(maxsize=4)
def compiled(cfg: Config, turn_lengths: tuple, stop_tokens: tuple) -> types.SimpleNamespace:
  """The jitted functions of a config (kept across runs in one process)."""
  sample = functools.partial(sampler.sample_tree, model_cfg=cfg.model,
                             fanouts=cfg.tree.fanout_tuple, lengths=turn_lengths,
                             stop_tokens=stop_tokens)
  greedy_cfg = SamplerConfig(temperature=0.0)
  return types.SimpleNamespace(  # the flat steps serve trees (train.loss_and_grad)
      rl_step=jax.jit(train.make_train_step(cfg, "rl"), donate_argnums=0),
      sft_step=jax.jit(train.make_train_step(cfg, "sft"), donate_argnums=0),
      score=jax.jit(functools.partial(engine.forward, model_cfg=cfg.model,
                                      temperature=cfg.sampler.temperature)),
      sample=jax.jit(functools.partial(sample, cfg=cfg.sampler)),
      greedy=jax.jit(functools.partial(sample, cfg=greedy_cfg, fanouts=(1, 1))))
