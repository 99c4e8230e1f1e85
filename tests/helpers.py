"""Helpers shared by the test modules: random flat batches and trees, the cached tiny model
(of any family), tiny run configs (`tiny_run`, `tiny_tree_run`, `short_run`, `short_tree_run`),
the loop's counting algorithm, gradient comparisons. No test module imports another
(tests/system/imports_test.py): what two share lives here, in oracles.py or in a cases module.
Import by basename (`from helpers import ...`), the name pytest imports test modules by
(tests/ has no __init__.py): `tests.helpers` would be a second copy with caches of its own."""

import functools
import json
import os
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from branch_replay.algorithms import base
from branch_replay.core import engine, losses, tree
from branch_replay.data.tokenizer import TOKENIZER
from branch_replay.train import state as train_state
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


# ----------------------------------------------------------------------------- short runs


def short_run(*overrides):
  """A tiny flat run of 1 SFT + 2 RL steps (B=2, R=4, T=2) with a checkpoint after each
  step (run_test, crash_test, preemption_test)."""
  return tiny_run(
    "train.sft_steps=1",
    "train.rl_steps=2",
    "train.batch_size=2",
    "train.n_branches=4",
    "train.sft_batch_size=2",
    "sampler.max_new_tokens=2",
    "train.checkpoint_every=1",
    "train.learning_rate=3e-3",
    *overrides,
  )


def short_tree_run(*overrides):
  """A tiny tree run of 1 SFT + 1 RL step on the character tokenizer's vocabulary, eval on 2
  prompts, a checkpoint every 2 steps (trainer_test, ppo_test)."""
  return tiny_tree_run(
    "train.sft_steps=1",
    "train.rl_steps=1",
    "train.batch_size=2",
    "train.sft_batch_size=2",
    "train.eval_size=2",
    "train.checkpoint_every=2",
    *overrides,
    vocab_size=TOKENIZER.vocab_size,
  )


# ----------------------------------------------------------------------------- the loop alone


class CountingAlgorithm(base.Algorithm):
  """An algorithm that trains nothing: each step adds 1 to every parameter and reports a
  loss (NaN at step `nan_at`); the loop's own logic (phases, checkpoints, resume, NaN stop)
  runs as for any algorithm, without compiling a train step (the rest: the base's)."""

  phase, progress_keys, nan_at, made = "rl", (), None, []

  def __init__(self, cfg, task, tok, workdir=None, runtime=None):
    super().__init__(cfg, task, tok, workdir, runtime)
    self.steps = []
    CountingAlgorithm.made.append(self)

  def _step(self, state, step):
    loss = float("nan") if step == self.nan_at else 1.0 / (step + 1)
    state = state.replace(step=state.step + 1, params=jax.tree.map(lambda x: x + 1, state.params))
    return state, {"loss/policy": loss, "grad/norm": 1.0}

  def warmup_batch(self, step):
    return ("sft", step)

  def warmup_update(self, state, batch):
    return self._step(state, batch[1])

  def start(self, state):
    self.steps.append("start")
    return state

  def batch(self, state, step):
    self.steps.append(step)
    return ("rl", step), {"reward/mean": 0.5}

  def update(self, state, batch, step):
    return self._step(state, step)

  def token_counts(self, batch, phase):
    return (1, 2, 4)

  def eval_examples(self):
    return []

  def restore_template(self, state, step):
    return train_state.state_dict(state)


def loop_config(*overrides):
  """The Config CountingAlgorithm runs under: 1 SFT + 2 RL steps, a checkpoint each, quiet."""
  from branch_replay.config import Config, apply_overrides

  return apply_overrides(
    Config(model=tfm.preset("tiny", vocab_size=TOKENIZER.vocab_size)),
    [
      "task.prompt_len=16",
      "task.n_keys=2",
      "train.sft_steps=1",
      "train.rl_steps=2",
      "train.eval_size=0",
      "train.progress=false",
      "train.plot=false",
      "train.tensorboard=false",
      "train.checkpoint_every=1",
      *overrides,
    ],
  )


# ----------------------------------------------------------------------------- more batches


def logp_batch(seed, B, R, P, T, W=2):
  """Left-padded prefixes with a trunk, ragged tails, off-policy and reference log-probs."""
  return make_batch(seed, B, R, P, T, W=W, logps=True)


SHARDING_LOSS = losses.LossConfig(name="grpo", kl_coef=0.05, epsilon=0.1)  # sharding and multihost


def trie_rollouts(seed, B=2, R=4, opening=3, group=2, vocab=128, logps=True):
  """Responses sharing an opening (per prompt) and, within groups of `group`, more."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, vocab, rng.integers(3, 7)) for _ in range(B)]
  responses, old = [], []
  for b in range(B):
    head = list(rng.integers(1, vocab, opening + b))  # prompt 1 shares one more token
    rs = []
    for g in range(R // group):
      mid = list(rng.integers(1, vocab, 2 + g))
      rs += [head + mid + list(rng.integers(1, vocab, rng.integers(1, 4))) for _ in range(group)]
    order = rng.permutation(R)  # shared openings need not be adjacent in the file
    rs = [rs[i] for i in order]
    responses.append([np.array(r) for r in rs])
    # Behaviour log-probs depend on the prefix only (as a sampler's), so shared tokens agree.
    old.append(
      [np.array([-(1 + (sum(r[: t + 1]) * 7919) % 97 / 20) for t in range(len(r))]) for r in rs]
    )
  adv = rng.normal(size=(B, R))
  return prompts, responses, adv, (old if logps else None)


def hf_batch(B=2, R=2, P=8, T=4, W=1, vocab=64):
  """A flat float32 batch for the checkpoint-import tests (hf_test, hf_hybrid_test): left
  padding on prompt 1, ragged tails, seed 0."""
  rng = np.random.default_rng(0)
  prefix_valid = np.ones((B, P), bool)
  prefix_valid[1, :2] = False  # left padding on prompt 1
  lengths = rng.integers(1, T + 1, (B, R))
  lengths[0, 0] = T
  return tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, vocab, (B, P)), jnp.int32),
    prefix_valid_BP=jnp.asarray(prefix_valid),
    tails_BRT=jnp.asarray(rng.integers(0, vocab, (B, R, T)), jnp.int32),
    tail_valid_BRT=jnp.asarray(np.arange(T)[None, None] < lengths[..., None]),
    advantages_BR=jnp.asarray(rng.normal(size=(B, R)), jnp.float32),
    trunk_len=W,
  )


def full_sequences(batch):
  """Every branch as its own [P+T] sequence: tokens, validity, RoPE positions ([B*R, S])."""
  B, R, T = batch.leaves.tokens_BRT.shape
  P = batch.root_BP.shape[1]
  seq = lambda prefix, tails: np.concatenate(
    [np.broadcast_to(np.asarray(prefix)[:, None], (B, R, P)), np.asarray(tails)], -1
  ).reshape(B * R, P + T)
  tokens = seq(batch.root_BP, batch.leaves.tokens_BRT)
  valid = seq(batch.root_valid_BP, batch.leaves.valid_BRT)
  return tokens, valid, np.maximum(np.cumsum(valid, 1) - 1, 0)


# ----------------------------------------------------------------------------- processes


def free_port():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def rl_run(*overrides):
  """A tiny flat RL run without warm-up: 2 steps of B=4 prompts x R=4 branches of 2 tokens
  (grpo_test, ppo_test, config_test)."""
  return tiny_run(
    "train.sft_steps=0",
    "train.rl_steps=2",
    "train.batch_size=4",
    "train.n_branches=4",
    "sampler.max_new_tokens=2",
    "train.checkpoint_every=5",
    *overrides,
  )


def fail_finalize_of(monkeypatch, step, error):
  """orbax's rename of a save's temporary directory to `step` raises `error` instead."""
  from orbax.checkpoint._src.path import atomicity

  finalize = atomicity.AtomicRenameTemporaryPath.finalize

  async def fail(self, *a, **k):
    if self._final_path.name == str(step):
      raise error
    return await finalize(self, *a, **k)

  monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", fail)
