"""GRPO-family RL on sampled groups: every group advantage estimator (`train.advantage`; GAE
is PPO's, algorithms/ppo.py, which builds on these), DAPO, the KL reference, epochs x
minibatches. `GRPO` samples flat
groups (R branches per prompt, optional trunk); `TreeGRPO` samples trees (`tree.fanouts`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay import sharding, tasks, train, tree, tree_train, trie, verify
from branch_replay import state as train_state
from branch_replay.batch import validate


def _floats(out) -> dict:
  return {k: float(v) for k, v in jax.device_get(out).items()}


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
  return batch, {"replay/tree_token_ratio": s["tree_token_ratio"],
                 "replay/trie_token_ratio": s["trie_token_ratio"],
                 "replay/trunk_len": s["trunk_len"],
                 "replay/fanouts": "x".join(map(str, s["fanouts"])),
                 "time/layout_s": time.perf_counter() - t0}


class GRPO:
  """Flat rollouts: the prompt prefilled once, R branches of it (train.rl_batch)."""

  phase = "rl"
  progress_keys = ("reward/mean", "loss/policy")

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.fns = train.compiled(train.compile_key(cfg),
                              tuple(getattr(tok, "stop_ids", (tok.eos_id,))))

  def warmup_batch(self, step):
    cfg = self.cfg
    batch = train.sft_batch(self.task, np.random.default_rng([cfg.train.seed, step]), cfg,
                            self.tok)
    validate(batch, cfg.model.vocab_size)
    return batch

  def warmup_update(self, state, batch):
    state, out = self.fns.sft_step(state, train_state.place(batch, "batch", self.cfg))
    return state, _floats(out)

  def start(self, state):
    if state.ref_params is not None:  # the reference policy: the policy as RL begins
      state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    return state

  def batch(self, state, step):
    batch, _, stats = train.rl_batch(self.fns, state, self.task, self.cfg, step, self.tok)
    if self.cfg.replay.auto_tree:  # config-checked: not with GAE
      batch, tree_stats = auto_tree(batch, self.cfg, self.tok.pad_id)
      stats = {**stats, **tree_stats}
    return batch, stats

  def update(self, state, batch, step):
    return train.rl_update(self.fns, state, batch, self.cfg, step)

  def verify(self, state, batch):
    """replay.verify: the first batch through replay and the naive twin (raises on a gap)."""
    return verify.check(train_state.weights(state, self.cfg.lora), batch, self.cfg.model,
                        train.rl_loss_config(self.cfg), branch_chunk=self.cfg.replay.branch_chunk)

  def token_counts(self, batch, phase):
    if phase == "sft":
      return batch.token_counts()
    return tuple(self.cfg.train.ppo_epochs * n for n in batch.token_counts())  # per pass

  def eval_examples(self):
    return self.task.eval_examples(self.cfg.train.seed, self.cfg.train.eval_size)

  def evaluate(self, state, examples):
    prompt_BP, valid_BP = tasks.encode_prompts(examples, self.task.max_prompt_len, self.tok)
    s = self.fns.greedy(train_state.weights(state, self.cfg.lora), prompt_BP=prompt_BP,
                        prompt_valid_BP=valid_BP, key=jax.random.key(0))
    s = sharding.to_host(s) if self.cfg.mesh else s
    return float(train.rewards_of(self.task, examples, train.completions(s, self.tok)).mean())

  def restore_template(self, state, step):
    return train_state.state_dict(state)

  def summarize(self, records):
    return train.summarize(records, self.cfg)

  format_summary = staticmethod(train.format_summary)


class TreeGRPO(GRPO):
  """Tree rollouts (tree_train.rl_batch): the prompt prefilled once, R_1 first turns, R_2
  second turns of each; tree-aware advantages; warm-up trees from the task's turns. The
  update, epochs x minibatches, KL reference and mesh are GRPO's (the step takes trees)."""

  progress_keys = ("reward/mean", "reward/turn1", "loss/policy")

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    self.fns = tree_train.compiled(tree_train.compile_key(cfg), task.turn_lengths,
                                   task.stop_tokens(tok))

  def warmup_batch(self, step):
    cfg = self.cfg
    batch = tree_train.sft_batch(self.task, np.random.default_rng([cfg.train.seed, step]), cfg,
                                 self.tok)
    tree.validate(batch, cfg.model.vocab_size)
    return batch

  def batch(self, state, step):  # a tree batch: GRPO's update and verify
    return tree_train.rl_batch(self.fns, state, self.task, self.cfg, step, self.tok)

  def eval_examples(self):
    t = self.cfg.train
    return train_state.sample_examples(self.task, t.seed, 2**31, t.eval_size)

  def evaluate(self, state, examples):
    prompt_BP, valid_BP = tasks.encode_prompts(examples, self.task.max_prompt_len, self.tok)
    s = self.fns.greedy(train_state.weights(state, self.cfg.lora), prompt_BP=prompt_BP,
                        prompt_valid_BP=valid_BP, key=jax.random.key(0))
    s = sharding.to_host(s)  # numpy; gathered when the mesh spans several processes
    return float(tree_train.rewards_of(self.task, examples, s, (1, 1), self.tok).mean())
