"""The loop around any algorithm: the trainer (`trainer.py`), the jitted step and its cache
(`steps.py`), the train state and its placement (`state.py`), atomic checkpoints, append-only
metrics, phase timers, the first-step self-check (`verify.py`), preemption, and huge pages
for XLA's CPU buffers (`hugepages.py`, run.py restarts itself with them). Imports
`core/`, `data/`, `config.py` and the algorithm registry (`algorithms.get`), never an
algorithm."""
