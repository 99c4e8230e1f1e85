"""Where branch replay's step goes: its stages timed apart, and the top XLA ops by self time.

Stages (each its own jit, median of --reps, wall and CPU seconds), in the order they run:
  prefix_fwd   step 1: jax.vjp of the prefill (K/V cache, residuals kept)
  tails        step 2: forward+backward of every tail against the cache (includes log-probs)
  logprobs     the tails' log-prob head alone: lm-head + log-softmax forward+backward over
               the R*T predicting hidden states (part of `tails`; `tails_body` = the rest)
  prefix_bwd   step 3: the prefix backward with the branch-summed cotangent
  optimizer    AdamW (clip + update + apply), as train.py's
  step         the whole fused step (engine.loss_and_grad, one jit) for comparison
Ops: one jax.profiler trace of --trace_reps fused steps; every XLA CPU thunk's self time
(its duration less the thunks nested in it on the same thread), summed per HLO instruction,
with its opcode and the jax op that made it (HLO metadata), and summed per op class
(`op_classes`: matmul, copy, reduce, transpose, elementwise, control; inside a while loop
or not).

  python experiments/profile_replay.py --out=experiments/results/profile_cpu_after_2026-12-02.jsonl \
      --md=experiments/results/profile_cpu_after_2026-12-02.md
"""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_integer("prefix_len", 2048, "P")
  flags.DEFINE_integer("tail_len", 128, "T")
  flags.DEFINE_integer("branches", 16, "R")
  flags.DEFINE_string("preset", "small", "model size preset")
  flags.DEFINE_integer("reps", 3, "timed repetitions per stage (median)")
  flags.DEFINE_integer("trace_reps", 2, "fused steps under the profiler trace")
  flags.DEFINE_integer("top", 20, "ops reported")
  flags.DEFINE_string("out", "", "write the JSON lines here (else stdout only)")
  flags.DEFINE_string("md", "", "write the markdown table here")


def timed(fn, *args, reps):
  import jax
  import numpy as np

  out = jax.block_until_ready(fn(*args))  # compile + warm-up
  walls, cpus = [], []
  for _ in range(reps):
    t0, c0 = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(fn(*args))
    walls.append(time.perf_counter() - t0)
    cpus.append(time.process_time() - c0)
  return out, float(np.median(walls)), float(np.median(cpus))


def make_inputs(P, T, R):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.core import tree
  from models import config, transformer as tfm

  cfg = config.preset(FLAGS.preset)
  params = tfm.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  batch = tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, cfg.vocab_size, (1, P)), jnp.int32),
    prefix_valid_BP=jnp.ones((1, P), bool),
    tails_BRT=jnp.asarray(rng.integers(0, cfg.vocab_size, (1, R, T)), jnp.int32),
    tail_valid_BRT=jnp.ones((1, R, T), bool),
    advantages_BR=jnp.asarray(rng.normal(size=(1, R)), jnp.float32),
  )
  return cfg, params, batch


def stage_times(cfg, params, batch):
  import jax
  import jax.numpy as jnp
  import optax
  from branch_replay.core import engine, losses, replay
  from models import transformer as tfm

  loss_cfg = losses.LossConfig("grpo")
  # The one engine's depth-1 functions: the root (prefix) and every leaf (tail) at once.
  root_fn, _, leaf_loss_fn, branches_R = engine.replay_fns(
    batch, cfg, engine.policy_head(batch, cfg, loss_cfg)
  )
  reps = FLAGS.reps
  rows = {}
  # The tails' inputs are arguments; the prefix tokens are constants of root_fn.
  (cache, prefix_vjp), *t = timed(
    jax.jit(lambda p: replay.prefix_forward(lambda q, _: root_fn(q), p, None)), params, reps=reps
  )
  rows["prefix_fwd"] = t
  tails = jax.jit(
    lambda p, c, b: replay.tails_value_and_grad(
      leaf_loss_fn, p, (c,), b, combine=engine.combine_fn(loss_cfg), batched=True
    )
  )
  (_, _, dparams_tail, (dcache,)), *t = timed(tails, params, cache, branches_R, reps=reps)
  rows["tails"] = t
  B, R, T = batch.leaves.tokens_BRT.shape
  N = B * R
  h_NTD = jax.random.normal(jax.random.key(1), (N, T, cfg.d_model), cfg.compute_dtype)
  tokens_NT = batch.leaves.tokens_BRT.reshape(N, T)

  def logp_loss(p, h):
    logp, entropy = tfm.token_logps(p, cfg, h, tokens_NT)
    return logp.sum() + 0.0 * entropy.sum()

  _, *t = timed(jax.jit(jax.value_and_grad(logp_loss, (0, 1))), params, h_NTD, reps=reps)
  rows["logprobs"] = t
  dcache = jax.tree.map(lambda d, c: d.astype(c.dtype), dcache, cache)
  (dparams_prefix,), *t = timed(jax.jit(lambda v, d: v(d)), prefix_vjp, dcache, reps=reps)
  rows["prefix_bwd"] = t
  grads = jax.tree.map(jnp.add, dparams_tail, dparams_prefix)
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, b1=0.9, b2=0.99))
  opt_state = opt.init(params)

  def opt_step(p, s, g):
    updates, s = opt.update(g, s, p)
    return optax.apply_updates(p, updates), s

  _, *t = timed(jax.jit(opt_step), params, opt_state, grads, reps=reps)
  rows["optimizer"] = t
  step = jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, "replay")[::2])
  _, *t = timed(step, params, batch, reps=reps)
  rows["step"] = t
  rows["tails_body"] = [
    rows["tails"][0] - rows["logprobs"][0],
    rows["tails"][1] - rows["logprobs"][1],
  ]
  return rows, step


def hlo_index(hlo_text):
  """HLO instruction name -> (opcode, jax op_name from the metadata)."""
  out = {}
  pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^=]*?\b([a-z][\w\-]*)\(")
  for line in hlo_text.splitlines():
    m = pat.match(line)
    if not m:
      continue
    op = re.search(r'op_name="([^"]*)"', line)
    kind = re.search(r"kind=(k\w+)", line)
    opcode = m.group(2) + (f"({kind.group(1)})" if kind else "")
    out[m.group(1)] = (opcode, op.group(1) if op else "")
  return out


def op_classes(hlo_text):
  """HLO instruction name -> (class, in_loop). class: `matmul` (a dot or convolution, or a
  fusion whose computations hold one), `reduce` (or a fusion holding one), `copy` (copy /
  transpose / slice moves, or a fusion of only those), `transpose` (element-wise work fused
  with a layout change: a fusion holding a transpose, e.g. an activation's gradient written
  transposed for a weight-gradient matmul), `elementwise` (other fusions and element-wise
  ops), `control` (while, conditional, call: their own dispatch time) or `other`;
  in_loop: the instruction runs inside an XLA while loop (the blockwise attention's tiles,
  chunked log-probs, a layer scan)."""
  comps, current = {}, None
  header = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{$")
  pat = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
  callee = re.compile(r"\b(?:calls|body|condition|to_apply)=%?([\w.\-]+)")
  for line in hlo_text.splitlines():
    m = header.match(line)
    if m:
      current = comps.setdefault(m.group(1), [])
      continue
    m = pat.match(line) if current is not None else None
    if m:
      callees = callee.findall(line)
      if "branch_computations={" in line:
        callees += re.findall(r"%([\w.\-]+)", line.split("branch_computations={")[1].split("}")[0])
      current.append((m.group(1), m.group(3), callees))
  memo = {}

  def opcodes(comp, seen=()):
    """Every opcode a computation runs, its callees' included."""
    if comp not in memo:
      found = set()
      for _, opcode, cs in comps.get(comp, ()):
        found.add(opcode)
        for c in cs:
          if c not in seen:
            found |= opcodes(c, seen + (comp,))
      memo[comp] = found
    return memo[comp]

  loop = set()  # computations a while loop runs, and everything they call
  frontier = [
    c for rows in comps.values() for _, opcode, cs in rows if opcode == "while" for c in cs
  ]
  while frontier:
    c = frontier.pop()
    if c not in loop:
      loop.add(c)
      frontier += [x for _, _, cs in comps.get(c, ()) for x in cs]
  moves = {
    "copy",
    "transpose",
    "bitcast",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "reshape",
    "broadcast",
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
  }
  out = {}
  for comp, rows in comps.items():
    for name, opcode, cs in rows:
      inner = set().union(*(opcodes(c) for c in cs)) if opcode == "fusion" else {opcode}
      if inner & {"dot", "convolution"}:
        cls = "matmul"
      elif opcode in ("while", "conditional", "call"):
        cls = "control"
      elif inner & {"reduce", "reduce-window"}:
        cls = "reduce"
      elif inner <= moves and opcode not in ("parameter", "constant", "tuple", "get-tuple-element"):
        cls = "copy"
      elif opcode == "fusion" and "transpose" in inner:
        cls = "transpose"
      elif opcode == "fusion" or opcode in ELEMENTWISE:
        cls = "elementwise"
      else:
        cls = "other"
      out[name] = (cls, comp in loop)
  return out


ELEMENTWISE = (
  "add",
  "subtract",
  "multiply",
  "divide",
  "exponential",
  "log",
  "maximum",
  "minimum",
  "select",
  "compare",
  "convert",
  "negate",
  "rsqrt",
  "sqrt",
  "tanh",
  "logistic",
  "broadcast",
  "iota",
  "and",
  "or",
  "not",
  "clamp",
  "power",
  "abs",
  "exponential-minus-one",
  "log-plus-one",
)


def by_class(self_ns, classes, reps):
  """Self time per (class, in_loop), ms per step and share, largest first."""
  total = sum(self_ns.values()) or 1
  acc = collections.Counter()
  for name, ns in self_ns.items():
    acc[classes.get(name, ("other", False))] += ns
  return [
    dict(
      op_class=cls,
      in_loop=in_loop,
      ms_per_step=round(ns / 1e6 / reps, 1),
      share=round(ns / total, 3),
    )
    for (cls, in_loop), ns in acc.most_common()
  ]


def top_ops(step, params, batch):
  """Self time per HLO instruction over FLAGS.trace_reps traced steps."""
  import jax

  compiled = step.lower(params, batch).compile()
  index = hlo_index(compiled.as_text())
  classes = op_classes(compiled.as_text())
  jax.block_until_ready(compiled(params, batch))
  folder = tempfile.mkdtemp()
  with jax.profiler.trace(folder):
    for _ in range(FLAGS.trace_reps):
      jax.block_until_ready(compiled(params, batch))
  (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
  data = jax.profiler.ProfileData.from_file(path)
  self_ns, calls = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      events = []
      for e in line.events:
        stats = dict(e.stats)
        if "hlo_op" in stats:
          events.append((e.start_ns, e.end_ns, stats["hlo_op"]))
      events.sort(key=lambda x: (x[0], -x[1]))
      stack = []  # [start, end, name, child_ns]

      def pop():
        s, e, name, child = stack.pop()
        self_ns[name] += (e - s) - child
        calls[name] += 1
        if stack:
          stack[-1][3] += e - s

      for s, e, name in events:
        while stack and stack[-1][1] <= s:
          pop()
        stack.append([s, e, name, 0])
      while stack:
        pop()
  total = sum(self_ns.values())
  rows = []
  for name, ns in self_ns.most_common(FLAGS.top):
    opcode, op_name = index.get(name, ("?", ""))
    rows.append(
      dict(
        hlo=name,
        opcode=opcode,
        op_name=op_name[-160:],
        ms_per_step=round(ns / 1e6 / FLAGS.trace_reps, 2),
        share=round(ns / total, 4),
        calls_per_step=calls[name] // FLAGS.trace_reps,
      )
    )
  return rows, total / 1e9 / FLAGS.trace_reps, by_class(self_ns, classes, FLAGS.trace_reps)


def main(argv):
  del argv
  from experiments import provenance
  from experiments import flops
  from experiments.measure import matmul_gflops

  P, T, R = FLAGS.prefix_len, FLAGS.tail_len, FLAGS.branches
  cfg, params, batch = make_inputs(P, T, R)
  stages, step = stage_times(cfg, params, batch)
  ops, traced_s, classes = top_ops(step, params, batch)
  useful = flops.step_flops(cfg, flops.flat(1, R, P, T, "replay"))
  rate = matmul_gflops()
  prov = provenance.provenance()
  shape = dict(prefix_len=P, tail_len=T, branches=R, preset=FLAGS.preset, dtype="float32")
  lines = []
  for name in ("prefix_fwd", "tails", "logprobs", "tails_body", "prefix_bwd", "optimizer", "step"):
    wall, cpu = stages[name]
    lines.append(
      dict(
        kind="stage",
        stage=name,
        seconds=round(wall, 4),
        cpu_seconds=round(cpu, 4),
        share_of_step=round(wall / stages["step"][0], 3),
        **shape,
      )
    )
  lines.append(
    dict(
      kind="summary",
      useful_gflop=round(useful / 1e9, 2),
      step_gflops=round(useful / stages["step"][0] / 1e9, 1),
      matmul_gflops=round(rate, 1),
      matmul_frac=round(useful / stages["step"][0] / 1e9 / rate, 3),
      traced_thunk_s_per_step=round(traced_s, 4),
      **shape,
    )
  )
  lines += [dict(kind="class", **c, **shape) for c in classes]
  lines += [dict(kind="op", rank=i + 1, **op, **shape) for i, op in enumerate(ops)]
  lines = [dict(line, provenance=prov) for line in lines]
  text = "\n".join(json.dumps(line) for line in lines)
  print(text, flush=True)
  if FLAGS.out:
    with open(FLAGS.out, "w") as f:
      f.write(text + "\n")
  if FLAGS.md:
    with open(FLAGS.md, "w") as f:
      f.write(markdown(lines, prov))


def markdown(lines, prov):
  s = lines[0]
  out = [
    f"# Replay step profile: P={s['prefix_len']} T={s['tail_len']} R={s['branches']}, "
    f"{s['preset']} preset, float32, CPU",
    "",
    f"commit {prov.get('git_commit')} (dirty={prov.get('git_dirty')}), {prov.get('date')}, "
    f"{prov.get('hostname')} ({prov.get('cpu_count')} cores, load {prov.get('load_avg_1m')})",
    f"command: `{prov.get('command')}`",
    "",
    "| stage | wall s | cpu s | share of step |",
    "|---|---|---|---|",
  ]
  for l in lines:
    if l["kind"] == "stage":
      out.append(f"| {l['stage']} | {l['seconds']} | {l['cpu_seconds']} | {l['share_of_step']} |")
  (summary,) = [l for l in lines if l["kind"] == "summary"]
  out += [
    "",
    f"useful {summary['useful_gflop']} GFLOP per step: {summary['step_gflops']} GFLOP/s "
    f"= {summary['matmul_frac']} of the {summary['matmul_gflops']} GFLOP/s matmul rate",
    "",
    "Self time by op class (matmul: a dot or a fusion holding one; in loop: inside an XLA",
    "while loop, the blockwise attention's tiles and chunked log-probs):",
    "",
    "| class | in loop | ms/step | share |",
    "|---|---|---|---|",
  ]
  for l in lines:
    if l["kind"] == "class":
      out.append(f"| {l['op_class']} | {l['in_loop']} | {l['ms_per_step']} | {l['share']} |")
  out += [
    "",
    "| # | HLO | opcode | ms/step | share | calls/step | jax op |",
    "|---|---|---|---|---|---|---|",
  ]
  for l in lines:
    if l["kind"] == "op":
      out.append(
        f"| {l['rank']} | {l['hlo']} | {l['opcode']} | {l['ms_per_step']} | {l['share']} "
        f"| {l['calls_per_step']} | `{l['op_name'][-90:]}` |"
      )
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  define_flags()
  app.run(main)
