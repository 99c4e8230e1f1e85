"""Context-parallel self-attention of the prefix: queries split over the `seq` mesh axis under
`shard_map`, keys and values all-gathered (shapes as in transformer.py).

Each device of the context axis holds a contiguous slice of P/C prefix positions: its
queries, its residual stream and its own keys/values. Per layer it all-gathers the K/V (and
their RoPE positions and validity) of the whole prefix and attends its queries to them with
`attention.attend` as a black box, over two segments:
  earlier  the gathered keys, valid only at indices before this device's slice (the causal
           mask of another device's keys is all or nothing);
  own      this device's keys, index-causal against its queries (`causal=True`).
Every query sees every key it may see in one joint softmax, so the kernel's log-sum-exp
(and the custom VJP that reuses it) is already global: the result is exact. Left padding,
sliding windows, soft-capping and GQA follow from the global positions and validity passed
in; key blocks with no valid key (the masked later slices, keys outside the window) are
skipped by the blockwise kernel's tile schedule, which is the causal skipping.

Why all-gather (not a ring of ppermute steps): it is exact with the kernel unchanged, its
AD transpose is a reduce-scatter of dK/dV over the context axis, and the tails need the full
K/V anyway. The cost is K/V memory of O(P) per device for one layer at a time (2*P*K*H
elements); a ring with an online-softmax backward would hold O(P/C) and overlap the
transfer with compute. Both shard_map paths run the kernel's backward key-major
(`attention.attend(key_major_bwd=True)`): each key block's dK/dV is finished before the next
and stored in the keys' dtype, so the gathered sequence never has a float32 accumulator
(small preset, P=32K, context:8: 212.8 -> 194.8 MiB per device). Load balancing (zig-zag
slices) is not built: a device's slice is contiguous, so the causal work grows with its index.

The tails (queries with a prefix-cache segment first) run under `shard_map` too while a
`sharded_tails` layout is active (engine.loss_and_grad with a mesh sets it around the replay
step): their rows stay split over (batch axes, `context`) as the branches are, the prefix
cache arrives in its sequence shards (sharding.CACHE_AXES), and each tail layer all-gathers
its own layer's K/V once, before the blockwise kernel, whose AD transpose reduce-scatters
the tails' dK/dV (partial sums over each device's branches) once per layer. Left to the
partitioner, the kernel's tile loops over a sequence-sharded cache re-gathered the layer's
whole K/V per query tile (13.5 TB per step at P=131K, experiments/results/
plan_8gpu_cpu_2026-12-02.md). Other context segments (a tree's inner levels, split by prompt
only) enter replicated over `context`; each device slices the key rows its queries read.
Shapes that do not split (a sliding layer's window cache shorter than `context`, rows that
do not divide) fall back to the partitioner's path.

Without a mesh, or when `seq` maps to one device, attention runs as before:
`attention.attend` with the own keys gathered by a logical sharding constraint (GSPMD), the
path `model.context_parallel='gspmd'` also forces (for the tails too).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models import attention
from models.attention.segments import KeySegment

Array = jax.Array
SCHEMES = ("all_gather", "gspmd")  # model.context_parallel
# HLO name scopes of the K/V gathers (experiments/plan_8gpu.py counts their traffic by them).
PREFIX_SCOPE, TAILS_SCOPE = "cp_prefix_kv", "cp_tails_kv"


class TailsLayout(NamedTuple):
  """Where the tails run: the mesh and the logical rules whose `batch` / `seq` / `heads` /
  `kv_heads` entries place the tails' rows, the cache's sequence and the heads."""

  mesh: Any  # jax.sharding.Mesh (or AbstractMesh)
  rules: tuple


_TAILS: list[TailsLayout] = []


@contextlib.contextmanager
def sharded_tails(mesh, rules):
  """Within: the tails' attention to a sequence-sharded prefix cache runs under shard_map
  on `mesh` (one K/V all-gather per layer); trace the replay step inside."""
  _TAILS.append(TailsLayout(mesh, tuple(rules)))
  try:
    yield
  finally:
    _TAILS.pop()


def seq_axes() -> Optional[tuple[str, ...]]:
  """The mesh axes the logical `seq` axis maps to under the active flax logical rules and
  abstract mesh, when they split it over more than one device; else None."""
  rules = nn.get_logical_axis_rules()
  mesh = jax.sharding.get_abstract_mesh()
  if not rules or mesh.empty:
    return None
  entry = nn.logical_to_mesh_axes(("seq",), rules)[0]
  if entry is None:
    return None
  axes = entry if isinstance(entry, tuple) else (entry,)
  return axes if math.prod(mesh.shape[a] for a in axes) > 1 else None


def check_prefix(P: int, axes: Sequence[str]) -> int:
  """The context size C; ValueError unless it splits the P prefix positions evenly."""
  mesh = jax.sharding.get_abstract_mesh()
  C = math.prod(mesh.shape[a] for a in axes)
  if P % C:
    raise ValueError(
      f"prefix length P={P} is not divisible by the context-parallel mesh "
      f"axes {tuple(axes)} of size {C}: expected a multiple of {C} (left-pad "
      f"the prefixes)"
    )
  return C


def attend(
  q_BTNH,
  q_pos_BT,
  q_valid_BT,
  segments: Sequence[KeySegment],
  *,
  scheme: str = "all_gather",
  **kwargs,
) -> Array:
  """`attention.attend` (same arguments, kwargs passed through), context-parallel for the
  prefix: one causal segment (no context) while `seq` is split over the mesh."""
  if scheme not in SCHEMES:
    raise ValueError(f"model.context_parallel={scheme!r}: expected one of {SCHEMES}")
  axes = seq_axes()
  if scheme == "all_gather" and axes is not None and len(segments) == 1 and segments[0].causal:
    return _all_gather_attend(q_BTNH, q_pos_BT, q_valid_BT, segments[0], axes, **kwargs)
  if scheme == "all_gather" and axes is None and _TAILS:
    out = _tails_attend(q_BTNH, q_pos_BT, q_valid_BT, segments, _TAILS[-1], **kwargs)
    if out is not None:
      return out
  segments = [
    seg._replace(k_BSKH=_gathered(seg.k_BSKH), v_BSKH=_gathered(seg.v_BSKH)) if seg.causal else seg
    for seg in segments
  ]
  return attention.attend(q_BTNH, q_pos_BT, q_valid_BT, segments, **kwargs)


def _gathered(t_BTKH):
  """GSPMD: the queries' own keys gathered over the sequence (no-op without logical rules)."""
  return nn.with_logical_constraint(t_BTKH, ("batch", None, "kv_heads", "head_dim"))


def _all_gather_attend(q_BTNH, q_pos_BT, q_valid_BT, own: KeySegment, axes, **kwargs):
  C = check_prefix(q_BTNH.shape[1], axes)
  spec = lambda *names: nn.logical_to_mesh_axes(names)
  q_spec = spec("batch", "seq", "heads", "head_dim")
  kv_spec = spec("batch", "seq", "kv_heads", "head_dim")
  bt_spec = spec("batch", "seq")
  axis = axes if len(axes) > 1 else axes[0]

  def local(q_BTNH, q_pos_BT, q_valid_BT, k_BTKH, v_BTKH, k_pos_BT, k_valid_BT):
    Tl = q_BTNH.shape[1]  # this device's slice: positions [c*Tl, (c+1)*Tl)
    k_BPKH, v_BPKH, pos_BP, valid_BP = _gather_seq(
      (k_BTKH, v_BTKH, k_pos_BT, k_valid_BT), axis, PREFIX_SCOPE
    )
    start = jax.lax.axis_index(axis) * Tl
    earlier_BP = valid_BP & (jnp.arange(C * Tl) < start)[None]
    segments = [
      KeySegment(k_BPKH, v_BPKH, pos_BP, earlier_BP),
      KeySegment(k_BTKH, v_BTKH, k_pos_BT, k_valid_BT, causal=True),
    ]
    return attention.attend(q_BTNH, q_pos_BT, q_valid_BT, segments, key_major_bwd=True, **kwargs)

  # check_vma=False: the kernel's loop carries are not typed per device. Sound here because
  # every input is split over every mesh axis (asserted): no replicated input whose
  # cotangent would need a psum.
  mesh = jax.sharding.get_abstract_mesh()
  used = {
    a
    for entry in (*q_spec, *kv_spec)
    if entry is not None
    for a in (entry if isinstance(entry, tuple) else (entry,))
  }
  assert used >= {a for a in mesh.axis_names if mesh.shape[a] > 1}, (q_spec, kv_spec, mesh)
  in_specs = (q_spec, bt_spec, bt_spec) + (kv_spec,) * 2 + (bt_spec,) * 2
  return jax.shard_map(local, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
    q_BTNH, q_pos_BT, q_valid_BT, *own[:4]
  )


def _gather_seq(arrays, axis, scope):
  """Each array all-gathered over `axis` along its sequence (dimension 1), in a named scope
  (its transpose, the reduce-scatter of the cotangent, keeps it)."""
  with jax.named_scope(scope):
    return tuple(jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in arrays)


def _mesh_axes(name: str, layout: TailsLayout) -> tuple[str, ...]:
  """The mesh axes (of size > 1) that the logical `name` maps to under the layout's rules."""
  entry = nn.logical_to_mesh_axes((name,), layout.rules)[0]
  entry = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
  return tuple(a for a in entry if layout.mesh.shape[a] > 1)


def _entry(axes: Sequence[str]):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _tails_attend(
  q_BTNH, q_pos_BT, q_valid_BT, segments: Sequence[KeySegment], layout: TailsLayout, **kwargs
) -> Optional[Array]:
  """The tails' attention with the prefix cache (segments[0], [Bk, P, K, H] split over
  `seq`) gathered once under shard_map; None where the shapes do not split (the caller
  falls back to the partitioner). Rows of the queries (and of their own causal keys) are
  split over the batch axes and `context` when they divide, else over the batch axes only."""
  root = segments[0]
  ctx, batch = _mesh_axes("seq", layout), _mesh_axes("batch", layout)
  heads, kv_heads = _mesh_axes("heads", layout), _mesh_axes("kv_heads", layout)
  size = lambda axes: math.prod(layout.mesh.shape[a] for a in axes)
  C, nb = size(ctx), size(batch)
  Bq, _, N, _ = q_BTNH.shape
  K = root.k_BSKH.shape[2]
  if (
    C == 1
    or root.causal
    or len(segments) < 2
    or set(ctx) & set(batch)
    or root.k_BSKH.shape[1] % C
    or N % size(heads)
    or K % size(kv_heads)
  ):
    return None
  cq = C if Bq % (nb * C) == 0 else 1  # the queries' rows split over `context` too
  if Bq % (nb * cq):
    return None
  n = Bq // (nb * cq)  # query rows per device
  rows = []  # per segment: (key rows per device, query rows per key row) or None (causal)
  for seg in segments:
    if seg.causal:
      rows.append(None)
      continue
    if seg.k_BSKH.shape[0] % nb:
      return None
    kb = seg.k_BSKH.shape[0] // nb
    g = n * cq // kb  # query rows per key row (Bq / Bk)
    if n % g and g % n:  # a device's rows would straddle key rows
      return None
    rows.append((kb, g))
  q_rows = _entry(batch + (ctx if cq > 1 else ()))
  q_spec = PartitionSpec(q_rows, None, _entry(heads), None)
  q_bt = PartitionSpec(q_rows, None)
  in_specs = [q_spec, q_bt, q_bt]
  for i, seg in enumerate(segments):
    seq = _entry(ctx) if i == 0 else None
    r = q_rows if seg.causal else _entry(batch)
    in_specs += [PartitionSpec(r, seq, _entry(kv_heads), None)] * 2 + [PartitionSpec(r, seq)] * 2
  axis = _entry(ctx)
  causal = [seg.causal for seg in segments]

  def local(q_BTNH, q_pos_BT, q_valid_BT, *arrays):
    c = jax.lax.axis_index(axis) if cq > 1 else 0
    local_segments = []
    for i, (is_causal, seg_rows) in enumerate(zip(causal, rows)):
      seg = arrays[4 * i : 4 * i + 4]
      if i == 0:
        seg = _gather_seq(seg, axis, TAILS_SCOPE)
      if seg_rows is not None and cq > 1:  # the key rows this device's queries read
        kb, g = seg_rows
        count = max(n // g, 1)
        start = c * n // g
        seg = tuple(jax.lax.dynamic_slice_in_dim(x, start, count, axis=0) for x in seg)
      local_segments.append(KeySegment(*seg, causal=is_causal))
    return attention.attend(
      q_BTNH, q_pos_BT, q_valid_BT, local_segments, key_major_bwd=True, **kwargs
    )

  # check_vma=False as for the prefix; an input replicated over `context` (the inner levels'
  # K/V, or queries that do not split) gets its cotangent psummed over it by the transpose.
  flat = [x for seg in segments for x in seg[:4]]
  return jax.shard_map(
    local, mesh=layout.mesh, in_specs=tuple(in_specs), out_specs=q_spec, check_vma=False
  )(q_BTNH, q_pos_BT, q_valid_BT, *flat)
