"""What is trained on: tasks by name (`tasks.py`: a new task is one file with
`@tasks.register`, its `Options`, `sample`, `supervised`, `rewards` and `check(cfg)`),
prompts from JSONL files (`jsonl_task.py`), the two-turn tree task (`tree_task.py`), recorded
rollouts (`rollouts.py`), preference pairs (`dpo.py`), rewards by name (`rewards.py`: one
`rewards.register`), chat templates and tokenizers. Imports `core/` and itself."""
