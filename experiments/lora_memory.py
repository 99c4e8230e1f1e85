"""LoRA vs full fine-tuning: compiled footprint of one AdamW train step (replay and naive),
and the replay-vs-naive speedup with and without LoRA, side by side in one process.

  python experiments/lora_memory.py --what=memory --out=experiments/results/lora_memory_cpu_2026-12-01.jsonl
  python experiments/lora_memory.py --what=speed --out=experiments/results/lora_speed_cpu_2026-12-01.jsonl

Memory (compile only, nothing runs): presets small and large, P in {8K, 32K}, R=16, T=128,
B=1, remat=full, LoRA rank 16 on q/k/v/o/gate/up/down. Bytes per parameter: full fine-tuning
holds float32 params (4) + their gradient (4) + AdamW mu, nu (8) = 16 B per parameter;
LoRA holds the frozen base (4 B per base parameter, no gradient, no optimizer state) and
16 B per adapter parameter. Speed: small preset, P=2048, T=128, R=16, B=1 (CPU; wall and
process CPU seconds per step, median of --reps after a warm-up).
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_enum(
    "what",
    "memory",
    ["memory", "speed", "table"],
    "footprint rows, speed rows, or a markdown table of --inputs",
  )
  flags.DEFINE_list("inputs", [], "table: results files of --what=memory and --what=speed")
  flags.DEFINE_string("out", "", "results JSON-lines file ('' prints only)")
  flags.DEFINE_list("presets", ["small", "large"], "memory: model presets")
  flags.DEFINE_list("prefix_lens", ["8192", "32768"], "memory: P values")
  flags.DEFINE_integer("rank", 16, "LoRA rank")
  flags.DEFINE_list("methods", ["full", "lora"], "memory: methods, in the order measured")
  flags.DEFINE_bool(
    "compile",
    True,
    "memory: compile for the footprint (false: the state's bytes "
    "from shapes only, one row per preset, method and mode)",
  )
  flags.DEFINE_integer("reps", 2, "speed: timed steps per configuration")
  flags.DEFINE_string("speed_preset", "small", "speed: model preset")
  flags.DEFINE_integer("speed_prefix_len", 2048, "speed: P")


FLAGS = flags.FLAGS
R, T = 16, 128


def _steps(cfg, lora_cfg, mode):
  """(jitted step, example args) of one AdamW step: full fine-tuning or LoRA."""
  import jax
  import optax
  from branch_replay.core import engine, losses
  from models import lora

  tx = optax.adamw(1e-5)
  loss_cfg = losses.LossConfig(name="grpo")
  if lora_cfg is None:

    def step(params, opt_state, batch):
      _, _, grads = engine.loss_and_grad(params, batch, cfg, loss_cfg, mode)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state
  else:

    def step(base, adapters, opt_state, batch):
      attached = lambda a: lora.attach(base, a, lora_cfg)
      _, _, grads = engine.loss_and_grad(adapters, batch, cfg, loss_cfg, mode, params_fn=attached)
      updates, opt_state = tx.update(grads, opt_state, adapters)
      return optax.apply_updates(adapters, updates), opt_state

  donate = (0, 1) if lora_cfg is None else (1, 2)
  return jax.jit(step, donate_argnums=donate), tx


def _shapes(cfg, lora_cfg, tx):
  import jax
  from models import lora
  from models import transformer as tfm

  params = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  if lora_cfg is None:
    return (params, jax.eval_shape(tx.init, params))
  adapters = jax.eval_shape(lambda: lora.init_adapters(cfg, lora_cfg, jax.random.key(1)))
  return (params, adapters, jax.eval_shape(tx.init, adapters))


def _batch(cfg, P, concrete=False):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.core import tree

  rng = np.random.default_rng(0)
  b = tree.flat(
    prefix_BP=jnp.asarray(rng.integers(0, cfg.vocab_size, (1, P)), jnp.int32),
    prefix_valid_BP=jnp.ones((1, P), bool),
    tails_BRT=jnp.asarray(rng.integers(0, cfg.vocab_size, (1, R, T)), jnp.int32),
    tail_valid_BRT=jnp.ones((1, R, T), bool),
    advantages_BR=jnp.asarray(rng.normal(size=(1, R)), jnp.float32),
  )
  return b if concrete else jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), b)


def _nbytes(tree):
  import jax

  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def memory(writer):
  from models import lora
  from models import transformer as tfm

  for preset in FLAGS.presets:
    cfg = tfm.preset(preset, remat="full")
    lora_cfg = lora.LoraConfig(rank=FLAGS.rank, alpha=2.0 * FLAGS.rank)
    n_params = _nbytes(_shapes(cfg, None, _steps(cfg, None, "replay")[1])[0]) // 4
    for P in map(int, FLAGS.prefix_lens):
      for method in FLAGS.methods:
        lc = {"full": None, "lora": lora_cfg}[method]
        for mode in ("replay", "naive"):
          step, tx = _steps(cfg, lc, mode)
          args = _shapes(cfg, lc, tx)
          t0 = time.time()
          mem = (
            step.lower(*args, _batch(cfg, P)).compile().memory_analysis()
            if (FLAGS.compile)
            else None
          )
          trainable = args[0] if lc is None else args[1]
          opt = args[-1]
          row = dict(
            preset=preset,
            P=P,
            R=R,
            T=T,
            B=1,
            method=method,
            mode=mode,
            rank=FLAGS.rank if lc else None,
            n_params=n_params,
            trainable_params=_nbytes(trainable) // 4,
            frozen_base_bytes=0 if lc is None else _nbytes(args[0]),
            trainable_bytes=_nbytes(trainable),
            optimizer_bytes=_nbytes(opt),
            # trainable state: trainable params + their gradient + AdamW mu, nu
            trainable_state_bytes=2 * _nbytes(trainable) + _nbytes(opt),
          )
          if mem is not None:
            row.update(
              argument_bytes=mem.argument_size_in_bytes,
              temp_bytes=mem.temp_size_in_bytes,
              output_bytes=mem.output_size_in_bytes,
              alias_bytes=mem.alias_size_in_bytes,
              compiled_total_bytes=(
                mem.argument_size_in_bytes
                + mem.temp_size_in_bytes
                + mem.output_size_in_bytes
                - mem.alias_size_in_bytes
              ),
              compile_s=round(time.time() - t0, 1),
            )
          writer.write(row)


def speed(writer):
  import jax
  import numpy as np
  from models import lora
  from models import transformer as tfm

  cfg = tfm.preset(FLAGS.speed_preset)
  lora_cfg = lora.LoraConfig(rank=FLAGS.rank, alpha=2.0 * FLAGS.rank)
  batch = _batch(cfg, FLAGS.speed_prefix_len, concrete=True)
  base = tfm.init_params(cfg, jax.random.key(0))
  for method, lc in (("full", None), ("lora", lora_cfg)):
    for mode in ("replay", "naive"):
      step, tx = _steps(cfg, lc, mode)
      fresh = lambda: jax.tree.map(lambda x: x.copy(), base)
      if lc is None:
        p = fresh()
        args = [p, tx.init(p)]
      else:
        a = lora.init_adapters(cfg, lc, jax.random.key(1))
        args = [base, a, tx.init(a)]
      compiled = step.lower(*args, batch).compile()
      wall, cpu = [], []
      for i in range(FLAGS.reps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        out = jax.block_until_ready(compiled(*args, batch))
        if i:
          wall.append(time.perf_counter() - t0)
          cpu.append(time.process_time() - c0)
        args = list(out) if lc is None else [base, *out]
      writer.write(
        dict(
          preset=FLAGS.speed_preset,
          P=FLAGS.speed_prefix_len,
          R=R,
          T=T,
          B=1,
          method=method,
          mode=mode,
          rank=FLAGS.rank if lc else None,
          wall_s=float(np.median(wall)),
          cpu_s=float(np.median(cpu)),
          reps=FLAGS.reps,
        )
      )


def table(paths) -> str:
  """Markdown: the footprint per (preset, P, mode), full vs LoRA, and the speedups (rows of
  a later input replace the same rows of an earlier one)."""
  from experiments import provenance

  rows = [r for p in paths for r in provenance.read(p)]
  mb = lambda b: f"{b / 2**20:,.1f}"
  out = [
    "| preset | P | mode | method | trainable params | base B/param | trainable state "
    "MB (16 B/param) | trainable state vs full | compiled total MB | temp MB |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  # a row measured again in a later input replaces the earlier one (same preset, P, method, mode)
  mem = list(
    {
      (r["preset"], r["P"], r["method"], r["mode"]): r
      for r in rows
      if r["experiment"] == "lora_memory"
    }.values()
  )
  full = {(r["preset"], r["P"], r["mode"]): r for r in mem if r["method"] == "full"}
  for r in mem:
    f = full.get((r["preset"], r["P"], r["mode"]))
    ratio = f"{100 * r['trainable_state_bytes'] / f['trainable_state_bytes']:.2f}%" if f else ""
    base = "4 (frozen)" if r["method"] == "lora" else "16 (trained)"
    out.append(
      f"| {r['preset']} | {r['P']} | {r['mode']} | {r['method']} | "
      f"{r['trainable_params']:,} | {base} | {mb(r['trainable_state_bytes'])} | "
      f"{ratio} | {mb(r['compiled_total_bytes']) if 'temp_bytes' in r else 'not compiled'}"
      f" | {mb(r['temp_bytes']) if 'temp_bytes' in r else ''} |"
    )
  speed = {(r["method"], r["mode"]): r for r in rows if r["experiment"] == "lora_speed"}
  if speed:
    out += [
      "",
      "| preset, P, T, R | method | replay cpu s | naive cpu s | speedup (cpu) | "
      "replay wall s | naive wall s | speedup (wall) |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for method in ("full", "lora"):
      rp, nv = speed.get((method, "replay")), speed.get((method, "naive"))
      if rp and nv:
        out.append(
          f"| {rp['preset']}, {rp['P']}, {rp['T']}, {rp['R']} | {method} | "
          f"{rp['cpu_s']:.2f} | {nv['cpu_s']:.2f} | "
          f"{nv['cpu_s'] / rp['cpu_s']:.2f}x | {rp['wall_s']:.1f} | {nv['wall_s']:.1f} | "
          f"{nv['wall_s'] / rp['wall_s']:.2f}x |"
        )
  return "\n".join(out)


def main(argv):
  if FLAGS.what == "table":
    print(table(FLAGS.inputs))
    return
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, experiment=f"lora_{FLAGS.what}")
  memory(writer) if FLAGS.what == "memory" else speed(writer)


if __name__ == "__main__":
  define_flags()
  app.run(main)
