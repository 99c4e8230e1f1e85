"""Where a number came from: every results line carries the git commit (and whether the tree
was dirty), the full command, jax's version and devices, the machine and the date.

  from experiments import provenance
  writer = provenance.ResultsWriter("experiments/results/q1_cpu.jsonl", experiment="q1")
  writer.write({"P": 256, "replay_s": 0.1})   # -> {..., "provenance": {...}}

  # a finished run's workdir (metrics.jsonl + config.json) as a results file
  python experiments/provenance.py --workdir=/tmp/x --command="python run.py --workdir=/tmp/x" \
      --out=experiments/results/default_run.jsonl [--run_info='{"git_commit": "..."}']
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.TimeoutExpired):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def git_info() -> dict:
  """Commit and dirty flag of the checkout this code runs from. A copy of the tree without
  `.git` (a device machine's) takes the commit from the GIT_COMMIT environment variable
  (gpu_check.sh passes it on), marked `git_commit_from: env`; None where neither exists."""
  status = _git("status", "--porcelain", "--untracked-files=no")
  info = {
    "git_commit": _git("rev-parse", "HEAD"),
    "git_branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
    "git_dirty": None if status is None else bool(status),
  }
  if info["git_commit"] is None and os.environ.get("GIT_COMMIT", "unknown") != "unknown":
    info.update(git_commit=os.environ["GIT_COMMIT"], git_commit_from="env")
  return info


def cpu_info() -> dict:
  """The CPU's model and widest vector ISA (Linux /proc/cpuinfo; {} elsewhere). XLA's CPU code
  differs with the ISA, so float32 results agree to the digit only on like machines: a run's
  first loss differed in its last bit between an AVX-512 host and the one of 2026-12-03."""
  try:
    with open("/proc/cpuinfo") as f:
      text = f.read()
  except OSError:
    return {}
  model = next(
    (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
    None,
  )
  flags = next(
    (set(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")),
    set(),
  )
  isa = next((name for name in ("avx512f", "avx2", "avx", "sse4_2") if name in flags), None)
  return {"cpu_model": model, "cpu_isa": isa}


def machine_info() -> dict:
  info = {
    "hostname": platform.node(),
    "platform": platform.platform(),
    "processor": platform.machine(),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
    **cpu_info(),
  }
  try:
    import psutil

    info["memory_gb"] = round(psutil.virtual_memory().total / 2**30, 1)
    info["load_avg_1m"] = round(os.getloadavg()[0], 2)
  except (ImportError, OSError):
    pass
  return info


def jax_info() -> dict:
  """jax/jaxlib/flax versions and the devices (imports jax: call after flags set the platform)."""
  import jax

  devices = jax.devices()
  info = {
    "jax": jax.__version__,
    "backend": jax.default_backend(),
    "device_kind": devices[0].device_kind,
    "device_count": len(devices),
    "process_count": jax.process_count(),
  }
  try:
    import jaxlib

    info["jaxlib"] = jaxlib.__version__
  except (ImportError, AttributeError):
    pass
  try:
    import flax

    info["flax"] = flax.__version__
  except ImportError:
    pass
  return info


def command(argv=None) -> str:
  """The command line as one could paste it (python + script + flags)."""
  argv = sys.argv if argv is None else argv
  return " ".join(shlex.quote(a) for a in ["python", *argv])


def provenance(argv=None, with_jax: bool = True, **extra) -> dict:
  """Everything needed to trace a number: commit, dirty flag, command, jax, machine, date."""
  out = dict(git_info())
  out["command"] = command(argv)
  out["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  out.update(machine_info())
  if with_jax:
    out.update(jax_info())
  out.update(extra)
  return out


def emit(row: dict, out: str = "") -> dict:
  """Print one result row as a JSON line (with `provenance` added where it has none) and
  append it to `out` (a JSON-lines file; '' prints only)."""
  row = row if "provenance" in row else dict(row, provenance=provenance())
  line = json.dumps(row, default=_jsonable)
  print(line, flush=True)
  if out:
    with open(out, "a") as f:
      f.write(line + "\n")
  return row


class ResultsWriter:
  """Appends JSON lines, each with a `provenance` dict (computed once per writer) and
  `experiment`. path '' prints only."""

  def __init__(
    self, path: str, experiment: str, argv=None, with_jax: bool = True, echo: bool = True, **extra
  ):
    self.path, self.experiment, self.echo = path, experiment, echo
    self._prov = provenance(argv, with_jax, **extra)
    if path:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

  def write(self, row: dict) -> dict:
    return self._emit({"experiment": self.experiment, **row, "provenance": self._prov})

  def write_plain(self, row: dict) -> dict:
    """A line without provenance (e.g. per-step records under a header line that has it)."""
    return self._emit({"experiment": self.experiment, **row})

  def _emit(self, row: dict) -> dict:
    line = json.dumps(row, default=_jsonable)
    if self.echo:
      print(line, flush=True)
    if self.path:
      with open(self.path, "a") as f:
        f.write(line + "\n")
    return row


def _jsonable(x):
  try:
    import numpy as np

    if isinstance(x, np.generic):
      return x.item()
    if isinstance(x, np.ndarray):
      return x.tolist()
  except ImportError:
    pass
  return str(x)


def read(path: str) -> list[dict]:
  """Every JSON line of a results file (blank lines skipped)."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def metrics_to_results(
  workdir: str,
  out: str,
  run_command: str,
  experiment: str = "run",
  argv=None,
  run_info: dict | None = None,
) -> list[dict]:
  """A finished run's workdir as a results file: a `kind: header` line (the run's command,
  config.json, what is known of the run in `run_info`: its commit, dates, wall time), one
  line per metrics record (kind train or eval, as written by the run), and a last
  `kind: summary` line (train/summary.py's, over the run's algorithm's phase and metrics). The header and summary carry `provenance` (this
  conversion's checkout and command) and `run_info` as `run` (a table credits the summary to
  the run's commit when it names one); the per-step lines do not repeat it."""
  from branch_replay import config as config_lib
  from branch_replay import registry
  from branch_replay.train import metrics
  from branch_replay.train import summary as summary_lib

  metrics_path = os.path.join(workdir, "metrics.jsonl")
  config_path = os.path.join(workdir, "config.json")
  missing = [os.path.basename(p) for p in (metrics_path, config_path) if not os.path.exists(p)]
  if missing:
    raise ValueError(
      f"workdir={workdir!r}: expected {' and '.join(missing)} in it (a finished run.py workdir)"
    )
  records = metrics.read(metrics_path)
  if not records:
    raise ValueError(f"workdir={workdir!r}: metrics.jsonl has no records")
  with open(config_path) as f:
    cfg_dict = json.load(f)
  cfg = config_lib.from_dict(cfg_dict)
  algorithm = registry.for_config(cfg)
  summary = summary_lib.summarize(records, algorithm.phase, algorithm.summary_metrics)
  if os.path.exists(out):
    os.remove(out)  # a results file describes one run
  writer = ResultsWriter(out, experiment, argv, with_jax=False, echo=False)
  rows = [
    writer.write(
      {"kind": "header", "run_command": run_command, "run": run_info or {}, "config": cfg_dict}
    )
  ]
  rows += [writer.write_plain(rec) for rec in records]
  rows.append(
    writer.write(
      {
        "kind": "summary",
        **summary,
        "run_command": run_command,
        **({"run": run_info} if run_info else {}),
      }
    )
  )
  return rows


def main(argv):
  import argparse

  parser = argparse.ArgumentParser(description="workdir metrics -> results file")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--out", required=True)
  parser.add_argument("--command", required=True, help="the command that produced the workdir")
  parser.add_argument("--experiment", default="run")
  parser.add_argument(
    "--run_info",
    default="{}",
    help='JSON of what is known of the run, e.g. {"git_commit": ..., '
    '"start": ..., "end": ..., "wall_s": ...}',
  )
  args = parser.parse_args(argv[1:])
  rows = metrics_to_results(
    args.workdir, args.out, args.command, args.experiment, argv, json.loads(args.run_info)
  )
  print(f"{len(rows)} lines -> {args.out}")


if __name__ == "__main__":
  main(sys.argv)
