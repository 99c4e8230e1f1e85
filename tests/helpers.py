"""Helpers shared by the test modules: random flat batches and trees, the cached tiny model
(of any family), tiny run configs (`tiny_run`, `tiny_tree_run`), gradient comparisons.
Import by basename (`from helpers import ...`), the name pytest imports test modules by
(tests/ has no __init__.py): `tests.helpers` would be a second copy with caches of its own."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.core import engine, tree
from branch_replay.core.tree import TreeBatch, TreeLevel
from models import transformer as tfm
from oracles import flat_naive_loss_and_grad


def x64_enabled() -> bool:
  """Whether float64 arrays are float64 here (inside `jax.enable_x64(True)`), without a warning."""
  return jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64


def cache_per_x64(fn):
  """functools.lru_cache keyed on the call AND on whether x64 is on: a model built with
  dtype='float64' outside `jax.enable_x64` has float32 arrays, and a plain cache would hand
  those to a later float64 test in the same worker (its 1e-10 checks then fail at ~1e-7, as
  they did when the test files' distribution over workers changed)."""
  cached = functools.lru_cache(maxsize=None)(lambda x64, *args, **kwargs: fn(*args, **kwargs))

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return cached(x64_enabled(), *args, **kwargs)

  return wrapper


# ----------------------------------------------------------------------------- tiny runs

# What every tiny trainer run shares: the "tiny" preset, no evaluation, no progress bar, no plot.
QUIET = ("train.eval_size=0", "train.progress=false", "train.plot=false")


def tiny_run(*overrides, **model):
  """A tiny flat run's Config: the haystack task at prompt_len 20 with 2 keys, quiet; then
  `overrides` in order (a test file's own settings, then the test's). `model`: preset fields."""
  from branch_replay.config import Config, apply_overrides

  return apply_overrides(
    Config(model=tfm.preset("tiny", **model)),
    ["task.prompt_len=20", "task.n_keys=2", *QUIET, *overrides],
  )


def tiny_tree_run(*overrides, **model):
  """A tiny tree run's Config: the two-turn haystack (prompt_len 16, 2 keys, warm-up prompts
  of 12) on 2x2 trees, quiet; then `overrides` in order."""
  from branch_replay.config import Config, apply_overrides

  return apply_overrides(
    Config(model=tfm.preset("tiny", **model)),
    [
      "task.name=tree_haystack",
      "task.prompt_len=16",
      "task.n_keys=2",
      "task.sft_prompt_len=12",
      "tree.fanouts=2x2",
      *QUIET,
      *overrides,
    ],
  )


# ----------------------------------------------------------------------------- tiny models

# Tiny models of each family: every option a family switches on (biases, q/k norms, post
# norms, soft caps, sliding windows below the test prompts' length, local RoPE, scaling).
TINY = dict(
  vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=48
)
GEMMA = dict(
  post_norms=True,
  scale_embeddings=True,
  norm_offset=1.0,
  activation="gelu_tanh",
  tie_embeddings=True,
  query_pre_attn_scalar=12.0,
)
WINDOW = 4  # below the test prefixes' length: the windowed prefix cache is really sliced
FAMILIES = {
  "llama3": dict(
    rope_theta=500000.0,
    rope_scaling=tfm.RopeScaling(
      "llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=16
    ),
  ),
  "qwen2": dict(qkv_bias=True, tie_embeddings=True, sliding_window=WINDOW, local_layers=(1,)),
  "qwen3": dict(qk_norm=True),
  "mistral": dict(sliding_window=WINDOW),
  "gemma2": dict(
    GEMMA, sliding_window=WINDOW, local_layers=(0,), attn_logit_softcap=2.0, final_logit_softcap=3.0
  ),
  "gemma3": dict(
    GEMMA,
    qk_norm=True,
    sliding_window=WINDOW,
    local_layers=(0,),
    local_rope_theta=100.0,
    rope_scaling=tfm.RopeScaling("linear", 2.0),
  ),
}


@cache_per_x64
def tiny_model(family=None, dtype="float64", perturb=0.1, **overrides):
  """(cfg, params): the "tiny" preset (vocab 128), or a family's tiny model (vocab 64), with
  every parameter leaf perturbed by `perturb` standard deviations (norm scales, biases and
  q/k norms away from their identity init, so their gradients are exercised)."""
  if family is None:
    cfg = tfm.preset("tiny", dtype=dtype, param_dtype=dtype, **overrides)
  else:
    cfg = tfm.ModelConfig(
      **{**TINY, **FAMILIES[family], **overrides}, dtype=dtype, param_dtype=dtype
    )

  @jax.jit
  def init(key):
    leaves, treedef = jax.tree.flatten(tfm.init_params(cfg, key))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    return jax.tree.unflatten(
      treedef, [x + perturb * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    )

  return cfg, init(jax.random.key(0))


# ----------------------------------------------------------------------------- random batches


def make_batch(
  seed, B, R, P, T, W=0, ragged=True, vocab=128, pad_prefix=True, logps=False, dtype=jnp.float32
):
  """A random flat batch (a depth-1 tree): left padding on prompt 1, ragged tails (>= 1 token), optional
  off-policy and reference log-probs (ratio clipping and KL are exercised)."""
  rng = np.random.default_rng(seed)
  prefix_valid = np.ones((B, P), bool)
  if pad_prefix and B > 1 and P > W + 2:
    prefix_valid[1, : rng.integers(1, P - W - 1)] = False  # left padding on prompt 1
  tail_valid = np.ones((B, R, T), bool)
  if ragged and T > 1:
    lengths = rng.integers(1, T + 1, size=(B, R))
    tail_valid = np.arange(T)[None, None] < lengths[..., None]
  extra = {}
  if logps:
    extra = dict(
      old_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, T)), dtype),
      ref_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, T)), dtype),
      trunk_old_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype),
      trunk_ref_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype),
    )
  return tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32),
    prefix_valid_BP=jnp.asarray(prefix_valid),
    tails_BRT=jnp.asarray(rng.integers(0, vocab, (B, R, T)), jnp.int32),
    tail_valid_BRT=jnp.asarray(tail_valid),
    advantages_BR=jnp.asarray(rng.normal(size=(B, R)), dtype),
    trunk_len=W,
    **extra,
  )


def make_tree(
  seed,
  fanouts,
  B=2,
  P=7,
  T=(4, 3, 3),
  W=0,
  ragged=True,
  logps=False,
  node_advantages=False,
  holes=False,
  vocab=128,
  dtype=jnp.float64,
):
  """A random tree: left-padded roots, ragged nodes (>= 1 token; node 0 of prompt 0 full),
  optional unscored holes in inner nodes (tool text), per-node advantages and
  off-policy/reference log-probs."""
  rng = np.random.default_rng(seed)
  root_valid = np.ones((B, P), bool)
  if B > 1:
    root_valid[1, : rng.integers(1, P - W - 1)] = False
  levels = []
  depth = len(fanouts)
  for d in range(1, depth + 1):
    R, Td = int(np.prod(fanouts[:d])), T[d - 1]
    lengths = rng.integers(1, Td + 1, size=(B, R)) if ragged else np.full((B, R), Td)
    lengths[0, 0] = Td
    valid = np.arange(Td)[None, None] < lengths[..., None]
    scored = valid.copy()
    if holes and d < depth:
      scored &= rng.random((B, R, Td)) < 0.6
    extra = {}
    if logps:
      extra = dict(
        old_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, Td)), dtype),
        ref_logp_BRT=jnp.asarray(-rng.uniform(0.5, 6, (B, R, Td)), dtype),
      )
    adv = None
    if d == depth or node_advantages:
      adv = jnp.asarray(rng.normal(size=(B, R)), dtype)
    levels.append(
      TreeLevel(
        tokens_BRT=jnp.asarray(rng.integers(0, vocab, (B, R, Td)), jnp.int32),
        valid_BRT=jnp.asarray(valid),
        scored_BRT=jnp.asarray(scored) if holes else None,
        advantages_BR=adv,
        **extra,
      )
    )
  trunk = {}
  if logps:
    trunk = dict(
      trunk_old_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype),
      trunk_ref_logp_BW=jnp.asarray(-rng.uniform(0.5, 6, (B, W)), dtype),
    )
  return TreeBatch(
    root_BP=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32),
    root_valid_BP=jnp.asarray(root_valid),
    levels=tuple(levels),
    fanouts=tuple(fanouts),
    trunk_len=W,
    **trunk,
  )


# ----------------------------------------------------------------------------- comparisons


def max_rel_err(a, b):
  """Largest error over leaves, relative to each leaf's scale (its largest magnitude)."""
  errs = jax.tree.map(
    lambda x, y: float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30)), a, b
  )
  return max(jax.tree.leaves(errs))


def assert_equal_f64(got, want, tol=1e-10, keys=None):
  """(loss, aux, grads) triples equal at `tol`: the loss relative to itself (or 1e-3), every
  gradient leaf relative to its scale, the aux sums `keys` (default: all of want's, which got
  must have); and the gradient is not trivially zero, so the test can fail."""
  (l1, aux1, g1), (l2, aux2, g2) = got, want
  assert abs(float(l1) - float(l2)) <= tol * max(abs(float(l2)), 1e-3), (l1, l2)
  assert jax.tree.structure(g1) == jax.tree.structure(g2)
  err = max_rel_err(g1, g2)
  assert err < tol, err
  for name in keys if keys is not None else aux2:
    np.testing.assert_allclose(aux1[name], aux2[name], rtol=tol, atol=tol, err_msg=name)
  assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(g2)) > 1e-6


def both_paths(cfg, params, batch: TreeBatch, loss_cfg, branch_chunk=None):
  """A flat batch by replay and by the flat oracle (tests/oracles.py: every branch its own
  sequence, no tree code)."""
  tree.validate(batch, cfg.vocab_size, branch_chunk)
  fast = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, "replay", branch_chunk))
  slow = jax.jit(lambda p, b: flat_naive_loss_and_grad(p, b, cfg, loss_cfg))
  return fast(params, batch), slow(params, batch)


def tree_both(cfg, params, batch: TreeBatch, loss_cfg, branch_chunk=None):
  """A tree by replay and by its naive twin (every root-to-leaf path its own sequence)."""
  tree.validate(batch, cfg.vocab_size, branch_chunk)
  run = jax.jit(
    lambda p, b, mode: engine.loss_and_grad(p, b, cfg, loss_cfg, mode, branch_chunk),
    static_argnums=2,
  )
  return run(params, batch, "replay"), run(params, batch, "naive")


def slow_where(values, slow, key=lambda v: v):
  """`values` for `pytest.mark.parametrize` (a tuple: one case's arguments), those whose key
  is in `slow` marked slow: run by `pytest -m slow` only, because a cheaper case of the same
  test covers their path in the default suite (the reason is written beside each call)."""
  return [
    pytest.param(
      *(v if isinstance(v, tuple) else (v,)), marks=[pytest.mark.slow] * (key(v) in slow)
    )
    for v in values
  ]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository


def run_script(script: str, *flags: str) -> list[dict]:
  """Run a script of the repository (e.g. "experiments/bench_reclaim.py") on the CPU with
  `flags`; assert it exits 0 (its stderr's tail otherwise) and return its JSON lines."""
  out = subprocess.run(
    [sys.executable, script, *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def make_hf_folder(path, vocab_size=96):
  """A tiny Llama checkpoint plus a character-level tokenizer.json whose ids differ from the
  shipped CharTokenizer's (reversed order), so using the wrong tokenizer would show."""
  import tokenizers  # a required dependency (requirements.txt)

  from branch_replay.data import tokenizer as tokenizer_lib
  from models import hf

  cfg = tfm.preset("tiny", vocab_size=vocab_size)
  params = tfm.init_params(cfg, jax.random.key(3))
  hf.save(str(path), cfg, params, extra_config=dict(bos_token_id=1, eos_token_id=2, pad_token_id=0))
  chars = tokenizer_lib.CHARS[::-1]
  vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.decoder = tokenizers.decoders.Fuse()
  tok.save(str(path / "tokenizer.json"))
  return cfg, params
