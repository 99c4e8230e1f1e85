"""Every experiments/ script imports beside every other in one process: absl flags are
defined when a script runs (`define_flags()` under `__main__`), not on import, so two
scripts' `--out` or `--branches` never collide in a test worker (CI failed on that)."""

import importlib
import pkgutil

from absl import flags

import experiments


def test_every_experiment_imports_beside_the_others():
  names = sorted(m.name for m in pkgutil.iter_modules(experiments.__path__))
  assert {"bench_trl", "profile_replay", "bench_replay", "plan_1gpu"} <= set(names)
  before = set(flags.FLAGS)
  for name in names:
    importlib.import_module(f"experiments.{name}")
  defined = {
    name
    for name in set(flags.FLAGS) - before
    if (flags.FLAGS.find_module_defining_flag(name) or "").startswith("experiments")
  }
  assert not defined, f"experiments define flags on import: {sorted(defined)}"
