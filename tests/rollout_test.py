"""rollout.py: DAPO's dynamic sampling and overlong shaping, and the temperature-consistent
ratio of a sampled batch (1 on the first update at the sampler's temperature)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses, sampler
from branch_replay import rollout
from models import transformer as tfm


def test_dynamic_sampling_drops_and_refills():
  draws = [np.asarray([[1, 1], [0, 1], [0, 0]], float), np.asarray([[1, 0], [1, 1], [0, 1]], float)]

  def draw(i):
    return {"id": np.arange(3) + 10 * i}, draws[i]

  rows, rewards, stats = rollout.dynamic_sample(draw, 3, max_rounds=2)
  np.testing.assert_array_equal(rows["id"], [1, 10, 12])  # informative groups, in order
  assert stats == {"dapo/rounds": 2, "dapo/kept_frac": 1.0}
  rows, rewards, stats = rollout.dynamic_sample(draw, 3, max_rounds=1)  # the cap: top up
  np.testing.assert_array_equal(rows["id"], [1, 0, 2])
  assert stats["dapo/kept_frac"] == pytest.approx(1 / 3)
  np.testing.assert_array_equal(rollout.informative(rewards), [True, False, False])


def test_overlong_penalty():
  got = rollout.overlong_penalty(np.asarray([[2, 6, 7, 8, 9]]), max_len=8, buffer=4, penalty=0.5)
  np.testing.assert_allclose(got, [[0.0, -0.25, -0.375, -0.5, -0.5]])
  assert not rollout.overlong_penalty(np.asarray([[8]]), 8, 0).any()


def test_flat_overlong_counts_the_whole_trunk_and_the_branch():
  """A flat group's path: every trunk token (decoded whole) plus the branch's valid tokens,
  against trunk_len + max_new_tokens (a hand loop), through the one shaper trees use."""
  rng = np.random.default_rng(0)
  B, R, W, T = 2, 3, 2, 5
  valid_BRT = np.arange(T)[None, None] < rng.integers(0, T + 1, (B, R, 1))
  samples = sampler.Samples(
    np.zeros((B, R, T), np.int32),
    valid_BRT,
    np.zeros((B, R, T)),
    np.zeros((B, W), np.int32),
    np.zeros((B, W)),
  )
  lengths, budget = rollout.path_lengths(samples)
  assert budget == W + T
  got = rollout.overlong(samples, buffer=4, penalty=0.5)
  for b in range(B):
    for r in range(R):
      assert lengths[b, r] == W + valid_BRT[b, r].sum()
      assert got[b, r] == pytest.approx(
        rollout.overlong_penalty(W + valid_BRT[b, r].sum(), 7, 4, 0.5)
      )
  assert got.min() < 0 and rollout.overlong(samples, buffer=0, penalty=0.5) == 0.0


def test_temperature_first_epoch_ratio_is_one():
  """Sampled at temperature 0.7, trained at the sampler's temperature: the first update's
  ratio is 1 to float rounding (and far from it if trained at temperature 1)."""
  cfg = tfm.preset("tiny")
  params = tfm.init_params(cfg, jax.random.key(3))
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
  valid = jnp.ones((2, 7), bool)
  scfg = sampler.SamplerConfig(max_new_tokens=5, temperature=0.7, trunk_len=2)
  s = jax.jit(functools.partial(sampler.sample, model_cfg=cfg, cfg=scfg, n_branches=4))(
    params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(4)
  )
  batch = sampler.to_batch(prompt, valid, s, jnp.ones((2, 4)))
  for temperature, close in ((0.7, True), (1.0, False)):
    lc = losses.LossConfig(name="ppo", temperature=temperature)
    _, aux, _ = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, lc))(params, batch)
    ratio_max = float(aux["ratio_max"].max())
    approx_kl = float(aux["approx_kl_sum"].sum())
    if close:
      assert abs(ratio_max - 1) < 1e-5 and approx_kl < 1e-9 and int(aux["clip_sum"].sum()) == 0
    else:
      assert abs(ratio_max - 1) > 1e-2
