"""Q1: does the compute cut shorten wall-clock time? A whole RL step (sampling, rewards,
batch assembly, update) for replay vs naive, by phase, over prefix lengths.

  python experiments/q1_wallclock.py --out=experiments/results/q1_cpu_$(date +%F).jsonl
  python experiments/q1_wallclock.py --prefix_len=256 --steps=2 --set=train.batch_size=4
  # a real model at its recipe's shape (prompts, R, T, LoRA), the prompt length its own:
  python experiments/q1_wallclock.py --experiment=math_smollm2 --prefix_len=0 \
      --model_dir=$(python -c "from models import gguf; print(gguf.smollm2_path())") --out=...

The default run's model and task (experiments/configs/grpo_haystack.py, no warm-up: timing does not
depend on what the model knows, except through when branches stop) with the haystack prompt
length set to each P. Both modes sample with the same shared-prefix sampler (the project's
naive mode changes only the update); the first step of each (mode, P) compiles and is not
reported. Each line: P, mode, the median over --steps of each phase's seconds, and the
update's share of the step. With --model_dir the model, its weights and tokenizer are
run.py's (`run.parse`: --experiment, --set, --model_dir, --model_dtype; LoRA adapters as the
run starts them) and --prefix_len=0 keeps the experiment's own prompt length; the row names
the model, its size, LoRA rank, dtype and remat, and the positions the last timed step
computed (prefix, tails) against its naive equivalent. Measured: docs/reproduction.md, Q1
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
  flags.DEFINE_multi_integer(
    "prefix_len", [256, 1024, 4096], "prompt lengths P (task.prompt_len; 0: the experiment's)"
  )
  flags.DEFINE_multi_string("mode", ["replay", "naive"], "paths to time")
  flags.DEFINE_integer("steps", 3, "timed RL steps per (P, mode) after one compiling step")
  flags.DEFINE_string("experiment", "grpo_haystack", "module in experiments/ with get_config()")
  flags.DEFINE_multi_string("set", [], "config overrides section.field=value")
  flags.DEFINE_string("model_dir", "", "an HF folder or .gguf (as run.py --model_dir)")
  flags.DEFINE_string("model_dtype", "float32", "as run.py --model_dtype (with --model_dir)")
  flags.DEFINE_string("out", "", "append JSON lines here")


def stepper_for(experiment, overrides, mode, model_dir="", model_dtype="float32"):
  """The Stepper of one (experiment, mode): the registry's config, or with model_dir run.py's
  parse (the imported model, weights, tokenizer; LoRA adapters as a run starts them)."""
  from experiments import registry, rl_step

  if not model_dir:
    cfg = rl_step.config_for(experiment, list(overrides), mode=mode)
    return rl_step.Stepper(rl_step.replace_train(cfg, sft_steps=0))
  from branch_replay.train import state as train_state

  argv = ["run.py", f"--experiment={experiment}", f"--model_dir={model_dir}"]
  argv += [f"--model_dtype={model_dtype}", f"--mode={mode}"]
  argv += [f"--set={o}" for o in overrides] + ["--set=train.sft_steps=0"]
  run_module = registry.run_module()
  fv, cfg, params, tokenizer = run_module.parse(argv)
  init_adapters, _ = run_module.lora_options(fv, cfg)
  state = train_state.init_state(cfg, params, init_adapters=init_adapters)
  return rl_step.Stepper(cfg, state, tok=tokenizer)


def run(
  prefix_lens, modes, steps, experiment, overrides, writer, model_dir="", model_dtype="float32"
) -> list[dict]:
  import os

  import jax
  import numpy as np

  rows = {}
  for P in prefix_lens:
    for mode in modes:
      sets = list(overrides) + ([f"task.prompt_len={P}"] if P else [])
      stepper = stepper_for(experiment, sets, mode, model_dir, model_dtype)
      cfg = stepper.cfg
      stepper.step(0)  # compiles
      timed = [stepper.step(k)[0] for k in range(1, steps + 1)]
      phases = {k: float(np.median([t[k] for t in timed])) for k in timed[0]}
      B, R = cfg.train.batch_size, cfg.train.n_branches
      weights = stepper.state.params if stepper.state.base is None else stepper.state.base
      computed = stepper.last_batch.token_counts()
      row = dict(
        P=cfg.task.prompt_len,
        mode=mode,
        B=B,
        R=R,
        T=cfg.sampler.max_new_tokens,
        steps=steps,
        **phases,
        update_share=phases["update_s"] / phases["step_s"],
        model=dict(
          name=os.path.basename(model_dir.rstrip("/")) if model_dir else experiment,
          d_model=cfg.model.d_model,
          n_layers=cfg.model.n_layers,
          n_params=int(sum(x.size for x in jax.tree.leaves(weights))),
          dtype=str(cfg.model.dtype),
          param_dtype=str(cfg.model.param_dtype),
          remat=str(cfg.model.remat),
          lora_rank=cfg.lora.rank,
        ),
        positions=dict(  # of the last timed step: prefix, tails, the naive equivalent
          zip(("prefix", "tails", "naive_equivalent"), (int(c) for c in computed))
        ),
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
    FLAGS.model_dir,
    FLAGS.model_dtype,
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
