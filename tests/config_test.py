"""config.py: a bad RL setting is refused by field, with the expected value, before any
compute; overrides across sections apply in any order; configs saved before the algo section
migrate and resume."""

import pytest

from branch_replay.config import Config, apply_overrides
from helpers import rl_run as tiny


@pytest.mark.parametrize(
  "overrides, match",
  [
    (["algo.advantage=nope"], r"algo.advantage='nope'.*\['dr_grpo', 'gae', 'grpo', 'rloo'\]"),
    (["algo.advantage=gae"], r"algo.advantage='gae': per-token advantages come from PPO's critic"),
    (["train.advantage=rloo"], r"'train.advantage': moved to 'algo.advantage'"),
    (
      ["algo.pairs_file=x.jsonl"],
      r"unknown field 'pairs_file' of algo \(an option of algo.name='dpo'\)",
    ),
    (
      ["loss.name=dpo", "train.n_branches=2"],
      r"loss.name='dpo' with algo.name='grpo': expected algo.name='dpo'",
    ),
    (
      ["critic.lam=0.5"],
      r"critic.lam=0.5 with algo.name='grpo': the critic is the value model of \['ppo'\]",
    ),
    (["algo.name=sft"], r"algo.name='sft' with train.sft_steps=0, train.rl_steps=\d+: SFT trains"),
    (["loss.name=nope"], r"loss.name='nope'.*expected one of"),
    (["algo.ppo_epochs=0"], r"algo.ppo_epochs=0: expected an int >= 1"),
    (["algo.minibatches=3"], r"algo.minibatches=3: expected a divisor of train.batch_size=4"),
    (
      ["algo.name=dpo", "loss.name=dpo"],
      r"train.n_branches=4: DPO trains on \(chosen, rejected\) pairs",
    ),
    (["sampler.top_k=5"], r"sampler.top_k=5.*RL trains against"),
    (["sampler.top_p=0.9"], r"top_p=0.9.*expected top_k=0 and top_p=1"),
    (["sampler.temperature=0"], r"sampler.temperature=0: RL needs sampled"),
    (["critic.share=maybe"], r"critic.share='maybe': expected true or false"),
  ],
)
def test_bad_rl_config_names_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    tiny(*overrides)


def test_overrides_across_sections_apply_in_any_order():
  import itertools

  items = ["loss.name=dpo", "algo.name=dpo", "train.n_branches=2", "algo.pairs_file="]
  made = {apply_overrides(Config(), list(p)) for p in itertools.permutations(items)}
  assert len(made) == 1 and next(iter(made)).algo.name == "dpo"
  cfg = apply_overrides(Config(), ["algo.ppo_epochs=3", "algo.name=ppo", "algo.minibatches=2"])
  assert (cfg.algo.name, cfg.algo.ppo_epochs, cfg.algo.minibatches, cfg.algo.advantage) == (
    "ppo",
    3,
    2,
    "gae",
  ) and cfg.uses_critic


def test_configs_saved_before_the_algo_section_migrate():
  """A config.json from before the section (train.advantage, train.ppo_epochs, dpo.pairs_file)
  loads as today's config and resumes against it; another algorithm is named field by field."""
  from branch_replay import config as config_lib

  now = apply_overrides(Config(), ["algo.name=ppo", "algo.ppo_epochs=2", "loss.name=ppo"])
  saved = config_lib.to_dict(now)
  algo = saved.pop("algo")
  saved["train"] = {
    **saved["train"],
    "advantage": "gae",
    "advantage_std": True,
    **{k: v for k, v in algo.items() if k != "name"},
  }
  saved["dpo"] = {"pairs_file": ""}
  assert config_lib.from_dict(saved) == now
  assert config_lib.incompatible(saved, now) == []
  diffs = config_lib.incompatible(saved, apply_overrides(Config(), ["loss.name=ppo"]))
  assert (
    "algo.name: saved 'ppo', now 'grpo'" in diffs and "algo.ppo_epochs: saved 2, now 1" in diffs
  )


@pytest.mark.parametrize("where", ["algo", "train"])
def test_a_saved_advantage_std_loads_as_the_one_spelling(where):
  """Dr. GRPO had two spellings: a config saved with `advantage_std=false` beside the GRPO
  estimator (under `algo`, or under `train` before that section) loads as advantage=dr_grpo
  and resumes against it; `advantage_std=true` and any other estimator's flag load unchanged."""
  from branch_replay import config as config_lib

  def saved_with(advantage, std):
    saved = config_lib.to_dict(apply_overrides(Config(), [f"algo.advantage={advantage}"]))
    if where == "algo":
      saved["algo"] = {**saved["algo"], "advantage_std": std}
    else:
      algo = saved.pop("algo")
      saved["train"] = {**saved["train"], "advantage": advantage, "advantage_std": std}
      saved["train"].update({k: v for k, v in algo.items() if k not in ("name", "advantage")})
    return saved

  dr = apply_overrides(Config(), ["algo.advantage=dr_grpo"])
  assert config_lib.from_dict(saved_with("grpo", False)) == dr
  assert config_lib.incompatible(saved_with("grpo", False), dr) == []
  assert config_lib.from_dict(saved_with("grpo", True)) == Config()
  rloo = apply_overrides(Config(), ["algo.advantage=rloo"])
  assert config_lib.from_dict(saved_with("rloo", False)) == rloo
