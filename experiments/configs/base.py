"""What the run configs share: the small character-level model, the GRPO loss, branch replay,
and the haystack runs' training schedule with its supervised warm-up. Each config in this
folder is `base.config(task, ...)` with only what differs from here."""

import dataclasses

from branch_replay.config import Config, ReplayConfig, TrainConfig
from branch_replay.core.losses import LossConfig
from branch_replay.core.sampler import SamplerConfig
from branch_replay.data.tokenizer import TOKENIZER
from models.transformer import ModelConfig

# A 2-layer d=64 model over the character tokenizer (79 ids); WIDE doubles the width.
MODEL = ModelConfig(
  vocab_size=TOKENIZER.vocab_size,
  d_model=64,
  n_layers=2,
  n_heads=4,
  n_kv_heads=4,
  head_dim=16,
  mlp_hidden=128,
)
WIDE_MODEL = dataclasses.replace(MODEL, d_model=128, head_dim=32, mlp_hidden=256)

LOSS = LossConfig(name="grpo", aggregation="token_mean", epsilon=0.2)

# The warm-up (supervised steps on short prompts through the same engine) and the RL
# schedule of the haystack runs; a config replaces what differs with train(...).
WARMUP = dict(sft_steps=600, sft_batch_size=32, sft_learning_rate=3e-3)
TRAIN = TrainConfig(
  seed=0,
  **WARMUP,
  rl_steps=150,
  batch_size=8,
  n_branches=8,
  learning_rate=1e-3,
  checkpoint_every=50,
  keep_checkpoints=2,
  eval_size=128,
)


def train(**changes) -> TrainConfig:
  """TRAIN with `changes` (TrainConfig field names)."""
  return dataclasses.replace(TRAIN, **changes)


def config(
  task,
  *,
  model: ModelConfig = MODEL,
  train: TrainConfig = TRAIN,
  sampler: SamplerConfig = SamplerConfig(),
  **sections,
) -> Config:
  """A GRPO run through branch replay of `task`; `sections`: other Config fields (tree=...)."""
  return Config(
    model=model,
    loss=LOSS,
    replay=ReplayConfig(mode="replay"),
    train=train,
    sampler=sampler,
    task=task,
    **sections,
  )
