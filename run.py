"""Train a policy with GRPO through branch replay.

  python run.py                                   # the default: experiments/grpo_haystack.py
  python run.py --experiment=grpo_arithmetic --set=train.rl_steps=100 --workdir=/tmp/arith
  python run.py --mode=naive                      # the same run through the naive twin
  python run.py --model_dir=PATH                  # train an imported Hugging Face checkpoint
  python run.py --mesh=data:2,fsdp:2,context:2    # sharded over 8 devices (branch_replay/sharding.py)
  python run.py --mesh=... --coordinator_address=HOST0:1234 --num_processes=N --process_id=I
                                                  # one per host, all with the same flags

Re-running with the same --workdir resumes from its latest checkpoint.
"""

import glob
import importlib
import os
import shutil
import sys

from absl import app, flags, logging

if shutil.which("nvidia-smi") is None and not glob.glob("/dev/nvidia*"):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU: skip the CUDA plugin's probe

flags.DEFINE_string("experiment", "grpo_haystack", "Module in experiments/ with get_config().")
flags.DEFINE_multi_string("set", [], "Config override section.field=value (repeatable).")
flags.DEFINE_string("workdir", "runs/default", "Checkpoints, metrics.jsonl and the plot go here.")
flags.DEFINE_enum("mode", None, ["replay", "naive"], "Override replay.mode.")
flags.DEFINE_string("mesh", None, "Device mesh, e.g. data:2,fsdp:2,context:2 (sets mesh=).")
flags.DEFINE_string("coordinator_address", None, "Multi-host: host:port of process 0.")
flags.DEFINE_integer("num_processes", None, "Multi-host: how many processes.")
flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.")
flags.DEFINE_string("model_dir", None, "A Hugging Face folder (config.json, *.safetensors, "
                    "optional tokenizer.json) to train from instead of the experiment's model.")
flags.DEFINE_bool("char_tokenizer", False, "With --model_dir: train on the shipped character "
                  "tokenizer (only for a folder without tokenizer.json).")
flags.DEFINE_enum("model_dtype", "float32", ["float32", "bfloat16"],
                  "compute dtype of --model_dir (parameters and AdamW state stay float32)")
FLAGS = flags.FLAGS


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if FLAGS.coordinator_address or FLAGS.num_processes:  # before JAX touches a device
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU runs
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  from branch_replay import config as config_lib
  here = os.path.dirname(os.path.abspath(__file__))
  names = sorted(os.path.basename(p)[:-3]
                 for p in glob.glob(os.path.join(here, "experiments", "[!_]*.py"))
                 if "def get_config(" in open(p).read())
  if FLAGS.experiment not in names:
    raise app.UsageError(f"--experiment={FLAGS.experiment!r}: unknown; expected one of {names}")
  module = importlib.import_module(f"experiments.{FLAGS.experiment}")
  overrides = list(FLAGS.set) + ([f"replay.mode={FLAGS.mode}"] if FLAGS.mode else [])
  overrides += [f"mesh={FLAGS.mesh}"] if FLAGS.mesh is not None else []
  base, init_params, tokenizer = module.get_config(), None, None
  if FLAGS.model_dir:  # an imported Hugging Face checkpoint (models/hf.py) replaces the model
    import dataclasses
    from branch_replay import tokenizer as tokenizer_lib
    from models import hf
    try:
      model_cfg, init_params = hf.load(FLAGS.model_dir, dtype=FLAGS.model_dtype)
      tokenizer = tokenizer_lib.from_model_dir(FLAGS.model_dir, hf.read_config(FLAGS.model_dir),
                                               char_tokenizer=FLAGS.char_tokenizer)
    except ValueError as e:
      raise app.UsageError(f"--model_dir={FLAGS.model_dir}: {e}")
    base = dataclasses.replace(base, model=model_cfg)
  try:
    cfg = config_lib.apply_overrides(base, overrides)
  except ValueError as e:
    raise app.UsageError(str(e))
  from branch_replay import train
  try:
    summary = train.run(cfg, FLAGS.workdir, init_params=init_params, tokenizer=tokenizer)
  except (ValueError, FloatingPointError) as e:
    sys.exit(f"error: {e}")
  except KeyboardInterrupt:
    sys.exit(f"interrupted: run again with --workdir={FLAGS.workdir} to resume from its "
             "latest checkpoint")
  import jax
  if jax.process_index() == 0:  # multi-host: one summary
    if cfg.loss.name == "dpo":
      from branch_replay import dpo
      print(dpo.format_summary(summary))
    else:
      print(train.format_summary(summary))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  app.run(main)
