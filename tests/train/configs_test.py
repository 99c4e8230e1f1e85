"""The run configs, built from experiments/configs/base.py, equal what they were before the
shared base (a frozen dump of each get_config() made at d1fa8e0)."""

import json
import os
import tempfile

import pytest

from branch_replay import config
from experiments import registry
from experiments.configs import base

FROZEN = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "configs_d1fa8e0.json"
)
# Fields added since the dump, at their defaults (none of them changes what a run computes:
# all are in config.RESUMABLE): section -> {field: default}.
ADDED = {
  "train": {"async_checkpoints": True, "preemption_grace_s": 120.0, "reward_timeout_s": 600.0},
  "model": {"flat_matmuls": True},
}


# Fields added after d1fa8e0, with the defaults that leave every config as it was; and the
# configs added after it (not in the dump).
ADDED_FIELDS = {
  "train": {"eval_batch": 0, "eval_shared_prefix": False, "eval_before": True},
  "model": {"logits_chunk_rows": False, "mlp_chunk": None},
  "critic": {"weight_decay": 1e-4},  # the decay optax.adamw gave the critic implicitly
}
ADDED_CONFIGS = ("math_smollm2", "needle_smollm2")


def dump(cfg) -> dict:
  """config.to_dict with the temp directory (math_jsonl's prompts file) as <tmp>; the added
  fields left out where they hold their defaults."""
  text = json.dumps(config.to_dict(cfg), sort_keys=True)
  d = json.loads(text.replace(tempfile.gettempdir(), "<tmp>"))
  for section, fields in ADDED_FIELDS.items():
    for name, default in fields.items():
      if name in d[section] and d[section][name] == default:
        del d[section][name]
  return d


def test_the_frozen_dump_covers_every_config():
  with open(FROZEN) as f:
    assert sorted([*json.load(f), *ADDED_CONFIGS]) == sorted(registry.CONFIGS)


@pytest.mark.parametrize("name", [n for n in registry.CONFIGS if n not in ADDED_CONFIGS])
def test_each_config_equals_its_dump_at_d1fa8e0(name):
  with open(FROZEN) as f:
    frozen = json.load(f)[name]
  for section, fields in ADDED.items():
    frozen[section] = {**frozen[section], **fields}
    assert all(f"{section}.{k}" in config.RESUMABLE for k in fields)
  cfg = registry.get_config(name)
  # the dump's retired fields (config.RETIRED: algo.advantage_std) in today's one spelling
  assert dump(cfg) == config.migrate(frozen)
  # and as a Config: the dump read back (temp directory restored) is == the config
  text = json.dumps(frozen).replace("<tmp>", tempfile.gettempdir())
  assert config.from_dict(json.loads(text)) == cfg


def test_a_run_saved_before_flat_matmuls_resumes():
  """A checkpoint's config.json from before model.flat_matmuls (the field absent) is the same
  experiment: the resume check lets it through, and names a real change beside it."""
  cfg = registry.get_config("grpo_haystack")
  saved = json.loads(json.dumps(config.to_dict(cfg)))
  del saved["model"]["flat_matmuls"]
  assert config.incompatible(saved, cfg) == []
  saved["model"]["d_model"] += 1
  assert config.incompatible(saved, cfg) == [
    f"model.d_model: saved {cfg.model.d_model + 1}, now {cfg.model.d_model}"
  ]


def test_base_is_what_the_haystack_configs_share():
  for name in ("grpo_haystack", "tree_haystack"):
    cfg = registry.get_config(name)
    assert (cfg.model, cfg.loss, cfg.train) == (base.MODEL, base.LOSS, base.TRAIN), name
  assert base.train(rl_steps=3).rl_steps == 3 and base.TRAIN.rl_steps == 150


def test_a_field_of_two_types_takes_either_from_the_command_line():
  """model.remat is `bool | str`: --set takes true/false and the policy names alike; a value
  neither type takes names both expectations; Optional fields still take none."""
  from branch_replay.config import Config, apply_overrides

  for text, remat in (("true", "full"), ("false", "none"), ("dots", "dots"), ("full", "full")):
    assert apply_overrides(Config(), [f"model.remat={text}"]).model.remat == remat
  with pytest.raises(ValueError, match=r"model.remat='bogus': expected one of"):
    apply_overrides(Config(), ["model.remat=bogus"])
  assert apply_overrides(Config(), ["replay.branch_chunk=none"]).replay.branch_chunk is None
  with pytest.raises(ValueError, match=r"replay.branch_chunk='x': expected int"):
    apply_overrides(Config(), ["replay.branch_chunk=x"])
