"""FLOPs of one forward+backward, counted from a ModelConfig and the token layout (arithmetic:
no model is built or run). Every benchmark and the cost model count with this module.

A layout is a tuple of `Segment`s: `n` sequences of `tokens` positions each, every position
attending to `context` earlier keys (a shared prefix, a tree node's ancestors) and causally
to its own segment, `scored` of them scored by the LM head. One forward is, per segment,

  n * (tokens * position_macs + pairs * pair_macs + scored * head_macs)

multiply-accumulates (MACs); a forward+backward is 3 forwards (backward = 2x forward) at
2 FLOPs per MAC; remat's recomputation is not counted. `pairs` are the query x key pairs:

  causal (dense=False)  each allowed pair once: tokens * context + tokens * (tokens + 1) / 2,
                        the work any exact method needs (the "useful" FLOPs);
  dense  (dense=True)   every score of the [tokens, context + tokens] block, as dense masked
                        attention computes it.

Layouts: `flat(B, R, P, T, mode)` (naive | replay), `tree(B, P, fanouts, lengths, mode)`
(naive | flat | tree) and `levels(B, root_len, nodes_and_lengths)` (a tree given by its
level sizes). `useful_flop_ratio` is naive's FLOPs over another layout's: the speedup a
method could reach if time followed FLOPs (`tree_flop_ratios`: flat's and tree's at once).
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Segment:
  name: str
  n: int  # sequences
  tokens: int  # positions of each
  context: int = 0  # earlier keys each position attends to (all of them)
  scored: int = 0  # positions of each scored by the head

  def __post_init__(self):
    for name in ("n", "tokens", "context", "scored"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"Segment {self.name!r}: {name}={v!r}, expected an int >= 0")
    if self.scored > self.tokens:
      raise ValueError(
        f"Segment {self.name!r}: scored={self.scored} > tokens={self.tokens}, "
        "expected scored <= tokens"
      )

  def pairs(self, dense: bool = False) -> int:
    """Query x key pairs of one sequence: causal (each allowed pair once) or dense."""
    T, C = self.tokens, self.context
    return T * (C + T) if dense else T * C + T * (T + 1) // 2


# ----------------------------------------------------------------------------- per position


def layer_macs(cfg, kind: str = "full_attention") -> int:
  """MACs of one layer for one position: projections and MLP of an attention layer (the
  query x key work is per pair: `pair_macs`), or a Gated DeltaNet layer's projections,
  short convolution, recurrence and MLP (linear attention: per position, not per pair)."""
  D, N, K, H, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden
  if kind == "full_attention":
    gate = N * H * D if cfg.attn_output_gate else 0  # a gated attention output (Qwen3.5)
    return D * (N + 2 * K) * H + N * H * D + gate + 3 * D * F
  if kind == "linear_attention":
    Kl, Nl = cfg.linear_key_heads, cfg.linear_value_heads
    Hl, J, Wc = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
    C = 2 * Kl * Hl + Nl * J
    return D * C + D * Nl * J + 2 * D * Nl + Nl * J * D + C * Wc + 3 * Nl * Hl * J + 3 * D * F
  raise ValueError(f"kind={kind!r}: expected 'full_attention' or 'linear_attention'")


def _kinds(cfg) -> list:
  return [cfg.layer_type(i) for i in range(cfg.n_layers)]


def position_macs(cfg) -> int:
  """MACs of every layer for one position (the per-pair attention excluded)."""
  kinds = _kinds(cfg)
  return sum(kinds.count(k) * layer_macs(cfg, k) for k in ("full_attention", "linear_attention"))


def pair_macs(cfg) -> int:
  """MACs of one query x key pair over the full-attention layers: QK^T and PV."""
  return _kinds(cfg).count("full_attention") * 2 * cfg.n_heads * cfg.head_dim


def head_macs(cfg, value_head: bool = False) -> int:
  """MACs of the head at one scored position: D -> V logits, or a critic's D -> 1."""
  return cfg.d_model * (1 if value_head else cfg.vocab_size)


# ----------------------------------------------------------------------------- a step


def forward_macs(cfg, segments, dense: bool = False, value_head: bool = False) -> int:
  pos, pair, head = position_macs(cfg), pair_macs(cfg), head_macs(cfg, value_head)
  return sum(s.n * (s.tokens * pos + s.pairs(dense) * pair + s.scored * head) for s in segments)


def step_flops(cfg, segments, dense: bool = False, value_head: bool = False) -> int:
  """FLOPs of one forward+backward over `segments` (3 forwards, 2 FLOPs per MAC)."""
  return 3 * 2 * forward_macs(cfg, segments, dense, value_head)


def useful_flop_ratio(cfg, naive, fast, dense: bool = False, value_head: bool = False) -> float:
  """step_flops of layout `naive` over layout `fast`."""
  return step_flops(cfg, naive, dense, value_head) / step_flops(cfg, fast, dense, value_head)


# ----------------------------------------------------------------------------- layouts


def flat(B: int, R: int, P: int, T: int, mode: str) -> tuple:
  """B prompts of P tokens, R branches of T tokens each. naive: B*R sequences of P + T
  (T scored); replay: the prefix once per prompt, then the B*R tails against it."""
  if mode == "naive":
    return (Segment("full", B * R, P + T, 0, T),)
  if mode == "replay":
    return (Segment("prefix", B, P), Segment("tails", B * R, T, P, T))
  raise ValueError(f"mode={mode!r}: expected 'naive' or 'replay'")


def levels(B: int, root_len: int, nodes_and_lengths) -> tuple:
  """A tree: a root of root_len tokens per prompt, then levels of (nodes per prompt, tokens
  per node), each node scored and attending to its ancestors (the root and one node of every
  level above)."""
  out, context = [Segment("root", B, root_len)], root_len
  for d, (nodes, T) in enumerate(nodes_and_lengths, start=1):
    out.append(Segment(f"level{d}", B * nodes, T, context, T))
    context += T
  return tuple(out)


def tree(B: int, P: int, fanouts, lengths, mode: str) -> tuple:
  """A tree of prompt P, fan-out fanouts[d] and lengths[d] tokens per node at level d+1.
  naive: every root-to-leaf path as its own sequence; flat: the prompt once, each leaf's
  whole response (its ancestors' tokens re-run) as one tail; tree: every node once."""
  if len(fanouts) != len(lengths):
    raise ValueError(
      f"fanouts={tuple(fanouts)} and lengths={tuple(lengths)}: expected one length per level"
    )
  leaves, response = math.prod(fanouts), sum(lengths)
  if mode == "naive":
    return (Segment("paths", B * leaves, P + response, 0, response),)
  if mode == "flat":
    return (Segment("prefix", B, P), Segment("tails", B * leaves, response, P, response))
  if mode == "tree":
    return levels(B, P, [(math.prod(fanouts[:d]), T) for d, T in enumerate(lengths, start=1)])
  raise ValueError(f"mode={mode!r}: expected 'naive', 'flat' or 'tree'")


def tree_flop_ratios(cfg, B: int, P: int, fanouts, lengths, dense: bool = True) -> dict:
  """{"flat": naive over flat replay, "tree": naive over tree replay} of tree(...) layouts
  (bench_tree.py's flat_flop_ratio and tree_flop_ratio; dense: as executed)."""
  naive = tree(B, P, fanouts, lengths, "naive")
  return {
    m: useful_flop_ratio(cfg, naive, tree(B, P, fanouts, lengths, m), dense)
    for m in ("flat", "tree")
  }
