"""Tokenizer round trip, task generation and rewards, the config override parser."""

import dataclasses

import numpy as np
import pytest

from branch_replay import config as config_lib
from branch_replay.data import tasks
from branch_replay.data.tokenizer import BOS, EOS, PAD, TOKENIZER


def test_tokenizer_round_trip():
  text = "".join(TOKENIZER.chars) + "A7..?Q 12+34=46"
  ids = TOKENIZER.encode(text, bos=True, eos=True)
  assert ids[0] == BOS and ids[-1] == EOS
  assert len(ids) == len(text) + 2
  assert max(ids) < TOKENIZER.vocab_size and min(ids[1:-1]) > EOS
  assert TOKENIZER.decode(ids) == text
  # Decoding stops at EOS and skips padding.
  assert TOKENIZER.decode([PAD, *TOKENIZER.encode("ab"), EOS, *TOKENIZER.encode("cd")]) == "ab"


def test_tokenizer_bad_input():
  with pytest.raises(ValueError, match="character 'é' at index 1"):
    TOKENIZER.encode("aé")
  with pytest.raises(ValueError, match="id 500 out of range"):
    TOKENIZER.decode([500])
  assert TOKENIZER.decode([TOKENIZER.vocab_size + 3], strict=False) == "\ufffd"


def test_haystack_examples_and_reward():
  cfg = tasks.TaskConfig(name="haystack", prompt_len=64, n_keys=5, value_len=2)
  task = tasks.make(cfg)
  rng = np.random.default_rng(0)
  for _ in range(20):
    ex = task.sample(rng)
    assert len(TOKENIZER.encode(ex.prompt, bos=True)) == 64
    assert ex.prompt[-2] == "?"
    key = ex.prompt[-1]
    body = ex.prompt[:-2]
    assert body.count(key) == 1 and sum(c.isupper() for c in body) == 5
    i = body.index(key)
    assert body[i + 1 : i + 3] == ex.answer and ex.answer.isdigit() and len(ex.answer) == 2
    assert task.reward(ex, ex.answer) == 1.0
    assert task.reward(ex, ex.answer + "1") == 0.0 and task.reward(ex, "") == 0.0
  # Deterministic per generator seed.
  a = task.sample(np.random.default_rng(3))
  assert a == task.sample(np.random.default_rng(3))
  # Warm-up: one tail per record, each `?KEY value`, on the (shorter) warm-up length.
  short = tasks.make(dataclasses.replace(cfg, sft_prompt_len=24))
  prefix, tails = short.supervised(np.random.default_rng(1))
  assert len(prefix) == 24 - 3 and len(tails) == 5
  for tail in tails:
    i = prefix.index(tail[1])
    assert tail == "?" + prefix[i : i + 3]


def test_arithmetic_examples_and_reward():
  task = tasks.make(tasks.TaskConfig(name="arithmetic", n_digits=3))
  rng = np.random.default_rng(0)
  for _ in range(20):
    ex = task.sample(rng)
    a, b = ex.prompt[:-1].split("+")
    assert int(ex.answer) == int(a) + int(b)
    assert len(TOKENIZER.encode(ex.prompt, bos=True)) <= task.max_prompt_len
    assert len(ex.answer) <= task.max_answer_len
    assert task.reward(ex, ex.answer) == 1.0 and task.reward(ex, "x") == 0.0


def test_encoding_pads_prompts_left_and_answers_right():
  ids, valid = tasks.encode_left(["ab", "abcd"], 6)
  assert valid.tolist() == [[0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]]
  assert ids[0, 3] == BOS and ids[0, 0] == PAD
  ids, valid = tasks.encode_right(["7", "42"], 4)
  assert valid.tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
  assert ids[0, 1] == EOS and TOKENIZER.decode(ids[1]) == "42"
  with pytest.raises(ValueError, match="expected <= 2"):
    tasks.encode_left(["abc"], 2)


def test_bad_task_config():
  with pytest.raises(ValueError, match="task.name='sorting'"):
    tasks.TaskConfig(name="sorting")
  with pytest.raises(ValueError, match="task.prompt_len=8"):
    tasks.TaskConfig(prompt_len=8, n_keys=4)
  with pytest.raises(ValueError, match="task.n_keys=27"):
    tasks.TaskConfig(n_keys=27, prompt_len=200)


def test_overrides_parse_types_and_validate():
  cfg = config_lib.apply_overrides(
    config_lib.Config(),
    [
      "train.n_branches=4",
      "loss.epsilon_high=0.28",
      "replay.branch_chunk=2",
      "algo.advantage=dr_grpo",
      "task.name=arithmetic",
      "model.d_model=32",
      "mesh=data:2",
      "loss.epsilon_high=none",
    ],
  )
  assert cfg.train.n_branches == 4 and cfg.replay.branch_chunk == 2
  assert cfg.loss.epsilon_high is None and cfg.algo.advantage == "dr_grpo"
  assert cfg.task.name == "arithmetic" and cfg.model.d_model == 32 and cfg.mesh == "data:2"
  assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg


@pytest.mark.parametrize(
  "override, match",
  [
    ("train.n_branchez=8", "unknown field 'n_branchez' of train"),
    ("trian.n_branches=8", "unknown config section 'trian'"),
    ("train.n_branches=eight", "train.n_branches='eight': expected int"),
    ("train.n_branches", "expected section.field=value"),
    ("task.name=sorting", "task.name='sorting'"),
    ("replay.mode=fast", "replay.mode='fast'"),
    ("replay.branch_chunk=3", "replay.branch_chunk=3: expected a divisor"),
    ("train.learning_rate=0", "train.learning_rate=0.0"),
    (
      "algo.name=dpo;loss.name=dpo",
      "train.n_branches=8: DPO trains on \\(chosen, rejected\\) pairs",
    ),
    ("model.vocab_size=10", "model.vocab_size=10"),
    ("mesh=data", "mesh='data'"),
    ("train.progress=maybe", "expected true or false"),
    (
      "algo.advantage_std=false",
      "'algo.advantage_std': retired; one spelling now: algo.advantage=dr_grpo",
    ),
    (
      "train.advantage_std=false",
      "'train.advantage_std': retired; one spelling now: algo.advantage=dr_grpo",
    ),
  ],
)
def test_bad_overrides_name_the_field(override, match):
  with pytest.raises(ValueError, match=match):
    config_lib.apply_overrides(config_lib.Config(), override.split(";"))


def test_incompatible_configs_are_listed():
  a = config_lib.Config()
  b = config_lib.apply_overrides(a, ["model.d_model=128", "train.rl_steps=7"])
  saved = config_lib.to_dict(a)
  assert config_lib.incompatible(saved, b) == ["model.d_model: saved 256, now 128"]
