"""GRPO through branch replay on a long-prompt key->value retrieval task (the default run).

  python run.py                        # this experiment, a few minutes on a 2-core CPU
  python run.py --set=task.prompt_len=1024 --workdir=runs/long   # longer haystacks (not run end to end)

A 2-layer d=64 model (char tokenizer, 79 ids) first warms up for 600 supervised steps on
*short* haystacks (32 tokens; one shared prefix, one tail per key, through the same
engine), where it learns the retrieval circuit almost perfectly; on the 256-token haystacks
of the RL phase it only half works (attention to the one right record is diluted by the
long filler). GRPO with 8 branches per prompt on the long prompts then raises it.
Measured (seed 0): experiments/results/default_run_2026-12-04.jsonl (its
`kind: summary` line; the table `default_run` in docs/training.md renders it).
"""

from branch_replay.core.sampler import SamplerConfig
from branch_replay.data.tasks import TaskConfig
from experiments.configs import base


def get_config():
  return base.config(
    TaskConfig(name="haystack", prompt_len=256, n_keys=4, value_len=1, sft_prompt_len=32),
    sampler=SamplerConfig(max_new_tokens=3),
  )
