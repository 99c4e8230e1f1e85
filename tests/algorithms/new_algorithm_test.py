"""A new algorithm is one file: Dr. GRPO written as a module of its own (its Options, its
check(cfg) and its class), registered by name, then configured, refused and trained like a
built-in; its run equals GRPO's with the same settings spelled as options."""

import pytest

from branch_replay import algorithms
from branch_replay.config import apply_overrides
from branch_replay.train import metrics, trainer
from helpers import tiny_run

DR_GRPO = '''"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its two
normalisations: group-centred advantages (no division by the group's std) and the token sum
(no division by each completion's length)."""

import dataclasses

from branch_replay import algorithms


@dataclasses.dataclass(frozen=True)
class Options(algorithms.SampledOptions):
  advantage = "dr_grpo"  # not an option: what Dr. GRPO is


def check(cfg):
  if cfg.loss.aggregation != "sum":
    raise ValueError(
      f"loss.aggregation={cfg.loss.aggregation!r} with algo.name='dr_grpo': Dr. GRPO does "
      "not divide by the completion's length; expected loss.aggregation='sum'"
    )


class DrGRPO(algorithms.get("grpo")):
  """GRPO's sampling and step: only the options differ."""
'''

RUN = ("train.sft_steps=2", "train.rl_steps=2", "train.eval_size=0", "train.batch_size=2")


@pytest.fixture
def dr_grpo(tmp_path, monkeypatch):
  (tmp_path / "dr_grpo_module.py").write_text(DR_GRPO)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(algorithms.ALGORITHMS, "dr_grpo", ("dr_grpo_module", "DrGRPO"))
  return tmp_path


def test_a_new_algorithm_is_one_file(dr_grpo):
  cfg = tiny_run("algo.name=dr_grpo", "loss.aggregation=sum", "algo.ppo_epochs=2")
  assert cfg.algo.advantage == "dr_grpo"
  assert cfg.algo.ppo_epochs == 2  # the base's options are its own
  assert algorithms.for_config(cfg).__name__ == "DrGRPO"
  # Its check(cfg) runs when the config is made, naming the field.
  with pytest.raises(ValueError, match=r"loss.aggregation='token_mean' with algo.name='dr_grpo'"):
    tiny_run("algo.name=dr_grpo")
  # What it does not have is refused by name; what another algorithm has names its owner.
  with pytest.raises(ValueError, match=r"unknown field 'advantage' of algo"):
    apply_overrides(cfg, ["algo.advantage=rloo"])
  with pytest.raises(ValueError, match=r"an option of algo.name='dpo'"):
    apply_overrides(cfg, ["algo.pairs_file=x.jsonl"])
  assert "dr_grpo" not in algorithms.owners("pairs_file")


def test_the_new_algorithm_trains_as_grpo_with_its_settings(dr_grpo):
  """Dr. GRPO through its own module == GRPO with advantage=dr_grpo and the token sum."""
  records = {}
  for name, extra in (
    ("dr_grpo", ["algo.name=dr_grpo"]),
    ("grpo", ["algo.advantage=dr_grpo"]),
  ):
    cfg = tiny_run(*RUN, "loss.aggregation=sum", *extra)
    summary = trainer.run(cfg, str(dr_grpo / name))
    records[name] = [
      {k: r[k] for k in ("step", "loss/policy", "grad/norm", "reward/mean") if k in r}
      for r in metrics.read(summary["metrics"])
      if r["kind"] == "train"
    ]
  assert [r["step"] for r in records["dr_grpo"]] == [0, 1, 2, 3]
  assert records["dr_grpo"] == records["grpo"]
