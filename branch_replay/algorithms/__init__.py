"""Training algorithms behind one small protocol; the loop (trainer.py) drives any of them.

An algorithm is a class built once per run, `Algorithm(cfg, task, tokenizer, workdir=...)`,
which compiles its jitted steps (cached across runs in one process) and then answers the loop:

  total_steps: int                            steps of the run, warm-up included (optional:
                                              default train.sft_steps + train.rl_steps)
  warmup_steps: int                           supervised steps before the phase (optional:
                                              default train.sft_steps; SFT's are its phase)
  phase: str                                  the name of its phase in metrics ("rl", "dpo")
  progress_keys: tuple                        metrics shown beside the progress bar
  warmup_batch(step) -> batch                 the supervised warm-up (train.sft_steps)
  warmup_update(state, batch) -> (state, metrics)
  start(state) -> state                       the phase boundary: reference copy, critic init
  batch(state, step) -> (batch, stats)        host: rollout and rewards, or preference pairs
  update(state, batch, step) -> (state, metrics)   its jitted steps (epochs x minibatches)
  token_counts(batch, phase) -> (prefix, tails, naive-equivalent) positions computed
  eval_examples() -> list; evaluate(state, examples) -> greedy reward
  restore_template(state, step) -> dict       the checkpoint's tree at `step` (resume)
  summarize(records) -> dict; format_summary(summary) -> str

Each lives in its own module and imports no other's names (PPO builds on GRPO's sampling
and policy step, GRPO on SFT's warm-up, through the registry, `get`); `for_config` imports only
the one a config selects (`algo.name`; its options: options.py).
"""

from __future__ import annotations

import importlib

# name -> (module, class); a new algorithm is one module, one line here and its options
# (options.py). `algo.name` selects one; each serves flat and tree rollouts (tree.fanouts).
ALGORITHMS = {
  "grpo": ("grpo", "GRPO"),
  "ppo": ("ppo", "PPO"),
  "dpo": ("dpo", "DPO"),
  "sft": ("sft", "SFT"),
  "rollouts": ("rollouts", "Rollouts"),
}


def get(name: str):
  if name not in ALGORITHMS:
    raise ValueError(f"algorithm {name!r}: expected one of {sorted(ALGORITHMS)}")
  module, cls = ALGORITHMS[name]
  return getattr(importlib.import_module(f"branch_replay.algorithms.{module}"), cls)


def for_config(cfg):
  return get(cfg.algo.name)
