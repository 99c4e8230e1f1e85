"""Regression guard: the engine on flat batches (engine.loss_and_grad) still produces the float64 loss, aux
and every gradient leaf frozen at 625fa22 (tests/fixtures/make_frozen_flat.py)."""

import jax
import numpy as np
import pytest
from helpers import slow_where

from tests.fixtures import make_frozen_flat as frozen

# Relative to each leaf's scale. Equal up to float64 reassociation: on the machine that froze the
# outputs the engine reproduced them to <= 1e-15 (bitwise where the op order is unchanged); on an
# AMD EPYC with AVX-512 (2026-12-02) the same code gives up to 4.2e-15, because XLA's CPU code
# generation picks other vector widths and fused multiply-adds there. A semantic change (a mask,
# a dropped or doubled term, a wrong temperature) moves results by >= 1e-8.
TOL = 1e-14


@pytest.fixture(scope="module")
def stored():
  with np.load(frozen.PATH) as f:
    return dict(f)


def _assert_close(name, got, want):
  scale = max(float(np.max(np.abs(want))), 1e-30) if want.size else 1.0
  err = float(np.max(np.abs(got - want))) if want.size else 0.0
  assert got.shape == want.shape, name
  assert err <= TOL * scale, f"{name}: max error {err:.3e} (scale {scale:.3e})"


# half the frozen-flat guard under -m slow (16-20 s each; kept: padding/ragged, streaming PPO,
# GSPO, DPO, GAE at 0.7)
SLOW_CASES = {
  "stream_chunk2_trunk",
  "single_token_tails",
  "grpo_trunk_seq_mean",
  "pg_sum",
  "ppo_clip_kl",
}


@pytest.mark.parametrize("name", slow_where(list(frozen.CASES), SLOW_CASES))
def test_flat_engine_matches_frozen(stored, name, production_compile):
  with jax.enable_x64(True):
    cfg, params = frozen.model()
    for key, value in frozen.flatten("params/", params).items():  # the same model
      np.testing.assert_array_equal(value, stored[key])
    loss, aux, grads = frozen.run_case(params, cfg, list(frozen.CASES).index(name), name)
    got = {
      f"{name}/loss": np.asarray(loss),
      **frozen.flatten(f"{name}/aux", aux),
      **frozen.flatten(f"{name}/grads", grads),
    }
    want = {k: v for k, v in stored.items() if k.startswith(name + "/")}
    assert sorted(got) == sorted(want)
    for key in want:
      _assert_close(key, np.asarray(got[key], want[key].dtype), want[key])
    # the case can fail: its gradient is not trivially zero
    assert max(float(np.max(np.abs(v))) for k, v in want.items() if "/grads" in k) > 1e-6
