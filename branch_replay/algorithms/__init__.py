"""Training algorithms behind one small protocol; the loop (trainer.py) drives any of them.

An algorithm is one module: its `Options` (the `algo` section's fields when `algo.name` selects
it), optionally `check(cfg)` (what it needs of the other sections, raised by field before any
compute), and a class built once per run, `Algorithm(cfg, task, tokenizer, workdir=...)`, that
subclasses `base.Algorithm` (or its parent's class) and overrides what differs. Its batches
come from rollout.py. The protocol (`base.Algorithm` holds every default):

Must define:
  batch(state, step) -> (batch, stats)             its phase's batch
  update(state, batch, step) -> (state, metrics)   its jitted steps on that batch
May override, [the default]:
  phase, progress_keys, summary_metrics   its phase's name in metrics, the progress bar's keys,
                                          what its summary shows (train/summary.py: one schema
                                          for all, rendered once) ["rl", loss/policy, loss/policy]
  objectives, uses_critic, auto_tree      what it needs of the other sections, checked when a
                                          config is made [sampled groups' objectives, no, no]
  total_steps, warmup_steps               [train.total_steps, train.sft_steps]
  warmup_batch(step); warmup_update(state, batch)   the warm-up [data/supervised.py, sft_step]
  start(state) -> state                   the phase boundary: reference copy, critic init [none]
  verify(state, batch, tol) -> dict       replay == naive on the first batch [the RL objective]
  token_counts(batch, phase) -> (prefix, tails, naive-equivalent) positions [the batch's]
  eval_examples(); evaluate(state, examples) -> per-prompt greedy rewards [train/evaluate.py]
  restore_template(state, step) -> dict   the checkpoint's tree at `step` [the state]

The registry (`branch_replay/registry.py`, below the config, so that neither the config nor the
trainer imports up to this package) resolves them by name: `for_config` and `options_class`
import only the module a config selects. A new algorithm is one module and one line in
`registry.ALGORITHMS` (or `register`). Its names are re-exported here for the algorithms'
modules (`algorithms.int_at_least`, `algorithms.SampledOptions`, ...).
"""

from branch_replay.registry import (  # noqa: F401 (re-exported for the algorithms' modules)
  ALGORITHMS,
  SampledOptions,
  check,
  check_estimator,
  for_config,
  get,
  int_at_least,
  options_class,
  owners,
  register,
)
