"""Rewards by name: the built-ins, `module:function`, one call per batch, and the errors that
stop a run (a reward that raises, returns the wrong count or a non-finite value)."""

import numpy as np
import pytest

from branch_replay.data import rewards
from branch_replay.data.tasks import Example

CALLS = []


def count_calls(examples, completions):  # a user's reward, by module:function
  CALLS.append(len(completions))
  return [float(len(c)) for c in completions]


def nan_on_second(examples, completions):
  return [float("nan") if i == 1 else 0.0 for i in range(len(completions))]


def broken(examples, completions):
  raise KeyError("score")


def ex(answer, **fields):
  return Example(f"q {answer}", answer, fields=dict(answer=answer, **fields), source=f"f:{answer}")


def test_builtins():
  exact = rewards.get("exact_match")
  r = rewards.compute(exact, [ex("ab"), ex("7")], [["ab", "ab ", "b"], ["7", "", "77"]])
  assert r.dtype == np.float32 and r.tolist() == [[1, 0, 0], [1, 0, 0]]
  num = rewards.get("numeric")
  r = rewards.compute(
    num, [ex("3.14"), ex("-2")], [["3.1400", "x=3.15", "no"], ["-2.0", "2", "-1,999.9"]]
  )
  assert r.tolist() == [[1, 0, 0], [1, 0, 0]]
  r = rewards.compute(num, [ex("3.14")], [["3.1400", "3.15", "3.2"]], tolerance=0.02)
  assert r.tolist() == [[1, 1, 0]]
  r = rewards.compute(num, [ex("1000")], [["1009", "1011"]], tolerance=0.01, relative=True)
  assert r.tolist() == [[1, 0]]
  rx = rewards.get("regex")
  r = rewards.compute(
    rx, [ex("", pattern=r"a+b"), ex("")], [["aab", "ab!"], ["x1", "xx"]], pattern=r"x\d"
  )
  assert r.tolist() == [[1, 0], [1, 0]]  # the example's own pattern wins over the option
  has = rewards.get("contains")
  assert rewards.compute(has, [ex("Cat")], [["a Cat!", "cat"]]).tolist() == [[1, 0]]
  assert rewards.compute(has, [ex("Cat")], [["cat"]], case_sensitive=False).tolist() == [[1]]


def test_module_function_is_called_once_per_batch():
  CALLS.clear()
  fn = rewards.get("rewards_test:count_calls")
  r = rewards.compute(fn, [ex("a"), ex("b")], [["x", "yy"], ["", "zzz"]])
  assert r.tolist() == [[1, 2], [0, 3]] and CALLS == [4]


def test_register_a_new_reward():
  @rewards.register("test_length_only")
  def length_only(examples, completions, *, scale=1.0):
    return [scale * len(c) for c in completions]

  try:
    r = rewards.compute(rewards.get("test_length_only"), [ex("a")], [["ab", "abc"]], scale=0.5)
    assert r.tolist() == [[1.0, 1.5]]
    with pytest.raises(ValueError, match="already registered"):
      rewards.register("test_length_only")(length_only)
  finally:
    rewards.REWARDS.pop("test_length_only")


@pytest.mark.parametrize(
  "spec, match",
  [
    (
      "exact",
      r"task.reward='exact': unknown reward; expected one of \['contains', "
      r"'exact_match', 'final_number', 'needle_number', 'numeric', 'regex', 'variable_set'\] "
      r"or 'module:function'",
    ),
    ("no_such_module:f", "cannot import 'f' from 'no_such_module'"),
    ("rewards_test:missing", "cannot import 'missing' from 'rewards_test'"),
  ],
)
def test_unknown_rewards(spec, match):
  with pytest.raises(ValueError, match=match):
    rewards.get(spec)


def test_a_task_modules_reward_resolves_by_name_whatever_was_imported():
  """In a fresh interpreter (nothing imported but rewards): a built-in task module's reward
  resolves by name, and the error lists it."""
  import subprocess
  import sys

  code = (
    "from branch_replay.data import rewards\n"
    "assert 'needle_number' not in rewards.REWARDS\n"
    "print(rewards.get('needle_number').name)\n"
    "try:\n  rewards.get('nope')\nexcept ValueError as e:\n  print(e)\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  first, second = out.stdout.splitlines()[:2]
  assert first == "needle_number" and "'variable_set'" in second


def test_garbage_stops_naming_the_example():
  exs = [ex("a"), ex("b")]
  with pytest.raises(
    ValueError,
    match=r"returned nan for f:a example 0 branch 1 .*completion "
    r"'y'.*expected a finite number",
  ):
    rewards.compute(rewards.get("rewards_test:nan_on_second"), exs, [["x", "y"], ["z", "w"]])
  with pytest.raises(ValueError, match=r"reward 'rewards_test:broken' raised: KeyError"):
    rewards.compute(rewards.get("rewards_test:broken"), exs, [["x"], ["z"]])
  with pytest.raises(
    ValueError,
    match=r"reward 'numeric' raised on example 1 \(f:oops prompt "
    r"'q oops'\): .*answer 'oops' holds no number",
  ):
    rewards.compute(rewards.get("numeric"), [ex("1"), ex("oops")], [["1"], ["2"]])
  with pytest.raises(ValueError, match="returned 1 values for 4 completions"):
    rewards.compute(rewards.Reward("short", lambda e, c: [1.0]), exs, [["x", "y"], ["z", "w"]])
