"""GRPO-family RL on sampled groups: every group advantage estimator (`algo.advantage`; GAE
is PPO's, algorithms/ppo.py, which builds on these), DAPO, the KL reference, epochs x
minibatches. `GRPO` samples flat
groups (R branches per prompt, optional trunk) and trees (`tree.fanouts`)."""

from __future__ import annotations

import dataclasses
import functools
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import advantages, sampler, sharding, tree, trie
from branch_replay import algorithms, dapo
from branch_replay.train import phases, steps, verify
from branch_replay.data import tasks, tree_task
from branch_replay.train import metrics
from branch_replay.train import state as train_state
from branch_replay.config import Config
from branch_replay.train.state import TrainState, place, reference, sample_examples, weights
from branch_replay.data.tokenizer import TOKENIZER


@dataclasses.dataclass(frozen=True)
class Options(algorithms.SampledOptions):
  """GRPO and its family on sampled groups or trees."""

  advantage: str = "grpo"  # a group estimator (advantages.py): grpo | dr_grpo | rloo | yours
  advantage_std: bool = True  # grpo: divide by the group std (False: centred only)

  def __post_init__(self):
    super().__post_init__()
    algorithms.check_estimator(self.advantage)


def auto_tree(batch, cfg, pad_id: int = 0):
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


def rl_batch(fns, state: TrainState, task, cfg: Config, step: int, tok=TOKENIZER):
  """Sample B fresh prompts' rollouts, reward them, and assemble the RL batch; returns
  (batch, shaped rewards [B, R or leaves], stats).

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
  t, a = cfg.train, cfg.algo
  fanouts = cfg.tree.fanout_tuple
  stats, structure = {}, {}  # structure: the samples' pytree, rebuilt from dynamic_sample's rows
  phase_s = dict.fromkeys(("data", "generate", "reward"), 0.0)
  model_weights = weights(state, cfg.lora)  # LoRA: the merged weights

  def draw(round_):
    d0 = time.perf_counter()
    examples = sample_examples(task, t.seed, step if round_ == 0 else (step, round_), t.batch_size)
    prompt_BP, valid_BP = tasks.encode_prompts(examples, task.max_prompt_len, tok)
    placed_BP, placed_valid_BP = place((prompt_BP, valid_BP), "batch", cfg)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
    if round_:
      key = jax.random.fold_in(key, round_)
    d1 = time.perf_counter()
    samples = jax.block_until_ready(
      fns.sample(model_weights, prompt_BP=placed_BP, prompt_valid_BP=placed_valid_BP, key=key)
    )
    samples = sharding.to_host(samples)  # every process decodes and rewards all samples
    d2 = time.perf_counter()
    extra = {}
    if fanouts:
      raw_BR = tree_task.rewards_of(task, examples, samples, fanouts, tok)
      extra["turn1_B"] = np.asarray(
        [
          np.mean([task.first_turn_right(e, x) for x in row])
          for e, row in zip(examples, tree_task.texts(samples.tokens[0], tok))
        ]
      )
      shaping = dapo.path_overlong(
        samples, task.turn_lengths, a.overlong_buffer, a.overlong_penalty
      )
    else:
      B, R, W = len(examples), t.n_branches, cfg.sampler.trunk_len
      chex.assert_shape(
        [samples.tokens_BRT, samples.valid_BRT, samples.logp_BRT],
        (B, R, cfg.sampler.max_new_tokens),
      )
      chex.assert_shape([samples.trunk_BW, samples.trunk_logp_BW], (B, W))
      raw_BR = task.rewards(examples, sampler.completions(samples, tok))
      shaping = _overlong(samples, cfg)
    leaves, structure["samples"] = jax.tree.flatten(samples)  # [B, ...]: kept by prompt
    rows = dict(
      prompt_BP=prompt_BP,
      valid_BP=valid_BP,
      raw_BR=raw_BR,
      **extra,
      **{f"samples_{i}": x for i, x in enumerate(leaves)},
    )
    for name, seconds in (
      ("data", d1 - d0),
      ("generate", d2 - d1),
      ("reward", time.perf_counter() - d2),
    ):
      phase_s[name] += seconds
    return rows, raw_BR + shaping

  if a.dynamic_sampling:
    rows, rewards_BR, stats = dapo.dynamic_sample(draw, t.batch_size, a.max_sample_rounds)
  else:
    rows, rewards_BR = draw(0)
  treedef = structure["samples"]
  samples = jax.tree.unflatten(treedef, [rows[f"samples_{i}"] for i in range(treedef.num_leaves)])
  t1 = time.perf_counter()
  prompt_BP, valid_BP = rows["prompt_BP"], rows["valid_BP"]
  if fanouts:
    batch = sampler.to_tree_batch(
      prompt_BP, valid_BP, samples, fanouts, _node_advantages(rewards_BR, cfg)
    )
  else:
    B, R = rewards_BR.shape
    adv_BR = (
      np.zeros((B, R), np.float32)
      if a.advantage in advantages.NEEDS_CRITIC
      else advantages.compute(a.advantage, rewards_BR, a)
    )
    batch = sampler.to_batch(prompt_BP, valid_BP, samples, jnp.asarray(adv_BR))
  ref = reference(state, cfg)  # LoRA: the base, adapters off
  if ref is not None:  # k3 KL: reference log-probs of every node, one shared-prefix forward
    r0 = time.perf_counter()
    scored = jax.block_until_ready(fns.score(ref, batch=place(batch, "batch", cfg)))
    stats["time/ref_logp_s"] = time.perf_counter() - r0
    batch = batch.with_reference(*sharding.to_host(scored))
  tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
  raw = rows["raw_BR"]
  return (
    batch,
    rewards_BR,
    {
      "reward/mean": float(raw.mean()),
      "reward/std": float(raw.std()),
      "reward/shaped_mean": float(rewards_BR.mean()),
      **({"reward/turn1": float(rows["turn1_B"].mean())} if fanouts else {}),
      **{f"time/{name}_s": seconds for name, seconds in phase_s.items()},
      "time/sample_s": phase_s["data"] + phase_s["generate"],
      "time/old_logp_s": 0.0,
      "time/ref_logp_s": 0.0,
      "time/assemble_s": time.perf_counter() - t1,
      **stats,
    },
  )


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


def _overlong(samples, cfg: Config):
  a = cfg.algo
  if not a.overlong_buffer:
    return 0.0
  W = np.asarray(samples.trunk_BW).shape[1]
  lengths_BR = np.asarray(samples.valid_BRT).sum(-1) + W
  return dapo.overlong_penalty(
    lengths_BR, cfg.sampler.max_new_tokens + W, a.overlong_buffer, a.overlong_penalty
  ).astype(np.float32)


def minibatches(tree, cfg: Config, step: int, epoch: int):
  """The sampled batch split by prompt into algo.minibatches parts, in a per-epoch order."""
  B = cfg.train.batch_size
  M = cfg.algo.minibatches
  if M == 1 and epoch == 0:
    return [tree]
  order = np.random.default_rng([cfg.train.seed, step, epoch, 7]).permutation(B)
  parts = np.split(order, M)
  return [jax.tree.map(lambda x, idx=np.sort(idx): np.asarray(x)[idx], tree) for idx in parts]


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


def summarize(records, cfg: Config) -> dict:
  train = [r for r in records if r.get("kind", "train") == "train"]
  rl = [r for r in train if r.get("reward/mean") is not None]
  k = max(1, min(10, len(rl) // 4))
  evals = {r["step"]: r["eval/greedy_reward"] for r in records if r.get("kind") == "eval"}
  mean = lambda xs: float(np.mean(xs)) if xs else float("nan")
  intervals = {}  # accuracy evaluations (train.eval_batch / eval_shared_prefix): n, Wilson 95%
  for when, step in (("before", cfg.train.sft_steps), ("after", cfg.train.total_steps)):
    rec = next(
      (
        r for r in records if r.get("kind") == "eval" and r["step"] == step and "eval/ci95_low" in r
      ),
      None,
    )
    if rec is not None:
      intervals.update(
        {
          f"eval_{when}_n": rec["eval/n"],
          f"eval_{when}_correct": rec["eval/correct"],
          f"eval_{when}_ci95": [rec["eval/ci95_low"], rec["eval/ci95_high"]],
        }
      )
  if "eval_before_ci95" in intervals and "eval_after_ci95" in intervals:
    intervals["eval_after_interval_above_before"] = (
      intervals["eval_after_ci95"][0] > intervals["eval_before_ci95"][1]
    )
  return {
    **intervals,
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
    "rl_steps": len(rl),
    "median_rl_step_s": float(np.median([r["time/step_s"] for r in rl])) if rl else None,
    "time_by_phase": phases.totals(records),
  }


def format_summary(s: dict) -> str:
  ratio = s["naive_equiv_tokens"] / max(s["computed_tokens"], 1)
  fmt = lambda x: "n/a" if x is None or x != x else f"{x:.3f}"
  return "\n".join(
    [
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
    ]
  )


class GRPO:
  """Flat rollouts (the prompt prefilled once, R branches of it) or, with tree.fanouts,
  trees (R_1 first turns, R_2 second turns of each; tree-aware advantages): `rl_batch`.
  The update, epochs x minibatches, KL reference and mesh are one
  (the step takes both)."""

  phase = "rl"

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    # the warm-up and the greedy evaluation: SFT's (flat or tree, as the config's rollouts)
    self.sft = algorithms.get("sft")(cfg, task, tok)
    self.fns = self.sft.fns
    self.warmup_batch, self.warmup_update = self.sft.warmup_batch, self.sft.warmup_update
    self.eval_examples, self.evaluate = self.sft.eval_examples, self.sft.evaluate
    self.evaluate_all = self.sft.evaluate_all
    self.progress_keys = (
      ("reward/mean",) + (("reward/turn1",) if self.sft.is_tree else ()) + ("loss/policy",)
    )

  def start(self, state):
    if state.ref_params is not None:  # the reference policy: the policy as RL begins
      state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    return state

  def batch(self, state, step):
    batch, _, stats = rl_batch(self.fns, state, self.task, self.cfg, step, self.tok)
    if self.cfg.replay.auto_tree and not self.sft.is_tree:  # config-checked: not with GAE
      batch, tree_stats = auto_tree(batch, self.cfg, self.tok.pad_id)
      stats = {**stats, **tree_stats}
    return batch, stats

  def update(self, state, batch, step):
    return rl_update(self.fns, state, batch, self.cfg, step)

  def verify(self, state, batch):
    """replay.verify: the first batch through replay and the naive twin (raises on a gap)."""
    return verify.check(
      train_state.weights(state, self.cfg.lora),
      batch,
      self.cfg.model,
      steps.rl_loss_config(self.cfg),
      branch_chunk=self.cfg.replay.branch_chunk,
    )

  def token_counts(self, batch, phase):
    if phase == "sft":
      return batch.token_counts()
    return tuple(self.cfg.algo.ppo_epochs * n for n in batch.token_counts())  # per pass

  def restore_template(self, state, step):
    return train_state.state_dict(state)

  def summarize(self, records):
    return summarize(records, self.cfg)

  format_summary = staticmethod(format_summary)
