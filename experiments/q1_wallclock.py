"""Q1: does the compute cut shorten wall-clock time? A whole RL step (sampling, rewards,
batch assembly, update) for replay vs naive, by phase, over prefix lengths.

  python experiments/q1_wallclock.py --out=experiments/results/q1_cpu_$(date +%F).jsonl
  python experiments/q1_wallclock.py --prefix_len=256 --steps=2 --set=train.batch_size=4

The default run's model and task (experiments/configs/grpo_haystack.py, no warm-up: timing does not
depend on what the model knows, except through when branches stop) with the haystack prompt
length set to each P. Both modes sample with the same shared-prefix sampler (the project's
naive mode changes only the update); the first step of each (mode, P) compiles and is not
reported. Each line: P, mode, the median over --steps of each phase's seconds, and the
update's share of the step. Measured: docs/reproduction.md, Q1
(experiments/results/q1_cpu_2026-12-05.jsonl).
"""

from __future__ import annotations

import os
import shutil

if __name__ == "__main__" and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Flags of the command line (defined only when run as a script, so the tests can
  import several experiments)."""
  flags.DEFINE_multi_integer("prefix_len", [256, 1024, 4096], "haystack prompt lengths P")
  flags.DEFINE_multi_string("mode", ["replay", "naive"], "paths to time")
  flags.DEFINE_integer("steps", 3, "timed RL steps per (P, mode) after one compiling step")
  flags.DEFINE_string("experiment", "grpo_haystack", "module in experiments/ with get_config()")
  flags.DEFINE_multi_string("set", [], "config overrides section.field=value")
  flags.DEFINE_string("out", "", "append JSON lines here")


def run(prefix_lens, modes, steps, experiment, overrides, writer) -> list[dict]:
  import numpy as np
  from experiments import rl_step

  rows = {}
  for P in prefix_lens:
    for mode in modes:
      cfg = rl_step.config_for(experiment, list(overrides) + [f"task.prompt_len={P}"], mode=mode)
      cfg = rl_step.replace_train(cfg, sft_steps=0)
      stepper = rl_step.Stepper(cfg)
      stepper.step(0)  # compiles
      timed = [stepper.step(k)[0] for k in range(1, steps + 1)]
      phases = {k: float(np.median([t[k] for t in timed])) for k in timed[0]}
      B, R = cfg.train.batch_size, cfg.train.n_branches
      row = dict(
        P=P,
        mode=mode,
        B=B,
        R=R,
        T=cfg.sampler.max_new_tokens,
        steps=steps,
        **phases,
        update_share=phases["update_s"] / phases["step_s"],
        model=dict(d_model=cfg.model.d_model, n_layers=cfg.model.n_layers),
      )
      rows[(P, mode)] = row
      if mode == "naive" and (P, "replay") in rows:
        rep = rows[(P, "replay")]
        row["step_speedup_of_replay"] = row["step_s"] / rep["step_s"]
        row["update_speedup_of_replay"] = row["update_s"] / rep["update_s"]
      rows[(P, mode)] = writer.write(row)
  return list(rows.values())


def main(argv):
  del argv
  from experiments import provenance

  run(
    FLAGS.prefix_len,
    FLAGS.mode,
    FLAGS.steps,
    FLAGS.experiment,
    FLAGS.set,
    provenance.ResultsWriter(FLAGS.out, "q1_wallclock"),
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
