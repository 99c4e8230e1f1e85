"""Experiments: run configs (configs/), reproduction scripts, benchmarks and tools, listed by
kind in registry.py.

The run configs lived at experiments/NAME.py before they moved to experiments/configs/; the
finder below keeps `experiments.NAME` importable (`from experiments import grpo_haystack`,
`importlib.import_module("experiments.grpo_haystack")`) as the same module object as
`experiments.configs.NAME`."""

import importlib
import importlib.abc
import importlib.util
import sys

from experiments.registry import CONFIGS

MOVED = {name: f"{__name__}.configs.{name}" for name in CONFIGS}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """experiments.NAME -> experiments.configs.NAME for the moved run configs."""

  def find_spec(self, fullname, path=None, target=None):
    package, _, name = fullname.rpartition(".")
    if package == __name__ and name in MOVED:
      return importlib.util.spec_from_loader(fullname, self)
    return None

  def create_module(self, spec):
    return importlib.import_module(MOVED[spec.name.rpartition(".")[2]])

  def exec_module(self, module):
    pass  # the real module ran when create_module imported it


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
  sys.meta_path.insert(0, _MovedFinder())
