"""The real-model recipe's pieces (experiments/configs/math_smollm2.py), all without the
model: the shared-header sampler equals the plain one, the Wilson interval equals a hand
computation and scipy's, the greedy evaluation's chunks and header read as one call, and the
config and its prompt files build (held-out prompts disjoint from training)."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.train import metrics
from branch_replay.core import sampler
from models import transformer as tfm

CFG = tfm.preset("tiny")


def _split_prompts(B=3, H=6, seed=0):
  """B prompts = one header of H ids + a left-padded rest of 2..4 ids each."""
  rng = np.random.default_rng(seed)
  header = rng.integers(3, CFG.vocab_size, size=H).astype(np.int32)
  rests = [list(rng.integers(3, CFG.vocab_size, size=n)) for n in (4, 2, 3)[:B]]
  L = max(map(len, rests))
  full = np.zeros((B, H + L), np.int32)
  full_valid = np.zeros((B, H + L), bool)
  rest = np.zeros((B, L), np.int32)
  rest_valid = np.zeros((B, L), bool)
  for b, r in enumerate(rests):
    ids = list(header) + r
    full[b, H + L - len(ids) :], full_valid[b, H + L - len(ids) :] = ids, True
    rest[b, L - len(r) :], rest_valid[b, L - len(r) :] = r, True
  return header, full, full_valid, rest, rest_valid


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("shape", ["flat", "tree"])
def test_shared_header_sampling_equals_full_prompts(temperature, shape):
  params = tfm.init_params(CFG, jax.random.key(1))
  header, full, full_valid, rest, rest_valid = _split_prompts()
  cfg = sampler.SamplerConfig(max_new_tokens=5, temperature=temperature)
  if shape == "flat":
    fn = functools.partial(sampler.sample, model_cfg=CFG, cfg=cfg, n_branches=2)
  else:  # two turns: 2 children of each prompt, 2 of each child
    fn = functools.partial(
      sampler.sample_tree, model_cfg=CFG, cfg=cfg, fanouts=(2, 2), lengths=(3, 4)
    )
  fn = jax.jit(fn)
  want = fn(params, prompt_BP=full, prompt_valid_BP=full_valid, key=jax.random.key(3))
  got = fn(
    params,
    prompt_BP=rest,
    prompt_valid_BP=rest_valid,
    key=jax.random.key(3),
    header_H=jnp.asarray(header),
  )
  if shape == "flat":
    pairs = [
      (got.tokens_BRT, want.tokens_BRT, got.valid_BRT, want.valid_BRT, got.logp_BRT, want.logp_BRT)
    ]
  else:  # every level
    pairs = zip(got.tokens, want.tokens, got.valid, want.valid, got.logp, want.logp)
  for tokens, tokens_want, valid, valid_want, logp, logp_want in pairs:
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(tokens_want))
    np.testing.assert_array_equal(np.asarray(valid), np.asarray(valid_want))
    np.testing.assert_allclose(np.asarray(logp), np.asarray(logp_want), rtol=1e-5, atol=1e-5)


def test_shared_header_refuses_a_trunk():
  params = tfm.init_params(CFG, jax.random.key(1))
  header, _, _, rest, rest_valid = _split_prompts()
  with pytest.raises(ValueError, match="trunk_len=0"):
    sampler.sample(
      params,
      CFG,
      sampler.SamplerConfig(trunk_len=2),
      rest,
      rest_valid,
      jax.random.key(0),
      2,
      header_H=jnp.asarray(header),
    )


def test_shared_header_split():
  header, rests = sampler.shared_header([[1, 5, 6, 7], [1, 5, 6, 9, 9], [1, 5, 6, 7, 2]])
  assert header.tolist() == [1, 5, 6] and rests == [[7], [9, 9], [7, 2]]
  header, rests = sampler.shared_header([[1, 2], [1, 2]])  # each keeps one id of its own
  assert header.tolist() == [1] and rests == [[2], [2]]
  assert sampler.shared_header([[4, 2], [1, 2]])[0].size == 0


def test_wilson_interval_by_hand_and_scipy():
  k, n, z = 41, 200, 1.959963984540054
  p = k / n
  center = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
  low, high = metrics.wilson_interval(k, n)
  assert low == pytest.approx(center - half, abs=1e-12)
  assert high == pytest.approx(center + half, abs=1e-12)
  assert (low, high) == pytest.approx((0.1548617620383621, 0.2662569805242252), abs=1e-12)
  scipy_stats = pytest.importorskip("scipy.stats")
  for k, n in ((0, 10), (10, 10), (3, 7), (117, 200)):
    ci = scipy_stats.binomtest(k, n).proportion_ci(method="wilson")
    assert metrics.wilson_interval(k, n) == pytest.approx((ci.low, ci.high), abs=1e-12)
  with pytest.raises(ValueError, match="k=5, n=4"):
    metrics.wilson_interval(5, 4)


def test_eval_record():
  rec = metrics.eval_record([1, 0, 0, 1])
  assert rec["eval/greedy_reward"] == 0.5 and rec["eval/n"] == 4 and rec["eval/correct"] == 2
  assert rec["eval/ci95_low"] == pytest.approx(metrics.wilson_interval(2, 4)[0])
  assert "eval/ci95_low" not in metrics.eval_record([0.5, 1.0])  # not a proportion


def test_recipe_config_and_prompt_files(tmp_path):
  from experiments import registry
  from experiments.configs import math_smollm2 as recipe

  assert "math_smollm2" in registry.CONFIGS
  cfg = recipe.get_config()
  assert cfg.lora.rank == 16 and cfg.loss.kl_coef > 0 and cfg.train.n_branches >= 8
  assert cfg.task.reward == "final_number" and cfg.train.eval_size >= 200
  assert cfg.train.eval_shared_prefix and 0 < cfg.sampler.temperature <= 1.0
  train, held = recipe.build_prompts(out_dir=str(tmp_path))
  read = lambda p: [json.loads(line) for line in open(p)]
  train, held = read(train), read(held)
  assert (len(train), len(held)) == (recipe.N_TRAIN, recipe.N_EVAL)
  assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
  header = train[0]["prompt"].rsplit(recipe.SEP, 1)[0]
  assert header.count("####") == recipe.SHOTS
  assert all(r["prompt"].startswith(header + recipe.SEP) for r in train + held)
  assert all(r["answer"].split("####")[1].strip().isdigit() for r in held)
  with pytest.raises(ValueError, match="expected >= shots"):
    recipe.build_prompts(n_train=5000, out_dir=str(tmp_path))
