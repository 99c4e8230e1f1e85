"""The long-context recipe (experiments/configs/needle_smollm2.py) builds and takes one tiny
GRPO step with LoRA on the needle task, on the tiny model and the character tokenizer (the
task's text is in its alphabet); the real model's run is the command in its docstring."""

import json

import numpy as np

from branch_replay.config import apply_overrides
from branch_replay.data import tasks
from branch_replay.train import trainer
from experiments import registry
from models import transformer as tfm


def test_needle_recipe_config():
  cfg = registry.get_config("needle_smollm2")
  assert cfg.task.name == "needle" and cfg.task.prompt_len >= 2048
  assert cfg.train.n_branches >= 8 and cfg.lora.rank == 16 and cfg.loss.kl_coef > 0
  assert cfg.train.eval_size >= 100 and cfg.train.eval_shared_prefix
  task = tasks.make(cfg.task)
  task.check(cfg)  # the answers fit sampler.max_new_tokens
  assert cfg.sampler.max_new_tokens == task.max_answer_len + 1


def test_needle_recipe_takes_one_tiny_step(tmp_path):
  base = registry.get_config("needle_smollm2")
  cfg = apply_overrides(
    base.__class__(**{**base.__dict__, "model": tfm.preset("tiny")}),
    [
      "task.prompt_len=480",
      "task.n_keys=2",
      "train.rl_steps=1",
      "train.batch_size=1",
      "train.eval_size=2",
      "train.eval_batch=2",
      "train.progress=false",
      "train.plot=false",
    ],
  )
  assert cfg.train.n_branches >= 8
  summary = trainer.run(cfg, str(tmp_path / "run"))
  assert summary["steps"] == 1
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  step = next(r for r in rows if "loss/policy" in r)
  assert np.isfinite(step["loss/policy"]) and 0.0 <= step["reward/mean"] <= 1.0
  assert sum("eval/greedy_reward" in r for r in rows) == 2  # before and after
  assert (tmp_path / "run" / "adapter").is_dir()  # LoRA: the adapters in PEFT's format
