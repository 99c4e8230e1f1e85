"""replay.auto_tree: the trainer's own sampled groups laid out as their token trie and trained
as a TreeBatch through the same train step: loss, diagnostics and every gradient leaf equal
the flat batch's (float64); the trainer end to end on and off; what Config refuses."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.train import metrics, phases, steps, summary, trainer
from branch_replay.core import tree
from branch_replay import rollout
from branch_replay.train import state as train_state
from branch_replay.config import Config, apply_overrides
from models import transformer as tfm
from helpers import max_rel_err
from branch_replay.core import trie
from helpers import trie_rollouts

# Diagnostics that are sums over every scored position of a path (trunk and tail alike),
# hence layout-independent. kl, entropy and logp/mean are means over a leaf's own tokens
# (a flat batch: its tails), which a tree's trunk shortens.
PATH_METRICS = ("loss/policy", "grad/norm", "clip_frac", "approx_kl", "ratio/max")


def sampled_batch(B=2, opening=4, trunk=2):
  """A flat batch as the sampler builds it: prompt + `trunk` trunk tokens as the prefix,
  the rest of each response as its tail; every response of a prompt shares `opening`
  tokens (trunk included) and, within groups of two, more."""
  prompts, responses, adv, old = trie_rollouts(2, B=B, opening=opening)
  ref = [[o - 0.25 for o in rs] for rs in old]
  flat = trie.flat_batch(
    prompts,
    [[r[trunk:] for r in rs] for rs in responses],
    adv,
    old_logps=[[o[trunk:] for o in rs] for rs in old],
    ref_logps=[[o[trunk:] for o in rs] for rs in ref],
  )
  f = lambda xs: jnp.asarray(np.stack([rs[0][:trunk] for rs in xs]))
  return flat.replace(
    root_BP=jnp.concatenate([flat.root_BP, f(responses).astype(jnp.int32)], 1),
    root_valid_BP=jnp.concatenate([flat.root_valid_BP, jnp.ones((B, trunk), bool)], 1),
    trunk_old_logp_BW=f(old),
    trunk_ref_logp_BW=f(ref),
    trunk_len=trunk,
  )


@pytest.mark.parametrize(
  "overrides",
  [(), pytest.param(("replay.branch_chunk=2", "loss.name=gspo"), marks=pytest.mark.slow)],
)
def test_auto_tree_batch_trains_as_the_flat_batch_float64(overrides):
  """The trainer's loss and gradient (steps.loss_and_grad, what its jitted step
  differentiates) on the sampled batch and on its automatic tree: equal loss and every
  gradient leaf. (The step itself on both layouts: the trainer test below.)"""
  with jax.enable_x64(True):
    cfg = apply_overrides(
      Config(model=tfm.preset("tiny", dtype="float64", param_dtype="float64")),
      [
        "replay.auto_tree=true",
        "train.n_branches=4",
        "loss.kl_coef=0.1",
        "train.batch_size=2",
        *overrides,
      ],
    )
    flat = sampled_batch()
    batch, stats = rollout.auto_tree(flat, cfg)
    assert isinstance(batch, tree.TreeBatch)
    # 4 shared tokens (2 of them already the sampler's trunk) -> trunk; pairs -> a level
    # (one level only with branch_chunk: the chunk must divide the last fan-out).
    assert stats["replay/trunk_len"] == 4
    assert stats["replay/fanouts"] == ("4" if overrides else "2x2")
    prefix, tails, _ = flat.token_counts()
    assert stats["replay/tree_token_ratio"] > 1 and sum(batch.token_counts()[:2]) < prefix + tails
    params = train_state.init_state(cfg).params
    fn = jax.jit(
      lambda p, b: steps.loss_and_grad(
        cfg, p, b, steps.rl_loss_config(cfg), cfg.replay.branch_chunk
      )
    )
    (lf, aux_f, gf), (lt, aux_t, gt) = fn(params, flat), fn(params, batch)
    assert abs(float(lt) - float(lf)) <= 1e-10 * abs(float(lf))
    assert max_rel_err(gt, gf) < 1e-10
    assert min(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(gf)) > 0
    # Per-path diagnostics (trunk and tail alike) do not depend on the layout.
    for k in ("scored_tokens", "clip_sum", "approx_kl_sum", "ratio_max"):
      np.testing.assert_allclose(
        float(aux_t[k].sum()), float(aux_f[k].sum()), rtol=1e-10, err_msg=k
      )


def _records(workdir):
  return [
    r for r in metrics.read(os.path.join(workdir, "metrics.jsonl")) if r.get("kind") == "train"
  ]


def char_sum(examples, completions):
  """A reward that varies with every completion (so the group advantages are not 0)."""
  del examples
  return [float(sum(map(ord, c)) % 7) / 7 for c in completions]


def test_trainer_with_auto_tree_on_and_off(tmp_path):
  """The trainer end to end, replay.auto_tree off and on: the same seed samples the same
  groups, so every step's loss and gradient agree (float64: in float32 the second step's
  metrics differ by ~1e-4 relative on some CPUs, because AdamW's first update normalises
  gradient components that are rounding noise into full-size steps, so the two runs start
  step 2 from different weights). The sampler's 2-token trunk and near-greedy branches
  (temperature 0.1) give the openings; old and reference log-probs travel with them into
  the tree."""
  path = tmp_path / "prompts.jsonl"
  path.write_text(
    "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(8))
  )
  common = (
    "task.name=jsonl",
    f"task.path={path}",
    "task.prompt_len=8",
    f"task.reward={__name__}:char_sum",
    "train.sft_steps=0",
    "sampler.temperature=0.1",
    "sampler.max_new_tokens=4",
    "sampler.trunk_len=2",
    "loss.kl_coef=0.05",
  )
  model = tfm.preset("tiny", dtype="float64", param_dtype="float64")
  cfg = lambda *more: apply_overrides(
    Config(model=model),
    [
      *common,
      "train.rl_steps=2",
      "train.batch_size=2",
      "train.n_branches=4",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      *more,
    ],
  )
  with jax.enable_x64(True):
    off = trainer.run(cfg(), str(tmp_path / "off"))
    on = trainer.run(cfg("replay.auto_tree=true"), str(tmp_path / "on"))
  ra, rb = _records(off["workdir"]), _records(on["workdir"])
  assert len(ra) == len(rb) == 2
  for x, y in zip(ra, rb):
    assert x["reward/mean"] == y["reward/mean"] and x["reward/std"] > 0
    assert x["grad/norm"] > 1e-3
    # The loss is a sum of O(1) terms (advantages x ratios) that cancel to ~1e-3 and
    # approx_kl is ~1e-13 (on-policy): both are compared at their terms' float64 resolution
    # (absolute), every metric at 1e-9 relative.
    for k in PATH_METRICS:
      atol = {"loss/policy": 1e-12, "approx_kl": 1e-15}.get(k, 0.0)
      np.testing.assert_allclose(y[k], x[k], rtol=1e-9, atol=atol, err_msg=k)
    assert y["replay/trunk_len"] >= 2 and y["time/layout_s"] > 0
    assert y["replay/computed_tokens"] <= x["replay/computed_tokens"]
    for r in (x, y):  # the step by phase, on both paths
      assert all(r[f"time/{p}_s"] >= 0 for p in phases.PHASES)
      assert r["time/sample_s"] > 0 and r["time/update_s"] > 0 and r["time/ref_logp_s"] > 0
      assert r["time/old_logp_s"] == 0.0  # returned by the sampler: part of sampling
  assert set(on["time_by_phase"]) == set(phases.PHASES) and on["time_by_phase"]["update"] > 0
  assert "time by phase (RL steps): sample" in summary.render(on)


@pytest.mark.parametrize(
  "override,field",
  [
    ("tree.fanouts=2x2;task.name=tree_haystack", "tree.fanouts"),
    ("algo.name=ppo", "algo.name"),
    ("algo.name=rollouts;task.name=rollouts", "algo.name"),
  ],
)
def test_config_refuses_what_the_tree_layout_cannot_serve(override, field):
  with pytest.raises(ValueError, match=f"{field}=.* with replay.auto_tree=true: .*expected"):
    apply_overrides(Config(), ["replay.auto_tree=true", *override.split(";")])
  apply_overrides(Config(), override.split(";") if "rollouts" not in override else [])  # alone: ok


def test_dpo_is_refused():
  with pytest.raises(ValueError, match="algo.name='dpo' with replay.auto_tree=true"):
    apply_overrides(
      Config(), ["train.n_branches=2", "algo.name=dpo", "loss.name=dpo", "replay.auto_tree=true"]
    )
