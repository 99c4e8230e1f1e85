"""GRPO through branch replay on the short reasoning task: two-digit addition `a+b=`.

  python run.py --experiment=grpo_arithmetic --workdir=runs/arithmetic

Short prompts (7 tokens), so branch replay saves little here: this experiment exercises the
trainer on a second verifiable task rather than the long-context regime. A 450-step supervised
warm-up teaches the format and part of the sums; GRPO (16 prompts x 8 branches, lr 3e-4)
then raises the exact-match reward.
No results file records a run of it yet: convert a finished workdir with
experiments/provenance.py --workdir=... before quoting a number of it.
"""

from branch_replay.config import Config, ReplayConfig, TrainConfig
from branch_replay.losses import LossConfig
from branch_replay.sampler import SamplerConfig
from branch_replay.tasks import TaskConfig
from branch_replay.tokenizer import TOKENIZER
from models.transformer import ModelConfig


def get_config() -> Config:
  return Config(
      model=ModelConfig(vocab_size=TOKENIZER.vocab_size, d_model=64, n_layers=2, n_heads=4,
                        n_kv_heads=4, head_dim=16, mlp_hidden=128),
      loss=LossConfig(name="grpo", aggregation="token_mean", epsilon=0.2),
      replay=ReplayConfig(mode="replay"),
      train=TrainConfig(seed=0, sft_steps=450, sft_batch_size=64, sft_learning_rate=3e-3,
                        rl_steps=150, batch_size=16, n_branches=8, learning_rate=3e-4,
                        checkpoint_every=50, keep_checkpoints=2, eval_size=128),
      sampler=SamplerConfig(max_new_tokens=4, temperature=1.0),
      task=TaskConfig(name="arithmetic", n_digits=2),
  )
