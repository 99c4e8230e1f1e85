"""Tree sampler: greedy trees equal an argmax loop over the full forward of every path;
sampled log-probs (ragged nodes, stop tokens at every level) equal the training forward's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import engine, sampler, tree
from branch_replay.core.sampler import SamplerConfig
from models import transformer as tfm

CFG = tfm.preset("tiny")


def _prompts(B=2, P=6, seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, CFG.vocab_size, size=(B, P)).astype(np.int32)
  valid = np.ones((B, P), bool)
  valid[0, :2] = False
  tokens[~valid] = 0
  return jnp.asarray(tokens), jnp.asarray(valid)


def _sample(cfg, fanouts, lengths, stops=()):
  return jax.jit(
    functools.partial(
      sampler.sample_tree,
      model_cfg=CFG,
      cfg=cfg,
      fanouts=fanouts,
      lengths=lengths,
      stop_tokens=stops,
    )
  )


def test_greedy_tree_equals_argmax_loop():
  params = tfm.init_params(CFG, jax.random.key(1))
  prompt, valid = _prompts()
  s = _sample(SamplerConfig(temperature=0.0), (2, 2), (3, 2))(
    params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(0)
  )
  fwd = jax.jit(lambda t, v: tfm.logits(params, CFG, tfm.forward(params, CFG, t, v)))
  B, P = prompt.shape
  tokens = np.concatenate([np.asarray(prompt), np.zeros((B, 5), np.int32)], 1)
  seq_valid = np.concatenate([np.asarray(valid), np.zeros((B, 5), bool)], 1)
  for i in range(5):
    tokens[:, P + i] = np.asarray(
      jnp.argmax(fwd(jnp.asarray(tokens), jnp.asarray(seq_valid))[:, P + i - 1], -1)
    )
    seq_valid[:, P + i] = True
  for r in range(2):
    np.testing.assert_array_equal(np.asarray(s.tokens[0][:, r]), tokens[:, P : P + 3])
  for r in range(4):
    np.testing.assert_array_equal(np.asarray(s.tokens[1][:, r]), tokens[:, P + 3 :])
  assert all(np.asarray(v).all() for v in s.valid)


def test_sampled_logps_equal_training_forward():
  """Depth 3 with stop tokens at every level (a third of the vocabulary: nodes end early)."""
  params = tfm.init_params(CFG, jax.random.key(2))
  prompt, valid = _prompts(seed=3)
  stops = tuple(range(3, CFG.vocab_size, 3))
  fanouts, lengths = (2, 3, 2), (4, 3, 3)
  s = _sample(SamplerConfig(temperature=1.0), fanouts, lengths, (stops, stops, stops))(
    params, prompt_BP=prompt, prompt_valid_BP=valid, key=jax.random.key(5)
  )
  for d, v in enumerate(s.valid):
    v = np.asarray(v)
    assert v.shape == (2, int(np.prod(fanouts[: d + 1])), lengths[d])
    assert v[..., 0].all() and not v.all()  # ragged nodes, none empty
  leaf_adv = np.zeros(s.tokens[-1].shape[:2], np.float32)
  assert s.fanouts == fanouts  # read from the levels' shapes
  batch = s.batch(prompt, valid, [None, None, leaf_adv])  # the samples' own layout
  assert batch.fanouts == fanouts and batch.levels[-1].advantages_BR is leaf_adv
  tree.validate(batch, CFG.vocab_size)
  want, _ = jax.jit(lambda p, b: engine.forward(p, b, CFG))(params, batch)
  for got, ref in zip(s.logp, want):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
  # Siblings differ (they are sampled, not copies of one another).
  assert (np.asarray(s.tokens[0][:, 0]) != np.asarray(s.tokens[0][:, 1])).any()
