"""The collectives of a compiled (SPMD, per-device) HLO module, counted as executed: every
all-gather / reduce-scatter / all-reduce / collective-permute / all-to-all with its result
shapes, group size and how many times it runs (the product of the known trip counts of the
while loops around it: a scanned layer's gathers run n_layers times).

  ops = hlo_collectives.collectives(compiled.as_text())
  hlo_collectives.link_bytes(op)   # bytes one device sends over its link for op, ring model

Used by experiments/plan_8gpu.py (and its test) to check a communication formula against
what the compiler emitted.
"""

from __future__ import annotations

import dataclasses
import math
import re

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "bf16": 2,
  "f16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(
  r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+(" + "|".join(KINDS) + r")(?:-start)?\("
)
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")
_CALLEE = re.compile(
  r"\b(?:body|condition|calls|to_apply|true_computation|"
  r"false_computation)=%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r"\bbody=%?([\w.\-]+)")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
# replica_groups=mesh['axis_0'=2,'axis_1'=2] {'axis_0'}: groups over the listed mesh axes
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str
  arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result
  group: int  # devices in one replica group
  count: int  # times it runs per step (loop trip counts multiplied)
  name: str = ""  # the op's metadata op_name (the JAX name stack: named scopes, transposes)

  @property
  def result_bytes(self) -> int:
    return sum(DTYPE_BYTES[d] * math.prod(s) for d, s in self.arrays)


def _group_size(line: str) -> int:
  m = _GROUPS_MESH.search(line)
  if m:
    sizes = {
      k.strip("' "): int(v)
      for k, v in (item.split("=") for item in m.group(1).split(",") if item.strip())
    }
    return math.prod(sizes[a.strip("' ")] for a in m.group(2).split(",") if a.strip())
  m = _GROUPS_IOTA.search(line)
  if m:
    return int(m.group(1).split(",")[-1])
  m = _GROUPS_LIST.search(line)
  if m:
    return len([x for x in m.group(1).split(",") if x])
  return 1  # no groups printed: one device (or a permute with source_target_pairs)


def collectives(hlo_text: str) -> list[Collective]:
  """Every collective op of the module, with its execution count from ENTRY."""
  comps: dict[str, list[str]] = {}
  entry, name = None, None
  for line in hlo_text.splitlines():
    if line and not line[0].isspace():
      m = _HEADER.match(line)
      if m:
        name = m.group(1)
        comps[name] = []
        if line.startswith("ENTRY"):
          entry = name
        continue
      if line.startswith("}"):
        name = None
        continue
    if name is not None:
      comps[name].append(line)
  if entry is None:
    raise ValueError("hlo_text: no ENTRY computation found (expected compiled.as_text())")
  counts: dict[str, int] = {}

  def visit(comp: str, times: int):
    counts[comp] = counts.get(comp, 0) + times
    for line in comps.get(comp, ()):
      trip = _TRIP.search(line)
      body = _BODY.search(line)
      callees = _CALLEE.findall(line)
      m = _BRANCHES.search(line)
      if m:
        callees += [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
      for callee in callees:
        if callee not in comps:
          continue
        mult = int(trip.group(1)) if (trip and body and callee == body.group(1)) else 1
        visit(callee, times * mult)

  visit(entry, 1)
  out = []
  for comp, times in counts.items():
    for line in comps[comp]:
      m = _OP.match(line)
      if not m:
        continue
      arrays = tuple(
        (d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(m.group(1))
      )
      name = _OP_NAME.search(line)
      out.append(
        Collective(m.group(2), arrays, _group_size(line), times, name.group(1) if name else "")
      )
  return out


def link_bytes(op: Collective) -> float:
  """Bytes one device sends per execution of `op` (ring algorithms): all-gather and
  all-to-all (n-1)/n of the result, reduce-scatter (n-1) x its (scattered) result,
  all-reduce 2 (n-1)/n of it, collective-permute all of it."""
  n, b = op.group, op.result_bytes
  if op.kind in ("all-gather", "all-to-all"):
    return b * (n - 1) / n
  if op.kind == "reduce-scatter":
    return b * (n - 1)
  if op.kind == "all-reduce":
    return 2 * b * (n - 1) / n
  return float(b)
