"""experiments/flops.py: a tiny model's FLOPs counted by hand, and every FLOP ratio the
committed results files record recomputed from their rows (arithmetic: no model runs)."""

import json
import os

import pytest

from experiments import flops, registry
from models import transformer as tfm

RESULTS = os.path.join(
  os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
  "experiments",
  "results",
)
# D=4, N=2 query heads, K=1 kv head, H=2, F=3, V=5, L=1.
TINY = tfm.ModelConfig(
  vocab_size=5, d_model=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, mlp_hidden=3
)


def rows(name):
  with open(os.path.join(RESULTS, name)) as f:
    return [json.loads(line) for line in f if line.strip()]


def test_a_tiny_model_counted_by_hand():
  # MACs per position: q 4*2*2 = 16, k 4*1*2 = 8, v 8, o 2*2*4 = 16, MLP 3*4*3 = 36.
  assert flops.position_macs(TINY) == flops.layer_macs(TINY) == 84
  # per query x key pair: QK^T 2*2 + PV 2*2; per scored position: 4 x 5 logits
  assert flops.pair_macs(TINY) == 8 and flops.head_macs(TINY) == 20
  assert flops.head_macs(TINY, value_head=True) == 4
  # B=1, R=2, P=3, T=2. replay: the prefix (3 positions, causal pairs 3+2+1 = 6) and two
  # tails (2 positions, pairs 2*3 + 1+2 = 9, 2 scored): 300 + 2 * 280 MACs.
  replay = flops.flat(1, 2, 3, 2, "replay")
  assert flops.forward_macs(TINY, replay) == (3 * 84 + 6 * 8) + 2 * (2 * 84 + 9 * 8 + 2 * 20)
  assert flops.step_flops(TINY, replay) == 6 * 860 == 5160  # fwd + 2x bwd, 2 FLOPs per MAC
  # naive: two sequences of 5 (pairs 15, 2 scored): 2 * (420 + 120 + 40) = 1160 MACs
  naive = flops.flat(1, 2, 3, 2, "naive")
  assert flops.step_flops(TINY, naive) == 6 * 1160 == 6960
  assert flops.useful_flop_ratio(TINY, naive, replay) == 6960 / 5160
  # dense (every score of the block): prefix 3*3 = 9 pairs, a tail 2*(3+2) = 10
  assert flops.forward_macs(TINY, replay, dense=True) == (252 + 72) + 2 * (168 + 80 + 40) == 900
  # a critic's head: D -> 1 at the 4 scored positions instead of D -> 5
  assert flops.forward_macs(TINY, replay, value_head=True) == 860 - 4 * 16


def test_a_tiny_tree_counted_by_hand():
  # P=3, fan-outs 2x2, lengths 2 then 1: 2 openings of 2 tokens, 4 leaves of 1 token.
  tree = flops.tree(1, 3, (2, 2), (2, 1), "tree")
  assert [(s.n, s.tokens, s.context, s.scored) for s in tree] == [
    (1, 3, 0, 0),
    (2, 2, 3, 2),
    (4, 1, 5, 1),
  ]
  # root 300; openings 2 * (168 + 9*8 + 40) = 560; leaves: pairs 1*5 + 1 = 6,
  # 4 * (84 + 48 + 20) = 608
  assert flops.forward_macs(TINY, tree) == 300 + 560 + 608 == 1468
  # flat: the prompt once, each leaf's 3-token response against it (pairs 3*3 + 6 = 15)
  flat = flops.tree(1, 3, (2, 2), (2, 1), "flat")
  assert flops.forward_macs(TINY, flat) == 300 + 4 * (3 * 84 + 15 * 8 + 3 * 20) == 2028
  # naive: 4 paths of 6 tokens (pairs 21), 3 scored
  naive = flops.tree(1, 3, (2, 2), (2, 1), "naive")
  assert flops.forward_macs(TINY, naive) == 4 * (6 * 84 + 21 * 8 + 3 * 20) == 2928
  # dense: the root's 9 pairs, an opening's 2*(3+2) = 10, a leaf's 1*(5+1) = 6
  assert flops.forward_macs(TINY, tree, dense=True) == 324 + 2 * 288 + 608 == 1508
  ratios = flops.tree_flop_ratios(TINY, 1, 3, (2, 2), (2, 1), dense=False)
  assert ratios == {"flat": 2928 / 2028, "tree": 2928 / 1468}
  # levels(): the same tree from its level sizes (nodes per prompt, tokens per node)
  assert flops.levels(1, 3, [(2, 2), (4, 1)]) == tree


def test_hybrid_layers_cost_per_position_and_attention_only_in_full_layers():
  cfg = tfm.preset("hybrid_tiny")
  kinds = [cfg.layer_type(i) for i in range(cfg.n_layers)]
  assert kinds.count("linear_attention") > 0 and kinds.count("full_attention") > 0
  assert flops.position_macs(cfg) == sum(flops.layer_macs(cfg, k) for k in kinds)
  assert flops.pair_macs(cfg) == kinds.count("full_attention") * 2 * cfg.n_heads * cfg.head_dim
  gate = cfg.n_heads * cfg.head_dim * cfg.d_model  # the gated attention output
  plain = tfm.ModelConfig(**{**cfg.__dict__, "attn_output_gate": False, "layer_types": None})
  assert flops.layer_macs(cfg) == flops.layer_macs(plain) + gate


def test_bad_layouts_are_refused_by_name():
  with pytest.raises(ValueError, match=r"Segment 'x': tokens=-1, expected an int >= 0"):
    flops.Segment("x", 1, -1)
  with pytest.raises(ValueError, match=r"scored=3 > tokens=2"):
    flops.Segment("x", 1, 2, 0, 3)
  with pytest.raises(ValueError, match=r"mode='tree': expected 'naive' or 'replay'"):
    flops.flat(1, 2, 3, 4, "tree")
  with pytest.raises(ValueError, match=r"expected one length per level"):
    flops.tree(1, 3, (2, 2), (2,), "tree")
  with pytest.raises(ValueError, match=r"kind='mamba'"):
    flops.layer_macs(TINY, "mamba")


TREE_FILES = (
  "tree_cpu_2026-12-05.jsonl",
  "superseded/tree_cpu_2026-12-03.jsonl",
  "superseded/tree_cpu_2026-12-02.jsonl",
  "superseded/tree_cpu_2026-12-01.jsonl",
  "superseded/tree_cpu_2026-11-30.jsonl",
)


@pytest.mark.parametrize("name", TREE_FILES)
def test_bench_tree_ratios_of_its_results_files(name):
  """Every row's flat_flop_ratio / tree_flop_ratio recomputed by flops.tree_flop_ratios from
  the row's own shape (dense counts: the ratios bench_tree records), not copied from the
  file; and the default shape's known values (4.775 / 7.847) from flops alone."""
  checked = 0
  for row in rows(name):
    fanouts, lengths = (tuple(map(int, row[k].split("x"))) for k in ("fanouts", "lengths"))
    got = flops.tree_flop_ratios(
      tfm.preset(row["preset"]), row["prompts"], row["prefix_len"], fanouts, lengths
    )
    assert (round(got["flat"], 3), round(got["tree"], 3)) == (
      row["flat_flop_ratio"],
      row["tree_flop_ratio"],
    ), (name, row["prefix_len"], row["fanouts"], row["lengths"])
    checked += 1
  assert checked > 0


def test_bench_tree_default_shape_ratios():
  got = flops.tree_flop_ratios(tfm.preset("small"), 1, 2048, (4, 4), (256, 128))
  assert (round(got["flat"], 3), round(got["tree"], 3)) == (4.775, 7.847)


# bench_replay's (and bench_hybrid's, q5's) rows: useful (causal) FLOPs since the blockwise
# engine; the dense engine's files counted dense (every score computed).
REPLAY_FILES = {
  "cpu_sweep_blockwise_2026-11-30.jsonl": False,
  "cpu_long_context_2026-11-30.jsonl": False,
  "cpu_long_context_2026-12-05.jsonl": False,
  "replay_naive_cpu_P8192_2026-12-02.jsonl": False,
  "hybrid_cpu_2026-12-01.jsonl": False,
  "hybrid_remat_cpu_2026-12-01.jsonl": False,
  "hybrid_speed_cpu_2026-12-01.jsonl": False,
  "q5_cpu_2026-12-05.jsonl": False,
  "q5_cpu_rerun_2026-12-05.jsonl": False,
  "superseded/q5_cpu_2026-11-30.jsonl": False,
  "q5_haystack_cpu_2026-11-30.jsonl": False,
  "gpu_h200_2026-11-30.jsonl": True,
  "superseded/cpu_sweep_2026-11-30.jsonl": True,
}


@pytest.mark.parametrize("name", sorted(REPLAY_FILES))
def test_bench_replay_flop_ratio_of_every_row(name):
  checked = 0
  for row in rows(name):
    if "flop_ratio" not in row:
      continue
    cfg = (
      registry.get_config(row["model_from"]).model
      if row.get("model_from")
      else tfm.preset(row["preset"])
    )
    B, R, P, T = row.get("prompts", 1), row["branches"], row["prefix_len"], row["tail_len"]
    got = flops.useful_flop_ratio(
      cfg,
      flops.flat(B, R, P, T, "naive"),
      flops.flat(B, R, P, T, "replay"),
      dense=REPLAY_FILES[name],
      value_head=row.get("loss") == "value",
    )
    assert round(got, 3) == row["flop_ratio"], (name, P, T, R)
    checked += 1
  assert checked > 0


def test_rollout_strategies_flop_ratio_of_every_row():
  """Flat replay over the automatic tree (as executed): the shared opening (trunk_len tokens)
  joins the root, the R branches' remaining tokens are one level."""
  for name in (
    "rollout_strategies_cpu_2026-12-01.jsonl",
    "rollout_strategies_target_cpu_2026-12-01.jsonl",
  ):
    for row in rows(name):
      B, R, P, T, W = row["B"], row["R"], row["P"], row["T"], row["trunk_len"]
      assert row["fanouts"] == str(R)
      got = flops.useful_flop_ratio(
        tfm.preset(row["preset"]),
        flops.flat(B, R, P, T, "replay"),
        flops.levels(B, P + W, [(R, T - W)]),
        dense=True,
      )
      assert round(got, 3) == row["flop_ratio"], (name, row["strategy"])
