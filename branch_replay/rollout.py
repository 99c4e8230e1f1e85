"""Where an algorithm's batches come from, flat (fan-outs (R,), the depth-1 tree) or trees of the
task's turns (`tree.fanouts`): sampled, rewarded, shaped and refilled (DAPO), with group
advantages and reference log-probs (`sampled`); supervised (`sft_batch`), preference pairs
(`Pairs`), greedy evaluations (`greedy_rewards`); or a rollouts file's lines (`from_file`).
This module decides flat or tree; an algorithm never reads `cfg.tree`."""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Callable

import chex
import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.config import Config
from branch_replay.core import advantages, sampler, sharding, tree, trie
from branch_replay.data import dpo, rollouts, tasks
from branch_replay.train import phases, steps
from branch_replay.train.runtime import Runtime
from branch_replay.train.state import TrainState, reference, sample_examples, weights

# ----------------------------------------------------------------------------- the shape


# The run's rollouts as its task states them (tasks.Task.turns): fan-outs (R,) or tree.fanouts.
Shape, shape = tasks.Shape, tasks.rollout_shape


def compiled(rt: Runtime, task) -> steps.Fns:
  """The policy's jitted functions for these rollouts (`Runtime.fns`, compiled once per config
  and mesh): trees sample the task's turns (its stop tokens, its turn lengths), flat groups
  stop at the tokenizer's."""
  tok = rt.tok
  if rt.cfg.tree.fanouts:
    return rt.fns(task.stop_tokens(tok), task.turn_lengths)
  return rt.fns(tuple(getattr(tok, "stop_ids", (tok.eos_id,))))


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


def path_overlong(samples, turn_lengths, buffer: int, penalty: float) -> np.ndarray | float:
  """DAPO's overlong shaping of every leaf [B, leaves] by its path's length: the valid
  tokens of its ancestors' turns and its own, against the turns' total budget."""
  if not buffer:
    return 0.0
  valid = [np.asarray(v) for v in samples.valid]
  leaves = valid[-1].shape[1]
  lengths_BR = sum(np.repeat(v.sum(-1), leaves // v.shape[1], axis=1) for v in valid)
  return overlong_penalty(lengths_BR, sum(turn_lengths), buffer, penalty).astype(np.float32)


def _overlong(samples, cfg: Config):
  """DAPO's overlong shaping of a flat group [B, R] by trunk + branch length."""
  a = cfg.algo
  if not a.overlong_buffer:
    return 0.0
  W = np.asarray(samples.trunk_BW).shape[1]
  lengths_BR = np.asarray(samples.valid_BRT).sum(-1) + W
  return overlong_penalty(
    lengths_BR, cfg.sampler.max_new_tokens + W, a.overlong_buffer, a.overlong_penalty
  ).astype(np.float32)


# ----------------------------------------------------------------------------- sampled batches


def sampled(fns, state: TrainState, task, rt: Runtime, step: int):
  """`rl_batch`, laid out as its token trie with replay.auto_tree (flat groups only; the
  config refuses it with GAE): (batch, shaped rewards [B, R or leaves], stats)."""
  batch, rewards_BR, stats = rl_batch(fns, state, task, rt, step)
  cfg = rt.cfg
  if cfg.replay.auto_tree and not cfg.tree.fanouts:
    batch, tree_stats = auto_tree(batch, cfg, rt.tok.pad_id)
    stats = {**stats, **tree_stats}
  return batch, rewards_BR, stats


def rl_batch(fns, state: TrainState, task, rt: Runtime, step: int):
  """Sample B fresh prompts' rollouts, reward them, and assemble the RL batch on the run's
  devices (`rt.put`); returns (batch, shaped rewards [B, R or leaves], stats).

  Flat: R branches per prompt (prefix = prompt + optional trunk, tails = branches);
  `algo.advantage` over each group (GAE: zeros, which PPO replaces from its critic,
  algorithms/ppo.py). Trees (`tree.fanouts`): R_1 first turns, R_2 second turns of each;
  the leaves rewarded by their paths, tree-aware advantages (`tree.tree_advantages`). Old
  log-probs are the sampler's (temperature-consistent). With `algo.dynamic_sampling` (DAPO)
  groups whose rewards are all equal are replaced by fresh prompts' groups, up to
  `algo.max_sample_rounds` rounds; `algo.overlong_buffer` shapes a reward by the length of
  its path. Stats include each phase's seconds (phases.py; every round included):
  time/sample_s = data_s (prompts drawn, encoded) + generate_s; reward_s; old_logp_s = 0
  (the sampler returns the behaviour log-probs with the tokens); ref_logp_s; assemble_s."""
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
  tree.validate(_assemble(rows["host"], adv, cfg), cfg.model.vocab_size, cfg.replay.branch_chunk)
  batch = rt.put(_assemble(rows["device"], adv, cfg), "batch")  # advantages: host -> device
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
      "time/assemble_s": time.perf_counter() - t1,
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
  if cfg.tree.fanouts:
    shaping = path_overlong(samples, task.turn_lengths, a.overlong_buffer, a.overlong_penalty)
  else:
    B, R, W = len(examples), cfg.train.n_branches, cfg.sampler.trunk_len
    chex.assert_shape(
      [samples.tokens_BRT, samples.valid_BRT, samples.logp_BRT],
      (B, R, cfg.sampler.max_new_tokens),
    )
    chex.assert_shape([samples.trunk_BW, samples.trunk_logp_BW], (B, W))
    shaping = _overlong(samples, cfg)
  raw_BR = task.leaf_rewards(examples, samples, tok)
  if np.shape(raw_BR) != (len(examples), leaves):
    raise ValueError(
      f"task {cfg.task.name!r}: leaf_rewards returned shape {np.shape(raw_BR)}; expected "
      f"[B, leaves] = {(len(examples), leaves)} ({shape(cfg).setting})"
    )
  return raw_BR, shaping


def _advantages(rewards_BR, cfg: Config):
  """Host: the group advantages of the shaped rewards ([B, R]; a tree: one per level)."""
  if cfg.tree.fanouts:
    return _node_advantages(rewards_BR, cfg)
  a = cfg.algo
  if a.advantage in advantages.NEEDS_CRITIC:  # PPO replaces them from its critic
    return np.zeros(rewards_BR.shape, np.float32)
  return np.asarray(advantages.compute(a.advantage, rewards_BR, a))


def _assemble(rows, adv, cfg: Config) -> tree.TreeBatch:
  """The kept rows (host or device arrays) as one TreeBatch with these advantages."""
  prompt_BP, valid_BP, samples = rows["prompt_BP"], rows["valid_BP"], rows["samples"]
  if cfg.tree.fanouts:
    return sampler.to_tree_batch(prompt_BP, valid_BP, samples, cfg.tree.fanout_tuple, adv)
  return sampler.to_batch(prompt_BP, valid_BP, samples, adv)


def _node_advantages(rewards_BR, cfg: Config) -> list:
  """Per-level advantages of a tree ([B, nodes] per level; None for an inner level = its
  leaves' own) from the leaves' rewards [B, leaves]."""
  a, fanouts = cfg.algo, cfg.tree.fanout_tuple
  if a.advantage in advantages.NEEDS_CRITIC:  # PPO's critic gives per-token advantages
    node_adv = [np.zeros_like(rewards_BR)]
  elif a.advantage in ("grpo", "dr_grpo"):  # normalised among siblings (dr_grpo: centred)
    node_adv = tree.tree_advantages(
      rewards_BR, fanouts, use_std=a.advantage_std and a.advantage != "dr_grpo"
    )
  else:  # another group estimator over each set of siblings
    node_adv = tree.tree_advantages(
      rewards_BR, fanouts, estimator=functools.partial(advantages.compute, a.advantage, train_cfg=a)
    )
  if not cfg.tree.node_advantages or len(node_adv) < len(fanouts):
    node_adv = [None] * (len(fanouts) - 1) + node_adv[-1:]
  return node_adv


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


# ----------------------------------------------------------------------------- supervised


def sft_batch(task, rng: np.random.Generator, cfg: Config, tok):
  """A warm-up batch: the task's long prefix shared by its reference answers (one per tail);
  with tree.fanouts, the task's warm-up trees (`TurnsTask.warmup_tree`; tree_haystack's: the
  haystack, one opening per key, its value below). Advantage 1 (objective -log p)."""
  if cfg.tree.fanouts:
    return task.warmup_tree(rng, cfg.train.sft_batch_size, tok)
  items = [task.supervised(rng) for _ in range(cfg.train.sft_batch_size)]
  prefix_BP, prefix_valid_BP = tasks.encode_prompts([p for p, _ in items], task.sft_prompt_len, tok)
  T = task.sft_tail_len  # the task's longest warm-up tail, EOS included
  tails = [tasks.encode_right(t, T, tok) for _, t in items]
  tails_BRT = np.stack([t for t, _ in tails])
  valid_BRT = np.stack([v for _, v in tails])
  B, R = tails_BRT.shape[:2]
  chex.assert_shape([tails_BRT, valid_BRT], (B, R, T))
  chex.assert_shape([prefix_BP, prefix_valid_BP], (B, task.sft_prompt_len))
  return tree.flat(
    prefix_BP=prefix_BP,
    prefix_valid_BP=prefix_valid_BP,
    tails_BRT=tails_BRT,
    tail_valid_BRT=valid_BRT,
    advantages_BR=np.ones(tails_BRT.shape[:2], np.float32),
  )


class Pairs:
  """DPO's (chosen, rejected) pairs sharing a prompt, as TreeBatches: flat, two branches per
  prompt, from algo.pairs_file or the task (its answer and a wrong value); or with
  tree.fanouts the task's preference trees (one opening per record, a pair below each)."""

  def __init__(self, cfg: Config, task, tok):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.turns = shape(cfg).turns
    if self.turns:  # the task's preference trees (TurnsTask.preference_trees)
      try:
        fanouts = task.preference_trees(np.random.default_rng(0), 1, tok).fanouts
      except NotImplementedError:
        raise ValueError(
          f"algo.name='dpo' with {shape(cfg).setting}: task {cfg.task.name!r} makes no "
          "preference trees (TurnsTask.preference_trees); expected tree.fanouts='' and "
          "algo.pairs_file, or another task"
        ) from None
      if cfg.tree.fanout_tuple != tuple(fanouts):
        raise ValueError(
          f"tree.fanouts={cfg.tree.fanouts!r} with algo.name='dpo': the preference trees of "
          f"task {cfg.task.name!r} have fan-outs {tuple(fanouts)} (their (chosen, rejected) "
          f"pairs below each opening); expected {'x'.join(map(str, fanouts))!r}"
        )
    self.file_pairs = dpo.load_pairs(cfg.algo.pairs_file) if cfg.algo.pairs_file else None
    if self.file_pairs is not None:
      enc = lambda text: len(tok.encode(text, bos=False, eos=False))
      self.prompt_len = 1 + max(enc(p.prompt) for p in self.file_pairs)
      self.answer_len = max(enc(x) for p in self.file_pairs for x in (p.chosen, p.rejected))
    elif not self.turns:
      self.prompt_len, self.answer_len = task.max_prompt_len, task.max_answer_len

  def batch(self, step: int) -> tree.TreeBatch:
    """Step `step`'s train.batch_size pairs (advantages unused: the objective is DPO's)."""
    t = self.cfg.train
    rng = np.random.default_rng([t.seed, step])
    if self.turns:
      return self.task.preference_trees(rng, t.batch_size, self.tok)
    pairs = (
      [self.file_pairs[i] for i in rng.integers(0, len(self.file_pairs), t.batch_size)]
      if self.file_pairs is not None
      else [dpo.task_pair(self.task, rng) for _ in range(t.batch_size)]
    )
    return dpo.make_batch(pairs, self.prompt_len, self.answer_len, self.tok)


# ----------------------------------------------------------------------------- greedy evaluation


def eval_examples(task, cfg: Config) -> list:
  """train.eval_size held-out prompts (draws from a stream training never uses)."""
  return task.eval_examples(cfg.train.seed, cfg.train.eval_size)


def greedy_reward(fns, params, task, examples, cfg: Config, tok) -> float:
  """The mean reward of greedy completions of `examples`, all at once (one per prompt;
  trees: one path)."""
  prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
  s = fns.greedy(params, prompt_BP=prompt_BP, prompt_valid_BP=valid_BP, key=jax.random.key(0))
  if cfg.tree.fanouts:
    s = sharding.to_host(s)  # numpy; gathered when the mesh spans several processes
    return float(task.leaf_rewards(examples, s, tok).mean())
  s = sharding.to_host(s) if cfg.mesh else s
  return float(task.rewards(examples, sampler.completions(s, tok)).mean())


def greedy_rewards(fns, params, task, examples, cfg: Config, tok) -> np.ndarray:
  """The reward of each prompt's greedy completion (flat), in chunks of train.eval_batch
  prompts (0: all at once; the last chunk padded with its last prompt, so one compiled
  shape); with train.eval_shared_prefix, the ids every prompt starts with (a k-shot
  header) prefilled once per chunk (`sampler.shared_header`). Trees: their one mean."""
  t = cfg.train
  if cfg.tree.fanouts:
    return np.asarray([greedy_reward(fns, params, task, examples, cfg, tok)])
  ids = [
    list(e.prompt_ids)
    if getattr(e, "prompt_ids", None) is not None
    else tok.encode(e.prompt, bos=True)
    for e in examples
  ]
  header_H = None
  if t.eval_shared_prefix:
    header_H, ids = sampler.shared_header(ids)
    header_H = header_H if len(header_H) else None
  L = max(len(x) for x in ids)
  n = t.eval_batch or len(examples)
  out = []
  for i in range(0, len(examples), n):
    chunk = ids[i : i + n]
    chunk = chunk + [chunk[-1]] * (n - len(chunk))
    prompt_BP, valid_BP = tasks.encode_prompts(
      [tasks.Example("", "", prompt_ids=tuple(x)) for x in chunk], L, tok
    )
    s = fns.greedy(
      params,
      prompt_BP=prompt_BP,
      prompt_valid_BP=valid_BP,
      key=jax.random.key(0),
      header_H=header_H,
    )
    s = sharding.to_host(s) if cfg.mesh else s
    got = examples[i : i + n]
    r = task.rewards(got, sampler.completions(s, tok)[: len(got)])
    out += list(np.asarray(r, np.float64).reshape(len(got), -1).mean(-1))
  return np.asarray(out, np.float64)


# ----------------------------------------------------------------------------- a rollouts file


class Recorded:
  """Our own scoring of lines without logprobs, kept across epochs and runs (JSON lines;
  `path=None`: in memory only, as on every process but the first)."""

  def __init__(self, path):
    self.path, self.logps = path, {}
    if path and os.path.exists(path):
      with open(path) as f:
        for line in f:
          rec = json.loads(line)
          self.logps[rec["source"]] = [np.asarray(x, np.float64) for x in rec["logprobs"]]

  def add(self, source, logps):
    self.logps[source] = logps
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps({"source": source, "logprobs": [x.tolist() for x in logps]}) + "\n")


def from_file(task, recorded: Recorded, score_fn, state, cfg: Config, step: int, tok):
  """Step `step`'s train.batch_size lines of the rollouts file as one TreeBatch (their shared
  openings found by trie.py with task.auto_tree, else flat): group advantages of the file's
  rewards, behaviour log-probs (`old_logps`), reference log-probs with a reference. Returns
  (batch, its flat positions (the naive equivalent), stats)."""
  t, timer = cfg.train, phases.Timer()
  lines = task.batch_lines(step, t.batch_size)
  rewards_BR = np.stack([l.rewards for l in lines])
  adv_BR = advantages.compute(cfg.algo.advantage, rewards_BR, cfg.algo)
  with timer("old_logp"):
    old = old_logps(lines, recorded, score_fn, state.params, cfg, adv_BR, tok.pad_id)
  batch, stats = rollouts.make_batch(lines, adv_BR, task.cfg, old_logps=old, pad_id=tok.pad_id)
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  if state.ref_params is not None:
    with timer("ref_logp"):
      ref_levels, ref_trunk = jax.block_until_ready(score_fn(state.ref_params, batch))
    batch = batch.replace(
      levels=tuple(l.replace(ref_logp_BRT=r) for l, r in zip(batch.levels, ref_levels)),
      trunk_ref_logp_BW=ref_trunk if batch.trunk_len else None,
    )
  return (
    batch,
    stats["flat_positions"],
    {
      "epoch": step // task.steps_per_epoch(t.batch_size),
      "reward/mean": float(rewards_BR.mean()),
      "reward/std": float(rewards_BR.std()),
      "replay/tree_token_ratio": stats["tree_token_ratio"],
      "replay/trie_token_ratio": stats["trie_token_ratio"],
      "replay/trunk_len": stats["trunk_len"],
      "replay/fanouts": "x".join(map(str, stats["fanouts"])),
      **timer.metrics(),
    },
  )


def old_logps(lines, recorded: Recorded, score_fn, params, cfg, adv_BR, pad_id):
  """Behaviour log-probs per line: the file's, else recorded, else scored now on the tree."""
  missing = [l for l in lines if l.logprobs is None and l.source not in recorded.logps]
  if missing:
    probe, stats = trie.layout(
      [l.prompt_ids for l in lines],
      [list(l.responses) for l in lines],
      adv_BR,
      max_depth=cfg.task.max_depth,
      min_shared=cfg.task.min_shared,
      pad_id=pad_id,
    )
    per_level, trunk_BW = jax.device_get(score_fn(params, probe))
    scored = trie.unroll(probe, stats["order"], per_level, trunk_BW)
    for b, l in enumerate(lines):
      if l.logprobs is None and l.source not in recorded.logps:
        recorded.add(l.source, scored[b])
  return [list(l.logprobs) if l.logprobs is not None else recorded.logps[l.source] for l in lines]
