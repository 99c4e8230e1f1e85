"""The first-step self-check's tolerance, measured: replay against its naive twin at every RL
step of a real run (not only the first batch), so `train/verify.py:TOLERANCE` is set from the
distribution of errors a correct engine shows on the runs users start.

  python experiments/verify_tolerance.py --out=experiments/results/verify_tolerance_cpu.jsonl
      # the default run (grpo_haystack), 12 RL steps
  python experiments/verify_tolerance.py --experiment=tree_haystack --steps=8 --out=...
  python experiments/verify_tolerance.py --experiment=math_smollm2 --steps=3 \
      --model_dir=$(python -c "from models import gguf; print(gguf.smollm2_path())") --out=...

Each RL step, before the update, runs `algorithm.verify(state, batch, tol=inf)` on the step's
own batch and parameters (the check the trainer runs once, with the run's model, loss, LoRA
and branch_chunk), and writes one line: the worst gradient leaf's error relative to that
leaf's largest entry (`max_rel_err`, verify.py's measure), the loss's relative error, the leaf,
the run's compute dtype, the check's (float32 for a half-precision run: verify.check_config)
and the tolerance in force, and the state it checked (the base's and the
trained parameters' dtypes, the train state's bytes per model parameter: with LoRA over a bf16
base the adapters are what is compared, and what the state costs). The last line summarises the run (max, median).
The run itself trains as `python run.py` would (same flags: --experiment, --set, --model_dir,
--model_dtype); the updates between checks move the parameters, so later steps check trained
weights too.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
from absl import app, flags

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_string("experiment", "grpo_haystack", "A run config (as run.py --experiment).")
  flags.DEFINE_multi_string("set", [], "Config overrides section.field=value (as run.py --set).")
  flags.DEFINE_string("model_dir", None, "An HF folder or .gguf (as run.py --model_dir).")
  flags.DEFINE_string("model_dtype", "float32", "As run.py --model_dtype.")
  flags.DEFINE_integer("steps", 12, "RL steps to train and check (train.rl_steps is set to it).")
  flags.DEFINE_string("out", "", "JSON-lines results file ('' prints only).")
  flags.DEFINE_bool(
    "dtype_gap",
    False,
    "Where the run computes in a half dtype, also run replay and naive in it on each batch "
    "with signal: their gap, and each one's distance from the float32 gradient (dtype_gap).",
  )


def run_argv(experiment, sets, model_dir, model_dtype, steps) -> list[str]:
  """The run.py argv this measurement trains with."""
  argv = ["run.py", f"--experiment={experiment}", f"--model_dtype={model_dtype}"]
  argv += [f"--set={s}" for s in sets]
  argv += [f"--set=train.rl_steps={steps}", "--set=train.progress=false"]
  argv += ["--set=train.plot=false", "--set=replay.verify=off", "--set=train.eval_size=0"]
  return argv + ([f"--model_dir={model_dir}"] if model_dir else [])


def measure(parsed, workdir, on_step, with_dtype_gap: bool = False) -> dict:
  """Train run.py's parsed argv (`run.parse`'s flags, cfg, params, tokenizer) in `workdir`,
  calling on_step(step, verify metrics) before each RL update (with `dtype_gap`'s fields on
  batches with signal if with_dtype_gap and the run computes in a half dtype); returns the
  run's summary."""
  from branch_replay import algorithms
  from branch_replay.train import trainer, verify
  from experiments import registry

  fv, cfg, init_params, tokenizer = parsed
  init_adapters, _ = registry.run_module().lora_options(fv, cfg)
  base = algorithms.for_config(cfg)

  class Checked(base):
    def update(self, state, batch, step):
      if step >= self.warmup_steps:
        stats = self.verify(state, batch, tol=float("inf"))
        signal = verify.has_signal(batch)
        half = verify.check_config(self.cfg.model) is not self.cfg.model
        if with_dtype_gap and signal and half:
          stats.update(dtype_gap(self.cfg, state, batch))
        on_step(step, {**stats, "has_signal": signal, **layout(state)})
      return super().update(state, batch, step)

  Checked.__name__ = f"Checked{base.__name__}"
  return trainer.run(
    cfg, workdir, Checked, init_params=init_params, tokenizer=tokenizer, init_adapters=init_adapters
  )


def dtype_gap(cfg, state, batch) -> dict:
  """The step's batch through replay and naive in the run's own (half) compute dtype and
  through naive in float32 over the same stored weights: the half-precision gap between the
  two paths (verify's measure: worst leaf's largest error over its largest entry) and each
  path's distance from the float32 gradient (global: the norm of the difference over all
  trained leaves over the float32 gradient's norm; and verify's measure)."""
  import functools

  import jax

  from branch_replay.train import steps, verify

  def grads(model_cfg, mode):
    fn = functools.partial(
      verify.loss_and_grad,
      model_cfg=model_cfg,
      loss_cfg=steps.rl_loss_config(cfg),
      mode=mode,
      branch_chunk=cfg.replay.branch_chunk if mode == "replay" else None,
      lora=None if state.base is None else cfg.lora,
    )
    loss, _, g = jax.jit(fn)(state.params, state.base, batch)
    return float(loss), [np.asarray(x, np.float64) for x in jax.tree.leaves(g)], g

  (l_r, r, g_r), (l_n, n, g_n) = grads(cfg.model, "replay"), grads(cfg.model, "naive")
  l_32, f, g_32 = grads(verify.check_config(cfg.model), "naive")
  norm = lambda xs: float(np.sqrt(sum(np.sum(x * x) for x in xs)))
  glob = lambda a, b: norm([x - y for x, y in zip(a, b)]) / max(norm(b), 1e-300)
  name, err = max(verify.leaf_errors(g_r, g_n), key=lambda e: e[1])[:2]
  return {
    "half_max_rel_err": err,  # replay vs naive, both in the run's dtype
    "half_worst_leaf": name,
    "half_loss": {"replay": l_r, "naive": l_n, "float32_naive": l_32},
    "half_vs_float32_global": {"replay": glob(r, f), "naive": glob(n, f)},
    "half_vs_float32_max_rel_err": {
      "replay": max(e[1] for e in verify.leaf_errors(g_r, g_32)),
      "naive": max(e[1] for e in verify.leaf_errors(g_n, g_32)),
    },
  }


def layout(state) -> dict:
  """What the check ran over: the frozen base's and the trained parameters' dtypes and the
  train state's bytes per model parameter (plan_1gpu.state_bytes: base + trained parameters +
  optimizer state + any reference copy, over the model's parameter count)."""
  import jax

  from experiments import plan_1gpu

  dtypes = lambda tree: ",".join(sorted({str(x.dtype) for x in jax.tree.leaves(tree)})) or None
  sizes = plan_1gpu.state_bytes(state)
  return {
    "base_dtype": dtypes(state.base),
    "trained_dtype": dtypes(state.params),
    "model_params": sizes["model_params"],
    "state_bytes": sizes["total"],
    "state_bytes_per_param": round(sizes["bytes_per_param"], 4),
  }


def summary_row(rows: list[dict]) -> dict:
  """The distribution over the batches the trainer would check (those with signal); the
  deferred ones' errors are reported apart (`*_no_signal`)."""
  checked = [r for r in rows if r.get("has_signal", True)]
  skipped = [r for r in rows if not r.get("has_signal", True)]
  if not checked:
    raise ValueError(f"verify_tolerance: none of the {len(rows)} batches had signal")
  errs = np.array([r["max_rel_err"] for r in checked], np.float64)
  loss = np.array([r["loss_rel_err"] for r in checked], np.float64)
  return {
    "kind": "summary",
    "n_steps": len(checked),
    "n_no_signal": len(skipped),
    "max_rel_err_no_signal": max((r["max_rel_err"] for r in skipped), default=None),
    "max_rel_err_max": float(errs.max()),
    "max_rel_err_median": float(np.median(errs)),
    "loss_rel_err_max": float(loss.max()),
    "tolerance": rows[0]["tolerance"],
    "margin": float(rows[0]["tolerance"] / max(errs.max(), 1e-300)),
    **half_summary(checked),
    **{  # what was checked (the step rows carry it; absent in rows made before it was kept)
      k: rows[0][k]
      for k in (
        "dtype",
        "check_dtype",
        "base_dtype",
        "trained_dtype",
        "model_params",
        "state_bytes_per_param",
      )
      if k in rows[0]
    },
  }


def half_summary(rows: list[dict]) -> dict:
  """The largest half-precision gaps over the rows that measured them (--dtype_gap)."""
  gap = [r for r in rows if "half_max_rel_err" in r]
  if not gap:
    return {}
  return {
    "half_max_rel_err_max": max(r["half_max_rel_err"] for r in gap),
    "half_vs_float32_global_max": {
      k: max(r["half_vs_float32_global"][k] for r in gap) for k in ("replay", "naive")
    },
  }


def main(argv):
  del argv
  from absl import logging

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO (as run.py)
  from branch_replay.train import verify
  from experiments import registry
  from experiments.provenance import ResultsWriter

  writer = ResultsWriter(FLAGS.out, experiment="verify_tolerance")
  argv = run_argv(FLAGS.experiment, FLAGS.set, FLAGS.model_dir, FLAGS.model_dtype, FLAGS.steps)
  parsed = registry.run_module().parse(argv)
  model_cfg = parsed[1].model
  rows = []

  def on_step(step, stats):
    rows.append(
      writer.write(
        {
          "kind": "step",
          "run": FLAGS.experiment,
          "model_dir": os.path.basename(FLAGS.model_dir or ""),
          "step": step,
          "max_rel_err": stats["verify/max_rel_err"],
          "loss_rel_err": stats["verify/loss_rel_err"],
          "loss_replay": stats["verify/loss_replay"],
          "loss_naive": stats["verify/loss_naive"],
          "worst_leaf": stats["verify/worst_leaf"],
          "has_signal": stats["has_signal"],  # False: the trainer would defer this batch
          "dtype": str(model_cfg.dtype),
          "check_dtype": stats.get("verify/dtype"),  # float32 for a half-precision run
          "tolerance": verify.tolerance(model_cfg),
          "verify_s": stats["time/verify_s"],
          **{k: stats[k] for k in ("base_dtype", "trained_dtype", "model_params")},
          **{k: stats[k] for k in ("state_bytes", "state_bytes_per_param")},
          **{k: v for k, v in stats.items() if k.startswith("half_")},
        }
      )
    )

  with tempfile.TemporaryDirectory(prefix="verify_tol_") as workdir:
    measure(parsed, workdir, on_step, with_dtype_gap=FLAGS.dtype_gap)
  writer.write({**summary_row(rows), "run": FLAGS.experiment, "run_argv": argv})


if __name__ == "__main__":
  define_flags()
  app.run(main)
