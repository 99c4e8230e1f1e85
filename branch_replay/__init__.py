"""branch-replay: RL post-training whose rollouts share long prompts, the shared prefix run
once forward and once backward (branch replay), the gradient exactly the naive one.

The rooms, each importing only the ones before it (tests/system/imports_test.py):

  core/        the method, no data, no loop: replay.py (the paper in one file), engine.py (the
               one entry `loss_and_grad`, trees, a mesh, LoRA, the naive twin), tree.py (the
               one batch type), losses.py (a new objective: `@losses.register`),
               advantages.py (a new estimator: `@advantages.register`), critic.py, sampler.py,
               trie.py, sharding.py (the one RULES table)
  data/        what is trained on: a new task is one file with `@tasks.register` (a multi-turn
               one sampled as trees: a `turns.TurnsTask` subclass); rewards
               (`@rewards.register`), prompts from JSONL, recorded rollouts, preference pairs,
               the supervised warm-up's batches
  registry.py  algo.name -> an algorithm's module and class, resolved by name (importlib)
  config.py    the frozen config and its sections (sections.py), --set, the resume check
  train/       the loop around any algorithm: trainer, the run's runtime (mesh, placement,
               compiled functions, built once), the jitted step, state, checkpoints, metrics,
               the first-step self-check, the greedy evaluation, preemption
  rollout.py   prompts -> samples -> rewards -> the sampled batch an algorithm trains on
  algorithms/  a new algorithm is one file with its class, `Options` and `check(cfg)`, and one
               line in the registry (`registry.py` or `algorithms.register`)

The model lives beside it in `models/` (a new family: its flags in models/config.py and its
weight names in models/hf.py; a new attention kernel: a module in models/attention/, equal to
the dense oracle beside it).
"""
