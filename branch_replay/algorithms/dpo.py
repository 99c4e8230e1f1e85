"""DPO on preference pairs that share a long prompt (branch_replay/data/dpo.py: pairs, batches,
metrics): the supervised warm-up, then the policy as DPO begins is frozen as the reference;
each step scores chosen and rejected under it (one shared-prefix forward) and takes the
`dpo` objective's replay step."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay import rollout
from branch_replay.core import tree
from branch_replay.data import dpo
from branch_replay.train import state as train_state
from branch_replay.algorithms import base


@dataclasses.dataclass(frozen=True)
class Options:
  pairs_file: str = ""  # JSON lines {"prompt", "chosen", "rejected"}; "" = pairs from the task

  def __post_init__(self):
    if self.pairs_file and not os.path.isfile(self.pairs_file):
      raise ValueError(f"algo.pairs_file={self.pairs_file!r}: no such file")


def check(cfg) -> None:
  """Pairs: two branches per prompt (chosen, rejected); on trees the last level's siblings;
  the policy and its reference scored with full weights (no LoRA)."""
  if cfg.lora.enabled:
    raise ValueError(
      f"lora.rank={cfg.lora.rank} with loss.name={cfg.loss.name!r}: LoRA is not supported "
      "there (DPO scores the policy and its reference with full weights); expected "
      "lora.rank=0 or another loss.name"
    )
  shape = rollout.shape(cfg)
  if shape.turns and cfg.algo.pairs_file:
    raise ValueError(
      f"algo.pairs_file={cfg.algo.pairs_file!r} with {shape.setting}: a pairs file holds flat "
      "(prompt, chosen, rejected) pairs; DPO on trees pairs the task's last turns; expected ''"
    )
  if shape.fanouts[-1] == 2:
    return
  if shape.turns:
    raise ValueError(
      f"{shape.setting} with algo.name='dpo': DPO pairs the last level's siblings "
      "(chosen, rejected); expected a last fan-out of 2"
    )
  raise ValueError(f"{shape.setting}: DPO trains on (chosen, rejected) pairs, expected 2")


KEYS = ("loss/policy", "grad/norm", "logp/mean", "entropy")  # of the replay step's metrics


class DPO(base.Algorithm):
  """The base's warm-up, then DPO steps on dpo.Pairs' batches (flat pairs or preference
  trees) against the policy as DPO began; no greedy evaluation."""

  phase = "dpo"
  objectives = ("dpo",)  # its pairs' objective (losses.py), not a sampled group's
  progress_keys = ("dpo/accuracy", "loss/policy")
  summary_metrics = ("dpo/accuracy", "dpo/margin")

  def __init__(self, cfg, task, tok, workdir=None, runtime=None):
    super().__init__(cfg, task, tok, workdir, runtime)
    self.pairs = dpo.Pairs(cfg, task, tok)

  def start(self, state):
    if state.ref_params is None:  # the reference: the policy as DPO begins
      state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
    return state

  def batch(self, state, step):
    cfg = self.cfg
    batch = self.pairs.batch(step)
    place = lambda b: self.rt.put(b, "batch")
    # 1. Reference log-probs of every node (flat: chosen and rejected), one shared-prefix
    #    forward; on every process.
    ref_levels, ref_trunk_BW = self.rt.to_host(self.fns.score(state.ref_params, batch=place(batch)))
    batch = batch.with_reference(ref_levels, ref_trunk_BW)
    tree.validate(batch, cfg.model.vocab_size, cfg.replay.branch_chunk)
    # 2. The policy's, for the metrics before the update: from the leaves, [pairs, 2] (0 where
    #    invalid; a pair's shared ancestors cancel in its margin).
    pol_levels, _ = self.rt.to_host(self.fns.score(state.params, batch=place(batch)))
    pair_sum = lambda logp_BRT: np.asarray(logp_BRT).sum(-1).reshape(-1, 2)
    return batch, dpo.preference_metrics(
      pair_sum(pol_levels[-1]), pair_sum(ref_levels[-1]), cfg.loss.beta
    )

  def update(self, state, batch, step):
    state, out = self.fns.rl_step(state, self.rt.put(batch, "batch"))
    return state, {k: float(v) for k, v in jax.device_get(out).items() if k in KEYS}

  def eval_examples(self):
    return []  # no greedy evaluation of preference pairs

  def restore_template(self, state, step):
    keys = train_state.state_dict(state)
    if step > self.cfg.train.sft_steps:  # the reference exists once DPO has begun
      keys["ref_params"] = state.params
    return keys
