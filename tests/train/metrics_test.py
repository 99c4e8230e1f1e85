"""train/metrics.py's writer keeps the run's records in memory exactly as read() returns them
from the file (the loop builds its summary and final-eval decision from them, never re-reading
what it wrote), a resumed run's earlier records included."""

import json
import math

from branch_replay.train import metrics


def test_records_in_memory_equal_the_file(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  w = metrics.MetricsWriter(path)
  assert w.records() == []
  w.write({"step": 0, "kind": "train", "loss/policy": 1.5, "t": (1, 2)})
  w.write({"step": 0, "kind": "eval", "eval/greedy_reward": float("nan")})
  w.write({"step": 1, "kind": "train", "loss/policy": 1.25})
  w.write({"step": 1, "kind": "train", "loss/policy": 1.0})  # logged twice: the last kept
  w.close()
  assert w.records() == metrics.read(path)
  assert [(r["step"], r["kind"]) for r in w.records()] == [(0, "eval"), (0, "train"), (1, "train")]
  assert w.records()[0]["eval/greedy_reward"] is None  # non-finite written as null, alike
  assert w.records()[1]["t"] == [1, 2]  # the JSON round trip, alike
  assert w.records()[2]["loss/policy"] == 1.0


def test_a_resumed_writer_starts_from_the_files_records(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text(json.dumps({"step": 0, "kind": "train", "x": 2.0}) + "\n")
  w = metrics.MetricsWriter(str(path))
  w.write({"step": 1, "kind": "train", "x": math.pi})
  assert [r["x"] for r in w.records()] == [2.0, math.pi]
  assert w.records() == metrics.read(str(path))
