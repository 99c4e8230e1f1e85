"""Objectives checked on their own: hand-picked values, and the whole loss of both paths
against an independent numpy computation from the model's own log-probs."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, losses
from models import transformer as tfm
from helpers import make_batch, tiny_model

# ----------------------------------------------------------------------------- hand values

EPS, EPS_HIGH = 0.2, 0.28


@pytest.mark.parametrize(
  "ratio, adv, loss, dloss_dlogp",
  [
    (1.1, 1.0, -1.1, -1.1),  # inside the band: -r A, gradient -r A
    (1.1, -1.0, 1.1, 1.1),
    (1.5, 1.0, -1.28, 0.0),  # above 1+eps_high with A>0: clipped, no gradient
    (1.5, -1.0, 1.5, 1.5),  # above the band with A<0: the unclipped term is the min
    (0.5, 1.0, -0.5, -0.5),  # below 1-eps with A>0: unclipped
    (0.5, -1.0, 0.8, 0.0),  # below the band with A<0: clipped at 1-eps, no gradient
    (1.25, 1.0, -1.25, -1.25),  # inside [1-eps, 1+eps_high] though outside 1+eps
  ],
)
def test_ppo_clip_hand_values(ratio, adv, loss, dloss_dlogp):
  with jax.enable_x64(True):
    cfg = losses.LossConfig(name="ppo", epsilon=EPS, epsilon_high=EPS_HIGH)
    old = -2.0
    f = lambda logp: losses.ppo_clip_token(logp, old, 0.0, adv, cfg)
    logp = old + math.log(ratio)
    assert float(f(logp)) == pytest.approx(loss, abs=1e-12)
    assert float(jax.grad(f)(logp)) == pytest.approx(dloss_dlogp, abs=1e-12)


def test_epsilon_high_defaults_to_epsilon():
  with jax.enable_x64(True):
    cfg = losses.LossConfig(epsilon=0.2)
    logp = -2.0 + math.log(1.25)
    assert float(losses.ppo_clip_token(logp, -2.0, 0.0, 1.0, cfg)) == pytest.approx(-1.2)


def test_k3_kl_value_sign_and_expectation():
  with jax.enable_x64(True):
    # value: logp=-1, ref=-2: exp(-1) - (-1) - 1
    assert float(losses.k3_kl(-1.0, -2.0)) == pytest.approx(math.exp(-1.0), abs=1e-15)
    assert float(losses.k3_kl(-1.3, -1.3)) == 0.0
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(7))
    q = rng.dirichlet(np.ones(7))
    k3 = np.asarray(losses.k3_kl(jnp.log(p), jnp.log(q)))
    assert (k3 >= 0).all()  # every sample non-negative
    # E_{x~p}[k3] = KL(p || q) exactly (the reference is q): the direction is pi || ref.
    assert float(np.sum(p * k3)) == pytest.approx(float(np.sum(p * np.log(p / q))), rel=1e-12)
    assert float(np.sum(p * k3)) != pytest.approx(float(np.sum(q * np.log(q / p))), rel=1e-3)
    # with the penalty, a token whose policy prob exceeds the reference is pushed down
    cfg = losses.LossConfig(kl_coef=1.0)
    g = jax.grad(lambda lp: losses.ppo_clip_token(lp, lp, -2.0, 0.0, cfg))(-1.0)
    assert float(g) > 0


def test_dpo_margin_and_sign():
  with jax.enable_x64(True):
    cfg = losses.LossConfig(name="dpo", beta=0.1)
    # chosen: log pi - log ref summed = 0.5; rejected: -0.3
    values_RB = jnp.asarray([[0.5], [-0.3]])
    expected = math.log1p(math.exp(-0.1 * 0.8))
    assert float(losses.dpo_combine(values_RB, cfg)) == pytest.approx(expected, rel=1e-14)
    # raising the chosen log-ratio lowers the loss; raising the rejected one raises it
    g = jax.grad(lambda v: losses.dpo_combine(v, cfg))(values_RB)
    assert float(g[0, 0]) < 0 < float(g[1, 0])
    with pytest.raises(ValueError, match="R=2"):
      losses.dpo_combine(jnp.zeros((3, 1)), cfg)


# ----------------------------------------------------------------------------- numpy reference


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def model_logps(cfg, params, batch, temperature=1.0):
  """log p of every scored token, [B, R, W+T], each branch as its own full sequence, with
  the log-softmax and the token picking done in numpy (independent of engine.py)."""
  B, R, T = batch.leaves.tokens_BRT.shape
  P, W = batch.root_BP.shape[1], batch.trunk_len
  tokens = np.concatenate(
    [np.repeat(np.asarray(batch.root_BP)[:, None], R, 1), np.asarray(batch.leaves.tokens_BRT)], -1
  ).reshape(B * R, P + T)
  valid = np.concatenate(
    [np.repeat(np.asarray(batch.root_valid_BP)[:, None], R, 1), np.asarray(batch.leaves.valid_BRT)],
    -1,
  ).reshape(B * R, P + T)
  logits = np.asarray(_logits(params, cfg, jnp.asarray(tokens), jnp.asarray(valid)))
  lp = np_log_softmax(logits / temperature)
  out = np.zeros((B * R, W + T))
  for n in range(B * R):
    for x, pos in enumerate(range(P - W, P + T)):  # token at pos, predicted from pos-1
      out[n, x] = lp[n, pos - 1, tokens[n, pos]]
  return out.reshape(B, R, W + T)


@functools.partial(jax.jit, static_argnums=1)
def _logits(params, cfg, tokens, valid):
  return tfm.logits(params, cfg, tfm.forward(params, cfg, tokens, valid))


@functools.partial(jax.jit, static_argnums=(2, 3))
def naive_loss(params, batch, cfg, lc):
  return engine.naive_loss(params, batch, cfg, lc)[0]


def np_loss(cfg: losses.LossConfig, batch, logp_BRX):
  """The objective by hand, in loops: independent of losses.py's vectorised code."""
  B, R, T = batch.leaves.tokens_BRT.shape
  W = batch.trunk_len
  cat = lambda trunk_BW, tail_BRT: np.concatenate(
    [np.broadcast_to(np.asarray(trunk_BW)[:, None], (B, R, W)), np.asarray(tail_BRT)], -1
  )
  valid = np.concatenate([np.ones((B, R, W), bool), np.asarray(batch.leaves.valid_BRT)], -1)
  leaves = batch.leaves
  old = (
    logp_BRX if leaves.old_logp_BRT is None else cat(batch.trunk_old_logp_BW, leaves.old_logp_BRT)
  )
  ref = (
    logp_BRX if leaves.ref_logp_BRT is None else cat(batch.trunk_ref_logp_BW, leaves.ref_logp_BRT)
  )
  if batch.leaves.advantages_BRT is None:
    adv = np.broadcast_to(np.asarray(batch.leaves.advantages_BR)[..., None], valid.shape)
  else:
    adv = np.concatenate(
      [np.asarray(batch.trunk_advantages_BRW), np.asarray(batch.leaves.advantages_BRT)], -1
    )
  mode = "sum" if cfg.name == "dpo" else cfg.aggregation
  n_total = valid.sum()
  values = np.zeros((B, R))
  for b in range(B):
    for r in range(R):
      n = valid[b, r].sum()
      w = {"token_mean": 1.0 / n_total, "seq_mean": 1.0 / (B * R * n), "sum": 1.0}[mode]
      toks = [x for x in range(W + T) if valid[b, r, x]]
      kl = sum(
        math.exp(ref[b, r, x] - logp_BRX[b, r, x]) - (ref[b, r, x] - logp_BRX[b, r, x]) - 1
        for x in toks
      )
      if cfg.name in ("grpo", "ppo"):
        v = 0.0
        for x in toks:
          ratio = math.exp(logp_BRX[b, r, x] - old[b, r, x])
          a = adv[b, r, x]
          clipped = min(max(ratio, 1 - cfg.epsilon), 1 + cfg.eps_high)
          v += -min(ratio * a, clipped * a)
        values[b, r] = w * (v + cfg.kl_coef * kl)
      elif cfg.name == "pg":
        values[b, r] = w * (sum(-adv[b, r, x] * logp_BRX[b, r, x] for x in toks) + cfg.kl_coef * kl)
      elif cfg.name == "gspo":
        s = math.exp(sum(logp_BRX[b, r, x] - old[b, r, x] for x in toks) / n)
        a = sum(adv[b, r, x] for x in toks) / n
        clipped = min(max(s, 1 - cfg.epsilon), 1 + cfg.eps_high)
        values[b, r] = w * n * -min(s * a, clipped * a) + w * cfg.kl_coef * kl
      elif cfg.name == "dpo":
        values[b, r] = sum(logp_BRX[b, r, x] - ref[b, r, x] for x in toks)
  if cfg.name == "dpo":
    margin = cfg.beta * (values[:, 0] - values[:, 1])
    return float(np.sum(np.log1p(np.exp(-margin))))
  return float(values.sum())


CASES = [
  dict(name="grpo", aggregation="token_mean"),
  dict(name="grpo", aggregation="seq_mean", kl_coef=0.1),
  dict(name="ppo", aggregation="sum", epsilon=0.1, epsilon_high=0.3, kl_coef=0.05),
  dict(name="pg", aggregation="seq_mean", kl_coef=0.2),
  dict(name="gspo", aggregation="seq_mean", epsilon=3e-3, epsilon_high=4e-3),
  dict(name="gspo", aggregation="token_mean", epsilon=0.5, kl_coef=0.1),
  dict(name="dpo", beta=0.3),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_loss_equals_numpy_reference(case):
  """Both paths' loss equals the hand-written objective on the model's own log-probs, with
  off-policy old log-probs (so clips bind on both sides) and a reference policy."""
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    R = 2 if case["name"] == "dpo" else 4
    batch = make_batch(21, B=2, R=R, P=7, T=4, W=2, dtype=jnp.float64)
    logp = model_logps(cfg, params, batch)
    rng = np.random.default_rng(1)
    # old log-probs near the policy's, so ratios straddle the clip band on both sides
    noise = lambda *s: rng.normal(scale=0.3, size=s)
    W = 2
    valid = batch.leaves.valid_BRT
    batch = batch.with_leaves(
      old_logp_BRT=jnp.asarray(np.where(valid, logp[..., W:] + noise(2, R, 4), 0.0)),
      ref_logp_BRT=jnp.asarray(np.where(valid, logp[..., W:] + noise(2, R, 4), 0.0)),
    ).replace(
      trunk_old_logp_BW=jnp.asarray(logp[:, 0, :W] + noise(2, W)),
      trunk_ref_logp_BW=jnp.asarray(logp[:, 0, :W] + noise(2, W)),
    )
    lc = losses.LossConfig(**case)
    loss = naive_loss(params, batch, cfg, lc)
    assert float(loss) == pytest.approx(np_loss(lc, batch, logp), rel=1e-10, abs=1e-13)
    if case["name"] in ("grpo", "ppo"):  # the test data exercises the clip on both sides
      ratio = np.exp(logp[..., 2:] - np.asarray(batch.leaves.old_logp_BRT))[np.asarray(valid)]
      assert (ratio > 1 + lc.eps_high).any() and (ratio < 1 - lc.epsilon).any()


def test_per_token_advantages_equal_numpy_reference():
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    batch = make_batch(22, B=2, R=3, P=8, T=4, W=2, logps=True, dtype=jnp.float64)
    rng = np.random.default_rng(2)
    batch = batch.with_leaves(advantages_BRT=jnp.asarray(rng.normal(size=(2, 3, 4)))).replace(
      trunk_advantages_BRW=jnp.asarray(rng.normal(size=(2, 3, 2)))
    )
    lc = losses.LossConfig(name="ppo", aggregation="token_mean", kl_coef=0.1)
    expected = np_loss(lc, batch, model_logps(cfg, params, batch))
    assert float(naive_loss(params, batch, cfg, lc)) == pytest.approx(expected, rel=1e-10)


def test_temperature_logps_equal_numpy_reference():
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    batch = make_batch(23, B=1, R=3, P=6, T=4, W=1, dtype=jnp.float64)
    lc = losses.LossConfig(name="pg", aggregation="sum", temperature=0.7)
    expected = np_loss(lc, batch, model_logps(cfg, params, batch, temperature=0.7))
    assert float(naive_loss(params, batch, cfg, lc)) == pytest.approx(expected, rel=1e-10)
    t1 = losses.LossConfig(name="pg", aggregation="sum")
    assert float(naive_loss(params, batch, cfg, t1)) != pytest.approx(expected, rel=1e-3)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
  "case, match",
  [
    (dict(name="dpo"), "needs reference log-probs"),
    (dict(name="grpo", kl_coef=0.1), r"needs reference log-probs \(kl_coef > 0\)"),
  ],
)
def test_missing_reference_raises(case, match):
  cfg, params = tiny_model(dtype="float32", perturb=0.0)
  R = 2 if case["name"] == "dpo" else 3
  batch = make_batch(0, B=2, R=R, P=6, T=3)
  for mode in ("replay", "naive"):
    with pytest.raises(ValueError, match=match):
      jax.eval_shape(
        lambda p: engine.loss_and_grad(p, batch, cfg, losses.LossConfig(**case), mode), params
      )


def test_dpo_needs_two_branches():
  cfg, params = tiny_model(dtype="float32", perturb=0.0)
  batch = make_batch(0, B=2, R=3, P=6, T=3, logps=True)
  with pytest.raises(ValueError, match=r"expects a last fan-out of 2"):
    jax.eval_shape(lambda p: engine.loss_and_grad(p, batch, cfg, losses.LossConfig("dpo")), params)


def test_unknown_objective_lists_choices():
  with pytest.raises(ValueError, match=r"loss.name='nope'.*\['dpo', 'grpo', 'gspo'"):
    losses.LossConfig(name="nope")


def test_register_a_new_objective():
  name = "test_only_neg_logp"
  if name not in losses.OBJECTIVES:
    losses.register(name)(lambda logp, old, ref, adv, cfg: -logp)
  with jax.enable_x64(True):
    cfg, params = tiny_model(dtype="float64", perturb=0.0)
    batch = make_batch(3, B=1, R=2, P=5, T=3, dtype=jnp.float64)
    a = naive_loss(params, batch, cfg, losses.LossConfig(name=name, aggregation="sum"))
    b = naive_loss(
      params,
      batch.with_leaves(advantages_BR=jnp.ones((1, 2))),
      cfg,
      losses.LossConfig(name="pg", aggregation="sum"),
    )
    assert float(a) == pytest.approx(float(b), rel=1e-12)
  with pytest.raises(ValueError, match="already registered"):
    losses.register(name)(lambda *a: 0)
