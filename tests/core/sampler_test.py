"""Shared-prefix sampler: greedy equals an argmax loop over the full forward; sampling
log-probs equal the training forward's; top-k/top-p/stop tokens behave; no prefix copies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import slow_where

from branch_replay.core import sampler
from models import transformer as tfm

CFG = tfm.preset("tiny")


def _prompts(B=2, P=7, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, size=(B, P)).astype(np.int32)
  valid = np.ones((B, P), bool)
  valid[0, :3] = False  # left padding on the first prompt
  tokens[~valid] = 0
  return jnp.asarray(tokens), jnp.asarray(valid)


@functools.lru_cache(maxsize=None)
def _sample_fn(cfg, n_branches, stop_tokens=()):
  return jax.jit(
    functools.partial(
      sampler.sample, model_cfg=CFG, cfg=cfg, n_branches=n_branches, stop_tokens=stop_tokens
    )
  )


def _argmax_loop(params, tokens_BP, valid_BP, n):
  """Greedy decoding by re-running the full forward over the whole sequence every token.
  One fixed shape [B, P+n]: not-yet-generated positions are invalid (and causally unseen)."""
  B, P = tokens_BP.shape
  fwd = jax.jit(lambda t, v: tfm.logits(params, CFG, tfm.forward(params, CFG, t, v)))
  tokens = np.concatenate([np.asarray(tokens_BP), np.zeros((B, n), np.int32)], 1)
  valid = np.concatenate([np.asarray(valid_BP), np.zeros((B, n), bool)], 1)
  for i in range(n):
    logits = fwd(jnp.asarray(tokens), jnp.asarray(valid))[:, P + i - 1]
    tokens[:, P + i] = np.asarray(jnp.argmax(logits, -1))
    valid[:, P + i] = True
  return tokens[:, P:]


@pytest.mark.parametrize("trunk_len", [0, 2])
def test_greedy_equals_argmax_loop_over_full_forward(trunk_len):
  params = tfm.init_params(CFG, jax.random.key(1))
  prompt, valid = _prompts()
  cfg = sampler.SamplerConfig(max_new_tokens=4, temperature=0.0, trunk_len=trunk_len)
  s = _sample_fn(cfg, 3)(params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(0))
  want = _argmax_loop(params, prompt, valid, trunk_len + 4)
  np.testing.assert_array_equal(np.asarray(s.trunk_BW), want[:, :trunk_len])
  for r in range(3):
    np.testing.assert_array_equal(np.asarray(s.tokens_BRT[:, r]), want[:, trunk_len:])
  assert np.asarray(s.valid_BRT).all()


@pytest.mark.parametrize("trunk_len", slow_where([0, 3], {0}))  # 25 s; [3] kept
def test_sampling_logps_equal_training_forward(trunk_len):
  params = tfm.init_params(CFG, jax.random.key(2))
  prompt, valid = _prompts(B=3, P=6, seed=1)
  cfg = sampler.SamplerConfig(max_new_tokens=5, temperature=1.0, trunk_len=trunk_len)
  s = _sample_fn(cfg, 4, (5, 6, 7))(
    params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(3)
  )
  B, R, T = s.tokens_BRT.shape
  W = trunk_len
  # The naive training forward: every branch as its own [P+W+T] sequence.
  seq = np.concatenate(
    [
      np.repeat(np.asarray(prompt)[:, None], R, 1),
      np.repeat(np.asarray(s.trunk_BW)[:, None], R, 1),
      np.asarray(s.tokens_BRT),
    ],
    -1,
  ).reshape(B * R, -1)
  seq_valid = np.concatenate(
    [
      np.repeat(np.asarray(valid)[:, None], R, 1),
      np.ones((B, R, W), bool),
      np.asarray(s.valid_BRT),
    ],
    -1,
  ).reshape(B * R, -1)
  P = prompt.shape[1]
  h = tfm.forward(params, CFG, jnp.asarray(seq), jnp.asarray(seq_valid))
  logp, _ = tfm.token_logps(params, CFG, h[:, P - 1 : -1], jnp.asarray(seq[:, P:]))
  logp = np.asarray(logp).reshape(B, R, W + T)
  m = np.asarray(s.valid_BRT)
  np.testing.assert_allclose(
    np.where(m, logp[..., W:], 0), np.asarray(s.logp_BRT), rtol=1e-5, atol=1e-5
  )
  if W:
    np.testing.assert_allclose(logp[:, 0, :W], np.asarray(s.trunk_logp_BW), rtol=1e-5, atol=1e-5)
  # `score` (one shared-prefix forward, used for the reference policy) agrees too.
  batch = s.batch(prompt, valid, [jnp.zeros((B, R))])  # one level of advantages
  assert batch.fanouts == (R,) and batch.trunk_len == W
  score_logp, score_trunk = jax.jit(sampler.score, static_argnums=1)(params, CFG, batch)
  np.testing.assert_allclose(np.asarray(score_logp), np.asarray(s.logp_BRT), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    np.asarray(score_trunk), np.asarray(s.trunk_logp_BW), rtol=1e-5, atol=1e-5
  )
  # Branches differ (different keys) and stop tokens end a branch (the stop token is valid).
  assert len({tuple(np.asarray(s.tokens_BRT[b, r])) for b in range(B) for r in range(R)}) > 1
  toks, valid_brt = np.asarray(s.tokens_BRT), np.asarray(s.valid_BRT)
  for b in range(B):
    for r in range(R):
      n = valid_brt[b, r].sum()
      assert valid_brt[b, r, :n].all() and not valid_brt[b, r, n:].any()
      stops = np.isin(toks[b, r, :n], (5, 6, 7))
      assert not stops[:-1].any()
      assert stops[-1] or n == T
      assert (toks[b, r, n:] == 0).all()


def test_stop_token_ends_greedy_branch():
  params = tfm.init_params(CFG, jax.random.key(1))
  prompt, valid = _prompts()
  want = _argmax_loop(params, prompt, valid, 4)
  stop = int(want[0, 1])  # the second greedy token of prompt 0 becomes a stop token
  cfg = sampler.SamplerConfig(max_new_tokens=4, temperature=0.0)
  s = _sample_fn(cfg, 1, (stop,))(
    params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(0)
  )
  first = int(np.argmax(want[0] == stop))
  np.testing.assert_array_equal(np.asarray(s.valid_BRT[0, 0]), np.arange(4) <= first)
  np.testing.assert_array_equal(np.asarray(s.tokens_BRT[0, 0, : first + 1]), want[0, : first + 1])


def test_top_k_and_top_p_filters():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  k2 = sampler.filter_logits(logits, sampler.SamplerConfig(top_k=2))
  assert np.isfinite(np.asarray(k2)).tolist() == [[True, True, False, False]]
  p = sampler.filter_logits(logits, sampler.SamplerConfig(top_p=0.75))
  assert np.isfinite(np.asarray(p)).tolist() == [[True, True, False, False]]
  p = sampler.filter_logits(logits, sampler.SamplerConfig(top_p=0.8))
  assert np.isfinite(np.asarray(p)).tolist() == [[True, True, False, False]]
  p = sampler.filter_logits(logits, sampler.SamplerConfig(top_p=0.81))
  assert np.isfinite(np.asarray(p)).tolist() == [[True, True, True, False]]
  # Sampling with top_k=1 is greedy.
  keys = jax.random.split(jax.random.key(0), 20)
  toks = jax.vmap(lambda k: sampler.choose(k, logits, sampler.SamplerConfig(top_k=1))[0])(keys)
  assert (np.asarray(toks) == 0).all()


def test_prefix_kv_is_not_copied_per_branch():
  """The decode loop's per-branch state holds only generated K/V: no [R, B, P, ...] buffer."""
  params = tfm.init_params(CFG, jax.random.key(1))
  P, R, T = 97, 5, 3
  prompt = jnp.ones((2, P), jnp.int32)
  valid = jnp.ones((2, P), bool)
  cfg = sampler.SamplerConfig(max_new_tokens=T)
  jaxpr = jax.make_jaxpr(functools.partial(sampler.sample, model_cfg=CFG, cfg=cfg, n_branches=R))(
    params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(0)
  )
  shapes = set()

  def visit(jx):
    for eqn in jx.eqns:
      for v in eqn.outvars:
        shapes.add(tuple(getattr(v.aval, "shape", ())))
      for val in eqn.params.values():
        inner = getattr(val, "jaxpr", None)
        if inner is not None:
          visit(getattr(inner, "jaxpr", inner))

  visit(jaxpr.jaxpr)
  K, H = CFG.n_kv_heads, CFG.head_dim
  assert (2, P, K, H) in shapes  # the prefix K/V, once
  # Per-branch arrays may hold scores over the P prefix keys, never a [.., P, K, H] K/V block.
  copies = [s for s in shapes if R in s[:-3] and s[-3:] == (P, K, H)]
  assert (R, 2, T, K, H) in shapes and not copies, copies


def test_bad_sampler_config():
  with pytest.raises(ValueError, match="sampler.max_new_tokens"):
    sampler.SamplerConfig(max_new_tokens=0)
  with pytest.raises(ValueError, match="sampler.top_p"):
    sampler.SamplerConfig(top_p=0.0)
  with pytest.raises(ValueError, match="sampler.temperature"):
    sampler.SamplerConfig(temperature=-1.0)
