"""Supervised fine-tuning through the engine (`algo.name=sft`, train.sft_steps steps): the
task's long prefix shared by its reference answers (flat: one tail each; trees: the task's
turns), objective -log p: the base's warm-up (algorithms/base.py), which every algorithm runs
for train.sft_steps before its phase, run as the phase."""

from __future__ import annotations


from branch_replay.algorithms import base
from branch_replay.sections import NoOptions as Options  # noqa: F401 (SFT has no options)


def check(cfg) -> None:
  if cfg.train.rl_steps or not cfg.train.sft_steps:
    raise ValueError(
      f"algo.name='sft' with train.sft_steps={cfg.train.sft_steps}, "
      f"train.rl_steps={cfg.train.rl_steps}: SFT trains train.sft_steps supervised steps; "
      "expected sft_steps >= 1 and rl_steps=0"
    )


class SFT(base.Algorithm):
  """The base's warm-up batches (`supervised.warmup_batch`, flat or trees) and step as the phase;
  the greedy evaluation of the policy on held-out prompts."""

  phase = "sft"
  warmup_steps = 0  # as the run, its steps are the phase (batch/update), not a warm-up

  @property
  def total_steps(self) -> int:  # as the run itself: its steps; as a warm-up: its owner's
    return self.cfg.train.sft_steps

  def batch(self, state, step):
    return self.warmup_batch(step), {}

  def update(self, state, batch, step):
    return self.warmup_update(state, batch)

  def verify(self, state, batch, tol=None):
    return {}  # supervised batches: the self-check is the RL objective's
