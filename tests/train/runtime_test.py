"""train/runtime.py: the run's context built once. The mesh is one object per spec (built from
the config's string in one place, once per run), the jitted functions are cached by what shapes
them (a second run of the same model compiles nothing), and placement goes where the state's
shardings say (a function given a config with a mesh but no mesh object refuses it by name:
state_test.py)."""

import dataclasses

import jax
import numpy as np

from branch_replay.algorithms import grpo
from branch_replay.config import Config, apply_overrides
from branch_replay.core import sharding
from branch_replay.data import tasks
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.train import runtime, steps, trainer
from helpers import QUIET, CountingAlgorithm, loop_config
from models import transformer as tfm


def tiny(*overrides):
  return apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size)), [*QUIET, *overrides]
  )


def test_mesh_of_is_one_object_per_spec_and_none_without_a_mesh():
  assert runtime.mesh_of("") is None
  a = runtime.mesh_of("data:2,fsdp:4")
  assert a is runtime.mesh_of("data:2,fsdp:4") and isinstance(a, jax.sharding.Mesh)
  assert dict(a.shape)["data"] == 2 and dict(a.shape)["fsdp"] == 4
  assert runtime.Runtime(tiny("mesh=data:2,fsdp:4"), TOKENIZER).mesh is a


def test_compiled_functions_are_cached_by_what_shapes_them():
  """Two runs that differ in what no compiled function reads (the seed, the step count) share
  one set of jitted functions; a different stop token or sampler is a different set."""
  a = runtime.Runtime(tiny("train.seed=1", "train.rl_steps=3"), TOKENIZER)
  b = runtime.Runtime(tiny("train.seed=2", "train.rl_steps=5"), TOKENIZER)
  assert a.fns(TOKENIZER.eos_id) is b.fns(TOKENIZER.eos_id)
  assert a.fns(TOKENIZER.eos_id) is not a.fns((TOKENIZER.eos_id, 5))
  c = runtime.Runtime(tiny("sampler.temperature=0.5"), TOKENIZER)
  assert c.fns(TOKENIZER.eos_id) is not a.fns(TOKENIZER.eos_id)
  built = []
  build = lambda cfg, mesh: built.append((cfg, mesh)) or object()
  first = a.compiled("probe", build)
  assert b.compiled("probe", build) is first and len(built) == 1
  assert built[0] == (steps.compile_key(a.cfg), None)


def test_the_cache_keeps_the_most_recently_used(monkeypatch):
  monkeypatch.setattr(runtime, "_CACHE", type(runtime._CACHE)())
  monkeypatch.setattr(runtime, "CACHE_SIZE", 2)
  values = [runtime.cached(k, object) for k in ("a", "b")]
  assert runtime.cached("a", object) is values[0]  # "a" used last: "b" goes first
  runtime.cached("c", object)
  assert list(runtime._CACHE) == ["a", "c"]


def test_put_places_the_state_on_the_runs_mesh():
  """Runtime.init_state / put: parameters FSDP-sharded as sharding.param_shardings says,
  batches split by prompt; one device without a mesh."""
  rt = runtime.Runtime(tiny("mesh=data:2,fsdp:4"), TOKENIZER)
  state = rt.init_state()
  expected = sharding.param_shardings(rt.mesh, rt.cfg.model)
  for p, s in zip(jax.tree.leaves(state.params), jax.tree.leaves(expected)):
    assert p.sharding.is_equivalent_to(s, p.ndim), (p.sharding, s)
  prompt_BP = rt.put(np.zeros((8, 4), np.int32), "batch")
  assert (
    prompt_BP.sharding.is_equivalent_to(sharding.prompt_shardings(rt.mesh, prompt_BP), 2)
    and len(prompt_BP.sharding.device_set) == 8
  )
  one = runtime.Runtime(tiny(), TOKENIZER)
  assert one.put(np.zeros(3), "batch").sharding == jax.sharding.SingleDeviceSharding(
    jax.devices()[0]
  )


def test_a_run_builds_its_mesh_once_and_hands_its_runtime_to_the_algorithm(tmp_path, monkeypatch):
  """trainer.run on a mesh: sharding.make_mesh is called once for the whole run (init,
  restore, every step's placement), and the algorithm holds the trainer's Runtime."""
  calls = []
  real = sharding.make_mesh
  monkeypatch.setattr(sharding, "make_mesh", lambda *a, **k: calls.append(a) or real(*a, **k))
  runtime.mesh_of.cache_clear()
  CountingAlgorithm.made.clear()
  trainer.run(loop_config("mesh=data:2,fsdp:4"), str(tmp_path / "run"), CountingAlgorithm)
  assert calls == [("data:2,fsdp:4",)]
  (algo,) = CountingAlgorithm.made
  assert algo.rt.mesh is runtime.mesh_of("data:2,fsdp:4") and algo.rt.tok is TOKENIZER


def test_an_algorithm_built_alone_makes_its_own_runtime():
  """A notebook's `GRPO(cfg, task, tok)`: its Runtime from the config, the same compiled
  functions the trainer's would use."""
  cfg = tiny()
  task = tasks.make(cfg.task, TOKENIZER)
  algo = grpo.GRPO(cfg, task, TOKENIZER)
  assert algo.rt.cfg is cfg and algo.rt.mesh is None
  assert algo.fns is runtime.Runtime(dataclasses.replace(cfg), TOKENIZER).fns(
    tuple(TOKENIZER.stop_ids)
  )
