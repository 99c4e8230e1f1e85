"""Metrics: an append-only JSON-lines file (one record per step, slash names), the same
scalars as TensorBoard events beside it, and a plot."""

from __future__ import annotations

import json
import math
import os


def wilson_interval(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
  """The Wilson score interval of a binomial proportion k/n (default: 95%, z = the normal's
  0.975 quantile): (low, high), inside [0, 1] even at k = 0 or n."""
  if not (isinstance(n, int) and n >= 1 and 0 <= k <= n):
    raise ValueError(f"wilson_interval(k={k!r}, n={n!r}): expected ints 0 <= k <= n, n >= 1")
  p, z2 = k / n, z * z
  center = (p + z2 / (2 * n)) / (1 + z2 / n)
  half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
  return max(0.0, center - half), min(1.0, center + half)


def eval_record(rewards) -> dict:
  """The greedy evaluation's metrics of per-prompt rewards: the mean and n; for 0/1 rewards
  (accuracy) the correct count and its Wilson 95% interval."""
  rewards = [float(r) for r in rewards]
  out = {"eval/greedy_reward": sum(rewards) / len(rewards), "eval/n": len(rewards)}
  if all(r in (0.0, 1.0) for r in rewards):
    k = int(sum(rewards))
    low, high = wilson_interval(k, len(rewards))
    out.update({"eval/correct": k, "eval/ci95_low": low, "eval/ci95_high": high})
  return out


class MetricsWriter:
  """Appends records to `path`; with tensorboard=True also writes every numeric key of each
  record as a TensorBoard scalar (same name, at the record's `step`) to an event file in the
  same directory, so `tensorboard --logdir runs/` shows every run. It keeps the run's records in
  memory too (`records()`: those already in the file when it opens, a resumed run's, then every
  one written), so the loop never reads back what it wrote."""

  def __init__(self, path: str, tensorboard: bool = False):
    self.path = path
    self._by_key = {_key(r): r for r in read(path)} if os.path.isfile(path) else {}
    self._tb = None
    if tensorboard:
      import tensorboardX

      self._tb = tensorboardX.SummaryWriter(
        logdir=os.path.dirname(os.path.abspath(path)), flush_secs=10
      )

  def write(self, record: dict) -> None:
    clean = {
      k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }
    line = json.dumps(clean, sort_keys=True)
    try:
      with open(self.path, "a") as f:
        f.write(line + "\n")
        f.flush()
    except OSError as e:  # a full disk: say what was lost and what a resume does
      from branch_replay.train import checkpoint

      error = checkpoint.StorageError(
        f"{self.path}: appending the {record.get('kind', 'train')} record of step "
        f"{record.get('step')} failed: {checkpoint.describe_os_error(e)}; the checkpoints "
        "already committed are intact (a torn last line is repaired at the next start); "
        "free space and run the same command to resume"
      )
      error.errno = e.errno
      raise error from e
    rec = json.loads(line)  # as read() would return it
    self._by_key[_key(rec)] = rec
    if self._tb is not None:
      for k, v in record.items():
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
          self._tb.add_scalar(k, v, global_step=record.get("step", 0))
      self._tb.flush()  # on disk with its JSON line (a run stopped by an error loses nothing)

  def records(self) -> list[dict]:
    """The run's records, as `read(path)` returns them (a step logged twice keeps its last)."""
    return sorted(self._by_key.values(), key=_order)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def repair(path: str, start: int, total: int) -> str | None:
  """Before a run (re)starts at `start`: drop what it will write again, so metrics.jsonl holds
  each record once. The records of steps >= start (a kill lost their checkpoint; the resumed
  run redoes them, bitwise) unless the run is finished (start == total: its final eval
  stays), and any line that is not a whole JSON record (a kill mid-write tears the last
  one). Rewritten aside and renamed (atomic). Returns what was dropped (for the log), or None."""
  if not os.path.exists(path):
    return None
  kept, torn, redone = [], [], 0
  with open(path) as f:
    lines = f.read().split("\n")
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      if not isinstance(rec, dict):
        raise ValueError("not a record")
    except ValueError:
      torn.append(number)
      continue
    if start < total and rec.get("step", 0) >= start:
      redone += 1
      continue
    kept.append(line)
  if not torn and not redone:
    return None
  tmp = f"{path}.{os.getpid()}.tmp"
  with open(tmp, "w") as f:
    f.write("".join(line + "\n" for line in kept))
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
  said = []
  if torn:
    said.append(
      f"dropped {len(torn)} torn line(s) (line {', '.join(map(str, torn))}: a write cut short)"
    )
  if redone:
    said.append(
      f"dropped {redone} record(s) of steps >= {start} (after the checkpoint "
      "resumed from; they are computed again)"
    )
  return f"{path}: repaired: " + "; ".join(said)


def read(path: str) -> list[dict]:
  """Records in order; a step logged twice (a crash after it, then a resume) keeps its last."""
  if not os.path.exists(path):
    return []
  by_key = {}
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        rec = json.loads(line)
        by_key[_key(rec)] = rec
  return sorted(by_key.values(), key=_order)


def _key(rec: dict):
  return rec.get("step"), rec.get("kind", "train")


def _order(rec: dict):
  return rec.get("step", 0), rec.get("kind", "train")


def plot(records: list[dict], path: str) -> str:
  """Reward (RL steps) and step time against the step, to a PNG."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  train = [r for r in records if r.get("kind", "train") == "train"]
  rl = [r for r in train if r.get("reward/mean") is not None]
  fig, (ax_r, ax_t) = plt.subplots(1, 2, figsize=(10, 3.5))
  if rl:
    steps = [r["step"] for r in rl]
    mean = [r["reward/mean"] for r in rl]
    ax_r.plot(steps, mean, alpha=0.35, label="reward/mean (sampled)")
    window = 10
    smooth = [
      sum(mean[max(0, i - window + 1) : i + 1]) / len(mean[max(0, i - window + 1) : i + 1])
      for i in range(len(mean))
    ]
    ax_r.plot(steps, smooth, label=f"running mean ({window} steps)")
  evals = [r for r in records if r.get("kind") == "eval"]
  if evals:
    ax_r.plot(
      [r["step"] for r in evals],
      [r["eval/greedy_reward"] for r in evals],
      "o--",
      label="eval/greedy_reward",
    )
  ax_r.set_xlabel("step")
  ax_r.set_ylabel("reward")
  ax_r.legend(loc="lower right")
  ax_t.plot([r["step"] for r in train], [r.get("time/step_s") for r in train], label="train step")
  from branch_replay.train import phases

  for phase in phases.PHASES:  # the RL step by phase (those that ran)
    seconds = [r.get(f"time/{phase}_s") or 0.0 for r in rl]
    if any(seconds):
      ax_t.plot([r["step"] for r in rl], seconds, label=phase, lw=0.8)
  ax_t.set_xlabel("step")
  ax_t.set_ylabel("seconds (log)")
  ax_t.set_yscale("log")
  ax_t.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def read_tensorboard(directory: str) -> dict:
  """{tag: [(step, value), ...]} from the event files in `directory`: TFRecord framing
  (length, crc, event proto, crc) read directly, so no TensorFlow/TensorBoard is needed."""
  import glob
  import struct

  from tensorboardX.proto import event_pb2

  out = {}
  for path in sorted(glob.glob(os.path.join(directory, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      data = f.read()
    at = 0
    while at + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[at : at + 8])
      event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
      at += 12 + length + 4
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step, value.simple_value))
  return out


def shown(path):
  """A path relative to the working directory when it lies under it (as it was given)."""
  if not path:
    return path
  rel = os.path.relpath(path)
  return path if rel.startswith("..") else rel
