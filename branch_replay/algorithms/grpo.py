"""GRPO-family RL on sampled groups: every group advantage estimator (`algo.advantage`; GAE
is PPO's, algorithms/ppo.py, which builds on these), DAPO, the KL reference, epochs x
minibatches. `GRPO` samples flat
groups (R branches per prompt, optional trunk) and trees (`tree.fanouts`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from branch_replay import algorithms, train, tree, tree_train, trie, verify
from branch_replay import state as train_state


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
  """Flat rollouts: the prompt prefilled once, R branches of it (train.rl_batch); with
  tree.fanouts trees (tree_train.rl_batch: R_1 first turns, R_2 second turns of each;
  tree-aware advantages). The update, epochs x minibatches, KL reference and mesh are one
  (the step takes both)."""

  phase = "rl"

  def __init__(self, cfg, task, tok, workdir=None):
    self.cfg, self.task, self.tok = cfg, task, tok
    # the warm-up and the greedy evaluation: SFT's (flat or tree, as the config's rollouts)
    self.sft = algorithms.get("sft")(cfg, task, tok)
    self.fns = self.sft.fns
    self.warmup_batch, self.warmup_update = self.sft.warmup_batch, self.sft.warmup_update
    self.eval_examples, self.evaluate = self.sft.eval_examples, self.sft.evaluate
    self.progress_keys = ("reward/mean",) + (("reward/turn1",) if self.sft.is_tree else ()) + (
        "loss/policy",)

  def start(self, state):
    if state.ref_params is not None:  # the reference policy: the policy as RL begins
      state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    return state

  def batch(self, state, step):
    if self.sft.is_tree:
      return tree_train.rl_batch(self.fns, state, self.task, self.cfg, step, self.tok)
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
    return tuple(self.cfg.algo.ppo_epochs * n for n in batch.token_counts())  # per pass

  def restore_template(self, state, step):
    return train_state.state_dict(state)

  def summarize(self, records):
    return train.summarize(records, self.cfg)

  format_summary = staticmethod(train.format_summary)
