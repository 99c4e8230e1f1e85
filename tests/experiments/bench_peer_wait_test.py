"""bench_peer's quiet-machine logic (experiments/measure.py) without timing anything:
wait_for_quiet against scripted load readings and a fake clock, and the other-processes' cores of a step."""

import pytest

from experiments import measure


class FakeClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t

  def sleep(self, s):
    assert s >= 0
    self.t += s


def _wait(loads, max_load=0.6, timeout_s=100, poll_s=10):
  readings, clock = iter(loads), FakeClock()
  out = measure.wait_for_quiet(
    max_load, timeout_s, poll_s, load_fn=lambda: next(readings), sleep=clock.sleep, clock=clock
  )
  return out, clock.t


def test_quiet_at_once_does_not_wait():
  out, t = _wait([0.3])
  assert out["quiet"] and t == 0 and out["loads"] == [0.3] and out["load_at_start"] == 0.3


def test_waits_until_the_load_drops():
  out, t = _wait([2.1, 1.4, 0.9, 0.59, 5.0])
  assert out["quiet"] and out["loads"] == [2.1, 1.4, 0.9, 0.59]
  assert t == 30 and out["waited_s"] == 30 and out["load_at_start"] == 0.59


def test_times_out_busy():
  out, t = _wait([1.5] * 20, timeout_s=25, poll_s=10)
  assert not out["quiet"] and t == 25 and out["load_at_start"] == 1.5
  assert len(out["loads"]) == 4  # readings at 0, 10, 20, 25 s


def test_threshold_is_strict_and_zero_disables():
  out, _ = _wait([0.6, 0.6], timeout_s=10, poll_s=10)
  assert not out["quiet"]
  out, t = _wait([9.0], max_load=0)
  assert out["quiet"] and t == 0


def test_other_cores():
  # 10 busy CPU seconds over a 4 s step, 6 of them the worker's: 1 other core
  assert measure.other_cores(100.0, 110.0, 6.0, 4.0) == pytest.approx(1.0)
  assert measure.other_cores(100.0, 105.0, 6.0, 4.0) == 0.0  # sampling noise: clipped at 0
