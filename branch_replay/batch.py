"""The replay batch: B prompts (shared prefixes) x R branches (divergent tails), validated.

A prefix is the prompt plus an optional shared response *trunk*: its last `trunk_len` (W)
tokens are response tokens every branch scores with its own weight. Prefixes are
left-padded (position P-1 is always real); tails are right-padded (ragged lengths).
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import numpy as np


@flax.struct.dataclass
class ReplayBatch:
  prefix_BP: jax.Array  # int32 prompt (+ trunk) tokens, left-padded
  prefix_valid_BP: jax.Array  # bool
  tails_BRT: jax.Array  # int32 branch tokens, right-padded
  tail_valid_BRT: jax.Array  # bool
  advantages_BR: jax.Array  # float, one per branch
  # Sampling-policy log-probs (PPO/GRPO ratio); None means on-policy (ratio 1).
  old_logp_BRT: Optional[jax.Array] = None
  trunk_old_logp_BW: Optional[jax.Array] = None
  # Frozen reference-policy log-probs (KL penalty, DPO); None when unused.
  ref_logp_BRT: Optional[jax.Array] = None
  trunk_ref_logp_BW: Optional[jax.Array] = None
  # Per-token advantages (PPO's GAE); when given they replace advantages_BR token by token.
  # A trunk token's advantage differs per branch (its future is the branch's).
  advantages_BRT: Optional[jax.Array] = None
  trunk_advantages_BRW: Optional[jax.Array] = None
  trunk_len: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def shape(self):
    B, R, T = self.tails_BRT.shape
    return dict(B=B, R=R, P=self.prefix_BP.shape[1], T=T, W=self.trunk_len)

  def token_counts(self):
    """(prefix positions, tail positions, naive-equivalent positions), padding included."""
    s = self.shape
    prefix = s["B"] * s["P"]
    tails = s["B"] * s["R"] * s["T"]
    return prefix, tails, s["B"] * s["R"] * (s["P"] + s["T"])


def _fail(field, arr, expected):
  shape = getattr(arr, "shape", None)
  raise ValueError(f"batch.{field}: shape {shape}: expected {expected}")


def validate(batch: ReplayBatch, vocab_size: int, branch_chunk: int | None = None) -> None:
  """Raise ValueError naming the field, its shape and what was expected. Runs on the host,
  before any compilation; call it on concrete arrays (not inside jit)."""
  prefix = np.asarray(batch.prefix_BP)
  if prefix.ndim != 2:
    _fail("prefix_BP", prefix, "rank 2 [B, P]")
  B, P = prefix.shape
  if P == 0:
    _fail("prefix_BP", prefix, "P >= 1 prefix tokens (P=0: there is no shared prefix)")
  if B == 0:
    _fail("prefix_BP", prefix, "B >= 1 prompts")
  tails = np.asarray(batch.tails_BRT)
  if tails.ndim != 3 or tails.shape[0] != B:
    _fail("tails_BRT", tails, f"[B={B}, R, T]")
  _, R, T = tails.shape
  if R == 0:
    _fail("tails_BRT", tails, "R >= 1 branches")
  if T == 0:
    _fail("tails_BRT", tails, "T >= 1 tail tokens (empty tails)")
  for name, arr, shape in (("prefix_valid_BP", batch.prefix_valid_BP, (B, P)),
                           ("tail_valid_BRT", batch.tail_valid_BRT, (B, R, T)),
                           ("advantages_BR", batch.advantages_BR, (B, R))):
    if np.shape(arr) != shape:
      _fail(name, arr, f"shape {shape}")
  W = batch.trunk_len
  for name, arr, shape in (("old_logp_BRT", batch.old_logp_BRT, (B, R, T)),
                           ("ref_logp_BRT", batch.ref_logp_BRT, (B, R, T)),
                           ("trunk_old_logp_BW", batch.trunk_old_logp_BW, (B, W)),
                           ("trunk_ref_logp_BW", batch.trunk_ref_logp_BW, (B, W)),
                           ("advantages_BRT", batch.advantages_BRT, (B, R, T)),
                           ("trunk_advantages_BRW", batch.trunk_advantages_BRW, (B, R, W))):
    if arr is not None:
      if np.shape(arr) != shape:
        _fail(name, arr, f"shape {shape}")
      if not np.all(np.isfinite(np.asarray(arr))):
        _fail(name, arr, "finite values (found NaN or inf)")
  for tail_name, trunk_name in (("old_logp_BRT", "trunk_old_logp_BW"),
                                ("ref_logp_BRT", "trunk_ref_logp_BW"),
                                ("advantages_BRT", "trunk_advantages_BRW")):
    if W and (getattr(batch, tail_name) is None) != (getattr(batch, trunk_name) is None):
      raise ValueError(f"batch.{trunk_name}: give it exactly when {tail_name} is given "
                       f"(trunk_len={W})")
  for name, arr in (("prefix_BP", prefix), ("tails_BRT", tails)):
    if not np.issubdtype(arr.dtype, np.integer):
      _fail(name, arr, f"integer token ids, got dtype {arr.dtype}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
      _fail(name, arr, f"token ids in [0, {vocab_size}) (found {arr.min()}..{arr.max()})")
  pv = np.asarray(batch.prefix_valid_BP, bool)
  if not pv[:, -1].all():
    _fail("prefix_valid_BP", pv, "left padding: the last prefix position must be valid")
  if np.any(pv[:, 1:] < pv[:, :-1]):
    _fail("prefix_valid_BP", pv, "left padding: once valid, every later position is valid")
  if W < 0 or W >= P:
    raise ValueError(f"batch.trunk_len={W}: expected 0 <= trunk_len < P={P}")
  if W and (pv.sum(1) <= W).any():
    _fail("prefix_valid_BP", pv, f"every prompt longer than trunk_len={W} (a prompt token "
          "must precede the trunk)")
  tv = np.asarray(batch.tail_valid_BRT, bool)
  if np.any(tv[..., 1:] > tv[..., :-1]):
    _fail("tail_valid_BRT", tv, "right padding: once invalid, every later position invalid")
  if W == 0 and not tv[..., 0].all():
    _fail("tail_valid_BRT", tv, "every branch to hold >= 1 token (found an empty tail)")
  adv = np.asarray(batch.advantages_BR)
  if not np.all(np.isfinite(adv)):
    _fail("advantages_BR", adv, "finite values (found NaN or inf)")
  if branch_chunk is not None and (branch_chunk < 1 or R % branch_chunk):
    raise ValueError(f"replay.branch_chunk={branch_chunk}: expected a divisor of "
                     f"R={R} (tails_BRT shape {tails.shape})")
