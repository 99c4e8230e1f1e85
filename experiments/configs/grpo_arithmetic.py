"""GRPO through branch replay on the short reasoning task: two-digit addition `a+b=`.

  python run.py --experiment=grpo_arithmetic --workdir=runs/arithmetic

Short prompts (7 tokens), so branch replay saves little here: this experiment exercises the
trainer on a second verifiable task rather than the long-context regime. A 450-step supervised
warm-up teaches the format and part of the sums; GRPO (16 prompts x 8 branches, lr 3e-4)
then raises the exact-match reward.
No results file records a run of it yet: convert a finished workdir with
experiments/provenance.py --workdir=... before quoting a number of it.
"""

from branch_replay.core.sampler import SamplerConfig
from branch_replay.data.tasks import TaskConfig
from experiments.configs import base


def get_config():
  return base.config(
    TaskConfig(name="arithmetic", n_digits=2),
    train=base.train(sft_steps=450, sft_batch_size=64, batch_size=16, learning_rate=3e-4),
    sampler=SamplerConfig(max_new_tokens=4),
  )
