"""DPO through branch replay on the long-prompt haystack task.

  python run.py --experiment=dpo_haystack --workdir=runs/dpo
  python run.py --experiment=dpo_haystack --set=algo.pairs_file=pairs.jsonl   # your own pairs

The warm-up of grpo_haystack (600 supervised steps on 32-token haystacks), then DPO on
256-token prompts: 8 pairs per step, each a shared prompt with two tails, chosen = the right
value and rejected = a wrong one. The frozen reference (the policy as DPO begins) scores
both tails from one shared-prefix forward per prompt. Metrics: dpo/accuracy, dpo/margin,
rewards/chosen, rewards/rejected. Measured: experiments/results/rl_compare_2026-11-30.jsonl
(its `algorithm: dpo` line; table `rl_compare` in docs/algorithms.md).
"""

import dataclasses

from branch_replay.config import AlgoConfig
from experiments.configs import grpo_haystack


def get_config():
  cfg = grpo_haystack.get_config()
  return dataclasses.replace(
    cfg,
    loss=dataclasses.replace(cfg.loss, name="dpo", beta=0.1),
    algo=AlgoConfig(name="dpo"),
    train=dataclasses.replace(
      cfg.train, rl_steps=100, n_branches=2, learning_rate=3e-4, eval_size=0
    ),
  )
