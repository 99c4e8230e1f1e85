"""Mesh axes, the one logical->mesh RULES table, and where each array of a replay step lives
on a mesh (GSPMD); engine.loss_and_grad(..., mesh=mesh) runs the step.

Parameters and activations carry logical names; `RULES` maps them to the four mesh axes.
Layout of one replay step:
  prefix      prompts over (data, fsdp), sequence over `context` (context-parallel prefix);
  tails       prompts over (data, fsdp), branches over `context` (the devices that shared
              the prefix sequence split the branches);
  parameters  `embed` over fsdp (FSDP), and over fsdp x context on a mesh with a `context`
              axis (`param_rules`); heads/mlp/vocab over `tensor`; optimizer state
              follows the parameters.

Context parallelism is a per-layer all-gather of K/V: inside the prefix each device keeps
its P/c queries and residual stream, and each layer all-gathers that layer's keys and
values (exact: the softmax sees every key), under shard_map (models/attention/context_parallel.py;
its transpose reduce-scatters the prefix attention's dK/dV). Per layer and per prompt a
device receives (c-1)/c * 2*P*K*H elements in the forward (again in each tail layer: the
cache crosses to the tails in its sequence shards, CACHE_AXES) and the K/V cotangents (summed over branch shards) go back by reduce-scatter (XLA on CPU
emits an all-reduce: twice that) in the backward; notes/issue4_readme.md has the numbers.
With model.remat the backward gathers once more. A ring scheme would
overlap that traffic with compute and never hold a layer's full K/V, at the price of an
online-softmax backward; the all-gather is simpler, exact, and the full K/V is what the
tails need anyway.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from branch_replay.core.tree import TreeBatch
from models import transformer as tfm

# The mesh axes, declared once (role words; sizes come from a spec such as "fsdp:4,context:2").
AXES = ("data", "fsdp", "tensor", "context")

# Logical name -> mesh axes, in flax's priority order: a rule applies if its mesh axes are
# still free in that array. Model code names only the logical side.
RULES = (
  ("batch", ("data", "fsdp")),  # prompts: data parallel (FSDP devices split the batch too)
  ("branch", "context"),  # tails: branches over the devices that split the prefix sequence
  ("seq", "context"),  # prefix sequence (context parallelism); tails are not seq-sharded
  ("embed", "fsdp"),  # parameters: FSDP shards d_model (x context: param_rules)
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("vocab", "tensor"),
  ("head_dim", None),
)

# Where the prefix cache crosses to the tails: K/V stay split over the sequence as the
# context-parallel prefix left them (and by prompt and kv head); each tail layer gathers its
# own layer's K/V when its attention needs every prefix key, and the cache cotangent comes
# back in the same shards. Gathering the whole cache here instead held every layer's full K/V
# and its cotangent on every device (small preset, P=32K, context:8: 326.9 -> 277.2 MB per
# device; large: temp 16,833 -> 11,896 MB; compile only: experiments/results/
# context_parallel_memory_cpu.jsonl before, context_parallel_memory_cache_sharded_cpu_2026-12-02.jsonl after).
CACHE_AXES = dict(
  kv=("batch", "seq", "kv_heads", "head_dim"),
  h_last_BD=("batch", None),
  trunk_score_BW=("batch", None),
)


# ----------------------------------------------------------------------------- the mesh


def parse_mesh_spec(spec: str, n_devices: int) -> dict[str, int]:
  """'data:2,fsdp:2,context:2' -> {axis: size} over all of AXES (absent axes are 1).

  One axis may be -1: it takes the devices the others leave. The sizes must multiply to
  n_devices; otherwise ValueError naming both numbers.
  """
  sizes = {axis: 1 for axis in AXES}
  seen = set()
  for item in filter(None, (s.strip() for s in spec.split(","))):
    name, sep, value = item.partition(":")
    name = name.strip()
    if not sep or name not in AXES:
      raise ValueError(f"mesh={spec!r}: bad entry {item!r}: expected axis:size with axis in {AXES}")
    if name in seen:
      raise ValueError(f"mesh={spec!r}: axis {name!r} given twice")
    seen.add(name)
    try:
      size = int(value)
    except ValueError:
      raise ValueError(f"mesh={spec!r}: size of {name!r} is {value!r}: expected an int") from None
    if size < 1 and size != -1:
      raise ValueError(f"mesh={spec!r}: size of {name!r} is {size}: expected >= 1 (or -1 once)")
    sizes[name] = size
  free = [axis for axis, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f"mesh={spec!r}: at most one axis may be -1, got {free}")
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if n_devices % fixed:
      raise ValueError(
        f"mesh={spec!r}: the fixed axes multiply to {fixed}, which does not "
        f"divide the {n_devices} devices"
      )
    sizes[free[0]] = n_devices // fixed
  elif fixed != n_devices:
    raise ValueError(
      f"mesh={spec!r}: axis sizes multiply to {fixed}, but there are {n_devices} devices"
    )
  return sizes


def make_mesh(spec: str, devices: Optional[Sequence[Any]] = None) -> Mesh:
  """A mesh over `devices` (default: every device of every process), Auto axis types
  (GSPMD propagates shardings from the inputs and our constraints)."""
  devices = jax.devices() if devices is None else list(devices)
  sizes = parse_mesh_spec(spec, len(devices))
  return jax.make_mesh(
    tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices
  )


def logical_spec(names: Sequence[Optional[str]], rules=None) -> PartitionSpec:
  """Logical axis names of one array -> its mesh PartitionSpec under RULES (or `rules`)."""
  return nn.logical_to_mesh_axes(tuple(names), RULES if rules is None else rules)


def param_rules(mesh: Mesh) -> tuple:
  """RULES for the parameters on `mesh`: with a `context` axis, d_model over fsdp x context
  (ZeRO-3 over every device of the mesh), since `context` alone splits no parameter and each
  of its devices would hold all parameters and their AdamW moments (Llama-3-8B at P=131K on
  context:8: 210.5 -> 50.6 GB per device, experiments/results/plan_8gpu_cpu_2026-12-02.md).
  A sharding only: exact (tests/models/context_parallel_test.py, float64). Without one, RULES."""
  if mesh.shape.get("context", 1) == 1:
    return RULES
  return tuple(
    ("embed", ("fsdp", "context")) if name == "embed" else (name, axes) for name, axes in RULES
  )


def axis_size(mesh: Mesh, entry) -> int:
  if entry is None:
    return 1
  entry = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[a] for a in entry)


def check_divisible(what: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
  """Every sharded dimension must divide the product of its mesh axes: ValueError naming
  the leaf, the dimension and both numbers."""
  for dim, (size, entry) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
    n = axis_size(mesh, entry)
    if size % n:
      raise ValueError(
        f"{what}: dimension {dim} has size {size}, not divisible by the {n} "
        f"devices of mesh axes {entry} (mesh {dict(mesh.shape)})"
      )


def named_sharding(mesh, what, shape, names, rules=None):
  """The NamedSharding of a leaf named `what` with logical axis names, divisibility checked."""
  spec = logical_spec(names, rules)
  check_divisible(what, shape, spec, mesh)
  return NamedSharding(mesh, spec)


# ----------------------------------------------------------------------------- shardings


def param_shardings(mesh: Mesh, model_cfg: tfm.ModelConfig):
  """A NamedSharding for every parameter leaf (from `param_axes`, under `param_rules`),
  divisibility checked."""
  axes = tfm.param_axes(model_cfg)
  shapes = jax.eval_shape(lambda: tfm.init_params(model_cfg, jax.random.key(0)))
  rules = param_rules(mesh)
  return jax.tree_util.tree_map_with_path(
    lambda path, names, leaf: named_sharding(
      mesh, "params" + jax.tree_util.keystr(path), leaf.shape, names, rules
    ),
    axes,
    shapes,
    is_leaf=lambda x: isinstance(x, PartitionSpec),
  )


def opt_state_shardings(mesh: Mesh, optimizer, opt_state, p_shardings):
  """Optimizer state sharded like the parameters (FSDP moments); non-parameter leaves
  (step counts) replicated. `opt_state` may be abstract (jax.eval_shape)."""
  return optax.tree_map_params(
    optimizer,
    lambda _, sharding: sharding,
    opt_state,
    p_shardings,
    transform_non_params=lambda _: replicated(mesh),
  )


def prompt_shardings(mesh: Mesh, tree):
  """Prompt-major arrays ([B, ...], e.g. prompts for the sampler): split by `batch`."""
  return jax.tree_util.tree_map_with_path(
    lambda path, x: named_sharding(
      mesh,
      "prompts" + jax.tree_util.keystr(path),
      np.shape(x),
      ("batch",) + (None,) * (np.ndim(x) - 1),
    ),
    tree,
  )


def put(tree, shardings):
  """Host arrays (identical on every process) -> global arrays with these shardings.
  Works on one process and across several (each process fills its own shards); arrays
  that already span several processes, or any device array on one process, are resharded
  on the devices (no host round trip)."""

  def one(x, sharding):
    if isinstance(x, jax.Array) and (not x.is_fully_addressable or jax.process_count() == 1):
      return jax.device_put(x, sharding)  # device -> device (a no-op where it already lies)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  return jax.tree.map(one, tree, shardings)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def to_host(tree):
  """Global arrays -> numpy on every process (an all-gather across processes when the
  arrays span several), e.g. sampled tokens that every host decodes and rewards."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    tree = multihost_utils.process_allgather(tree, tiled=True)
  return jax.tree.map(np.asarray, tree)


def constrain(tree, shardings):
  return jax.tree.map(jax.lax.with_sharding_constraint, tree, shardings)


def constrain_weights(tree, shardings):
  """`constrain` for a params_fn's weights: layers' attached LoRA adapters (replicated, as
  the adapters are) pass through; the rest is sharded like the parameters."""
  adapters = {
    k: v[tfm.ADAPTERS] for k, v in tree.items() if isinstance(v, dict) and tfm.ADAPTERS in v
  }
  bare = {
    k: ({n: x for n, x in v.items() if n != tfm.ADAPTERS} if k in adapters else v)
    for k, v in tree.items()
  }
  out = constrain(bare, shardings)
  for k, a in adapters.items():
    out[k] = dict(out[k], **{tfm.ADAPTERS: a})
  return out


def cache_constraint(mesh: Mesh):
  """The layout decision where the prefix cache crosses to the tails (see CACHE_AXES)."""

  def apply(cache):
    return dict(
      kv=jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(
          x, NamedSharding(mesh, logical_spec(CACHE_AXES["kv"]))
        ),
        cache["kv"],
      ),
      **{
        k: jax.lax.with_sharding_constraint(
          cache[k], NamedSharding(mesh, logical_spec(CACHE_AXES[k]))
        )
        for k in ("h_last_BD", "trunk_score_BW")
      },
    )

  return apply


# ----------------------------------------------------------------------------- replay


def sharded_prefill(mesh: Mesh, prefill_fn):
  """prefill_fn with the model's logical constraints switched on (flax logical_axis_rules):
  the prefix runs context-parallel. Only the prefix is traced under the rules, so the
  tails keep the layout they get from the batch (branches over `context`)."""

  def fn(params, prefix):
    with nn.logical_axis_rules(RULES), jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return prefill_fn(params, prefix)

  return fn


# Batches (a flat batch is the depth-1 tree): the root's prompts over (data, fsdp) and its
# sequence over `context` (the context-parallel prefill); inner nodes split by prompt only
# (every device of a `context` group runs every opening: they are few and short); leaves
# (branches) split by prompt and over `context` (a prompt's leaf count must divide the
# `context` size). The root cache crosses to the levels below under cache_constraint; the
# partitioner sums the leaves' cotangents across `context` before the inner levels' and the
# root's VJPs.


def batch_shardings(mesh: Mesh, batch: TreeBatch) -> TreeBatch:
  """A TreeBatch of NamedShardings (None fields stay None); a dimension its mesh axes do not
  divide is a ValueError naming the level, the field and both numbers."""

  def spec(where, x, names):
    return None if x is None else named_sharding(mesh, f"tree.{where}", np.shape(x), names)

  root = dict(
    root_BP=spec("root_BP", batch.root_BP, ("batch", "seq")),  # checked first
    root_valid_BP=spec("root_valid_BP", batch.root_valid_BP, ("batch", "seq")),
  )
  levels = []
  for d, level in enumerate(batch.levels, start=1):
    node_axis = "branch" if d == batch.depth else None  # leaves over `context`
    at = f"levels[{d - 1}] (level {d})"
    three = ("batch", node_axis, None)
    levels.append(
      level.replace(
        **{
          name: spec(
            f"{at}.{name}", getattr(level, name), three[:2] if name.endswith("_BR") else three
          )
          for name in (
            "tokens_BRT",
            "valid_BRT",
            "scored_BRT",
            "advantages_BR",
            "old_logp_BRT",
            "ref_logp_BRT",
            "advantages_BRT",
          )
        },
        # per path: split like the leaves
        path_advantages_BLT=spec(
          f"{at}.path_advantages_BLT", level.path_advantages_BLT, ("batch", "branch", None)
        ),
      )
    )
  return batch.replace(
    **root,
    trunk_old_logp_BW=spec("trunk_old_logp_BW", batch.trunk_old_logp_BW, ("batch", None)),
    trunk_ref_logp_BW=spec("trunk_ref_logp_BW", batch.trunk_ref_logp_BW, ("batch", None)),
    trunk_advantages_BRW=spec(
      "trunk_advantages_BRW", batch.trunk_advantages_BRW, ("batch", "branch", None)
    ),
    levels=tuple(levels),
  )


# ----------------------------------------------------------------------------- memory


def per_device_bytes(tree) -> int:
  """Bytes of `tree`'s arrays held by the most loaded device."""
  per_device: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    if not hasattr(x, "sharding"):
      continue
    for device, index in x.sharding.devices_indices_map(x.shape).items():
      shape = [len(range(*s.indices(n))) for s, n in zip(index, x.shape)]
      per_device[device] = per_device.get(device, 0) + math.prod(shape) * x.dtype.itemsize
  return max(per_device.values(), default=0)


def memory_report(compiled) -> dict[str, int]:
  """Per-device bytes of a compiled (SPMD) executable, from its memory_analysis():
  arguments, outputs, temporaries (activations, residuals, collectives' buffers), code,
  and their sum less aliased (donated) bytes: what one device must hold."""
  m = compiled.memory_analysis()
  report = dict(
    argument_bytes=int(m.argument_size_in_bytes),
    output_bytes=int(m.output_size_in_bytes),
    temp_bytes=int(m.temp_size_in_bytes),
    alias_bytes=int(m.alias_size_in_bytes),
    code_bytes=int(m.generated_code_size_in_bytes),
  )
  report["total_bytes"] = (
    report["argument_bytes"]
    + report["output_bytes"]
    + report["temp_bytes"]
    - report["alias_bytes"]
    + report["code_bytes"]
  )
  peak = getattr(m, "peak_memory_in_bytes", 0)
  if peak:
    report["peak_bytes"] = int(peak)
  return report
