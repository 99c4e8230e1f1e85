"""GRPO through branch replay on a long-prompt key->value retrieval task (the default run).

  python run.py                        # this experiment, a few minutes on a 2-core CPU
  python run.py --set=task.prompt_len=1024 --workdir=runs/long   # longer haystacks (not run end to end)

A 2-layer d=64 model (char tokenizer, 79 ids) first warms up for 600 supervised steps on
*short* haystacks (32 tokens; one shared prefix, one tail per key, through the same
engine), where it learns the retrieval circuit almost perfectly; on the 256-token haystacks
of the RL phase it only half works (attention to the one right record is diluted by the
long filler). GRPO with 8 branches per prompt on the long prompts then raises it.
Measured (seed 0): experiments/results/default_run_2026-12-02.jsonl (its
`kind: summary` line; the table `default_run` in docs/training.md renders it).
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
      train=TrainConfig(seed=0, sft_steps=600, sft_batch_size=32, sft_learning_rate=3e-3,
                        rl_steps=150, batch_size=8, n_branches=8, learning_rate=1e-3,
                        checkpoint_every=50, keep_checkpoints=2, eval_size=128),
      sampler=SamplerConfig(max_new_tokens=3, temperature=1.0),
      task=TaskConfig(name="haystack", prompt_len=256, n_keys=4, value_len=1,
                      sft_prompt_len=32),
  )
