"""What is trained on: tasks by name (`tasks.py`: a new task is one file with
`@tasks.register`, its `Options`, `sample`, `supervised`, `rewards` and `check(cfg)`; it states
its rollouts, `turns`, and returns every leaf's reward, `leaf_rewards` -> [B, leaves]), a new
multi-turn task sampled as trees one `turns.TurnsTask` subclass (its turn lengths and a path's
reward), prompts from JSONL files (`jsonl_task.py`), the two-turn tree task (`tree_task.py`), recorded
rollouts (`rollouts.py`), preference pairs (`dpo.py`), rewards by name (`rewards.py`: one
`rewards.register`), chat templates and tokenizers. Imports `core/` and itself."""
