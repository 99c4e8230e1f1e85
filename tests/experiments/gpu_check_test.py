"""experiments/gpu_check.sh and its preflight (experiments/gpu_preflight.py): the one-GPU row's
shape by the card's memory against the plan's compiled footprint, the one line that names a
missing module, and (slow) the whole script with SMOKE=1 in a copy of the tracked files without
.git under a fresh virtualenv holding requirements.txt only, as on a bare device image."""

import os
import re
import shutil
import subprocess
import sys

import pytest

from experiments import gpu_preflight, gpu_target, provenance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MIB = {name: card.memory_bytes / 2**20 for name, card in gpu_target.CARDS.items()}


def test_one_gpu_shape_by_the_cards_memory():
  h200 = gpu_preflight.one_gpu_shape(MIB["H200"])
  assert (h200.card, h200.model, h200.prefix_len) == ("H200", "llama3_8b", 131072)
  assert (h200.branches, h200.tail_len, h200.rank) == (16, 512, 16)
  h100 = gpu_preflight.one_gpu_shape(MIB["H100"])
  assert (h100.card, h100.model, h100.prefix_len) == ("H100", "llama3_8b", 65536)
  assert gpu_preflight.one_gpu_shape(MIB["H20"]).prefix_len == 65536  # 96 GB: the H100 row
  assert gpu_preflight.one_gpu_shape(40960) is None  # a 40 GB card: no 8B row
  assert gpu_preflight.one_gpu_shape(None) is None  # no nvidia-smi
  assert gpu_preflight.one_gpu_shape(None, smoke=True).model == "tiny"


def test_each_cards_row_is_the_longest_prefix_the_plan_fits():
  """Against plan_1gpu.py's compiled rows (PLAN_RESULTS): each card's P has its compiled total
  within HEADROOM of the memory JAX is given (gpu_check.sh's fraction x the card), the next
  longer P of the plan does not."""
  script = open(os.path.join(ROOT, "experiments/gpu_check.sh")).read()
  (fraction,) = re.findall(r"XLA_PYTHON_CLIENT_MEM_FRACTION:-([0-9.]+)", script)
  assert float(fraction) == gpu_preflight.MEM_FRACTION
  rows = [
    r
    for r in provenance.read(os.path.join(ROOT, gpu_preflight.PLAN_RESULTS))
    if r.get("full_model") and "error" not in r
  ]
  for shape in gpu_preflight.ONE_GPU_SHAPES:
    usable = gpu_preflight.MEM_FRACTION * gpu_target.CARDS[shape.card].memory_bytes
    assert shape.min_memory_gb <= gpu_target.CARDS[shape.card].memory_bytes / 1e9
    total = {
      r["P"]: r["total_bytes"]
      for r in rows
      if r["model"] == shape.model
      and r.get("target", shape.card) == shape.card  # compiled for this card
      and (r["T"], r["R"], r["rank"]) == (shape.tail_len, shape.branches, shape.rank)
    }
    assert total[shape.prefix_len] <= gpu_preflight.HEADROOM * usable, shape
    longer = [P for P in total if P > shape.prefix_len]
    if longer:  # the H200's 131,072 is the plan's longest
      assert total[min(longer)] > gpu_preflight.HEADROOM * usable, shape


def test_imports_of_a_script_include_function_level_and_skip_guarded_ones(tmp_path):
  script = tmp_path / "step.py"
  script.write_text(
    "import os\n"
    "from absl import app\n"
    "try:\n"
    "  import not_here_optional_abc\n"
    "except ImportError:\n"
    "  pass\n"
    "def run():\n"
    "  import jax.numpy as jnp\n"
    "  from experiments import flops\n"
  )
  assert gpu_preflight.imports_of(str(script)) == [
    "os",
    "absl.app",
    "jax.numpy",
    "experiments.flops",
  ]


def test_a_missing_module_stops_the_preflight_with_one_line_naming_it(
  tmp_path, capsys, monkeypatch
):
  """A module imported inside a function of a later step's script, and one imported by a
  module that script imports: the preflight exits 2 with one FAILED line naming the absent
  module, the file whose import failed and the script that needs it (nothing compiled)."""
  script = tmp_path / "later_step.py"
  script.write_text("import json\ndef main():\n  import not_a_module_xyz\n")
  out = tmp_path / "preflight.jsonl"
  assert gpu_preflight.main(["--smoke", f"--out={out}", "--scripts", str(script)]) == 2
  (failed,) = [l for l in capsys.readouterr().out.splitlines() if "FAILED" in l and "{" not in l]
  assert failed.startswith("preflight: FAILED: no module named 'not_a_module_xyz'")
  assert "later_step.py needs not_a_module_xyz" in failed
  (row,) = provenance.read(out)
  assert not row["ok"] and "not_a_module_xyz" in row["error"]

  pkg = tmp_path / "gpu_check_fake_pkg"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "mod.py").write_text("import json\nimport missing_dependency_abc\n")
  script.write_text("from gpu_check_fake_pkg import mod\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    with pytest.raises(gpu_preflight.PreflightFailed) as e:
      gpu_preflight.check_imports([str(script)], extra=())
  finally:
    sys.modules.pop("gpu_check_fake_pkg", None)
  message = str(e.value)
  assert message.startswith("no module named 'missing_dependency_abc' (imported by ")
  assert "mod.py:2" in message and "needs gpu_check_fake_pkg.mod" in message


def test_without_a_gpu_the_preflight_stops_naming_the_backend(tmp_path, capsys):
  """Not SMOKE and jax on its CPU: one line saying so, exit 2, no shape file for the row."""
  shape = tmp_path / "shape.env"
  assert gpu_preflight.main([f"--shape_out={shape}"]) == 2
  out = capsys.readouterr().out
  assert "preflight: FAILED: jax's backend is 'cpu', not 'gpu'" in out
  assert not shape.exists()


def test_the_later_steps_imports_are_all_here():
  """Here every module gpu_check.sh's scripts import is installed: the check passes and lists
  the third-party ones (the standard library left out)."""
  out = gpu_preflight.check_imports()
  assert {"jax", "absl.flags", "branch_replay.core.engine"} <= set(out["checked"])
  assert "os" not in out["checked"] and "branch_replay.train.steps" in out["checked"]
  assert set(out["optional_missing"]) <= set(gpu_preflight.OPTIONAL)


def test_shape_env_is_what_gpu_check_sources():
  shape = gpu_preflight.one_gpu_shape(MIB["H100"])
  row = {
    "one_gpu_shape": gpu_preflight.dataclasses.asdict(shape),
    "imports": {"optional_missing": {"tokamax": "skipped"}},
  }
  env = dict(line.split("=") for line in gpu_preflight.shape_env(row).splitlines())
  assert env["ONE_GPU_PREFIX_LEN"] == "65536" and env["ONE_GPU_MODEL"] == "llama3_8b"
  assert env["ONE_GPU_REPS"] == "2" and env["TOKAMAX_AVAILABLE"] == "0"
  script = open(os.path.join(ROOT, "experiments/gpu_check.sh")).read()
  used = set(re.findall(r"\$\{?(ONE_GPU_[A-Z_]+|TOKAMAX_AVAILABLE)", script))
  assert used - {"ONE_GPU_S"} <= set(env), used - set(env)


@pytest.mark.slow  # a fresh virtualenv (pip, from its cache: ~1.5 min) + the smoke run (~2-4 min)
def test_gpu_check_smoke_in_a_bare_copy_with_requirements_only(tmp_path):
  """The tracked files copied without .git, a virtualenv with requirements.txt only (no
  `-e .`, no test packages), `SMOKE=1 bash experiments/gpu_check.sh`: it runs to the end and
  writes the preflight's line, the one-GPU row (compiled, each step, the run row) and the
  steps' record; results carry the commit passed in GIT_COMMIT."""
  files = subprocess.run(
    ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
  ).stdout.split("\0")
  tree = tmp_path / "tree"
  for name in filter(None, files):
    if os.path.isfile(os.path.join(ROOT, name)):
      os.makedirs(tree / os.path.dirname(name), exist_ok=True)
      shutil.copy2(os.path.join(ROOT, name), tree / name)
  assert not (tree / ".git").exists() and (tree / "experiments/gpu_check.sh").exists()
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
  pip = subprocess.run(
    [str(venv / "bin/python"), "-m", "pip", "install", "-q", "-r", "requirements.txt"],
    cwd=tree,
    capture_output=True,
    text=True,
  )
  assert pip.returncode == 0, pip.stderr[-3000:]
  env = {
    k: v
    for k, v in os.environ.items()
    if k not in ("PYTHONPATH", "VIRTUAL_ENV", "XLA_FLAGS") and not k.startswith("JAX_")
  }
  commit = "0123456789abcdef0123456789abcdef01234567"
  out = tmp_path / "out"
  env.update(
    PATH=f"{venv / 'bin'}:{env['PATH']}",
    SMOKE="1",
    OUT=str(out),
    GIT_COMMIT=commit,
    JAX_PLATFORMS="cpu",
  )
  run = subprocess.run(
    ["bash", "experiments/gpu_check.sh"], cwd=tree, env=env, capture_output=True, text=True
  )
  assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
  steps = {l["step"]: l for l in provenance.read(out / "gpu_check.jsonl")}
  assert steps["settings"]["mem_fraction"] == "0.95" and steps["settings"]["git_commit"] == commit
  for name in ("preflight", "one_gpu_row", "fused_check"):
    assert steps[name]["status"] == "ok" and steps[name]["seconds"] <= steps[name]["limit_s"]
  assert steps["total"]["exit_status"] == 0
  (pre,) = provenance.read(out / "preflight.jsonl")
  assert pre["ok"] and pre["git_commit"] == commit and pre["backend"] == "cpu"
  assert pre["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.95"
  assert pre["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
  assert pre["versions"]["jax"] and pre["versions"]["flax"] and pre["versions"]["optax"]
  assert pre["tiny_step"]["compile_s"] > 0 and pre["one_gpu_shape"]["model"] == "tiny"
  lines = provenance.read(out / "one_gpu_8b.jsonl")
  assert [l["kind"] for l in lines] == ["compiled", "step", "step", "step", "run"]
  row = lines[-1]
  assert row["model"] == "tiny" and row["P"] == 64 and row["finite"] and row["step_s"] > 0
  assert "mfu" in row and "peak_gb" in row and len(row["step_times"]) == 2
  assert row["provenance"]["git_commit"] == commit
  assert row["provenance"]["git_commit_from"] == "env"
  (check,) = provenance.read(out / "fused_check.jsonl")
  assert check["passed"] and check["kernel"] == "reference"
  assert (out / "nvidia_smi_q.txt").read_text() and (out / "env.txt").read_text()
