"""RL algorithms: the critic through branch replay (== naive), GAE and the value loss against
numpy loops, RLOO / DAPO / overlong shaping, temperature-consistent ratios, the trainer with
PPO epochs, minibatches, a critic and dynamic sampling, and their bad-input errors."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import advantages, critic, engine, losses, sampler
from branch_replay.train import checkpoint, metrics
from branch_replay import rollout
from branch_replay.train import trainer
from branch_replay.algorithms import ppo
from branch_replay.train import state as train_state
from branch_replay.config import Config, apply_overrides
from models import transformer as tfm
from helpers import assert_equal_f64, make_batch, max_rel_err, tiny_model, tiny_run
from helpers import slow_where


# ----------------------------------------------------------------------------- GAE, value loss


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


# ----------------------------------------------------------------------------- critic replay


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


# ----------------------------------------------------------------------------- estimators


def test_rloo_equals_leave_one_out():
  rng = np.random.default_rng(2)
  r = rng.normal(size=(3, 5))
  expected = np.asarray(
    [[r[b, i] - np.mean(np.delete(r[b], i)) for i in range(5)] for b in range(3)]
  )
  np.testing.assert_allclose(advantages.compute("rloo", r, Config().train), expected, rtol=1e-6)
  dr = advantages.compute("dr_grpo", r, Config().train)
  np.testing.assert_allclose(dr, r - r.mean(1, keepdims=True), rtol=1e-6)
  g = advantages.compute("grpo", r, Config().train)
  np.testing.assert_allclose(
    g, (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6), rtol=1e-5
  )


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


# ----------------------------------------------------------------------------- temperature


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


# ----------------------------------------------------------------------------- the trainer


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


def test_critic_step_fits_a_fixed_batch():
  """The trainer's critic step (optimizer, clip, replay) learns: on one fixed batch whose
  returns are a function of the token before each scored token (1 if it is even), the
  value loss falls and the explained variance rises above 0.9 within 40 steps."""
  cfg = apply_overrides(
    Config(model=tfm.preset("tiny")),
    ["algo.name=ppo", "loss.name=ppo", "critic.learning_rate=3e-3"],
  )
  params = tfm.init_params(cfg.model, jax.random.key(0))
  state = train_state.TrainState(params, None, jnp.zeros((), jnp.int32), None, None, None)
  cparams = critic.init_params(cfg.model, jax.random.key(1), params)
  state = state.replace(
    critic=dict(params=cparams, opt_state=train_state.make_critic_optimizer(cfg).init(cparams))
  )
  batch = make_batch(5, B=2, R=4, P=6, T=3, W=1, ragged=True, pad_prefix=False)
  seq = np.concatenate(
    [
      np.broadcast_to(np.asarray(batch.root_BP)[:, None], (2, 4, 6)),
      np.asarray(batch.leaves.tokens_BRT),
    ],
    -1,
  )
  mask = critic.scored_mask(batch)
  returns = np.where(mask, (seq[..., 6 - 1 - 1 : -1] % 2 == 0).astype(np.float32), 0.0)
  step = jax.jit(ppo.make_critic_step(cfg))
  values = jax.jit(lambda p, b: critic.values(p, cfg.model, b))
  ev, losses_ = [], []
  for _ in range(40):
    old = np.asarray(values(state.critic["params"], batch))
    ev.append(1 - np.mean((old - returns)[mask] ** 2) / returns[mask].var())
    state, out = step(
      state, critic.CriticBatch(batch, jnp.asarray(returns), jnp.asarray(old, jnp.float32))
    )
    losses_.append(float(out["loss/value"]))
  assert ev[0] < 0 and ev[-1] > 0.9, (ev[0], ev[-1])
  assert losses_[-1] < 0.1 * losses_[0], (losses_[0], losses_[-1])


def tiny(*overrides):
  return tiny_run(
    "train.sft_steps=0",
    "train.rl_steps=2",
    "train.batch_size=4",
    "train.n_branches=4",
    "sampler.max_new_tokens=2",
    "train.checkpoint_every=5",
    *overrides,
  )


def test_ppo_with_critic_epochs_and_minibatches_runs(tmp_path):
  cfg = tiny(
    "loss.name=ppo",
    "algo.name=ppo",
    "algo.ppo_epochs=2",
    "algo.minibatches=2",
    "sampler.trunk_len=1",
    "sampler.temperature=0.8",
  )
  s = trainer.run(cfg, str(tmp_path / "ppo"))
  recs = [r for r in metrics.read(s["metrics"]) if r.get("kind") == "train"]
  assert len(recs) == 2
  for r in recs:
    for k in ("loss/value", "clip_frac", "approx_kl", "ratio/max", "value/mean"):
      assert np.isfinite(r[k]), (k, r)
    assert "value/explained_variance" in r  # NaN (null) while every return is 0
    assert r["ratio/max"] > 1.0  # epochs after the first move the ratio
    assert r["value/tokens"] == 4 * 4 * 1 + int(r["replay/tail_tokens"]) // 2  # trunk + tails
  # the summary pools the critic's explained variance over its first/last windows
  assert "value_ev_before" in s and "value_ev_after" in s
  assert "value/explained_variance (pooled" in ppo.PPO.format_summary(s)
  # resume restores the critic (same run continued equals nothing broken)
  s2 = trainer.run(apply_overrides(cfg, ["train.rl_steps=3"]), str(tmp_path / "ppo"))
  assert s2["steps"] == 3


# the shared critic on a mesh under -m slow (150 s; [false] kept, and
# test_critic_on_a_mesh_equals_one_device_float64[True] checks the shared critic's mesh step)
@pytest.mark.parametrize("share", slow_where(["false", "true"], {"true"}))
def test_ppo_on_a_mesh_takes_one_devices_steps(tmp_path, share):
  """PPO (GAE from the critic, epochs x minibatches, a trunk) on data:2,context:4: the same
  rewards, value loss, policy loss and explained variance as one device, step by step (the
  sampler draws the same tokens: threefry bits do not depend on the sharding)."""
  runs = {}
  for mesh in ("", "data:2,context:4"):
    cfg = tiny(
      "loss.name=ppo",
      "algo.name=ppo",
      f"critic.share={share}",
      "algo.ppo_epochs=2",
      "algo.minibatches=2",
      "sampler.trunk_len=1",
      "sampler.temperature=0.8",
      "task.prompt_len=19",  # P = 19 + 1 (the trunk)
      "algo.overlong_buffer=1",
      f"mesh={mesh}",
    )  # shaped rewards vary: returns != 0
    s = trainer.run(cfg, str(tmp_path / (mesh.replace(":", "").replace(",", "_") or "one")))
    runs[mesh] = s, [r for r in metrics.read(s["metrics"]) if r.get("kind") == "train"]
  (_, one_recs), (_, sharded_recs) = runs[""], runs["data:2,context:4"]
  assert len(one_recs) == len(sharded_recs) == 2
  for a, b in zip(sharded_recs, one_recs):
    assert a["reward/mean"] == b["reward/mean"] and a["value/tokens"] == b["value/tokens"]
    for k in (
      "loss/value",
      "loss/policy",
      "value/mean",
      "value/sq_err",
      "grad/norm",
      "value/grad_norm",
    ):
      np.testing.assert_allclose(a[k], b[k], rtol=2e-4, atol=1e-6, err_msg=k)
  assert one_recs[0]["loss/value"] > 0 and one_recs[1]["value/mean"] != 0  # the critic learns


@pytest.mark.slow  # the shared critic's exactness tests run by default; this trains
def test_ppo_with_shared_critic_runs_and_checkpoints(tmp_path):
  """critic.share=true: the critic is a value head on the policy ({'head'} alone in the
  state and checkpoint, which restores into a fresh state's tree), trained alongside the
  policy; the overlong penalty makes the returns non-zero so the head must move."""
  cfg = tiny(
    "loss.name=ppo",
    "algo.name=ppo",
    "critic.share=true",
    "algo.ppo_epochs=2",
    "algo.minibatches=2",
    "sampler.trunk_len=1",
    "algo.overlong_buffer=1",
    "train.checkpoint_every=1",
  )
  workdir = str(tmp_path / "shared")
  s = trainer.run(cfg, workdir)
  recs = [r for r in metrics.read(s["metrics"]) if r.get("kind") == "train"]
  assert len(recs) == 2
  for r in recs:
    for k in (
      "loss/value",
      "value/mean",
      "value/clip_frac",
      "value/grad_norm",
      "value/sq_err",
      "value/explained_variance",
    ):
      assert r[k] is not None and np.isfinite(r[k]), (k, r)
  assert recs[0]["value/mean"] == 0.0 and recs[0]["loss/value"] > 0  # the zero head, then
  assert recs[1]["value/mean"] != 0.0  # the head has moved
  fresh = train_state.init_state(cfg)
  assert set(fresh.critic["params"]) == {"head"}
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  restored = ckpt.restore(2, train_state.state_dict(fresh))
  ckpt.close()
  assert set(restored["critic"]["params"]) == {"head"}
  assert float(jnp.abs(restored["critic"]["params"]["head"]["w_D"]).max()) > 0
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
    restored["params"],
    s["final_params"],
  )


def test_grpo_family_runs_rloo_gspo_dapo(tmp_path, monkeypatch):
  """The trainer takes each option to where it acts: the shaped rewards of the kept groups
  to the rloo estimator (whose advantages are leave-one-out), the gspo objective's sequence
  function into the compiled step, DAPO's rounds and kept fraction into the metrics."""
  seen, traced = [], []
  rloo = advantages.ESTIMATORS["rloo"]
  monkeypatch.setitem(
    advantages.ESTIMATORS,
    "rloo",
    lambda r_BR, t: seen.append((np.array(r_BR), rloo(r_BR, t))) or seen[-1][1],
  )
  gspo = losses.OBJECTIVES["gspo"]
  monkeypatch.setitem(
    losses.OBJECTIVES,
    "gspo",
    dataclasses.replace(gspo, sequence_fn=lambda *a: traced.append(1) or gspo.sequence_fn(*a)),
  )
  cfg = tiny(
    "loss.name=gspo",
    "loss.aggregation=seq_mean",
    "algo.advantage=rloo",
    "algo.dynamic_sampling=true",
    "algo.max_sample_rounds=2",
    "algo.overlong_buffer=1",
    "train.checkpoint_every=1",
  )
  s = trainer.run(cfg, str(tmp_path / "g"))
  recs = [r for r in metrics.read(s["metrics"]) if r.get("kind") == "train"]
  assert len(recs) == len(seen) == 2 and traced  # one estimate per step; gspo compiled
  for r, (rewards_BR, adv_BR) in zip(recs, seen):
    R = rewards_BR.shape[1]
    np.testing.assert_allclose(
      adv_BR, (rewards_BR * R - rewards_BR.sum(1, keepdims=True)) / (R - 1), rtol=1e-6
    )
    assert r["reward/shaped_mean"] == pytest.approx(rewards_BR.mean(), abs=1e-6)
    assert r["reward/shaped_mean"] <= r["reward/mean"] + 1e-6  # the overlong penalty is >= 0
    assert 1 <= r["dapo/rounds"] <= 2
    informative = int((rewards_BR.std(1) > 0).sum())  # kept groups come first
    assert r["dapo/kept_frac"] == pytest.approx(min(informative, 4) / 4)
    if r["dapo/rounds"] == 1:  # stopped early: every group of the batch was informative
      assert informative == 4


@pytest.mark.parametrize(
  "overrides, match",
  [
    (["algo.advantage=nope"], r"algo.advantage='nope'.*\['dr_grpo', 'gae', 'grpo', 'rloo'\]"),
    (["algo.advantage=gae"], r"algo.advantage='gae': per-token advantages come from PPO's critic"),
    (["train.advantage=rloo"], r"'train.advantage': moved to 'algo.advantage'"),
    (
      ["algo.pairs_file=x.jsonl"],
      r"unknown field 'pairs_file' of algo \(an option of algo.name='dpo'\)",
    ),
    (
      ["loss.name=dpo", "train.n_branches=2"],
      r"loss.name='dpo' with algo.name='grpo': expected algo.name='dpo'",
    ),
    (
      ["critic.lam=0.5"],
      r"critic.lam=0.5 with algo.name='grpo': the critic is the value model of \['ppo'\]",
    ),
    (["algo.name=sft"], r"algo.name='sft' with train.sft_steps=0, train.rl_steps=\d+: SFT trains"),
    (["loss.name=nope"], r"loss.name='nope'.*expected one of"),
    (["algo.ppo_epochs=0"], r"algo.ppo_epochs=0: expected an int >= 1"),
    (["algo.minibatches=3"], r"algo.minibatches=3: expected a divisor of train.batch_size=4"),
    (
      ["algo.name=dpo", "loss.name=dpo"],
      r"train.n_branches=4: DPO trains on \(chosen, rejected\) pairs",
    ),
    (["sampler.top_k=5"], r"sampler.top_k=5.*RL trains against"),
    (["sampler.top_p=0.9"], r"top_p=0.9.*expected top_k=0 and top_p=1"),
    (["sampler.temperature=0"], r"sampler.temperature=0: RL needs sampled"),
    (["critic.share=maybe"], r"critic.share='maybe': expected true or false"),
  ],
)
def test_bad_rl_config_names_the_field(overrides, match):
  with pytest.raises(ValueError, match=match):
    tiny(*overrides)


def test_critic_share_must_be_a_bool():
  with pytest.raises(ValueError, match=r"critic.share=1: expected true or false"):
    critic.CriticConfig(share=1)
