"""kill -9 in the middle of a checkpoint save, then the same command again: the run resumes
from the last complete checkpoint and finishes as an uninterrupted run would.

Run as a script, this file is the training process:
  python tests/system/crash_test.py --workdir=DIR [--kill_at_step=N]
With --kill_at_step, the process SIGKILLs itself inside orbax's save of step N, after the
step's files are written to the temporary directory and before the rename that commits it.
"""

import argparse
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker():
  parser = argparse.ArgumentParser()
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--kill_at_step", type=int, default=None)
  args = parser.parse_args()  # (the repository and test rooms: PYTHONPATH, conftest.py)
  if args.kill_at_step is not None:
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def die_mid_save(self, *a, **k):
      if self._final_path.name == str(args.kill_at_step):
        os.kill(os.getpid(), signal.SIGKILL)
      return await finalize(self, *a, **k)

    atomicity.AtomicRenameTemporaryPath.finalize = die_mid_save
  from branch_replay.train import trainer
  from helpers import short_run

  trainer.run(short_run("train.rl_steps=2"), args.workdir)  # 3 steps, a checkpoint after each


def _run(*args):
  return subprocess.run(
    [sys.executable, os.path.abspath(__file__), *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )


@pytest.mark.slow  # two training subprocesses: ~1 min on an idle 2-core CPU, 7 under load
def test_kill_9_during_checkpoint_save_then_resume(tmp_path):
  from branch_replay.train import metrics, trainer
  from helpers import short_run

  workdir = tmp_path / "w"
  out = _run(f"--workdir={workdir}", "--kill_at_step=2")
  assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
  left = sorted(os.listdir(workdir / "checkpoints"))
  assert left[0] == "1" and left[1].startswith("2.orbax-checkpoint-tmp"), left  # half-written
  out = _run(f"--workdir={workdir}")  # the same command
  assert out.returncode == 0, out.stderr[-3000:]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "3"]  # tmp directory cleaned
  records = [r for r in metrics.read(str(workdir / "metrics.jsonl")) if r["kind"] == "train"]
  assert [r["step"] for r in records] == [0, 1, 2]
  # Equal to an uninterrupted run (step 1 was logged twice: before the kill and after the
  # resume from checkpoint 1; the last line wins and equals the uninterrupted one).
  trainer.run(short_run("train.rl_steps=2"), str(tmp_path / "full"))
  untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
  reference = [
    r for r in metrics.read(str(tmp_path / "full" / "metrics.jsonl")) if r["kind"] == "train"
  ]
  assert untimed(records) == untimed(reference)


if __name__ == "__main__":
  worker()
