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
transfer with compute. Load balancing (zig-zag slices) is not built: a device's slice is
contiguous, so the causal work grows with its index.

Without a mesh, or when `seq` maps to one device, or for the tails (queries with context
segments), attention runs as before: `attention.attend` with the own keys gathered by a
logical sharding constraint (GSPMD), the path `model.context_parallel='gspmd'` also forces.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from models import attention
from models.segments import KeySegment

Array = jax.Array
SCHEMES = ("all_gather", "gspmd")  # model.context_parallel


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
    raise ValueError(f"prefix length P={P} is not divisible by the context-parallel mesh "
                     f"axes {tuple(axes)} of size {C}: expected a multiple of {C} (left-pad "
                     f"the prefixes)")
  return C


def attend(q_BTNH, q_pos_BT, q_valid_BT, segments: Sequence[KeySegment], *,
           scheme: str = "all_gather", **kwargs) -> Array:
  """`attention.attend` (same arguments, kwargs passed through), context-parallel for the
  prefix: one causal segment (no context) while `seq` is split over the mesh."""
  if scheme not in SCHEMES:
    raise ValueError(f"model.context_parallel={scheme!r}: expected one of {SCHEMES}")
  axes = seq_axes()
  if (scheme == "all_gather" and axes is not None and len(segments) == 1
      and segments[0].causal):
    return _all_gather_attend(q_BTNH, q_pos_BT, q_valid_BT, segments[0], axes, **kwargs)
  segments = [seg._replace(k_BSKH=_gathered(seg.k_BSKH), v_BSKH=_gathered(seg.v_BSKH))
              if seg.causal else seg for seg in segments]
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
    gather = lambda x: jax.lax.all_gather(x, axis, axis=1, tiled=True)
    k_BPKH, v_BPKH, pos_BP, valid_BP = map(gather, (k_BTKH, v_BTKH, k_pos_BT, k_valid_BT))
    start = jax.lax.axis_index(axis) * Tl
    earlier_BP = valid_BP & (jnp.arange(C * Tl) < start)[None]
    segments = [KeySegment(k_BPKH, v_BPKH, pos_BP, earlier_BP),
                KeySegment(k_BTKH, v_BTKH, k_pos_BT, k_valid_BT, causal=True)]
    return attention.attend(q_BTNH, q_pos_BT, q_valid_BT, segments, **kwargs)

  # check_vma=False: the kernel's loop carries are not typed per device. Sound here because
  # every input is split over every mesh axis (asserted): no replicated input whose
  # cotangent would need a psum.
  mesh = jax.sharding.get_abstract_mesh()
  used = {a for entry in (*q_spec, *kv_spec) if entry is not None
          for a in (entry if isinstance(entry, tuple) else (entry,))}
  assert used >= {a for a in mesh.axis_names if mesh.shape[a] > 1}, (q_spec, kv_spec, mesh)
  in_specs = (q_spec, bt_spec, bt_spec) + (kv_spec,) * 2 + (bt_spec,) * 2
  return jax.shard_map(local, in_specs=in_specs, out_specs=q_spec, check_vma=False)(
      q_BTNH, q_pos_BT, q_valid_BT, *own[:4])
