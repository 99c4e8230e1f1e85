"""core/critic.py: GAE and the value loss against numpy loops, the pooled explained variance,
the critic (separate or sharing the policy's body) through branch replay equal to the naive
twin and to numpy in float64, on a mesh equal to one device, causal values, bad input."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import critic
from models import transformer as tfm
from helpers import assert_equal_f64, make_batch, max_rel_err, tiny_model
from helpers import slow_where


def gae_loop(rewards_BR, values_BRX, valid_BRX, gamma, lam):
  """GAE the textbook way, one branch at a time over its n scored tokens."""
  B, R, X = valid_BRX.shape
  adv = np.zeros((B, R, X))
  for b in range(B):
    for r in range(R):
      n = int(valid_BRX[b, r].sum())
      v = list(values_BRX[b, r, :n]) + [0.0]  # V after the last token is 0 (terminal)
      last = 0.0
      for x in reversed(range(n)):
        reward = rewards_BR[b, r] if x == n - 1 else 0.0
        delta = reward + gamma * v[x + 1] - v[x]
        last = delta + gamma * lam * last
        adv[b, r, x] = last
  return adv, np.where(valid_BRX, adv + values_BRX, 0.0)


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 1.0), (0.99, 0.0)])
def test_gae_equals_loop(gamma, lam):
  rng = np.random.default_rng(0)
  W, T = 2, 5
  lengths = rng.integers(1, T + 1, (3, 4))
  valid = np.concatenate(
    [np.ones((3, 4, W), bool), np.arange(T)[None, None] < lengths[..., None]], -1
  )
  values = rng.normal(size=(3, 4, W + T))
  rewards = rng.normal(size=(3, 4))
  adv, ret = critic.gae(rewards, values, valid, gamma, lam)
  adv2, ret2 = gae_loop(rewards, values, valid, gamma, lam)
  np.testing.assert_allclose(np.where(valid, adv, 0), adv2, rtol=1e-13, atol=1e-13)
  np.testing.assert_allclose(ret, ret2, rtol=1e-13, atol=1e-13)


def test_gae_bootstraps_across_the_trunk_boundary():
  """Trunk [V=0.5], tail [V=0.2, V=0.1], reward 1, gamma=lam=1: the trunk token's delta
  bootstraps from the branch's first tail value: A_trunk = (0 + 0.2 - 0.5) + A_tail0."""
  valid = np.ones((1, 1, 3), bool)
  values = np.asarray([[[0.5, 0.2, 0.1]]])
  adv, ret = critic.gae(np.asarray([[1.0]]), values, valid, 1.0, 1.0)
  np.testing.assert_allclose(adv[0, 0], [0.5, 0.8, 0.9], atol=1e-15)  # = R - V with lam=1
  adv, _ = critic.gae(np.asarray([[1.0]]), values, valid, 1.0, 0.0)  # lam=0: one-step TD
  np.testing.assert_allclose(adv[0, 0], [0.2 - 0.5, 0.1 - 0.2, 1.0 - 0.1], atol=1e-15)
  # Two branches sharing the trunk token (same V) get different trunk advantages.
  valid = np.ones((1, 2, 2), bool)
  adv, _ = critic.gae(
    np.asarray([[1.0, 0.0]]), np.asarray([[[0.5, 0.3], [0.5, 0.7]]]), valid, 1.0, 0.0
  )
  np.testing.assert_allclose(adv[0, :, 0], [0.3 - 0.5, 0.7 - 0.5], atol=1e-15)


def test_value_loss_equals_numpy():
  rng = np.random.default_rng(1)
  v, old, ret = rng.normal(size=(3, 2, 6))
  w = rng.uniform(size=(2, 6)) * (rng.uniform(size=(2, 6)) > 0.3)
  clip = 0.2
  expected = np.zeros(2)
  for b in range(2):
    for x in range(6):
      vc = old[b, x] + min(max(v[b, x] - old[b, x], -clip), clip)
      expected[b] += w[b, x] * 0.5 * max((v[b, x] - ret[b, x]) ** 2, (vc - ret[b, x]) ** 2)
  with jax.enable_x64(True):
    got = critic.value_loss(
      jnp.asarray(v), jnp.asarray(old), jnp.asarray(ret), jnp.asarray(w), clip
    )
  np.testing.assert_allclose(got, expected, rtol=1e-13)


def test_pooled_explained_variance_is_that_of_the_pooled_tokens():
  """Steps whose batches have different mean returns: the pooled EV equals the EV of all
  their tokens together (independent numpy), so predicting the overall mean everywhere
  reads 0, not below (the mean of per-step variances as denominator read -1.34 here)."""
  rng = np.random.default_rng(0)
  steps = [(rng.normal(mu, 0.3, size=n), n) for mu, n in ((0.2, 40), (0.9, 64), (0.5, 50))]
  all_ret = np.concatenate([r for r, _ in steps])

  def records(predict):
    return [
      {
        "value/tokens": n,
        "value/sq_err": float(np.mean((r - predict(r)) ** 2)),
        "value/return_var": float(r.var()),
        "value/return_mean": float(r.mean()),
      }
      for r, n in steps
    ]

  const = lambda r: np.full_like(r, all_ret.mean())
  assert abs(critic.pooled_explained_variance(records(const))) < 1e-12
  old = records(const)  # the former formula: 1 - mean(sq_err) / mean(return_var)
  assert (
    1 - np.mean([r["value/sq_err"] for r in old]) / np.mean([r["value/return_var"] for r in old])
    < -0.5
  )
  noisy = lambda r: r + 0.5 * np.sin(7 * r)
  pooled = np.concatenate([noisy(r) for r, _ in steps])
  np.testing.assert_allclose(
    critic.pooled_explained_variance(records(noisy)),
    1 - np.mean((all_ret - pooled) ** 2) / all_ret.var(),
    rtol=1e-12,
  )
  assert critic.pooled_explained_variance(records(lambda r: r)) == 1.0
  assert math.isnan(critic.pooled_explained_variance([{"kind": "train"}]))


def critic_batch(seed, B, R, P, T, W, dtype=jnp.float64):
  batch = make_batch(seed, B=B, R=R, P=P, T=T, W=W, dtype=dtype)
  rng = np.random.default_rng(seed + 1)
  mask = critic.scored_mask(batch)
  return critic.CriticBatch(
    batch,
    jnp.asarray(np.where(mask, rng.normal(size=mask.shape), 0), dtype),
    jnp.asarray(np.where(mask, rng.normal(scale=0.1, size=mask.shape), 0), dtype),
  )


@pytest.mark.parametrize(
  "B, R, P, T, W", slow_where([(2, 3, 9, 4, 2), (1, 4, 6, 1, 0)], {(1, 4, 6, 1, 0)})
)  # the trunk case kept
def test_critic_replay_equals_naive_float64(B, R, P, T, W):
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    cparams = critic.init_params(cfg, jax.random.key(1), params)
    # a non-zero head, so values (and the clip) depend on the transformer
    cparams["head"] = {
      "w_D": jax.random.normal(jax.random.key(2), (cfg.d_model,)),
      "b": jnp.asarray(0.1),
    }
    cb = critic_batch(31, B, R, P, T, W)
    ccfg = critic.CriticConfig(value_clip=0.5)
    fast = jax.jit(lambda p, b: critic.loss_and_grad(p, b, cfg, ccfg, "replay"))(cparams, cb)
    slow = jax.jit(lambda p, b: critic.loss_and_grad(p, b, cfg, ccfg, "naive"))(cparams, cb)
    assert_equal_f64(fast, slow)
    assert int(slow[1]["clip_sum"].sum()) > 0  # the value clip binds somewhere
    # the loss equals the numpy value loss on the naive values
    v = np.asarray(critic.naive_values(cparams, cb.batch, cfg))
    mask = critic.scored_mask(cb.batch)
    n = mask.sum()
    old, ret = np.asarray(cb.old_values_BRX), np.asarray(cb.returns_BRX)
    vc = old + np.clip(v - old, -0.5, 0.5)
    expected = np.sum(np.where(mask, 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2), 0)) / n
    assert float(fast[0]) == pytest.approx(expected, rel=1e-10)
    # `critic.values` (one shared-prefix forward) equals the naive values
    np.testing.assert_allclose(
      np.where(mask, critic.values(cparams, cfg, cb.batch), 0),
      np.where(mask, v, 0),
      rtol=1e-11,
      atol=1e-12,
    )


def random_head(cfg, seed=2):
  return {
    "w_D": jax.random.normal(jax.random.key(seed), (cfg.d_model,), jnp.float64),
    "b": jnp.asarray(0.1, jnp.float64),
  }


def numpy_shared_critic(params, cfg, cb, head, clip):
  """A shared critic's values, value loss and head gradient by hand: the policy
  transformer's hidden states of every branch as its own sequence (one tfm.forward per
  branch), the head in numpy, the clipped loss token-mean over the scored tokens."""
  b_ = cb.batch
  B, R, T = b_.leaves.tokens_BRT.shape
  P, W = b_.root_BP.shape[1], b_.trunk_len
  forward = jax.jit(lambda tokens, valid: tfm.forward(params, cfg, tokens, valid))
  h = np.zeros((B, R, W + T, cfg.d_model))
  for b in range(B):
    for r in range(R):
      tokens = jnp.concatenate([b_.root_BP[b], b_.leaves.tokens_BRT[b, r]])[None]
      valid = jnp.concatenate([b_.root_valid_BP[b], b_.leaves.valid_BRT[b, r]])[None]
      h[b, r] = np.asarray(forward(tokens, valid))[0, P - 1 - W : P + T - 1]
  w, bias = np.asarray(head["w_D"]), float(head["b"])
  v = h @ w + bias
  mask = critic.scored_mask(b_)
  n = mask.sum()
  old, ret = np.asarray(cb.old_values_BRX), np.asarray(cb.returns_BRX)
  vc = old + np.clip(v - old, -clip, clip)
  plain, clipped = (v - ret) ** 2, (vc - ret) ** 2
  loss = np.sum(np.where(mask, 0.5 * np.maximum(plain, clipped), 0)) / n
  inside = np.abs(v - old) < clip
  dv = np.where(mask, np.where(plain >= clipped, v - ret, (vc - ret) * inside), 0) / n
  return v, mask, loss, {"w_D": np.einsum("brx,brxd->d", dv, h), "b": dv.sum()}


@pytest.mark.parametrize(
  "B, R, P, T, W", slow_where([(2, 3, 9, 4, 2), (1, 4, 6, 1, 0)], {(1, 4, 6, 1, 0)})
)  # the trunk case kept
def test_shared_critic_replay_equals_naive_and_numpy_float64(B, R, P, T, W):
  """critic.share: a value head on the policy's (detached) transformer. Replay == naive
  (loss, aux, head gradient), and both == the numpy loss and head gradient built from the
  policy's hidden states."""
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    head = {"head": random_head(cfg)}
    cb = critic_batch(31, B, R, P, T, W)
    ccfg = critic.CriticConfig(value_clip=0.5, share=True)
    run = lambda mode: jax.jit(
      lambda h, b, body: critic.loss_and_grad(h, b, cfg, ccfg, mode, body_params=body)
    )(head, cb, params)
    fast, slow = run("replay"), run("naive")
    assert_equal_f64(fast, slow)
    assert jax.tree.structure(fast[2]) == jax.tree.structure(head)  # the head alone
    assert int(slow[1]["clip_sum"].sum()) > 0  # the value clip binds somewhere
    v, mask, loss, grad = numpy_shared_critic(params, cfg, cb, head["head"], 0.5)
    assert float(fast[0]) == pytest.approx(loss, rel=1e-10)
    for name in ("w_D", "b"):
      np.testing.assert_allclose(fast[2]["head"][name], grad[name], rtol=1e-10, atol=1e-12)
    # `critic.values` (one shared-prefix forward of the policy) equals the numpy values
    got = critic.values(head, cfg, cb.batch, body_params=params)
    np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, v, 0), rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("share", [False, True])
def test_critic_on_a_mesh_equals_one_device_float64(share):
  """PPO's value model on data:2,context:4 (prompts x branches, the prefix context-parallel):
  the loss, aux and every gradient leaf equal one device's replay (== naive above), the
  critic's transformer grads sharded like the policy's; `critic.values` from placed inputs
  equals one device's."""
  from branch_replay.core import sharding

  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    ccfg = critic.CriticConfig(value_clip=0.5, share=share)
    cparams = (
      {"head": random_head(cfg)}
      if share
      else {**critic.init_params(cfg, jax.random.key(1), params), "head": random_head(cfg)}
    )
    body = params if share else None
    cb = critic_batch(31, B=2, R=4, P=8, T=4, W=2)
    one = jax.jit(lambda p, b, body: critic.loss_and_grad(p, b, cfg, ccfg, body_params=body))(
      cparams, cb, body
    )
    mesh = sharding.make_mesh("data:2,context:4")
    placed = (
      sharding.put(cparams, critic.param_shardings(mesh, cfg, cparams)),
      sharding.put(cb, critic.batch_shardings(mesh, cb)),
      None if body is None else sharding.put(body, sharding.param_shardings(mesh, cfg)),
    )
    on_mesh = jax.jit(
      lambda p, b, body: critic.loss_and_grad(p, b, cfg, ccfg, body_params=body, mesh=mesh)
    )(*placed)
    assert_equal_f64(jax.tree.map(np.asarray, on_mesh), jax.tree.map(np.asarray, one))
    assert int(one[1]["clip_sum"].sum()) > 0  # the value clip binds somewhere
    if not share:  # the value model's transformer grads are sharded like the policy's
      expected = sharding.param_shardings(mesh, cfg)
      for g, s_ in zip(jax.tree.leaves(on_mesh[2]["model"]), jax.tree.leaves(expected)):
        assert g.sharding.is_equivalent_to(s_, g.ndim), (g.sharding, s_)
    values = jax.jit(functools.partial(critic.values, model_cfg=cfg))
    np.testing.assert_allclose(
      sharding.to_host(values(placed[0], batch=placed[1].batch, body_params=placed[2])),
      values(cparams, batch=cb.batch, body_params=body),
      rtol=1e-11,
      atol=1e-12,
    )


def test_shared_critic_head_gradient_equals_separate_model_with_policy_body():
  """Independent cross-check: a separate value model whose 'model' params ARE the policy's
  has, w.r.t. its head, the shared critic's loss and head gradient (its body gradient is
  what the shared critic leaves out)."""
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    head = random_head(cfg, seed=5)
    cb = critic_batch(7, 2, 3, 8, 3, 1)
    ccfg = critic.CriticConfig(value_clip=0.3)
    separate = {"model": params, "head": head}
    (loss_sep, _), g_sep = jax.jit(
      jax.value_and_grad(lambda p: critic.naive_loss(p, cb, cfg, ccfg), has_aux=True)
    )(separate)
    loss, _, g = jax.jit(
      lambda h, body: critic.loss_and_grad(
        h, cb, cfg, dataclasses.replace(ccfg, share=True), body_params=body
      )
    )({"head": head}, params)
    assert float(loss) == pytest.approx(float(loss_sep), rel=1e-10)
    assert max_rel_err(g["head"], g_sep["head"]) < 1e-10
    assert float(jnp.abs(g_sep["head"]["w_D"]).max()) > 1e-6
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_sep["model"])) > 1e-6


def test_shared_critic_params_and_body_must_agree():
  cfg, params = tiny_model(dtype="float32", perturb=0.0)
  batch = make_batch(3, B=1, R=2, P=5, T=2)
  with pytest.raises(ValueError, match=r"body_params=None: a shared critic"):
    critic.values({"head": critic.init_head(cfg)}, cfg, batch)
  with pytest.raises(ValueError, match=r"hold a 'model' and body_params was given"):
    critic.values(
      critic.init_params(cfg, jax.random.key(0), params), cfg, batch, body_params=params
    )
  assert set(critic.init_params(cfg, jax.random.key(0), share=True)) == {"head"}


def test_critic_value_of_a_token_reads_only_the_tokens_before_it():
  """Token x's value is V(state before x): changing tail token t leaves the values of
  tokens <= t (and every trunk token) as they were and changes the later ones."""
  cfg, params = tiny_model(dtype="float32", perturb=0.0)
  cparams = critic.init_params(cfg, jax.random.key(1), params)
  cparams["head"]["w_D"] = jax.random.normal(jax.random.key(2), (cfg.d_model,))
  batch = make_batch(3, B=2, R=2, P=7, T=4, W=2, ragged=False)
  values = jax.jit(lambda b: critic.values(cparams, cfg, b))
  v = np.asarray(values(batch))
  for t in range(4):
    tails = np.asarray(batch.leaves.tokens_BRT).copy()
    tails[1, 0, t] = (tails[1, 0, t] + 1) % cfg.vocab_size
    v2 = np.asarray(values(batch.with_leaves(tokens_BRT=jnp.asarray(tails))))
    x = 2 + t  # the W trunk tokens come first
    np.testing.assert_array_equal(v2[1, 0, : x + 1], v[1, 0, : x + 1])
    assert np.all(np.abs(v2[1, 0, x + 1 :] - v[1, 0, x + 1 :]) > 1e-6), t
    np.testing.assert_array_equal(
      np.delete(v2.reshape(4, -1), 2, 0), np.delete(v.reshape(4, -1), 2, 0)
    )  # other branches


def test_critic_share_must_be_a_bool():
  with pytest.raises(ValueError, match=r"critic.share=1: expected true or false"):
    critic.CriticConfig(share=1)
