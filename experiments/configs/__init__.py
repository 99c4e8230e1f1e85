"""Run configs: modules with get_config(), trained by `python run.py --experiment=NAME`
(registered in experiments/registry.py)."""
