"""A new tree task is one file: a three-turn task written as a module of its own (a
`turns.TurnsTask` subclass with its Options, turn lengths and path reward), registered by name
with `@tasks.register`, then configured, refused and trained on 2x2x2 trees like the built-in
two-turn lookup; its rewards reach the batch as [B, leaves] and equal a hand count."""

import importlib
import sys

import numpy as np
import pytest

from branch_replay.data import tasks
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.train import metrics, trainer
from branch_replay.data import dpo as dpo_data
from branch_replay.config import Config, apply_overrides
from helpers import QUIET
from models import transformer as tfm

SPELL = '''"""Spell a word hidden in the prompt over three turns: its first letter, its second, then
the word's length and EOS; a leaf earns a third for each right turn on its path."""

import dataclasses

import numpy as np

from branch_replay.data import tasks, turns


@tasks.register("spell3")
class Spell(turns.TurnsTask):
  @dataclasses.dataclass(frozen=True)
  class Options:
    prompt_len: int = 12

  turns = 3
  metric_names = ("first",)

  def __init__(self, cfg, tokenizer):
    super().__init__(cfg, tokenizer)
    self.max_prompt_len = cfg.prompt_len
    self.turn_lengths = (1, 1, 2)  # a letter, a letter, a digit and EOS

  def sample(self, rng):
    word = "".join(rng.choice(list("abcdefgh"), size=int(rng.integers(2, 6))))
    filler = "".join(rng.choice(list("xyz"), size=self.cfg.prompt_len - len(word) - 3))
    return tasks.Example(filler + "=" + word + "?", word)

  def reward(self, example, path):
    first, second, length = path
    word = example.answer
    return (float(first == word[0]) + float(second == word[1]) + float(length == str(len(word)))) / 3

  def prompt_metrics(self, examples, samples, tok):
    firsts = turns.texts(samples.tokens[0], tok)
    return {"first": np.asarray([np.mean([t == e.answer[0] for t in row]) for e, row in zip(examples, firsts)])}
'''

RUN = (
  "task.name=spell3",
  "tree.fanouts=2x2x2",
  "train.sft_steps=0",
  "train.rl_steps=2",
  "train.batch_size=2",
  "train.eval_size=2",
  "replay.verify=first",  # replay == naive on the first three-level batch
)


def spell_run(*overrides):
  return apply_overrides(Config(model=tfm.preset("tiny")), [*QUIET, *RUN, *overrides])


@pytest.fixture
def spell(tmp_path, monkeypatch):
  (tmp_path / "spell_task.py").write_text(SPELL)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setattr(tasks, "TASKS", dict(tasks.TASKS))  # the registration is undone after
  sys.modules.pop("spell_task", None)
  module = importlib.import_module("spell_task")  # registers "spell3"
  yield module.Spell
  sys.modules.pop("spell_task", None)


def test_the_new_task_states_its_turns(spell):
  cfg = spell_run()
  assert cfg.task.prompt_len == 12  # its own Options
  with pytest.raises(ValueError, match=r"task 'spell3' is sampled as a tree of its 3 turns"):
    spell_run("tree.fanouts=2x2")
  with pytest.raises(
    ValueError, match=r"tree.fanouts='': task 'spell3' is sampled as a tree of its 3 turns"
  ):
    spell_run("tree.fanouts=")
  warm = spell_run("train.sft_steps=1")
  with pytest.raises(ValueError, match=r"train.sft_steps=1: task 'spell3' has no supervised"):
    tasks.make(warm.task).check(warm)
  # DPO on its trees needs the task's preference trees, which this one does not make.
  dpo = spell_run("algo.name=dpo", "loss.name=dpo")
  with pytest.raises(ValueError, match=r"task 'spell3' makes no preference trees"):
    dpo_data.Pairs(dpo, tasks.make(dpo.task), TOKENIZER)


def test_the_new_task_trains_on_three_level_trees(spell, tmp_path, monkeypatch):
  seen = []
  leaf_rewards = spell.leaf_rewards

  def recorded(self, examples, samples, tok=TOKENIZER):
    out = leaf_rewards(self, examples, samples, tok)
    seen.append((examples, [np.asarray(t) for t in samples.tokens], out))
    return out

  monkeypatch.setattr(spell, "leaf_rewards", recorded)
  summary = trainer.run(spell_run(), str(tmp_path / "run"))
  records = metrics.read(summary["metrics"])
  train = [r for r in records if r["kind"] == "train"]
  assert [r["step"] for r in train] == [0, 1]
  assert all(np.isfinite(r["loss/policy"]) and np.isfinite(r["grad/norm"]) for r in train)
  # replay == naive on the three-level tree, at the first batch with signal (an all-zero
  # advantage batch defers the check: verify.has_signal)
  checked = [i for i, r in enumerate(train) if "verify/max_rel_err" in r]
  assert checked and train[checked[0]]["verify/max_rel_err"] < 1e-4
  assert all(r.get("verify/deferred") == 1 for r in train[: checked[0]])
  sampled = [s for s in seen if s[1][0].shape[1] == 2]  # the training trees (greedy: one path)
  assert len(sampled) == 2
  for (examples, tokens, rewards_BL), r in zip(sampled, train):
    B = len(examples)
    assert [t.shape[:2] for t in tokens] == [(B, 2), (B, 4), (B, 8)]
    assert rewards_BL.shape == (B, 8)
    # The hand count, independent of turns.paths: leaf l's ancestors are l // 4 and l // 2.
    text = lambda row: TOKENIZER.decode(row, strict=False)
    for b, ex in enumerate(examples):
      for leaf in range(8):
        first, second = text(tokens[0][b, leaf // 4]), text(tokens[1][b, leaf // 2])
        length = text(tokens[2][b, leaf])
        want = (
          (first == ex.answer[0]) + (second == ex.answer[1]) + (length == str(len(ex.answer)))
        ) / 3
        assert rewards_BL[b, leaf] == pytest.approx(want)
    assert r["reward/mean"] == pytest.approx(float(rewards_BL.mean()), abs=1e-6)
    # The task's own metric, by hand: each prompt's share of right first turns, averaged.
    first = [
      np.mean([text(tokens[0][b, r1]) == ex.answer[0] for r1 in range(2)])
      for b, ex in enumerate(examples)
    ]
    assert r["reward/first"] == pytest.approx(float(np.mean(first)), abs=1e-9)
