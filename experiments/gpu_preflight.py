"""gpu_check.sh's first step (<= 60 s on the card): before device minutes go to the 8B row,
check that every module the later steps import is here, record the versions, the card and the
memory JAX is given, run one tiny compiled step of the trainer (LoRA, the RL step of
train/steps.py), and pick the one-GPU row's shape from the card's memory. Any failure stops
with one line `preflight: FAILED: ...` naming what is missing (exit status 2).

  python3 experiments/gpu_preflight.py --out=$OUT/preflight.jsonl --shape_out=$OUT/shape.env
  python3 experiments/gpu_preflight.py --smoke ...   # a CPU: the tiny row, no GPU expected

Only the standard library at module level: the import check must run before anything it checks.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import json
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The scripts gpu_check.sh runs after this one: every import in them (module level and inside
# functions) is imported here, which imports each project module's own module-level imports.
SCRIPTS = ("experiments/plan_1gpu.py", "experiments/fused_check.py")
# Imported by the tiny step below (the trainer's step), whatever the scripts import.
EXTRA_MODULES = ("branch_replay.train.steps", "branch_replay.train.state")
# Absent on a bare device image without harm: what each one's absence costs.
OPTIONAL = {
  "tokamax": "the fused-kernel check (experiments/fused_check.py) is skipped",
  "psutil": "results lines carry no host memory or load",
}
VERSIONS = ("jax", "jaxlib", "flax", "optax", "numpy", "orbax.checkpoint", "chex", "einops")

# The one-GPU row by the card's memory (nvidia-smi memory.total): the longest prefix whose
# compiled step (plan_1gpu.py's row for the card, `plan_gb`, from PLAN_RESULTS) is within
# HEADROOM of the memory JAX is given (MEM_FRACTION x the card). Llama-3-8B shapes, R=16
# branches of T=512, LoRA rank 16; H200 at 143,771 MiB, H100 80GB at 81,559 MiB.
PLAN_RESULTS = "experiments/results/plan_1gpu_trainer_step_2026-12-05.jsonl"
MEM_FRACTION = 0.95  # gpu_check.sh's XLA_PYTHON_CLIENT_MEM_FRACTION
HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class OneGpuShape:
  card: str  # the smallest card of this row
  min_memory_gb: float  # memory.total (1e9 bytes) from which the row applies
  model: str
  prefix_len: int
  tail_len: int = 512
  branches: int = 16
  rank: int = 16
  mlp_chunk: int = 8192
  reps: int = 2  # timed steps after the warm-up (gpu_check.sh's time budget)


ONE_GPU_SHAPES = (  # largest card first
  OneGpuShape("H200", 120.0, "llama3_8b", 131072, reps=1),  # ~80 s a step (cost_model)
  OneGpuShape("H100", 80.0, "llama3_8b", 65536, reps=2),  # ~25 s a step
)
SMOKE_SHAPE = OneGpuShape("cpu", 0.0, "tiny", 64, tail_len=8, branches=4, rank=2, mlp_chunk=16)


def one_gpu_shape(memory_total_mib: float | None, smoke: bool = False) -> OneGpuShape | None:
  """The row for a card of memory_total_mib (nvidia-smi's MiB); None: no 8B row fits."""
  if smoke:
    return SMOKE_SHAPE
  if memory_total_mib is None:
    return None
  gb = memory_total_mib * 2**20 / 1e9
  return next((s for s in ONE_GPU_SHAPES if gb >= s.min_memory_gb), None)


class PreflightFailed(Exception):
  """The check cannot go on: one line saying what is missing (a module and who imports it,
  the GPU, a row for this card) or wrong."""


def imports_of(path: str) -> list[str]:
  """Every module a file imports, at module level and inside functions, in order; imports
  inside `try: ... except ImportError` are the file's own optional ones and are left out.
  `from a import b` yields 'a.b' (a submodule or a name: the check tries both)."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  guarded = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
      for stmt in node.body:
        guarded.update(id(n) for n in ast.walk(stmt))
  names = []
  for node in ast.walk(tree):
    if id(node) in guarded:
      continue
    if isinstance(node, ast.Import):
      names += [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module != "__future__":
      names += [f"{node.module}.{a.name}" for a in node.names]
  return list(dict.fromkeys(names))


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
  types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
  return any(
    isinstance(t, ast.Name) and t.id in ("ImportError", "ModuleNotFoundError") for t in types
  )


def import_or_explain(name: str, needed_by: str) -> None:
  """Imports `name` ('a.b': module a.b, or module a holding b); raises PreflightFailed with one line
  naming the absent module, the file whose import failed and the script that needs it."""
  try:
    importlib.import_module(name)
    return
  except ModuleNotFoundError as e:
    parent, _, attr = name.rpartition(".")
    if parent and e.name == name:  # `from a import b` where b is a name in a, not a module
      try:
        if hasattr(importlib.import_module(parent), attr):
          return
      except ModuleNotFoundError as e2:
        e = e2
    where = _failing_file(e, needed_by)
    raise PreflightFailed(
      f"no module named {e.name!r} (imported by {where}; {needed_by} needs {name}): this image "
      f"lacks it: install it there (requirements.txt pins it) or run on an image that has it"
    ) from None


def _failing_file(e: BaseException, needed_by: str) -> str:
  """The file whose import statement failed (the traceback's last frame outside importlib and
  this module): a project file, or a package's own file when a dependency of it is absent."""
  frames = [
    f
    for f in traceback.extract_tb(e.__traceback__)
    if not f.filename.startswith("<") and os.path.abspath(f.filename) != os.path.abspath(__file__)
  ]
  if not frames:
    return needed_by
  path = os.path.abspath(frames[-1].filename)
  shown = os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else path
  return f"{shown}:{frames[-1].lineno}"


def check_imports(scripts=SCRIPTS, extra=EXTRA_MODULES) -> dict:
  """Imports everything the scripts import (raises PreflightFailed at the first absent module) and
  reports the optional ones: {'checked': [...], 'optional_missing': {name: consequence}}."""
  checked = []
  for script in scripts:
    path = script if os.path.isabs(script) else os.path.join(ROOT, script)
    for name in imports_of(path):
      if name.split(".")[0] in OPTIONAL:
        continue
      import_or_explain(name, os.path.relpath(path, ROOT))
      if name.split(".")[0] not in sys.stdlib_module_names:
        checked.append(name)
  for name in extra:
    import_or_explain(name, "the preflight's tiny step")
    checked.append(name)
  optional_missing = {}
  for name, consequence in OPTIONAL.items():
    try:
      importlib.import_module(name)
    except ImportError:
      optional_missing[name] = consequence
  return {"checked": sorted(set(checked)), "optional_missing": optional_missing}


def versions() -> dict:
  out = {"python": sys.version.split()[0]}
  for name in VERSIONS:
    try:
      out[name] = getattr(importlib.import_module(name), "__version__", "?")
    except ImportError:
      out[name] = None
  return out


def nvidia_smi() -> dict:
  """The card by nvidia-smi (name, memory.total MiB, driver); {} without nvidia-smi."""
  query = "name,memory.total,driver_version"
  try:
    out = subprocess.run(
      ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
      capture_output=True,
      text=True,
      timeout=20,
    )
  except (OSError, subprocess.TimeoutExpired):
    return {}
  lines = [l for l in out.stdout.splitlines() if l.strip()]
  if out.returncode or not lines:
    return {}
  name, memory, driver = [s.strip() for s in lines[0].split(",")]
  return {"name": name, "memory_total_mib": float(memory), "driver": driver, "count": len(lines)}


def tiny_step() -> dict:
  """One compiled RL step of the trainer (train/steps.py's make_train_step on init_state's
  state: LoRA rank 2 on the tiny preset), twice: compile and step seconds, finite loss."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay import config as config_lib
  from branch_replay.core import tree
  from branch_replay.train import state as train_state
  from branch_replay.train import steps
  from models import lora
  from models import transformer as tfm

  cfg = config_lib.Config(model=tfm.preset("tiny"), lora=lora.LoraConfig(rank=2))
  state = train_state.init_state(cfg)
  rng = np.random.default_rng(0)
  B, R, P, T, V = 1, 2, 16, 4, cfg.model.vocab_size
  batch = tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, V, (B, P)), jnp.int32),
    prefix_valid_BP=jnp.ones((B, P), bool),
    tails_BRT=jnp.asarray(rng.integers(0, V, (B, R, T)), jnp.int32),
    tail_valid_BRT=jnp.ones((B, R, T), bool),
    advantages_BR=jnp.asarray(rng.normal(size=(B, R)), jnp.float32),
  )
  t0 = time.time()
  step = jax.jit(steps.make_train_step(cfg)).lower(state, batch).compile()
  compile_s = time.time() - t0
  t0 = time.time()
  state, metrics = jax.block_until_ready(step(state, batch))
  loss = float(metrics["loss/policy"])
  if not np.isfinite(loss):
    raise PreflightFailed(f"the tiny step's loss is {loss}: the device computes garbage")
  return {"compile_s": round(compile_s, 2), "step_s": round(time.time() - t0, 3), "loss": loss}


def preflight(smoke: bool, scripts=SCRIPTS) -> dict:
  """Everything the check needs to know before the 8B row; raises PreflightFailed."""
  t0 = time.time()
  row = {"kind": "preflight", "smoke": smoke}
  row["imports"] = check_imports(scripts)
  row["versions"] = versions()
  row["env"] = {
    k: os.environ.get(k)
    for k in (
      "XLA_PYTHON_CLIENT_MEM_FRACTION",
      "XLA_PYTHON_CLIENT_PREALLOCATE",
      "JAX_PLATFORMS",
      "XLA_FLAGS",
      "GIT_COMMIT",
      "PYTHONPATH",
    )
  }
  row["git_commit"] = os.environ.get("GIT_COMMIT") or "unknown"
  row["nvidia_smi"] = smi = nvidia_smi()
  import jax

  devices = jax.devices()
  row["backend"] = jax.default_backend()
  row["devices"] = [str(d) for d in devices]
  row["device_kind"] = devices[0].device_kind
  if not smoke and row["backend"] != "gpu":
    raise PreflightFailed(
      f"jax's backend is {row['backend']!r}, not 'gpu' (devices {row['devices']}): this jax "
      "has no CUDA plugin or sees no driver (SMOKE=1 runs the check on a CPU)"
    )
  shape = one_gpu_shape(smi.get("memory_total_mib"), smoke)
  if shape is None:
    raise PreflightFailed(
      f"no one-GPU row for this card ({smi or 'nvidia-smi gave no memory.total'}): the "
      f"smallest row needs {ONE_GPU_SHAPES[-1].min_memory_gb} GB (experiments/gpu_preflight.py)"
    )
  row["one_gpu_shape"] = dataclasses.asdict(shape)
  row["tiny_step"] = tiny_step()
  stats = devices[0].memory_stats() or {}
  row["bytes_limit_gb"] = round(stats["bytes_limit"] / 1e9, 3) if "bytes_limit" in stats else None
  row["seconds"] = round(time.time() - t0, 1)
  row["ok"] = True
  return row


def shape_env(row: dict) -> str:
  """What gpu_check.sh needs of a passed preflight, as shell assignments (`. $OUT/shape.env`):
  the one-GPU row's shape and whether the fused check can run."""
  lines = [f"ONE_GPU_{k.upper()}={v}" for k, v in row["one_gpu_shape"].items()]
  lines.append(f"TOKAMAX_AVAILABLE={int('tokamax' not in row['imports']['optional_missing'])}")
  return "".join(line + "\n" for line in lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true", help="a CPU: the tiny row, no GPU expected")
  parser.add_argument("--out", default="", help="append the JSON line here")
  parser.add_argument("--shape_out", default="", help="write the row's shape as shell here")
  parser.add_argument("--scripts", nargs="*", default=list(SCRIPTS), help="files to import-check")
  args = parser.parse_args(argv)
  try:
    row = preflight(args.smoke, args.scripts)
  except PreflightFailed as e:
    row = {"kind": "preflight", "ok": False, "error": str(e)}
  except Exception as e:  # noqa: BLE001 (any other failure: its type and first line, once)
    traceback.print_exc()
    first = (str(e).strip().splitlines() or [""])[0][:300]
    row = {"kind": "preflight", "ok": False, "error": f"{type(e).__name__}: {first}"}
  if not row["ok"]:
    print(f"preflight: FAILED: {row['error']}", flush=True)
  line = json.dumps(row)
  print(line, flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.write(line + "\n")
  if not row["ok"]:
    return 2
  if args.shape_out:
    with open(args.shape_out, "w") as f:
      f.write(shape_env(row))
  print(f"preflight: ok in {row['seconds']} s; the one-GPU row: {row['one_gpu_shape']}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
