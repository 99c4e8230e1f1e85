"""The long-context tasks (branch_replay/data/longctx.py): determinism, the prompt length in the
real SmolLM2 tokenizer and the character one, each hidden line once at its stated depth,
disjoint splits, the rewards on hand-written completions, and bad options named."""

import numpy as np
import pytest

from branch_replay.core.sampler import SamplerConfig
from branch_replay.data import longctx, rewards, tasks
from branch_replay.data import tokenizer as tokenizer_lib
from branch_replay.data.tasks import Example

DIFFICULTIES = {"needle": dict(n_keys=4), "vartrack": dict(hops=3, distractors=2)}


@pytest.fixture(scope="module")
def smollm2():
  from models import gguf

  try:
    path = gguf.smollm2_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return tokenizer_lib.from_model_dir(path, gguf.read_config(path))


def make(name, tok=tokenizer_lib.TOKENIZER, **options):
  return tasks.make(tasks.TaskConfig(name=name, **{**DIFFICULTIES[name], **options}), tok)


def draws(task, seed, n=3):
  rng = np.random.default_rng(seed)
  return [task.sample(rng) for _ in range(n)]


@pytest.mark.parametrize("name", ["needle", "vartrack"])
def test_same_seed_same_problems(name):
  task = make(name, prompt_len=600)
  a, b, c = draws(task, 0), draws(task, 0), draws(task, 1)
  assert a == b and [x.prompt_ids for x in a] == [x.prompt_ids for x in b]
  assert [x.fields for x in a] == [x.fields for x in b]
  assert [x.prompt for x in a] != [x.prompt for x in c]
  assert task.eval_examples(3, 4) == make(name, prompt_len=600).eval_examples(3, 4)


def filler_tokens(tok, text: str) -> int:
  """Tokens of filler text (its sentences, each with its leading space)."""
  text = " ".join(text.split())
  return len(tok.encode(" " + text)) if text else 0


def check_lines(task, ex: Example, tok):
  """Each hidden line once; its depth (the filler's tokens before it / all the filler's) is
  the realised one recorded, and within a sentence of the drawn one."""
  intro, question, lines = ex.fields["intro"], ex.fields["question"], ex.fields["lines"]
  assert ex.prompt.startswith(intro + " ") and ex.prompt.endswith(" " + question)
  haystack = ex.prompt[len(intro) : -len(question)]
  for line in lines:
    assert ex.prompt.count(line) == 1, line

  def without_lines(text):
    for line in lines:
      text = text.replace(line, "")
    return text

  total = filler_tokens(tok, without_lines(haystack))
  assert ex.fields["n_filler"] > 0 and total > 0
  sentence = int(task.sentence_tokens.max())
  for line, depth, target in zip(lines, ex.fields["depths"], ex.fields["target_depths"]):
    measured = filler_tokens(tok, without_lines(haystack[: haystack.index(line)]))
    assert abs(measured - depth * total) <= 3, (line, measured, depth * total)
    assert abs(depth - target) * total <= sentence, (line, depth, target)


def opening(name, ex: Example) -> str:
  if name == "needle":
    return f"The special number for {ex.fields['key']} is"
  return f"The variables that hold {ex.fields['value']} are:"


@pytest.mark.parametrize("name", ["needle", "vartrack"])
@pytest.mark.parametrize("prompt_len", [1024, 2048, 8192])
def test_prompt_length_and_lines_in_the_smollm2_tokenizer(smollm2, name, prompt_len):
  task = make(name, smollm2, prompt_len=prompt_len)
  sentence = int(task.sentence_tokens.max())
  for ex in draws(task, prompt_len, n=2):
    assert prompt_len - sentence < len(ex.prompt_ids) <= prompt_len
    text, bos = smollm2.chat_template.render(ex.prompt)  # the template, the answer's opening
    assert bos and list(ex.prompt_ids) == [smollm2.bos_id] + smollm2.encode(
      text + opening(name, ex)
    )
    check_lines(task, ex, smollm2)


@pytest.mark.parametrize("name", ["needle", "vartrack"])
def test_prompt_length_and_lines_in_the_character_tokenizer(name):
  tok = tokenizer_lib.TOKENIZER
  task = make(name, prompt_len=900)
  for ex in draws(task, 5, n=4):
    assert 900 - int(task.sentence_tokens.max()) < len(ex.prompt_ids) <= 900
    want = tok.encode(f"{ex.prompt} Answer: {opening(name, ex)}", bos=True)
    assert list(ex.prompt_ids) == want
    check_lines(task, ex, tok)
  bare = make(name, prompt_len=900, answer_prefix=False)
  ex = draws(bare, 5, n=1)[0]
  assert list(ex.prompt_ids) == tok.encode(f"{ex.prompt} Answer:", bos=True)


def test_needle_asks_for_one_of_its_keys():
  task = make("needle", prompt_len=800, n_keys=6)
  for ex in draws(task, 2, n=5):
    keys, values = ex.fields["keys"], ex.fields["values"]
    assert len(set(keys)) == 6 and ex.fields["key"] in keys
    want = values[keys.index(ex.fields["key"])]
    assert ex.answer == f" {want}." and len(want) == 7
    assert ex.prompt.count(want) == 1 and ex.prompt.count(f"for {ex.fields['key']} ") == 2
    assert ex.prompt.endswith(
      f"What is the special number for {ex.fields['key']} mentioned in the text?"
    )


def test_vartrack_chains_in_order():
  task = make("vartrack", prompt_len=900, hops=4, distractors=3)
  for ex in draws(task, 4, n=4):
    names, value = ex.fields["names"], ex.fields["value"]
    assert len(names) == 5 and len(ex.fields["lines"]) == 4 * 5
    at = [ex.prompt.index(f"VAR {names[0]} = {value}.")]
    at += [ex.prompt.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
    assert at == sorted(at)  # a chain's assignments in order
    assert ex.prompt.count(value) == 2  # its line and the question
    assert ex.answer == " " + ", ".join(names)


@pytest.mark.parametrize("name", ["needle", "vartrack"])
def test_splits_are_disjoint(name):
  task = make(name, prompt_len=600)
  train = draws(task, 0, n=60)
  held = task.eval_examples(0, 20)
  assert not any(longctx.held_out(e.answer) for e in train)
  assert all(longctx.held_out(e.answer) for e in held)
  assert not {e.prompt for e in train} & {e.prompt for e in held}


def test_needle_number_reward():
  ex = Example("q", " 1234567.")
  completions = [
    " 1234567.",  # the canonical answer
    "1234567",
    " 1,234,567",  # grouped digits
    "The special number for apple is 1234567. I am sure.",
    " 1234567 or maybe 7654321",  # the first number counts
    " 7654321.",  # another key's number
    " 12345678.",  # one digit too many
    " 123456.",
    " 7654321, not 1234567",
    " the number is unknown",
    "",
  ]
  got = longctx.needle_number([ex] * len(completions), completions)
  assert got == [1.0] * 5 + [0.0] * 6


def test_variable_set_reward():
  ex = Example("q", " ABCDE, FGHIJ, KLMNO")
  completions = [
    " ABCDE, FGHIJ, KLMNO",
    " VAR KLMNO, VAR ABCDE and VAR FGHIJ.",  # order, VAR and `and` do not matter
    " ABCDE ABCDE FGHIJ KLMNO",  # a repeat
    " ABCDE, FGHIJ",  # one missing
    " ABCDE, FGHIJ, KLMNO, PQRST",  # one extra
    " abcde, fghij, klmno",  # names are uppercase
    " ABCDEF, FGHIJ, KLMNO",  # not a 5-letter name
    "",
  ]
  exact = longctx.variable_set([ex] * len(completions), completions)
  assert exact == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
  partial = longctx.variable_set([ex] * len(completions), completions, partial=True)
  assert partial == pytest.approx([1, 1, 1, 2 / 3, 3 / 4, 0, 2 / 3, 0])


def test_task_rewards_use_the_options():
  exact, partial = (
    make("vartrack", prompt_len=600),
    make("vartrack", prompt_len=600, partial_credit=True),
  )
  ex = draws(exact, 0, n=1)[0]
  names = ex.fields["names"]
  half = [[" " + ", ".join(names), " " + names[0]]]
  assert exact.rewards([ex], half).tolist() == [[1.0, 0.0]]
  assert partial.rewards([ex], half).tolist() == [[1.0, pytest.approx(1 / 4)]]
  needle = make("needle", prompt_len=600)
  assert rewards.get("needle_number").fn is longctx.needle_number  # by name, as jsonl's too
  assert rewards.get("variable_set").needs == ("answer",)
  ex = draws(needle, 0, n=1)[0]
  assert needle.rewards([ex], [[ex.answer, " 0000000."]]).tolist() == [[1.0, 0.0]]


@pytest.mark.parametrize(
  "name, options, match",
  [
    ("needle", dict(n_keys=0), "task.n_keys=0: expected an int >= 1"),
    ("needle", dict(n_keys=1000), r"task.n_keys=1000: expected an int <= \d+"),
    ("needle", dict(n_keys=2.5), "task.n_keys=2.5"),
    ("needle", dict(prompt_len=8), "task.prompt_len=8: expected an int >= 16"),
    ("needle", dict(answer_prefix="yes"), "task.answer_prefix='yes': expected a bool"),
    ("vartrack", dict(hops=0), "task.hops=0: expected an int >= 1"),
    ("vartrack", dict(hops=5), "task.hops=5: expected an int <= 4"),
    ("vartrack", dict(distractors=-1), "task.distractors=-1: expected an int >= 0"),
    ("vartrack", dict(distractors=9), "task.distractors=9: expected an int <= 8"),
    ("vartrack", dict(partial_credit=1), "task.partial_credit=1: expected a bool"),
  ],
)
def test_bad_options_are_named(name, options, match):
  with pytest.raises(ValueError, match=match):
    tasks.TaskConfig(name=name, **options)


@pytest.mark.parametrize("name", ["needle", "vartrack"])
def test_too_short_a_prompt_and_a_bad_template_are_named(name):
  with pytest.raises(ValueError, match=r"task.prompt_len=100: expected >= \d+ tokens"):
    make(name, prompt_len=100)
  with pytest.raises(ValueError, match="task.chat_template='chatml'"):
    make(name, prompt_len=600, chat_template="chatml")


def test_check_names_a_too_short_answer_budget():
  from branch_replay.config import Config

  task = make("vartrack", prompt_len=900, hops=4)
  cfg = Config(sampler=SamplerConfig(max_new_tokens=8))
  with pytest.raises(
    ValueError, match=rf"sampler.max_new_tokens=8: expected >= {task.max_answer_len + 1}"
  ):
    task.check(cfg)
  task.check(Config(sampler=SamplerConfig(max_new_tokens=task.max_answer_len + 1)))
