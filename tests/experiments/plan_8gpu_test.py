"""experiments/plan_8gpu.py and experiments/hlo_collectives.py: the collective counter on a
hand-written HLO module (loop trip counts, the three replica-group spellings), the row's bad
input before compilation, and one toy row (tiny model, context:4) whose prefix K/V traffic
from the shapes equals the compiled step's, byte for byte."""

import pytest

from experiments import hlo_collectives as hc
from experiments import plan_8gpu

HLO = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %ag = f32[4,8]{1,0} all-gather(f32[1,8]{1,0} %x), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %inner = (s32[], f32[2]) while((s32[], f32[2]) %t), condition=%cond2, body=%body2, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = (s32[], f32[4,8]) tuple(%i, %ag)
}

%body2 (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  %ar = (f32[2]{0}, bf16[3,3]{1,0}) all-reduce(f32[2]{0} %a, bf16[3,3]{1,0} %b), replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %r2 = (s32[], f32[2]) tuple(%j, %a)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %w = (s32[], f32[4,8]) while((s32[], f32[4,8]) %t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %rs = f32[2,16]{1,0} reduce-scatter(f32[16,16]{1,0} %g), replica_groups=mesh['axis_0'=2,'axis_1'=8] {'axis_1'}, dimensions={0}, to_apply=%add
  ROOT %out = f32[8] copy(%a)
}
"""


def test_collectives_counted_through_loops():
  ops = {op.kind: op for op in hc.collectives(HLO)}
  assert set(ops) == {"all-gather", "all-reduce", "reduce-scatter"}
  ag, ar, rs = ops["all-gather"], ops["all-reduce"], ops["reduce-scatter"]
  assert (ag.count, ag.group, ag.result_bytes) == (3, 4, 4 * 8 * 4)
  assert (ar.count, ar.group, ar.result_bytes) == (15, 4, 2 * 4 + 9 * 2)  # 3 x 5 trips
  assert (rs.count, rs.group, rs.result_bytes) == (1, 8, 2 * 16 * 4)
  # Ring model: an all-gather sends 3/4 of its result, an all-reduce 2 x 3/4, a
  # reduce-scatter over 8 devices 7 x its (scattered) result.
  assert hc.link_bytes(ag) == 128 * 3 / 4
  assert hc.link_bytes(ar) == 2 * 26 * 3 / 4
  assert hc.link_bytes(rs) == 128 * 7
  with pytest.raises(ValueError, match="no ENTRY computation"):
    hc.collectives("HloModule m\n")


def test_bad_input_before_compilation():
  with pytest.raises(ValueError, match=r"axis sizes multiply to 4, but there are 8 devices"):
    plan_8gpu.check_row(131072, "context:4", "fsdp_context", 1)
  with pytest.raises(
    ValueError,
    match=r"prefix_len P=1004 is not divisible by the mesh's "
    r"context axis of size 8 \(mesh 'context:8'\): expected a multiple of 8",
  ):
    plan_8gpu.check_row(1004, "context:8", "fsdp_context", 1)
  with pytest.raises(
    ValueError,
    match=r"prompts B=1 is not divisible by data\*fsdp=2 \(mesh "
    r"'fsdp:2,context:4'\)",
  ):
    plan_8gpu.check_row(131072, "fsdp:2,context:4", "fsdp", 1)
  with pytest.raises(ValueError, match=r"params='zero': expected one of"):
    plan_8gpu.check_row(131072, "context:8", "zero", 1)
  assert plan_8gpu.check_row(131072, "tensor:2,context:4", "fsdp", 1)["context"] == 4


def test_toy_row_kv_traffic_matches_compiled_step():
  """The tiny model (float32, so the CPU's collectives carry the formula's dtype) on
  context:4, parameters over fsdp x context: the prefix attention's K/V all-gathers (forward
  and remat) and dK/dV reduce-scatters, counted in the compiled HLO through the layer scan,
  equal comm_formula's kv_prefix; the tails' the same (kv_tails: each tail layer gathers
  its K/V once per pass, not per tile); the row then predicts and tabulates."""
  row = plan_8gpu.worker(64, "context:4", "fsdp_context", model="tiny", B=1, R=8, T=4)
  hlo, formula = row["hlo_comm_bytes"], row["formula_comm_bytes_cpu_dtypes"]
  # 2 layers x (K, V) x (2 gathers of [1, 64, 2, 8] f32 at 3/4 + 1 scatter to [1, 16, 2, 8]
  # at 3 shards): a hand count, independent of comm_formula.
  assert formula["kv_prefix"] == 2 * 2 * (2 * 64 * 2 * 8 * 4 * 3 / 4 + 16 * 2 * 8 * 4 * 3)
  assert formula["kv_tails"] == formula["kv_prefix"]
  for cat in ("kv_prefix", "kv_tails"):
    assert hlo[cat] == formula[cat], (cat, hlo, formula)
    assert row["hlo_comm_ops"][cat] == 2 * 2 * 3, (cat, row["hlo_comm_ops"])
  assert hlo["weights"] > 0  # parameters sharded over context: gathered per layer
  assert row["param_opt_gb"] < 1e-3 and row["fits"] == {"H20": True, "H100": True, "H200": True}
  row = dict(row, kind="row", prediction=plan_8gpu.predict(row))
  table = plan_8gpu.markdown([row])
  assert "| 64 | context:4 | fsdp_context |" in table
