"""A fault campaign: N short GRPO runs, each SIGKILLed once at a random moment, then resumed
with the same command; every run must end as the uninterrupted run does.

  python experiments/fault_campaign.py --trials=21 \\
      --out=experiments/results/fault_campaign_cpu_2026-12-03.jsonl

The run: the tiny model on the 20-token haystack, 1 warm-up step then 4 GRPO steps of
2 prompts x 4 branches, a checkpoint every 2 steps (and at the end), asynchronous checkpoints
(the default). Each trial draws (seeded by --seed) where the SIGKILL lands:

  anytime   a timer, uniform over the uninterrupted run's process lifetime
  compile   a timer, uniform over the time before the first step's metrics line
            (imports, the algorithm's compilation, init, restore)
  sample    inside the reward call of RL step k (after generation, before the update)
  update    right after the update of step k is dispatched (in flight: JAX is asynchronous)
  save      right after the asynchronous save of step k returned (orbax writing it)
  finalize  inside orbax's save of step k, files written, before the commit's rename
  metrics   half of step k's metrics line written (a torn line)

Launches compile as the test suite does (tests/conftest.py: XLA's fast pipeline and a
persistent compilation cache shared by the campaign's launches; --no_cache: neither), so
"compile" kills land in tracing, cache loads and what compilation remains. The uninterrupted
run is launched twice (its metrics must agree, and the second, warm, sets the kill windows).
The fault is injected through the environment (FAULT_CAMPAIGN_KILL) into the first launch
only; the resume is the identical command line. A trial survives when the killed process
died by SIGKILL (or finished before the timer fired: counted apart), the resume exits 0, and
then: metrics.jsonl parses line by line, holds each (step, kind) once, and equals the
uninterrupted run's records on every key but time/* (reward, loss, grad norm, ...);
checkpoints/ holds no temporary directory and its newest step is the last. One JSON line per
trial and a summary line (survived / lost) go to --out, with provenance.
"""

from __future__ import annotations

import time

T0 = time.time()  # the process's start (before jax is imported), for the compile window

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OVERRIDES = [
  "task.prompt_len=20",
  "task.n_keys=2",
  "train.eval_size=0",
  "train.progress=false",
  "train.plot=false",
  "train.tensorboard=false",
  "train.sft_steps=1",
  "train.rl_steps=4",
  "train.batch_size=2",
  "train.n_branches=4",
  "train.sft_batch_size=2",
  "sampler.max_new_tokens=2",
  "train.checkpoint_every=2",
  "train.learning_rate=3e-3",
]
TOTAL = 5  # steps: 1 warm-up + 4 RL; checkpoints 2, 4, 5
KINDS = ("anytime", "compile", "sample", "update", "save", "finalize", "metrics")
STEPS = {
  "sample": (1, 2, 3, 4),
  "update": (1, 2, 3, 4),
  "save": (2, 4, 5),
  "finalize": (2, 4, 5),
  "metrics": (0, 1, 2, 3, 4),
}
ENV = "FAULT_CAMPAIGN_KILL"  # "kind:step_or_delay"


def config():
  from branch_replay.config import Config, apply_overrides
  from branch_replay.data.tokenizer import TOKENIZER
  from models import transformer as tfm

  return apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size)), OVERRIDES
  )


def die():
  os.kill(os.getpid(), signal.SIGKILL)


def install(kind: str, value: float):
  """Arm the kill of the first launch (the worker's process only)."""
  import threading

  if kind in ("anytime", "compile"):
    timer = threading.Timer(value, die)
    timer.daemon = True
    timer.start()
    return
  step = int(value)
  from branch_replay import algorithms
  from branch_replay.train import checkpoint, metrics
  from branch_replay.data import rewards

  if kind in ("sample", "update"):
    algo = algorithms.for_config(config())
    batch, update, compute = algo.batch, algo.update, rewards.compute
    armed = []

    def batch_k(self, state, s):
      armed[:] = [s == step]
      return batch(self, state, s)

    def compute_k(*a, **k):
      if armed and armed[0] and kind == "sample":
        die()
      return compute(*a, **k)

    def update_k(self, state, b, s):
      out = update(self, state, b, s)
      if s == step and kind == "update":
        die()
      return out

    algo.batch, algo.update, rewards.compute = batch_k, update_k, compute_k
  elif kind == "save":
    save = checkpoint.Checkpointer.save

    def save_k(self, s, state):
      save(self, s, state)
      if s == step:
        die()

    checkpoint.Checkpointer.save = save_k
  elif kind == "finalize":
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def finalize_k(self, *a, **k):
      if self._final_path.name == str(step):
        die()
      return await finalize(self, *a, **k)

    atomicity.AtomicRenameTemporaryPath.finalize = finalize_k
  elif kind == "metrics":
    write = metrics.MetricsWriter.write

    def write_k(self, record):
      if record.get("step") == step and record.get("kind") == "train":
        line = json.dumps(record, sort_keys=True)
        with open(self.path, "a") as f:
          f.write(line[: len(line) // 2])
          f.flush()
        die()
      return write(self, record)

    metrics.MetricsWriter.write = write_k
  else:
    raise ValueError(f"{ENV}={kind}:{value}: unknown kind; expected one of {KINDS}")


def worker(workdir: str):
  fault = os.environ.get(ENV)
  if fault:
    kind, value = fault.split(":")
    install(kind, float(value))
  from absl import logging

  logging.set_verbosity(logging.WARNING)
  from branch_replay.train import metrics, trainer

  first = []
  write = metrics.MetricsWriter.write

  def stamped(self, record):
    write(self, record)
    first.append(time.time() - T0)

  metrics.MetricsWriter.write = stamped
  trainer.run(config(), workdir)
  print(json.dumps({"process_s": time.time() - T0, "first_line_s": first[0] if first else None}))


def launch(workdir: str, fault: str | None = None, timeout: float = 900, cache: str = ""):
  env = {k: v for k, v in os.environ.items() if k != ENV}
  env["JAX_PLATFORMS"] = "cpu"
  if cache:  # as the test suite compiles (tests/conftest.py): fast XLA, a shared cache
    env.update(
      JAX_COMPILATION_CACHE_DIR=cache,
      JAX_DISABLE_MOST_OPTIMIZATIONS="true",
      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
  if fault:
    env[ENV] = fault
  t0 = time.time()
  out = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--worker", f"--workdir={workdir}"],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  return out, time.time() - t0


def check(workdir: str, reference: list[dict]) -> list[str]:
  """What is wrong with a finished workdir (empty: it survived)."""
  problems = []
  path = os.path.join(workdir, "metrics.jsonl")
  records, seen = [], set()
  with open(path) as f:
    for number, line in enumerate(f, 1):
      try:
        rec = json.loads(line)
      except ValueError:
        problems.append(f"metrics.jsonl line {number} is torn: {line[:60]!r}")
        continue
      key = (rec.get("step"), rec.get("kind"))
      if key in seen:
        problems.append(f"metrics.jsonl: {key} twice (line {number})")
      seen.add(key)
      records.append(rec)
  untimed = lambda rs: [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rs]
  got, want = untimed(records), untimed(reference)
  if got != want:
    steps = [r.get("step") for r in records]
    differ = [w.get("step") for g, w in zip(got, want) if g != w]
    problems.append(
      f"metrics differ from the uninterrupted run (steps {steps}; differing at {differ[:5]})"
    )
  directory = os.path.join(workdir, "checkpoints")
  names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
  tmp = [n for n in names if "tmp" in n]
  if tmp:
    problems.append(f"temporary checkpoint directories left: {tmp}")
  steps = [int(n) for n in names if n.isdigit()]
  if not steps or max(steps) != TOTAL:
    problems.append(f"newest checkpoint {max(steps) if steps else None}, expected {TOTAL}")
  return problems


def campaign(args):
  from experiments import provenance

  rng = random.Random(args.seed)
  scratch = tempfile.mkdtemp(prefix="fault_campaign_")
  writer = provenance.ResultsWriter(
    args.out, "fault_campaign", with_jax=False, config=OVERRIDES, trials=args.trials, seed=args.seed
  )
  try:
    cache = "" if args.no_cache else os.path.join(scratch, "jax_cache")
    reference = None
    for attempt in range(2):  # the second, warm: its times set the kill windows
      ref_dir = os.path.join(scratch, f"reference{attempt}")
      out, ref_s = launch(ref_dir, cache=cache)
      if out.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed:\n{out.stderr[-3000:]}")
      with open(os.path.join(ref_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
      problems = check(ref_dir, reference or records)
      if problems:  # the same run twice must agree, or nothing below means anything
        raise SystemExit(f"the uninterrupted run, twice: {problems}")
      reference = records
      times = json.loads(out.stdout.strip().splitlines()[-1])
      writer.write(
        {
          "kind": "reference",
          "attempt": attempt,
          "wall_s": round(ref_s, 2),
          **times,
          "steps": [r["step"] for r in reference],
        }
      )
    startup_s = times["first_line_s"]  # imports, compilation, init: before step 0's line
    counts = {"survived": 0, "lost": 0, "not_killed": 0}
    for trial in range(args.trials):
      kind = KINDS[trial % len(KINDS)]  # each kind in turn; where and when: drawn
      if kind == "anytime":
        value = round(rng.uniform(0, ref_s), 2)
      elif kind == "compile":
        value = round(rng.uniform(0, startup_s), 2)
      else:
        value = rng.choice(STEPS[kind])
      workdir = os.path.join(scratch, f"trial{trial}")
      fault = f"{kind}:{value}"
      first, first_s = launch(workdir, fault, cache=cache)
      killed = first.returncode == -signal.SIGKILL
      left = (
        sorted(os.listdir(os.path.join(workdir, "checkpoints")))
        if os.path.isdir(os.path.join(workdir, "checkpoints"))
        else []
      )
      torn = _torn_lines(os.path.join(workdir, "metrics.jsonl"))
      second, second_s = launch(workdir, cache=cache)  # the same command, no fault
      problems = (
        []
        if second.returncode == 0
        else [f"resume exited {second.returncode}: {second.stderr[-800:]}"]
      )
      if not problems:
        problems = check(workdir, reference)
      if first.returncode not in (0, -signal.SIGKILL):
        problems.append(f"the faulted launch exited {first.returncode}: {first.stderr[-800:]}")
      outcome = "lost" if problems else ("survived" if killed else "not_killed")
      counts[outcome] += 1
      repaired = [
        line
        for line in second.stderr.splitlines()
        if "repaired" in line or "does not restore" in line
      ]
      writer.write(
        {
          "kind": "trial",
          "trial": trial,
          "fault": fault,
          "killed": killed,
          "first_returncode": first.returncode,
          "first_s": round(first_s, 2),
          "left_after_kill": {"checkpoints": left, "torn_metrics_lines": torn},
          "resume_s": round(second_s, 2),
          "resume_log": repaired,
          "outcome": outcome,
          "problems": problems,
        }
      )
      shutil.rmtree(workdir, ignore_errors=True)
    writer.write({"kind": "summary", **counts, "trials": args.trials, "kinds": sorted(set(KINDS))})
    return counts
  finally:
    shutil.rmtree(scratch, ignore_errors=True)


def _torn_lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  torn = 0
  with open(path) as f:
    for line in f:
      try:
        json.loads(line)
      except ValueError:
        torn += 1
  return torn


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--worker", action="store_true", help="(internal) one training process")
  parser.add_argument("--workdir")
  parser.add_argument("--trials", type=int, default=21)
  parser.add_argument(
    "--no_cache",
    action="store_true",
    help="compile every launch with XLA's full pipeline and no persistent cache (slower)",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="", help="append JSON lines here")
  args = parser.parse_args(argv)
  if args.worker:
    return worker(args.workdir)
  counts = campaign(args)
  if counts["lost"]:
    raise SystemExit(f"{counts['lost']} of {args.trials} runs lost: see {args.out or 'above'}")


if __name__ == "__main__":
  main()
