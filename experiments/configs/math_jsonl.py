"""GRPO on GSM8K-layout math problems: k-shot prompts (a long prefix shared by every branch),
the checkpoint's chat template, the `final_number` reward (the number after `####`, else the
last number; branch_replay/data/rewards.py).

A local Qwen2.5-0.5B-Instruct folder on a GPU (GSM8K's train.jsonl, or the generated file):
  python run.py --experiment=math_jsonl --model_dir=/models/Qwen2.5-0.5B-Instruct \
      --model_dtype=bfloat16 --set=task.path=$(python experiments/configs/math_jsonl.py \
      --shots=8 --data=gsm8k/train.jsonl) --set=task.prompt_len=2048 \
      --set=sampler.max_new_tokens=320 --set=train.batch_size=8 --set=train.n_branches=16 \
      --set=train.rl_steps=200 --set=train.learning_rate=1e-6 --workdir=runs/qwen_math
This CPU, on a tiny random checkpoint (a byte-level BPE trained on the data, a Qwen-style
chat template; written by this script, no downloads) -- the plumbing, not a result:
  python experiments/configs/math_jsonl.py --write_tiny_checkpoint=/tmp/tiny_math
  python run.py --experiment=math_jsonl --model_dir=/tmp/tiny_math --workdir=runs/tiny_math \
      --set=train.rl_steps=5
Without --model_dir the experiment's own small model trains on the character tokenizer.

The data: experiments/data/math.jsonl (200 generated problems, make_math.py); the k-shot
prompt file is built from it (the first k problems are the shots, left out of training)
into the temp directory when the config is made.
"""

from __future__ import annotations

import json
import os
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dataclasses  # noqa: E402

from branch_replay.config import TrainConfig  # noqa: E402
from branch_replay.core.sampler import SamplerConfig  # noqa: E402
from branch_replay.data.tasks import TaskConfig  # noqa: E402
from experiments.configs import base  # noqa: E402

DATA = os.path.join(ROOT, "experiments", "data", "math.jsonl")
SHOTS = 2
SEP = " | "  # between shots (the character tokenizer has no newline)
QWEN_TEMPLATE = (
  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
  "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
  "{% endif %}"
)


def shot(question: str, answer: str = "") -> str:
  return f"Question: {question} Answer:" + (f" {answer}" if answer else "")


def build_prompts(data: str = DATA, shots: int = SHOTS, out: str = "") -> str:
  """A GSM8K-layout file (question, answer per line) -> a JSON-lines file of k-shot prompts
  (`prompt`, `answer`); the first `shots` records are the examples, not trained on.
  Returns the written path (default: the temp directory, named by data and shots)."""
  with open(data, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  for i, row in enumerate(rows, 1):
    if not {"question", "answer"} <= set(row) or "####" not in row["answer"]:
      raise ValueError(
        f"{data}:{i}: expected fields 'question' and 'answer' (ending "
        "'#### <number>'), GSM8K's layout"
      )
  if len(rows) <= shots:
    raise ValueError(f"{data}: {len(rows)} problems, expected more than shots={shots}")
  header = SEP.join(shot(r["question"], r["answer"]) for r in rows[:shots])
  out = out or os.path.join(
    tempfile.gettempdir(), "branch_replay_math", f"{os.path.basename(data)[:-6]}_{shots}shot.jsonl"
  )
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    for r in rows[shots:]:
      prompt = (header + SEP if header else "") + shot(r["question"])
      f.write(json.dumps({"prompt": prompt, "answer": " " + r["answer"]}) + "\n")
  return out


def get_config():
  # No warm-up (an imported checkpoint already answers): its own short schedule.
  return base.config(
    TaskConfig(name="jsonl", path=build_prompts(), prompt_len=768, reward="final_number"),
    model=dataclasses.replace(base.WIDE_MODEL, n_kv_heads=2),
    train=TrainConfig(
      seed=0,
      sft_steps=0,
      rl_steps=20,
      batch_size=2,
      n_branches=4,
      learning_rate=1e-4,
      checkpoint_every=20,
      keep_checkpoints=1,
      eval_size=4,
    ),
    sampler=SamplerConfig(max_new_tokens=80),
  )


def write_tiny_checkpoint(path: str, data: str = DATA, vocab: int = 384) -> str:
  """A tiny random Qwen2 folder: config.json + weights, a byte-level BPE tokenizer.json
  trained on `data`, tokenizer_config.json with a Qwen-style chat template, and
  generation_config.json with two eos ids (<|im_end|>, <|endoftext|>)."""
  import jax
  import tokenizers
  from models import hf
  from models import transformer as tfm

  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
    vocab_size=vocab,
    special_tokens=specials,
    initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
  )
  with open(data, encoding="utf-8") as f:
    texts = [v for line in f if line.strip() for v in json.loads(line).values()]
  tok.train_from_iterator(texts + [shot("q", "a") + SEP, QWEN_TEMPLATE], trainer)
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  ids = {s: tok.token_to_id(s) for s in specials}
  rows = -(-tok.get_vocab_size() // 64) * 64  # embedding rows: the vocabulary rounded up
  cfg = tfm.preset("tiny", vocab_size=rows, qkv_bias=True, tie_embeddings=True)
  hf.save(
    path,
    cfg,
    tfm.init_params(cfg, jax.random.key(0)),
    family="qwen2",
    extra_config=dict(
      bos_token_id=ids["<|endoftext|>"],
      eos_token_id=ids["<|im_end|>"],
      pad_token_id=ids["<|endoftext|>"],
    ),
  )
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(
      {
        "chat_template": QWEN_TEMPLATE,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
      },
      f,
      indent=2,
    )
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump(
      {
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
      },
      f,
      indent=2,
    )
  return path


if __name__ == "__main__":
  import argparse

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", default=DATA, help="GSM8K-layout JSON lines")
  parser.add_argument("--shots", type=int, default=SHOTS)
  parser.add_argument("--out", default="", help="the k-shot prompt file (default: temp dir)")
  parser.add_argument("--write_tiny_checkpoint", default="", help="write a tiny folder here")
  args = parser.parse_args()
  if args.write_tiny_checkpoint:
    print(write_tiny_checkpoint(args.write_tiny_checkpoint, args.data))
  else:
    print(build_prompts(args.data, args.shots, args.out))
