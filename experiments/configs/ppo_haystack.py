"""PPO with a critic through branch replay on the long-prompt haystack task.

  python run.py --experiment=ppo_haystack --workdir=runs/ppo

The warm-up of grpo_haystack (600 supervised steps on 32-token haystacks), then PPO on the
256-token prompts: 8 prompts x 8 branches per step, each sampled batch reused for 2 epochs
of 2 minibatches (split by prompt), so the ratio moves and the clip binds. The value model
(same family as the policy, a copy of it at RL start plus a zero value head) is trained
through branch replay too: prefix forward once, tails vmapped, one prefix backward; GAE
(gamma 1, lambda 0.95) per branch from its per-token values, reward at the last token.
Metrics: reward/mean, value/explained_variance, loss/value, clip_frac, approx_kl, ratio/max.
Measured: experiments/results/ppo_haystack_2026-11-30.jsonl and rl_compare_ppo_2026-11-30.jsonl
(tables `ppo_haystack` and `rl_compare` in docs/algorithms.md).
"""

import dataclasses

from branch_replay.config import AlgoConfig
from branch_replay.core.critic import CriticConfig
from experiments.configs import grpo_haystack


def get_config():
  cfg = grpo_haystack.get_config()
  return dataclasses.replace(
    cfg,
    loss=dataclasses.replace(cfg.loss, name="ppo", epsilon=0.2),
    train=dataclasses.replace(cfg.train, rl_steps=100),
    algo=AlgoConfig(name="ppo", ppo_epochs=2, minibatches=2),
    critic=CriticConfig(learning_rate=3e-3, value_clip=0.2, gamma=1.0, lam=0.95),
  )
