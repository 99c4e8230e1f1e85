"""model.attention=fused against blockwise (the oracle of the GPU path), float32, one JSON line.

Two checks: (1) attention alone on the replay tail's shape (a prefix segment folded over R
branch rows + the tails' own causal keys, left/right padding): the output and the gradients
of q and of every segment's k, v; (2) the whole replay step (engine.loss_and_grad): the loss
and every parameter gradient. Each leaf passes when max|fused - blockwise| <= rtol *
max|blockwise| (rtol 1e-3 by default). Exit status 1 on a mismatch.

  python experiments/fused_check.py --out=$OUT/fused_check.jsonl        # on an H100/H200
  python experiments/fused_check.py --kernel=reference --preset=tiny     # CPU: the merge only
"""

from __future__ import annotations

import sys


from absl import app, flags  # noqa: E402

from experiments import compare  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_enum(
    "kernel",
    "tokamax",
    ["tokamax", "reference"],
    "reference: tokamax's contract in plain jax (checks the dispatch and merge on a CPU)",
  )
  flags.DEFINE_string("preset", "small", "model preset of the step check")
  flags.DEFINE_integer("prefix_len", 512, "P")
  flags.DEFINE_integer("tail_len", 64, "T")
  flags.DEFINE_integer("branches", 4, "R")
  flags.DEFINE_float("rtol", 1e-3, "per-leaf tolerance relative to the leaf's max")
  flags.DEFINE_string("out", "", "append the JSON line here")


def attention_check():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from models import attention

  rng = np.random.default_rng(0)
  B, R, T, P, N, K, H = 2, FLAGS.branches, FLAGS.tail_len, FLAGS.prefix_len, 8, 4, 128
  valid_BP = np.arange(P)[None] >= np.array([[P // 3], [0]])
  pos_BP = np.cumsum(valid_BP, 1) - valid_BP
  lens = rng.integers(1, T + 1, B * R)
  tvalid = np.arange(T)[None] < lens[:, None]
  tpos = np.cumsum(tvalid, 1) - tvalid + np.repeat(valid_BP.sum(1), R)[:, None]
  new = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  segs = [
    attention.KeySegment(
      new(B, P, K, H), new(B, P, K, H), jnp.asarray(pos_BP), jnp.asarray(valid_BP)
    ),
    attention.KeySegment(
      new(B * R, T, K, H), new(B * R, T, K, H), jnp.asarray(tpos), jnp.asarray(tvalid), causal=True
    ),
  ]
  q = new(B * R, T, N, H)
  w = new(B * R, T, N, H)

  def run(impl):
    def loss(q, kvs):
      ss = [s._replace(k_BSKH=k, v_BSKH=v) for s, (k, v) in zip(segs, kvs)]
      o = attention.attend(q, jnp.asarray(tpos), jnp.asarray(tvalid), ss, impl=impl)
      return jnp.sum(o * w), o

    kvs = [(s.k_BSKH, s.v_BSKH) for s in segs]
    (_, o), g = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(q, kvs)
    return o, g

  names = ["out", "dq", "dk_prefix", "dv_prefix", "dk_own", "dv_own"]
  return compare.tree_rel_errs(run("fused"), run("blockwise"), names)


def step_check():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.core import engine, losses, tree
  from models import config, transformer as tfm

  P, T, R = FLAGS.prefix_len, FLAGS.tail_len, FLAGS.branches
  cfgs = {impl: config.preset(FLAGS.preset, attention=impl) for impl in ("fused", "blockwise")}
  params = tfm.init_params(cfgs["blockwise"], jax.random.key(0))
  rng = np.random.default_rng(0)
  V = cfgs["blockwise"].vocab_size
  batch = tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, V, (1, P)), jnp.int32),
    prefix_valid_BP=jnp.ones((1, P), bool),
    tails_BRT=jnp.asarray(rng.integers(0, V, (1, R, T)), jnp.int32),
    tail_valid_BRT=jnp.ones((1, R, T), bool),
    advantages_BR=jnp.asarray(rng.normal(size=(1, R)), jnp.float32),
  )
  out = {
    impl: jax.jit(
      lambda p, b, c=c: engine.loss_and_grad(p, b, c, losses.LossConfig("grpo"), "replay")[::2]
    )(params, batch)
    for impl, c in cfgs.items()
  }
  names = ["loss"] + [
    jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(params)
  ]
  return compare.tree_rel_errs(out["fused"], out["blockwise"], names)


def main(argv):
  del argv
  import jax
  from experiments import provenance
  from models.attention import fused as attention_fused

  if FLAGS.kernel == "reference":  # the dispatch and merge, on any backend
    attention_fused.unavailable_reason = lambda: None
    attention_fused.kernel = attention_fused.reference_kernel
  with jax.default_matmul_precision("highest"):
    errs = {"attention": attention_check(), "step": step_check()}
  worst = max((e, f"{part}:{name}") for part, d in errs.items() for name, e in d.items())
  row = dict(
    check="fused_vs_blockwise",
    kernel=FLAGS.kernel,
    preset=FLAGS.preset,
    prefix_len=FLAGS.prefix_len,
    tail_len=FLAGS.tail_len,
    branches=FLAGS.branches,
    dtype="float32",
    rtol=FLAGS.rtol,
    max_rel_err=worst[0],
    worst_leaf=worst[1],
    passed=worst[0] <= FLAGS.rtol,
    errors=errs,
    device=attention_fused.device_found(),
    provenance=provenance.provenance(),
  )
  provenance.emit(row, FLAGS.out)
  sys.exit(0 if row["passed"] else 1)


if __name__ == "__main__":
  define_flags()
  app.run(main)
