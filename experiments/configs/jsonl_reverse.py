"""GRPO on your own prompts: a JSON-lines file of "reverse this word" prompts, exact match.

  python experiments/data/make_reverse.py        # writes experiments/data/reverse.jsonl
  python run.py --experiment=jsonl_reverse --set=task.path=experiments/data/reverse.jsonl \
      --set=task.reward=exact_match --workdir=runs/reverse

400 prompts `reverse: kqz=` -> `zqk` (3-5 random letters); 40 (a seeded 10%) are held out
for the greedy evaluation. A 2-layer d=128 model warms up on the `answer` field (1500
supervised steps through branch replay; weight decay 0.1 and lr 1e-3: the d=64 model, lr 3e-3
or fewer steps memorise the 360 training words and reverse few held-out ones), then GRPO
with 8 branches per prompt.
Measured (seed 0): experiments/results/jsonl_reverse_2026-11-30.jsonl (read in
docs/training.md).
"""

from branch_replay.core.sampler import SamplerConfig
from branch_replay.data.tasks import TaskConfig
from experiments.configs import base


def get_config():
  return base.config(
    TaskConfig(
      name="jsonl", path="experiments/data/reverse.jsonl", prompt_len=16, reward="exact_match"
    ),
    model=base.WIDE_MODEL,
    train=base.train(
      sft_steps=1500,
      sft_learning_rate=1e-3,
      rl_steps=100,
      learning_rate=3e-4,
      weight_decay=0.1,
      checkpoint_every=100,
      eval_size=40,
    ),
    sampler=SamplerConfig(max_new_tokens=6),
  )
