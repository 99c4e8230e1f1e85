"""Runs that survive the cluster (docs/training.md, "Preemption and faults"): SIGTERM/SIGINT
checkpoint the step in progress and the same call resumes as if never stopped; the grace
bound; every process stops after the same step; a damaged newest checkpoint, a torn
metrics line, a full disk during a save or a metrics write; a reward that hangs.

The loop's own logic runs with tests/helpers.py's `CountingAlgorithm` algorithm (no train step to
compile, real orbax checkpoints); the GRPO runs and two processes are `slow`.

Run as a script, this file is one process of a two-process GRPO run (multihost_test's
harness) that SIGTERMs itself inside step --term_at_step when it is process --term_process:
  python tests/train/preemption_test.py --coordinator_address=localhost:PORT --process_id=I \\
      --workdir=DIR [--term_at_step=N --term_process=P]
"""

import errno
import glob
import json
import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A worker process (below) finds the repository and the test rooms through PYTHONPATH
# (conftest.py sets it for every subprocess of the suite).

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from branch_replay.train import checkpoint, metrics, preemption, trainer
from branch_replay.data import rewards, tasks  # noqa: E402
from branch_replay.train import state as train_state  # noqa: E402
from helpers import CountingAlgorithm, fail_finalize_of, loop_config  # noqa: E402


def _records(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]  # every line (read() would hide a duplicate)


def _steps(workdir):
  return [r["step"] for r in _records(workdir)]


def _params_after(n_steps):
  """The first parameter leaf after `n_steps` of CountingAlgorithm (+1 each, float32, in order)."""
  expected = jax.tree.leaves(train_state.init_state(loop_config()).params)[0]
  for _ in range(n_steps):
    expected = expected + 1
  return np.asarray(expected)


def _first_leaf(summary):
  return np.asarray(jax.tree.leaves(summary["final_params"])[0])


def _signal_at(signum, at_step):
  class SignalAt(CountingAlgorithm):
    def update(self, state, batch, step):
      if step == at_step:  # arrives mid-step (before the update), as a scheduler's would
        os.kill(os.getpid(), signum)
      return super().update(state, batch, step)

  return SignalAt


# ----------------------------------------------------------------------------- (1) preemption


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_signal_finishes_the_step_checkpoints_it_and_the_same_call_resumes(tmp_path, signum):
  handlers = {s: signal.getsignal(s) for s in preemption.SIGNALS}
  workdir = str(tmp_path / "w")
  cfg = loop_config("train.rl_steps=4", "train.checkpoint_every=100")  # no periodic save
  with pytest.raises(
    preemption.Preempted,
    match=r"stopped after step 2; checkpoint 3 "
    r"written in .*run the same command to resume at step 3",
  ) as stopped:
    trainer.run(cfg, workdir, _signal_at(signum, 2))
  assert (stopped.value.step, stopped.value.signum) == (3, signum)
  assert preemption.exit_code(signum) == 128 + signum
  assert {s: signal.getsignal(s) for s in preemption.SIGNALS} == handlers  # restored
  assert _steps(workdir) == [0, 1, 2]  # the step in progress finished and was logged
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
  resumed = trainer.run(cfg, workdir, CountingAlgorithm)
  assert CountingAlgorithm.made[-1].steps == [3, 4]
  assert _steps(workdir) == [0, 1, 2, 3, 4]  # each once
  np.testing.assert_array_equal(_first_leaf(resumed), _params_after(5))
  full = trainer.run(cfg, str(tmp_path / "full"), CountingAlgorithm)
  untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
  assert untimed(_records(workdir)) == untimed(_records(full["workdir"]))


def test_signal_before_the_first_step_saves_nothing_new(tmp_path):
  class SignalWhileCompiling(CountingAlgorithm):
    def __init__(self, *a, **k):
      super().__init__(*a, **k)
      os.kill(os.getpid(), signal.SIGTERM)

  workdir = str(tmp_path / "w")
  with pytest.raises(preemption.Preempted, match="stopped before step 0 .nothing new") as e:
    trainer.run(loop_config(), workdir, SignalWhileCompiling)
  assert not e.value.saved and not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
  done = trainer.run(loop_config(), workdir, CountingAlgorithm)
  assert metrics.read(done["metrics"])[-1]["step"] == 2


def test_every_process_stops_after_the_same_step(monkeypatch):
  """Only process 1 was signalled; the per-step gather tells process 0 (faked: what
  process_allgather returns on two processes)."""
  from jax.experimental import multihost_utils

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  gathered = []
  monkeypatch.setattr(
    multihost_utils,
    "process_allgather",
    lambda x: (gathered.append(int(x)), np.asarray([int(x), peer]))[1],
  )
  guard = preemption.Guard(5.0)
  peer = 0
  assert not guard.agreed() and guard.signum is None
  peer = int(signal.SIGTERM)
  assert guard.agreed() and guard.signum == signal.SIGTERM
  assert gathered == [0, 0]  # this process sent "not signalled" both times


def _guard_script(body):
  return subprocess.run(
    [
      sys.executable,
      "-c",
      "import os, signal, sys, time\nfrom branch_replay.train import preemption\n" + body,
    ],
    capture_output=True,
    text=True,
    timeout=60,
  )


def test_grace_bounds_the_exit():
  """A step that never ends: EXIT_GRACE once train.preemption_grace_s has passed; a
  second signal does not wait for it."""
  out = _guard_script(
    "t0 = time.time()\nwith preemption.Guard(0.5):\n"
    "  os.kill(os.getpid(), signal.SIGTERM)\n  time.sleep(30)\n"
  )
  assert out.returncode == preemption.EXIT_GRACE, out.stderr
  assert "preemption_grace_s=0.5 s ran out: exiting now (124)" in out.stderr
  out = _guard_script(
    "with preemption.Guard(30):\n  os.kill(os.getpid(), signal.SIGINT)\n"
    "  time.sleep(0.2)\n  os.kill(os.getpid(), signal.SIGINT)\n"
    "  time.sleep(30)\n"
  )
  assert out.returncode == preemption.EXIT_GRACE and "a second SIGINT" in out.stderr


# ----------------------------------------------------------------------------- (4) damage


def _three_checkpoints(workdir):
  trainer.run(loop_config("train.keep_checkpoints=3"), workdir, CountingAlgorithm)
  return os.path.join(workdir, "checkpoints")


def _largest_data_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "**", "d", "*"), recursive=True)
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_newest_checkpoint_is_named_and_the_previous_resumes(tmp_path, capfd, damage):
  workdir = str(tmp_path / "w")
  directory = _three_checkpoints(workdir)
  if damage == "truncated":  # a copy or a disk cut short
    path = _largest_data_file(os.path.join(directory, "3"))
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  else:
    os.remove(os.path.join(directory, "3", "default", "_METADATA"))
  capfd.readouterr()
  resumed = trainer.run(
    loop_config("train.rl_steps=4", "train.keep_checkpoints=3"), workdir, CountingAlgorithm
  )
  err = capfd.readouterr().err
  assert f"checkpoint {os.path.join(directory, '3')} does not restore" in err, err
  assert "resuming from step 2" in err
  assert CountingAlgorithm.made[-1].steps == [2, 3, 4]
  assert [
    os.path.basename(p).split(".")[0]
    for p in glob.glob(os.path.join(workdir, checkpoint.DAMAGED, "*"))
  ] == ["3"]
  assert _steps(workdir) == [0, 1, 2, 3, 4]  # steps 2.. logged once (repaired, redone)
  np.testing.assert_array_equal(_first_leaf(resumed), _params_after(5))


def test_no_checkpoint_that_restores_is_a_refusal_that_moves_nothing(tmp_path):
  workdir = str(tmp_path / "w")
  directory = _three_checkpoints(workdir)
  for step in ("1", "2", "3"):
    os.remove(os.path.join(directory, step, "default", "_METADATA"))
  with pytest.raises(
    ValueError,
    match=r"(?s)checkpoint .*checkpoints/3 does not restore .* no "
    r"older checkpoint does either \(3, 2, 1 tried\): .*move checkpoints/ "
    r"aside",
  ):
    trainer.run(loop_config(), workdir, CountingAlgorithm)
  assert sorted(os.listdir(directory)) == ["1", "2", "3"]


def test_torn_metrics_line_is_repaired_on_resume_and_named(tmp_path, capfd):
  workdir = str(tmp_path / "w")
  trainer.run(
    loop_config("train.rl_steps=1"), workdir, CountingAlgorithm
  )  # steps 0, 1; checkpoint 2
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"kind": "train", "step": 2, "loss/po')  # a kill mid-write
  capfd.readouterr()
  trainer.run(loop_config(), workdir, CountingAlgorithm)
  err = capfd.readouterr().err
  assert "metrics.jsonl: repaired: dropped 1 torn line(s) (line 3" in err, err
  assert _steps(workdir) == [0, 1, 2]


def test_repair_drops_the_steps_a_resume_redoes_and_keeps_a_finished_runs_eval(tmp_path):
  path = str(tmp_path / "metrics.jsonl")
  lines = [
    {"step": 0, "kind": "eval"},
    {"step": 0},
    {"step": 1},
    {"step": 2},
    {"step": 2, "kind": "eval"},
  ]
  write = lambda: open(path, "w").write("".join(json.dumps(r) + "\n" for r in lines))
  write()
  assert metrics.repair(path, 2, 2) is None  # finished: nothing to redo, nothing torn
  assert "dropped 3 record(s) of steps >= 1" in metrics.repair(path, 1, 2)
  assert [json.loads(x) for x in open(path)] == lines[:2]
  write()
  metrics.repair(path, 0, 2)  # no checkpoint: everything is redone
  assert open(path).read() == ""


@pytest.mark.parametrize("asynchronous", [True, False], ids=["async", "sync"])
def test_full_disk_during_a_save_names_it_and_keeps_the_previous(
  tmp_path, monkeypatch, asynchronous
):
  workdir = str(tmp_path / "w")
  cfg = loop_config(f"train.async_checkpoints={str(asynchronous).lower()}")
  fail_finalize_of(monkeypatch, 2, OSError(errno.ENOSPC, "No space left on device"))
  with pytest.raises(
    checkpoint.StorageError,
    match=r"checkpoint save of step 2 in .*"
    r"checkpoints failed: No space left on device \(ENOSPC\); the previous "
    r"checkpoint \(step 1\) is intact",
  ) as e:
    trainer.run(cfg, workdir, CountingAlgorithm)
  assert e.value.errno == errno.ENOSPC
  monkeypatch.undo()
  resumed = trainer.run(
    loop_config(), workdir, CountingAlgorithm
  )  # restores 1: the previous, intact
  assert CountingAlgorithm.made[-1].steps == ["start", 1, 2]
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "3"]  # tmp gone
  np.testing.assert_array_equal(_first_leaf(resumed), _params_after(3))


def test_full_disk_during_a_metrics_write_names_it(tmp_path, monkeypatch):
  workdir = str(tmp_path / "w")
  real_open = open

  class Full:
    def __init__(self, f):
      self.f = f

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.f.close()

    def write(self, text):
      if '"step": 2' in text:
        self.f.write(text[:10])  # half a line, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
      return self.f.write(text)

    def flush(self):
      self.f.flush()

  monkeypatch.setattr(metrics, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
  with pytest.raises(
    checkpoint.StorageError,
    match=r"metrics.jsonl: appending the train "
    r"record of step 2 failed: No space left on device \(ENOSPC\)",
  ):
    trainer.run(loop_config(), workdir, CountingAlgorithm)
  monkeypatch.undo()
  trainer.run(loop_config(), workdir, CountingAlgorithm)
  assert _steps(workdir) == [0, 1, 2]


# ----------------------------------------------------------------------------- (5) rewards


def _examples(n):
  return [
    tasks.Example(prompt=f"prompt {i}", answer="a", source=f"data.jsonl:{i + 1}") for i in range(n)
  ]


def _hangs_on(index, seconds=30.0):
  import time

  def reward(examples, completions):
    if any(e.source == f"data.jsonl:{index + 1}" for e in examples):
      time.sleep(seconds)
    return [1.0] * len(examples)

  return rewards.Reward("hangs", reward)


def test_reward_that_hangs_stops_naming_the_example():
  with rewards.time_limit(0.3):
    with pytest.raises(
      rewards.RewardTimeout,
      match=r"reward 'hangs' did not return within "
      r"train.reward_timeout_s=0.3 s on 6 completions; data.jsonl:3 example 2 "
      r"branch 0 \(prompt 'prompt 2'",
    ):
      rewards.compute(_hangs_on(2), _examples(3), [["a", "b"]] * 3)
    # Slow as a batch, quick alone: said so.
    slow = rewards.Reward(
      "slow", lambda ex, c: (__import__("time").sleep(0.1 * len(ex)), [0.0] * len(ex))[1]
    )
    with pytest.raises(rewards.RewardTimeout, match="the batch as a whole is too slow"):
      rewards.compute(slow, _examples(3), [["a", "b"]] * 3)
    # Quick: the same values as without a limit; an error or a NaN as before.
    quick = rewards.REWARDS["exact_match"]
    np.testing.assert_array_equal(
      rewards.compute(quick, _examples(2), [["a", "b"]] * 2), [[1, 0], [1, 0]]
    )
    with pytest.raises(ValueError, match="reward 'nan' returned nan for data.jsonl:1 example 0"):
      rewards.compute(
        rewards.Reward("nan", lambda e, c: [float("nan")] * len(e)), _examples(1), [["a"]]
      )
  with pytest.raises(ValueError, match=r"train.reward_timeout_s=-1.0: expected a finite number"):
    loop_config("train.reward_timeout_s=-1")


def test_the_run_applies_its_reward_timeout(tmp_path):
  class HangingReward(CountingAlgorithm):
    def batch(self, state, step):
      rewards.compute(_hangs_on(0), _examples(1), [["a"]])
      return super().batch(state, step)

  with pytest.raises(rewards.RewardTimeout, match="reward_timeout_s=0.2 s .* data.jsonl:1"):
    trainer.run(loop_config("train.reward_timeout_s=0.2"), str(tmp_path / "w"), HangingReward)
  assert rewards._LIMIT_S[0] == 0.0  # restored after the run


# ----------------------------------------------------------------------------- (3) campaign


def test_fault_campaign_check_finds_each_kind_of_loss(tmp_path):
  from experiments import fault_campaign

  reference = [
    {"step": s, "kind": "train", "loss/policy": 0.5 + s, "time/step_s": 1.0}
    for s in range(fault_campaign.TOTAL)
  ]

  def workdir(name, lines, checkpoints):
    d = tmp_path / name
    (d / "checkpoints").mkdir(parents=True)
    for c in checkpoints:
      (d / "checkpoints" / c).mkdir()
    (d / "metrics.jsonl").write_text("".join(lines))
    return str(d)

  good = [json.dumps(dict(r, **{"time/step_s": 2.0})) + "\n" for r in reference]
  last = str(fault_campaign.TOTAL)
  assert fault_campaign.check(workdir("good", good, ["4", last]), reference) == []
  torn = good[:-1] + [good[-1][:20] + "\n", good[-1]]
  assert "line 5 is torn" in " ".join(
    fault_campaign.check(workdir("torn", torn, [last]), reference)
  )
  twice = good + good[-1:]
  assert "twice" in " ".join(fault_campaign.check(workdir("twice", twice, [last]), reference))
  other = good[:-1] + [json.dumps(dict(reference[-1], **{"loss/policy": 9.0})) + "\n"]
  assert "differ" in " ".join(fault_campaign.check(workdir("other", other, [last]), reference))
  tmp = [last, "4.orbax-checkpoint-tmp-123"]
  assert "temporary" in " ".join(fault_campaign.check(workdir("tmp", good, tmp), reference))
  assert "newest checkpoint 4" in " ".join(
    fault_campaign.check(workdir("old", good, ["4"]), reference)
  )


@pytest.mark.slow  # 2 trials: 6 tiny GRPO launches, ~2-3 min on a 2-core CPU
def test_a_small_fault_campaign_loses_nothing(tmp_path):
  import argparse
  from experiments import fault_campaign

  counts = fault_campaign.campaign(
    argparse.Namespace(trials=2, seed=1, no_cache=False, out=str(tmp_path / "campaign.jsonl"))
  )
  assert counts == {"survived": 2, "lost": 0, "not_killed": 0}


# ----------------------------------------------------------------------------- slow: GRPO


def _grpo(*overrides):
  from helpers import short_run

  return short_run("train.rl_steps=3", "train.checkpoint_every=100", *overrides)


@pytest.mark.slow  # three tiny GRPO runs (compilation shared): ~1 min on an idle 2-core CPU
def test_grpo_sigterm_then_the_same_call_resumes_bitwise(tmp_path):
  from branch_replay.train import metrics as metrics_lib
  from branch_replay import algorithms

  algo = algorithms.for_config(_grpo())
  update = algo.update

  def term_at_2(self, state, batch, step):
    if step == 2:
      os.kill(os.getpid(), signal.SIGTERM)
    return update(self, state, batch, step)

  workdir = str(tmp_path / "w")
  algo.update = term_at_2
  try:
    with pytest.raises(preemption.Preempted, match="stopped after step 2; checkpoint 3"):
      trainer.run(_grpo(), workdir)
  finally:
    algo.update = update
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
  trainer.run(_grpo(), workdir)
  full = trainer.run(_grpo(), str(tmp_path / "full"))
  untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
  assert _steps(workdir) == [0, 1, 2, 3]
  assert untimed(_records(workdir)) == untimed(metrics_lib.read(full["metrics"]))


@pytest.mark.slow  # two tiny GRPO runs: ~1 min on a 2-core CPU
def test_async_checkpoints_equal_sync_ones_while_later_steps_donate(tmp_path):
  """An asynchronous save returns before its files are written, and the next steps donate
  the state's buffers: every checkpoint must still hold its own step's state, bitwise."""
  restored = {}
  for asynchronous in ("false", "true"):
    cfg = _grpo(
      "train.checkpoint_every=1",
      "train.keep_checkpoints=5",
      f"train.async_checkpoints={asynchronous}",
    )
    trainer.run(cfg, str(tmp_path / asynchronous))
    ckpt = checkpoint.Checkpointer(str(tmp_path / asynchronous), cfg)
    template = train_state.state_dict(train_state.init_state(cfg))
    restored[asynchronous] = {
      s: jax.tree.map(np.asarray, ckpt.restore(s, template)) for s in ckpt.manager.all_steps()
    }
    ckpt.close()
  assert sorted(restored["true"]) == sorted(restored["false"]) == [1, 2, 3, 4]
  for step, want in restored["false"].items():
    jax.tree.map(np.testing.assert_array_equal, restored["true"][step], want)
  assert not np.array_equal(
    *(jax.tree.leaves(restored["false"][s]["params"])[0] for s in (1, 4))
  )  # the steps moved the parameters


MESH_OVERRIDES = [
  "model.vocab_size=128",
  "model.d_model=32",
  "model.n_layers=2",
  "model.n_heads=4",
  "model.n_kv_heads=2",
  "model.head_dim=8",
  "model.mlp_hidden=64",
  "task.prompt_len=20",
  "task.n_keys=2",
  "train.sft_steps=0",
  "train.rl_steps=3",
  "train.batch_size=4",
  "train.n_branches=4",
  "sampler.max_new_tokens=2",
  "train.eval_size=0",
  "train.progress=false",
  "train.plot=false",
  "train.tensorboard=false",
  "train.checkpoint_every=100",
  "mesh=data:2,fsdp:2",
]


def worker():
  import argparse

  parser = argparse.ArgumentParser()
  parser.add_argument("--coordinator_address", required=True)
  parser.add_argument("--process_id", type=int, required=True)
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--term_at_step", type=int, default=None)
  parser.add_argument("--term_process", type=int, default=1)
  args = parser.parse_args()
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(args.coordinator_address, 2, args.process_id)
  from branch_replay import algorithms, config as config_lib
  from branch_replay.train import metrics as metrics_lib
  from branch_replay.train import preemption as preemption_lib, trainer as trainer_lib

  cfg = config_lib.apply_overrides(config_lib.Config(), MESH_OVERRIDES)
  if args.term_at_step is not None and args.process_id == args.term_process:
    write = metrics_lib.MetricsWriter.write

    def term(self, record):  # inside the step, before this process's agreement call
      if record.get("step") == args.term_at_step:
        os.kill(os.getpid(), signal.SIGTERM)
      return write(self, record)

    metrics_lib.MetricsWriter.write = term
  try:
    trainer_lib.run(cfg, args.workdir, algorithms.for_config(cfg))
  except preemption_lib.Preempted as e:
    print(f"preempted at {e.step}", flush=True)
    sys.exit(preemption_lib.exit_code(e.signum))


def _two_processes(workdir, *extra, timeout=500):
  from helpers import free_port

  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
  address = f"localhost:{free_port()}"
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        os.path.abspath(__file__),
        f"--coordinator_address={address}",
        f"--process_id={i}",
        f"--workdir={workdir}",
        *extra,
      ],
      env=env,
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return [p.returncode for p in procs], logs


@pytest.mark.slow  # three two-process GRPO runs: ~3 min on an idle 2-core CPU
def test_sigterm_on_one_process_stops_every_process_after_the_same_step(tmp_path):
  """Process 1 alone is signalled inside step 1; both stop after step 1, save checkpoint 2
  together (exit 143), and the same command on both resumes to the uninterrupted run's
  metrics."""
  workdir = str(tmp_path / "w")
  codes, logs = _two_processes(workdir, "--term_at_step=1", "--term_process=1")
  assert codes == [preemption.exit_code(signal.SIGTERM)] * 2, logs
  assert all("preempted at 2" in log for log in logs), logs
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2"]
  assert _steps(workdir) == [0, 1]  # process 0 writes: it stopped after step 1 too
  codes, logs = _two_processes(workdir)
  assert codes == [0, 0], logs
  codes, logs = _two_processes(str(tmp_path / "full"))
  assert codes == [0, 0], logs
  untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
  assert _steps(workdir) == [0, 1, 2]
  assert untimed(_records(workdir)) == untimed(_records(str(tmp_path / "full")))


if __name__ == "__main__":
  worker()
