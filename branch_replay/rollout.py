"""Sampled batches: where GRPO's and PPO's batches come from, flat (fan-outs (R,), the depth-1
tree) or trees of the task's turns (`tree.fanouts`): B prompts sampled, rewarded, shaped and
refilled (DAPO), with group advantages and reference log-probs (`sampled`), optionally laid
out as their trie (`auto_tree`). The other sources live beside their data: supervised warm-up
batches in data/supervised.py, DPO's pairs in data/dpo.py, a rollouts file's lines and their
behaviour log-probs in data/rollouts.py; the greedy evaluation is train/evaluate.py. This module
decides flat or tree; an algorithm never reads `cfg.tree`."""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.config import Config
from branch_replay.core import advantages, tree, trie
from branch_replay.data import tasks
from branch_replay.train import steps
from branch_replay.train.runtime import Runtime
from branch_replay.train.state import TrainState, reference, sample_examples, weights

# ----------------------------------------------------------------------------- the shape


# The run's rollouts as its task states them (tasks.Task.turns): fan-outs (R,) or tree.fanouts.
Shape, shape = tasks.Shape, tasks.rollout_shape


def compiled(rt: Runtime, task) -> steps.Fns:
  """The policy's jitted functions for these rollouts (`Runtime.fns`, compiled once per config
  and mesh): trees sample the task's turns (its stop tokens, its turn lengths), flat groups
  stop at the tokenizer's."""
  return rt.fns(task.stop_tokens(rt.tok), task.turn_lengths)  # the task's own shape


def reward_keys(task) -> tuple:
  """The reward metrics shown beside the progress bar (the task's own too, e.g. a tree
  task's first-turn accuracy)."""
  return ("reward/mean",) + tuple(f"reward/{name}" for name in task.metric_names)


# ----------------------------------------------------------------------------- DAPO


def informative(rewards_BR) -> np.ndarray:
  """[B] bool: the group's rewards are not all equal (its advantages are not all zero)."""
  r = np.asarray(rewards_BR)
  return r.max(axis=1) > r.min(axis=1)


def overlong_penalty(lengths_BR, max_len: int, buffer: int, penalty: float = 1.0):
  """DAPO's soft overlong punishment: 0 up to max_len - buffer, then falling linearly to
  -penalty at max_len (and -penalty beyond). buffer=0: off (all zeros)."""
  lengths = np.asarray(lengths_BR, np.float64)
  if buffer <= 0:
    return np.zeros_like(lengths)
  start = max_len - buffer
  return -penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)


def dynamic_sample(
  draw: Callable[[int], tuple[dict, np.ndarray]], batch_size: int, max_rounds: int
):
  """DAPO's dynamic sampling: groups whose R rewards are all equal carry no GRPO signal, so
  draw rounds until `batch_size` informative groups are kept (or `max_rounds` are spent).

  draw(round) -> (rows, rewards_BR): rows a pytree (a dict) of arrays with a leading prompt
  axis. Kept groups come first in round order; if fewer than batch_size were found, the
  batch is topped up with dropped groups (their centred advantages are 0: they add nothing
  but keep the compiled shape). Returns (rows, rewards_BR, stats)."""
  if max_rounds < 1:
    raise ValueError(f"algo.max_sample_rounds={max_rounds}: expected >= 1")
  kept, dropped = [], []
  rounds = 0
  n_kept = 0
  while rounds < max_rounds and n_kept < batch_size:
    rows, rewards_BR = draw(rounds)
    rounds += 1
    mask = informative(rewards_BR)
    kept.append(_take(rows, rewards_BR, mask))
    dropped.append(_take(rows, rewards_BR, ~mask))
    n_kept += int(mask.sum())
  parts = kept + dropped
  rows = jax.tree.map(lambda *xs: _concat(xs)[:batch_size], *[p[0] for p in parts])
  rewards_BR = np.concatenate([p[1] for p in parts])[:batch_size]
  stats = {"dapo/rounds": rounds, "dapo/kept_frac": min(n_kept, batch_size) / batch_size}
  return rows, rewards_BR, stats


def take_rows(rows, idx):
  """Rows `idx` (by prompt, axis 0) of every array of a pytree: host arrays on the host,
  device arrays on their device (no round trip)."""
  take = lambda v: jnp.take(v, idx, axis=0) if isinstance(v, jax.Array) else np.asarray(v)[idx]
  return jax.tree.map(take, rows)


def _take(rows, rewards_BR, mask):
  idx = np.flatnonzero(mask)
  return take_rows(rows, idx), np.asarray(rewards_BR)[idx]


def _concat(xs):
  return jnp.concatenate(xs) if isinstance(xs[0], jax.Array) else np.concatenate(xs)


def path_lengths(samples) -> tuple[np.ndarray, int]:
  """(the tokens on every leaf's path below the prompt [B, leaves], their budget): the valid
  tokens of its ancestors' levels and its own (`path_valid`: a flat group's trunk is a level of
  one node, decoded whole), against the levels' lengths summed."""
  valid = samples.path_valid()
  leaves = valid[-1].shape[1]
  lengths_BR = sum(np.repeat(v.sum(-1), leaves // v.shape[1], axis=1) for v in valid)
  return lengths_BR, sum(v.shape[-1] for v in valid)


def overlong(samples, buffer: int, penalty: float) -> np.ndarray | float:
  """DAPO's overlong shaping of every leaf [B, leaves] by its path's length (`path_lengths`),
  flat groups and trees alike; 0.0 when off (buffer 0)."""
  if not buffer:
    return 0.0
  lengths_BR, budget = path_lengths(samples)
  return overlong_penalty(lengths_BR, budget, buffer, penalty).astype(np.float32)


# ----------------------------------------------------------------------------- sampled batches


def sampled(fns, state: TrainState, task, rt: Runtime, step: int):
  """`rl_batch`, laid out as its token trie with replay.auto_tree (flat groups only; the
  config refuses it with GAE): (batch, shaped rewards [B, R or leaves], stats)."""
  batch, rewards_BR, stats = rl_batch(fns, state, task, rt, step)
  cfg = rt.cfg
  if cfg.replay.auto_tree:  # flat groups only: the config refuses it with tree.fanouts
    batch, tree_stats = auto_tree(batch, cfg, rt.tok.pad_id)
    stats = {**stats, **tree_stats}
  return batch, rewards_BR, stats


def rl_batch(fns, state: TrainState, task, rt: Runtime, step: int):
  """Sample B fresh prompts' rollouts, reward them, and assemble the RL batch on the run's
  devices (`rt.put`); returns (batch, shaped rewards [B, R or leaves], stats).

  Flat: R branches per prompt (prefix = prompt + optional trunk, tails = branches);
  `algo.advantage` over each group (GAE: zeros, which PPO replaces from its critic,
  algorithms/ppo.py). Trees (`tree.fanouts`): R_1 first turns, R_2 second turns of each;
  the leaves rewarded by their paths, tree-aware advantages (`advantages.levels`). Old
  log-probs are the sampler's (temperature-consistent). With `algo.dynamic_sampling` (DAPO)
  groups whose rewards are all equal are replaced by fresh prompts' groups, up to
  `algo.max_sample_rounds` rounds; `algo.overlong_buffer` shapes a reward by the length of
  its path. Stats include each phase's seconds (phases.py; every round included):
  time/sample_s = data_s (prompts drawn, encoded) + generate_s; reward_s; old_logp_s = 0
  (the sampler returns the behaviour log-probs with the tokens); ref_logp_s; assemble_s
  (advantages, the batch checked and put on the devices; the reference's forward apart)."""
  cfg = rt.cfg
  a = cfg.algo
  phase_s = dict.fromkeys(("data", "generate", "reward"), 0.0)  # summed over the rounds
  draw = functools.partial(
    _draw,
    fns,
    weights(state, cfg.lora, cfg.model.compute_dtype),
    state,
    task,
    rt,
    step,
    phase_s,
  )
  if a.dynamic_sampling:
    rows, rewards_BR, stats = dynamic_sample(draw, cfg.train.batch_size, a.max_sample_rounds)
  else:
    (rows, rewards_BR), stats = draw(0), {}
  t1 = time.perf_counter()
  adv = _advantages(rewards_BR, cfg)
  # Checked on the host copy the rewards were read from (the same tokens, masks and old
  # log-probs); the batch itself stays where the sampler left it: on the device.
  tree.validate(_assemble(rows["host"], adv), cfg.model.vocab_size, cfg.replay.branch_chunk)
  batch = rt.put(_assemble(rows["device"], adv), "batch")  # advantages: host -> device
  assemble_s = time.perf_counter() - t1  # the reference's forward below is ref_logp_s
  ref = reference(state, cfg)  # LoRA: the base, adapters off
  if ref is not None:  # k3 KL: reference log-probs of every node, one shared-prefix forward
    r0 = time.perf_counter()
    scored = jax.block_until_ready(fns.score(ref, batch=batch))
    stats["time/ref_logp_s"] = time.perf_counter() - r0
    batch = batch.with_reference(*scored)  # on the device, beside the batch
  raw = rows["raw_BR"]
  return (
    batch,
    rewards_BR,
    {
      "reward/mean": float(raw.mean()),
      "reward/std": float(raw.std()),
      "reward/shaped_mean": float(rewards_BR.mean()),
      **{f"reward/{name}": float(v_B.mean()) for name, v_B in rows["metrics"].items()},
      **{f"time/{name}_s": seconds for name, seconds in phase_s.items()},
      "time/sample_s": phase_s["data"] + phase_s["generate"],
      "time/old_logp_s": 0.0,
      "time/ref_logp_s": 0.0,
      "time/assemble_s": assemble_s,
      **stats,
    },
  )


def _draw(fns, model_weights, state, task, rt: Runtime, step: int, phase_s, round_: int):
  """One sampling round: B prompts drawn, encoded and sampled; their samples rewarded (raw)
  and shaped. Returns (rows with a leading prompt axis, shaped rewards [B, R or leaves]);
  adds its seconds to phase_s."""
  d0 = time.perf_counter()
  cfg, tok = rt.cfg, rt.tok
  t = cfg.train
  examples = sample_examples(task, t.seed, step if round_ == 0 else (step, round_), t.batch_size)
  prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
  placed_BP, placed_valid_BP = rt.put((prompt_BP, valid_BP), "batch")
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
  if round_:
    key = jax.random.fold_in(key, round_)
  d1 = time.perf_counter()
  samples = jax.block_until_ready(
    fns.sample(model_weights, prompt_BP=placed_BP, prompt_valid_BP=placed_valid_BP, key=key)
  )
  host = rt.to_host(samples)  # a copy: every process decodes and rewards all samples
  d2 = time.perf_counter()
  raw_BR, shaping = _rewards(task, examples, host, cfg, tok)
  rows = dict(
    host=dict(prompt_BP=prompt_BP, valid_BP=valid_BP, samples=host),
    device=dict(prompt_BP=placed_BP, valid_BP=placed_valid_BP, samples=samples),
    raw_BR=raw_BR,
    metrics=task.prompt_metrics(examples, host, tok),  # {name: [B]}
  )
  phase_s["data"] += d1 - d0
  phase_s["generate"] += d2 - d1
  phase_s["reward"] += time.perf_counter() - d2
  return rows, raw_BR + shaping


def _rewards(task, examples, samples, cfg: Config, tok):
  """(the task's raw rewards of every leaf [B, R or leaves], DAPO's overlong shaping (0.0
  when off))."""
  a, leaves = cfg.algo, int(np.prod(shape(cfg).fanouts))
  shaping = overlong(samples, a.overlong_buffer, a.overlong_penalty)
  raw_BR = task.leaf_rewards(examples, samples, tok)
  if np.shape(raw_BR) != (len(examples), leaves):
    raise ValueError(
      f"task {cfg.task.name!r}: leaf_rewards returned shape {np.shape(raw_BR)}; expected "
      f"[B, leaves] = {(len(examples), leaves)} ({shape(cfg).setting})"
    )
  return raw_BR, shaping


def _advantages(rewards_BR, cfg: Config):
  """Host: the group advantages of the shaped rewards, one array per level of the rollouts'
  fan-outs (`advantages.levels`; a flat group: one level, [B, R]; None for an inner level that
  takes its leaves' own when tree.node_advantages is off). GAE: zeros, which PPO replaces
  from its critic."""
  a, fanouts = cfg.algo, shape(cfg).fanouts
  if a.advantage in advantages.NEEDS_CRITIC:
    node_adv = [np.zeros(np.shape(rewards_BR), np.float32)]
  else:
    node_adv = advantages.levels(a.advantage, rewards_BR, fanouts, a)
  if not cfg.tree.node_advantages or len(node_adv) < len(fanouts):
    node_adv = [None] * (len(fanouts) - 1) + node_adv[-1:]
  return node_adv


def _assemble(rows, adv) -> tree.TreeBatch:
  """The kept rows (host or device arrays) as one TreeBatch with these advantages (one array
  per level): the samples' own layout (`Samples.batch`, `TreeSamples.batch`)."""
  return rows["samples"].batch(rows["prompt_BP"], rows["valid_BP"], adv)


def auto_tree(batch, cfg: Config, pad_id: int = 0):
  """replay.auto_tree: a sampled flat batch as its cheapest exact tree (trie.auto_tree: the
  opening all of a prompt's branches share becomes scored trunk, a shared run of a group a
  level), for the same train step; the gradient is the flat batch's. With replay.branch_chunk
  the layout keeps one level (fan-out R, which the chunk divides). Host side. Returns
  (TreeBatch, stats: replay/tree_token_ratio = naive positions / tree positions, ...)."""
  t0 = time.perf_counter()
  max_depth = 1 if cfg.replay.branch_chunk else 2
  batch, s = trie.auto_tree(batch, max_depth=max_depth, pad_id=pad_id)
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  return batch, {
    "replay/tree_token_ratio": s["tree_token_ratio"],
    "replay/trie_token_ratio": s["trie_token_ratio"],
    "replay/trunk_len": s["trunk_len"],
    "replay/fanouts": "x".join(map(str, s["fanouts"])),
    "time/layout_s": time.perf_counter() - t0,
  }
