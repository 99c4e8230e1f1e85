"""The loop around any algorithm: the trainer (`trainer.py`), the run's context built once
(`runtime.py`: its mesh, placement, compiled functions, tokenizer), the jitted step
(`steps.py`), the train state and its placement (`state.py`), atomic checkpoints, append-only
metrics, phase timers, the first-step self-check (`verify.py`), preemption, and huge pages
for XLA's CPU buffers (`hugepages.py`, run.py restarts itself with them). Imports
`core/`, `data/`, `config.py` and the algorithm registry (`registry.get`), never an
algorithm."""
