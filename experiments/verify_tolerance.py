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


def run_argv(experiment, sets, model_dir, model_dtype, steps) -> list[str]:
  """The run.py argv this measurement trains with."""
  argv = ["run.py", f"--experiment={experiment}", f"--model_dtype={model_dtype}"]
  argv += [f"--set={s}" for s in sets]
  argv += [f"--set=train.rl_steps={steps}", "--set=train.progress=false"]
  argv += ["--set=train.plot=false", "--set=replay.verify=off", "--set=train.eval_size=0"]
  return argv + ([f"--model_dir={model_dir}"] if model_dir else [])


def measure(parsed, workdir, on_step) -> dict:
  """Train run.py's parsed argv (`run.parse`'s flags, cfg, params, tokenizer) in `workdir`,
  calling on_step(step, verify metrics) before each RL update; returns the run's summary."""
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
        on_step(step, {**stats, "has_signal": verify.has_signal(batch), **layout(state)})
      return super().update(state, batch, step)

  Checked.__name__ = f"Checked{base.__name__}"
  return trainer.run(
    cfg, workdir, Checked, init_params=init_params, tokenizer=tokenizer, init_adapters=init_adapters
  )


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
        }
      )
    )

  with tempfile.TemporaryDirectory(prefix="verify_tol_") as workdir:
    measure(parsed, workdir, on_step)
  writer.write({**summary_row(rows), "run": FLAGS.experiment, "run_argv": argv})


if __name__ == "__main__":
  define_flags()
  app.run(main)
