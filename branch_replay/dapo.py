"""DAPO's sampling-side pieces: dynamic sampling (groups whose R rewards are all equal carry
no GRPO signal: drop them and refill the batch from fresh prompts, up to a cap on rounds)
and overlong reward shaping (a soft penalty for responses that approach the length limit).
Host-side numpy, called by the trainer between sampling and the replay step.
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def informative(rewards_BR) -> np.ndarray:
  """[B] bool: the group's rewards are not all equal (its advantages are not all zero)."""
  r = np.asarray(rewards_BR)
  return r.max(axis=1) > r.min(axis=1)


def overlong_penalty(lengths_BR, max_len: int, buffer: int, penalty: float = 1.0):
  """DAPO's soft overlong punishment: 0 up to max_len - buffer, then falling linearly to
  -penalty at max_len (and -penalty beyond). buffer=0: off (all zeros)."""
  lengths = np.asarray(lengths_BR, np.float64)
  if buffer <= 0:
    return np.zeros_like(lengths)
  start = max_len - buffer
  return -penalty * np.clip((lengths - start) / buffer, 0.0, 1.0)


def dynamic_sample(
  draw: Callable[[int], tuple[dict, np.ndarray]], batch_size: int, max_rounds: int
):
  """Draw rounds until `batch_size` informative groups are kept (or `max_rounds` are spent).

  draw(round) -> (rows, rewards_BR): rows a dict of arrays with a leading prompt axis. Kept
  groups come first in round order; if fewer than batch_size were found, the batch is
  topped up with dropped groups (their centred advantages are 0: they add nothing but keep
  the compiled shape). Returns (rows, rewards_BR, stats)."""
  if max_rounds < 1:
    raise ValueError(f"algo.max_sample_rounds={max_rounds}: expected >= 1")
  kept, dropped = [], []
  rounds = 0
  n_kept = 0
  while rounds < max_rounds and n_kept < batch_size:
    rows, rewards_BR = draw(rounds)
    rounds += 1
    mask = informative(rewards_BR)
    kept.append(_take(rows, rewards_BR, mask))
    dropped.append(_take(rows, rewards_BR, ~mask))
    n_kept += int(mask.sum())
  parts = kept + dropped
  rows = {k: np.concatenate([p[0][k] for p in parts])[:batch_size] for k in parts[0][0]}
  rewards_BR = np.concatenate([p[1] for p in parts])[:batch_size]
  stats = {"dapo/rounds": rounds, "dapo/kept_frac": min(n_kept, batch_size) / batch_size}
  return rows, rewards_BR, stats


def _take(rows, rewards_BR, mask):
  return {k: np.asarray(v)[mask] for k, v in rows.items()}, np.asarray(rewards_BR)[mask]


def path_overlong(samples, turn_lengths, buffer: int, penalty: float) -> np.ndarray | float:
  """DAPO's overlong shaping of every leaf [B, leaves] by its path's length: the valid
  tokens of its ancestors' turns and its own, against the turns' total budget."""
  if not buffer:
    return 0.0
  valid = [np.asarray(v) for v in samples.valid]
  leaves = valid[-1].shape[1]
  lengths_BR = sum(np.repeat(v.sum(-1), leaves // v.shape[1], axis=1) for v in valid)
  return overlong_penalty(lengths_BR, sum(turn_lengths), buffer, penalty).astype(np.float32)
