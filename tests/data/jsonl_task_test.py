"""Tasks from a JSON-lines file: loading, the train/eval split, left truncation or rejection,
the warm-up from `answer`, errors naming file and line, the task registry and its options,
and a short run through trainer.run (TensorBoard events beside metrics.jsonl)."""

import dataclasses
import json
import os

import numpy as np
import pytest

from branch_replay import config as config_lib
from branch_replay.train import metrics
from branch_replay.data import tasks
from branch_replay.data import supervised
from branch_replay.train import trainer
from branch_replay.config import Config, apply_overrides
from branch_replay.data.tokenizer import TOKENIZER
from models import transformer as tfm


def write(path, lines):
  path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
  return str(path)


def reverse_lines(n):
  words = [f"{a}{b}{c}" for a in "abc" for b in "defg" for c in "hijk"][:n]
  return [{"prompt": f"reverse: {w}=", "answer": w[::-1]} for w in words]


def make(path, tok=TOKENIZER, **options):
  return tasks.make(tasks.TaskConfig(name="jsonl", path=path, **options), tok)


def test_load_split_sample_and_warm_up(tmp_path):
  path = write(tmp_path / "d.jsonl", reverse_lines(40) + [""])  # a blank line is skipped
  task = make(path, eval_fraction=0.25, split_seed=3)
  assert len(task.train) == 30 and len(task.eval) == 10
  assert not {e.prompt for e in task.train} & {e.prompt for e in task.eval}
  assert [e.prompt for e in make(path, eval_fraction=0.25, split_seed=3).eval] == [
    e.prompt for e in task.eval
  ]  # seeded
  assert [e.prompt for e in make(path, eval_fraction=0.25, split_seed=4).eval] != [
    e.prompt for e in task.eval
  ]
  assert task.eval_examples(0, 4) == task.eval[:4]
  ex = task.sample(np.random.default_rng(0))
  assert ex in task.train and ex.source.startswith(path + ":")
  assert list(ex.prompt_ids) == TOKENIZER.encode(ex.prompt, bos=True)
  # The answer length comes from the task (the longest answer, 3 tokens) + EOS.
  assert (task.max_answer_len, task.sft_tail_len, task.max_prompt_len) == (3, 4, 64)
  prefix, tails = task.supervised(np.random.default_rng(1))
  assert tails == [prefix.answer]
  batch = supervised.warmup_batch(task, np.random.default_rng(1), 3, TOKENIZER)
  assert batch.leaves.tokens_BRT.shape == (3, 1, 4) and batch.root_BP.shape == (3, 64)
  first = supervised.warmup_batch(task, np.random.default_rng(1), 3, TOKENIZER)
  np.testing.assert_array_equal(first.root_BP, batch.root_BP)
  # A second file as the eval split.
  ev = write(tmp_path / "e.jsonl", reverse_lines(3))
  task = make(path, eval_path=ev)
  assert len(task.train) == 40 and [e.source for e in task.eval] == [
    f"{ev}:1",
    f"{ev}:2",
    f"{ev}:3",
  ]


def test_truncate_from_the_left_or_reject(tmp_path, caplog):
  path = write(
    tmp_path / "d.jsonl",
    [{"prompt": "abcdefghij", "answer": "x"}, {"prompt": "abc", "answer": "y"}],
  )
  task = make(path, prompt_len=6, eval_fraction=0.0)
  assert task.n_truncated == 1
  long, short = task.train
  assert TOKENIZER.decode(long.prompt_ids) == "fghij" and long.prompt_ids[0] == TOKENIZER.bos_id
  assert len(long.prompt_ids) == 6 and TOKENIZER.decode(short.prompt_ids) == "abc"
  ids_BP, valid_BP = tasks.encode_prompts([long, short], 6)
  assert valid_BP.sum(1).tolist() == [6, 4] and ids_BP[1, :2].tolist() == [0, 0]
  with pytest.raises(
    ValueError,
    match=rf"{path}:1: prompt is 11 tokens, expected <= "
    r"task.prompt_len=6",
  ):
    make(path, prompt_len=6, overlong="reject", eval_fraction=0.0)


@pytest.mark.parametrize(
  "lines, options, match",
  [
    (
      ['{"prompt": "ab", "answer": "b"}', '{"prompt": "ab" "answer"}'],
      {},
      r"d.jsonl:2: not valid JSON",
    ),
    (['["ab", "b"]'], {}, r"d.jsonl:1: expected a JSON object, got list"),
    (
      [{"prompt": "ab", "answer": "b"}, {"prompt": "cd"}],
      {},
      r"d.jsonl:2: missing field 'answer' \(expected fields \['answer', 'prompt'\]; reward "
      r"'exact_match'\)",
    ),
    ([{"question": "ab", "answer": "b"}], {}, r"d.jsonl:1: missing field 'prompt'"),
    (
      [{"prompt": "ab", "answer": 7}],
      {},
      r"d.jsonl:1: field 'answer' is int 7, expected a "
      "string",
    ),
    ([{"prompt": "", "answer": "b"}], {}, r"d.jsonl:1: field 'prompt' is empty"),
    (
      [{"prompt": "ab", "answer": "b"}, {"prompt": "a\u00e9", "answer": "b"}],
      {},
      r"d.jsonl:2: tokenizer.encode: character '\u00e9' at index 1",
    ),
    (
      [{"prompt": "ab", "answer": "bcd"}],
      {"answer_len": 2, "eval_fraction": 0.0},
      r"d.jsonl:1: answer is 3 tokens, expected <= task.answer_len=2",
    ),
    ([], {}, r"no prompts"),
    (
      [{"p": "ab", "a": "b"}],
      {"prompt_field": "p", "answer_field": "answer"},
      r"d.jsonl:1: missing field 'answer'",
    ),
    ([{"prompt": "ab"}], {"reward": "regex"}, r"^$"),  # regex needs no answer: loads
  ],
)
def test_bad_lines_name_file_and_line(tmp_path, lines, options, match):
  path = write(tmp_path / "d.jsonl", lines)
  options = {"eval_fraction": 0.0, **options}
  if match == "^$":
    make(path, **options)
    return
  with pytest.raises(ValueError, match=match):
    make(path, **options)


def test_options_are_the_tasks_own(tmp_path):
  with pytest.raises(ValueError, match="task.path='': expected a JSON-lines file"):
    tasks.make(tasks.TaskConfig(name="jsonl"))
  with pytest.raises(ValueError, match="no such file"):
    make(str(tmp_path / "missing.jsonl"))
  cfg = apply_overrides(
    Config(),
    [
      "task.path=x.jsonl",
      "task.name=jsonl",
      "task.reward=numeric",
      'task.reward_options={"tolerance": 1}',
    ],
  )
  assert cfg.task.name == "jsonl" and cfg.task.path == "x.jsonl" and cfg.task.prompt_len == 64
  assert cfg.task.options.reward_kwargs() == {"tolerance": 1}
  assert config_lib.from_dict(config_lib.to_dict(cfg)) == cfg
  assert config_lib.to_dict(cfg)["task"]["path"] == "x.jsonl"  # flat in config.json
  for override, match in [
    ("task.reward=exact", r"task.reward='exact': unknown reward"),
    ("task.overlong=drop", r"task.overlong='drop': expected one of \('truncate', 'reject'\)"),
    ("task.reward_options=[1]", r"task.reward_options='\[1\]': expected a JSON object"),
    ("task.chat_template=yes", r"task.chat_template='yes'"),
    ("task.n_keys=3", r"unknown field 'n_keys' of task; expected one of \['name', 'path'"),
  ]:
    with pytest.raises(ValueError, match=match):
      apply_overrides(cfg, [override])
  # Switching task keeps the options both have that were set, drops the others.
  hay = tasks.TaskConfig(name="haystack", prompt_len=100, sft_prompt_len=32)
  moved = dataclasses.replace(hay, name="jsonl")
  assert moved.prompt_len == 100 and not hasattr(moved.options, "sft_prompt_len")


def test_a_new_task_is_one_registered_class():
  @tasks.register("test_copy")
  class Copy(tasks.Task):
    @dataclasses.dataclass(frozen=True)
    class Options:
      length: int = 3

    def __init__(self, cfg, tokenizer):
      super().__init__(cfg, tokenizer)
      self.max_prompt_len = self.sft_prompt_len = cfg.length + 2
      self.max_answer_len, self.sft_tail_len = cfg.length, cfg.length + 1

    def sample(self, rng):
      word = "".join(rng.choice(list("abc"), self.cfg.length))
      return tasks.Example(word + "=", word)

  try:
    cfg = apply_overrides(Config(), ["task.name=test_copy", "task.length=4"])
    task = tasks.make(cfg.task)
    ex = task.sample(np.random.default_rng(0))
    assert len(ex.answer) == 4
    assert task.rewards([ex], [[ex.answer, "x"]]).tolist() == [[1.0, 0.0]]
  finally:
    tasks.TASKS.pop("test_copy")


def test_jsonl_run_writes_tensorboard_events(tmp_path):
  path = write(tmp_path / "d.jsonl", reverse_lines(12))
  cfg = apply_overrides(
    Config(model=tfm.preset("tiny")),
    [
      "task.name=jsonl",
      f"task.path={path}",
      "task.prompt_len=16",
      "task.eval_fraction=0.25",
      "train.sft_steps=1",
      "train.rl_steps=1",
      "train.batch_size=2",
      "train.n_branches=2",
      "train.sft_batch_size=2",
      "sampler.max_new_tokens=4",
      "train.eval_size=2",
      "train.progress=false",
      "train.plot=false",
      "train.checkpoint_every=1",
    ],
  )
  s = trainer.run(cfg, str(tmp_path / "run"))
  records = metrics.read(s["metrics"])
  assert [(r["step"], r["kind"]) for r in records] == [
    (0, "train"),
    (1, "eval"),
    (1, "train"),
    (2, "eval"),
  ]
  events = metrics.read_tensorboard(s["workdir"])
  for r in records:  # every numeric key of every record, at its step, same value
    for k, v in r.items():
      if k not in ("step", "kind", "phase") and v is not None:
        assert (r["step"], pytest.approx(v, rel=1e-6)) in events[k], k
  assert len(events["reward/mean"]) == 1 and len(events["eval/greedy_reward"]) == 2
  assert os.path.dirname(s["metrics"]) == s["workdir"]


def test_garbage_reward_stops_the_run(tmp_path):
  path = write(tmp_path / "d.jsonl", reverse_lines(4))
  cfg = apply_overrides(
    Config(model=tfm.preset("tiny")),
    [
      "task.name=jsonl",
      f"task.path={path}",
      "task.prompt_len=16",
      "task.eval_fraction=0",
      "task.reward=rewards_test:nan_on_second",
      "train.sft_steps=0",
      "train.rl_steps=1",
      "train.batch_size=2",
      "train.n_branches=2",
      "sampler.max_new_tokens=2",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
    ],
  )
  with pytest.raises(ValueError, match=rf"returned nan for {path}:\d example 0 branch 1"):
    trainer.run(cfg, str(tmp_path / "run"))
  assert not os.path.exists(tmp_path / "run" / "checkpoints" / "1")


def test_run_py_names_the_bad_line_before_compute(tmp_path):
  import re
  import run  # its parser, in process (run_test starts run.py itself once)

  path = write(tmp_path / "d.jsonl", reverse_lines(3) + ['{"prompt": "abc"}'])
  argv = [
    "run.py",
    "--set=task.name=jsonl",
    f"--set=task.path={path}",
    f"--workdir={tmp_path / 'w'}",
  ]
  _, cfg, _, _ = run.parse(argv + ["--set=task.reward=exact_match"])
  with pytest.raises(ValueError, match=re.escape(f"{path}:4: missing field 'answer'")):
    trainer.run(cfg, str(tmp_path / "w"))
  assert not os.path.exists(tmp_path / "w" / "checkpoints")  # nothing ran
  with pytest.raises(
    run.app.UsageError,
    match=re.escape(
      "task.reward='exactmatch': unknown reward; expected one of ['contains', 'exact_match'"
    ),
  ):
    run.parse(argv + ["--set=task.reward=exactmatch"])
