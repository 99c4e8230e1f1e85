"""What a run builds once and every step reuses: the device mesh (a jax `Mesh` object, or None:
the first device), placement of the state and batches (`put`, `to_host`), the run's tokenizer,
and the one cache of compiled functions (the policy's step, sampler, greedy decoder and scorer;
PPO's critic step; a rollouts file's step), keyed by what shapes them.

  rt = Runtime(cfg, tok)            the trainer builds it and hands it to the algorithm
  rt.mesh                           built once from cfg.mesh (`mesh_of`, the one place)
  rt.put(tree, 'state' | 'batch')   host or device arrays -> where the run keeps them
  rt.fns(stop_tokens, turn_lengths) the policy's jitted functions (steps.Fns)
  rt.compiled(name, build)          any other jitted functions of this config (cached)

Jitted functions close over the mesh object, so no traced function builds a mesh from the
config's string; the cache outlives a run (a notebook's or the tests' second run of the same
model does not compile again)."""

from __future__ import annotations

import collections
import functools
from typing import Any, Callable

from branch_replay.config import Config
from branch_replay.core import sharding
from branch_replay.train import state as train_state
from branch_replay.train import steps


@functools.cache
def mesh_of(spec: str):
  """The Mesh of a config's `mesh` string over every device of every process, one object per
  spec in a process; None for '' (one device). The only place a mesh is built from the
  config."""
  return sharding.make_mesh(spec) if spec else None


_CACHE: collections.OrderedDict = collections.OrderedDict()
CACHE_SIZE = 16  # configs' function sets kept (least recently used dropped)


def cached(key, build: Callable[[], Any]):
  """The one jit cache: build() once per key (hashable: what shapes the functions), the least
  recently used set dropped beyond CACHE_SIZE."""
  if key in _CACHE:
    _CACHE.move_to_end(key)
    return _CACHE[key]
  value = _CACHE[key] = build()
  if len(_CACHE) > CACHE_SIZE:
    _CACHE.popitem(last=False)
  return value


class Runtime:
  """A run's context: its config, tokenizer and mesh, placement, and compiled functions."""

  def __init__(self, cfg: Config, tok):
    self.cfg, self.tok = cfg, tok
    self.mesh = mesh_of(cfg.mesh)
    self.key = steps.compile_key(cfg)  # the config less what no compiled function reads

  def shardings(self, tree, kind: str):
    """Where `tree` lives, kind 'state' or 'batch' (`train.state.shardings`)."""
    return train_state.shardings(tree, kind, self.cfg, self.mesh)

  def put(self, tree, kind: str):
    """`tree` placed where the run keeps it (kind 'state' or 'batch'): on the mesh (host data
    -> global arrays, one process or several) or on the first device."""
    return train_state.place(tree, kind, self.cfg, self.mesh)

  @staticmethod
  def to_host(tree):
    """Global arrays -> numpy on every process (`sharding.to_host`)."""
    return sharding.to_host(tree)

  def init_state(self, init_params=None, init_adapters=None) -> train_state.TrainState:
    """The train state, created where it lives (`train.state.init_state`)."""
    return train_state.init_state(self.cfg, init_params, init_adapters, self.mesh)

  def fns(self, stop_tokens, turn_lengths: tuple = ()) -> steps.Fns:
    """The policy's jitted functions (`steps.build_fns`): stop_tokens the stop id or ids (flat)
    or one tuple per turn (trees, with the task's turn_lengths)."""
    key = ("policy", self.key, stop_tokens, tuple(turn_lengths), self.mesh)
    return cached(key, lambda: steps.build_fns(self.key, stop_tokens, turn_lengths, self.mesh))

  def compiled(self, name: str, build: Callable[[Config, Any], Any]):
    """Other jitted functions of this config: build(compile_key(cfg), mesh), once per name,
    config and mesh (e.g. PPO's critic step)."""
    return cached((name, self.key, self.mesh), lambda: build(self.key, self.mesh))
