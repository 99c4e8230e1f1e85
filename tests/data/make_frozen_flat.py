"""Freeze the flat engine's outputs (loss, aux, every gradient leaf) in float64 on seeded batches.

  JAX_PLATFORMS=cpu python -m tests.data.make_frozen_flat   # writes tests/data/frozen_flat.npz

Generated once at 625fa22 (policy.loss_and_grad before the one-engine refactor); the regression
test tests/frozen_flat_test.py checks the engine still produces these numbers.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import losses, policy
from models import transformer as tfm

PATH = os.path.join(os.path.dirname(__file__), "frozen_flat.npz")
MODEL = dict(vocab_size=32, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8,
             mlp_hidden=32)
# name -> (batch shape/options, loss config, branch_chunk)
CASES = {
    "grpo_padding_ragged": (dict(B=2, R=4, P=7, T=5), dict(), None),
    "grpo_trunk_seq_mean": (dict(B=2, R=3, P=8, T=4, W=3), dict(aggregation="seq_mean"), None),
    "ppo_clip_kl": (dict(B=2, R=4, P=8, T=5, W=2, logps=True),
                    dict(name="ppo", kl_coef=0.1, epsilon=0.1, epsilon_high=0.3), None),
    "gspo": (dict(B=2, R=3, P=8, T=5, W=2, logps=True),
             dict(name="gspo", epsilon=0.01, kl_coef=0.1, aggregation="seq_mean"), None),
    "dpo": (dict(B=2, R=2, P=9, T=5, W=2, logps=True), dict(name="dpo"), None),
    "stream_chunk2_trunk": (dict(B=2, R=4, P=8, T=4, W=2), dict(), 2),
    "pg_sum": (dict(B=2, R=3, P=6, T=4), dict(name="pg", aggregation="sum"), None),
    "ppo_gae_temperature": (dict(B=2, R=3, P=8, T=5, W=2, logps=True, token_adv=True),
                            dict(name="ppo", temperature=0.7, kl_coef=0.1), None),
    "single_token_tails": (dict(B=1, R=3, P=5, T=1, ragged=False), dict(), None),
    "stream_chunk1_ppo": (dict(B=2, R=4, P=7, T=4, W=1, logps=True),
                          dict(name="ppo", aggregation="seq_mean", kl_coef=0.05), 1),
}


def model():
  cfg = tfm.ModelConfig(**MODEL, dtype="float64", param_dtype="float64")
  params = tfm.init_params(cfg, jax.random.key(0))
  leaves, treedef = jax.tree.flatten(params)  # perturb norms/biases away from their init
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return cfg, jax.tree.unflatten(treedef, leaves)


def batch_of(seed, spec):
  from tests.replay_test import make_batch
  spec = dict(spec)
  token_adv = spec.pop("token_adv", False)
  batch = make_batch(seed, vocab=MODEL["vocab_size"], dtype=jnp.float64, **spec)
  if token_adv:  # PPO's per-token (GAE) advantages
    rng = np.random.default_rng(seed + 1000)
    B, R, T = batch.leaves.tokens_BRT.shape
    batch = batch.with_leaves(advantages_BRT=jnp.asarray(rng.normal(size=(B, R, T)))).replace(
        trunk_advantages_BRW=jnp.asarray(rng.normal(size=(B, R, batch.trunk_len))))
  return batch


def flatten(prefix, tree):
  return {prefix + jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_leaves_with_path(tree)}


def run_case(params, cfg, i, name):
  spec, loss_kw, chunk = CASES[name]
  batch = batch_of(i, spec)
  lc = losses.LossConfig(**loss_kw)
  fn = jax.jit(lambda p, b: policy.loss_and_grad(p, b, cfg, lc, "replay", chunk))
  return fn(params, batch)


def main():
  with jax.enable_x64(True):
    cfg, params = model()
    out = flatten("params/", params)
    for i, name in enumerate(CASES):
      loss, aux, grads = run_case(params, cfg, i, name)
      out[f"{name}/loss"] = np.asarray(loss)
      out.update(flatten(f"{name}/aux", aux))
      out.update(flatten(f"{name}/grads", grads))
    np.savez_compressed(PATH, **out)
    print(f"wrote {PATH}: {len(out)} arrays, {os.path.getsize(PATH)} bytes")


if __name__ == "__main__":
  main()
