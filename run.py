"""Train a policy with GRPO through branch replay.

  python run.py                                   # the default: experiments/configs/grpo_haystack.py
  python run.py --experiment=grpo_arithmetic --set=train.rl_steps=100 --workdir=/tmp/arith
  python run.py --mode=naive                      # the same run through the naive twin
  python run.py --model_dir=PATH                  # train an imported Hugging Face checkpoint
  python run.py --model_dir=FILE.gguf             # or a GGUF file (models/gguf.py), e.g.
  python run.py --model_dir=$(python -c "from models import gguf; print(gguf.smollm2_path())")
                                                  # the packaged SmolLM2-135M-Instruct Q4_1
  python run.py --model_dir=PATH --set=lora.rank=16 --merge
                                                  # LoRA: WORKDIR/adapter (PEFT) + WORKDIR/merged
  python run.py --mesh=data:2,fsdp:2,context:2    # sharded over 8 devices (branch_replay/core/sharding.py)
  python run.py --mesh=... --coordinator_address=HOST0:1234 --num_processes=N --process_id=I
                                                  # one per host, all with the same flags

--model_dir takes a Hugging Face folder (config.json, *.safetensors, tokenizer.json, ...), a
.gguf file, or a folder holding exactly one .gguf and no config.json. A GGUF run is an HF-folder
run: the same ModelConfig, parameter layout, tokenizer, chat template and stop ids, read from
the file's metadata (docs/architectures.md#gguf-files).

Re-running with the same --workdir resumes from its latest checkpoint. SIGTERM or SIGINT
checkpoints the step in progress and exits 128 + the signal (143, 130); past
train.preemption_grace_s it exits 124 (docs/training.md, "Preemption and faults").

On Linux/glibc run.py restarts itself once with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (XLA's
large CPU buffers on transparent huge pages: the small CPU step -9%;
branch_replay/train/hugepages.py); BRANCH_REPLAY_HUGEPAGES=0 declines it.
"""

import dataclasses
import glob
import os
import shutil
import sys

from absl import app, flags, logging

if shutil.which("nvidia-smi") is None and not glob.glob("/dev/nvidia*"):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")  # no GPU: skip the CUDA plugin's probe


def define_flags(fv: flags.FlagValues) -> flags.FlagValues:
  """The command line's flags, on `fv` (the global FLAGS for a run; a fresh set for `parse`)."""
  flags.DEFINE_string(
    "experiment",
    "grpo_haystack",
    "A run config of experiments/registry.py (CONFIGS).",
    flag_values=fv,
  )
  flags.DEFINE_multi_string(
    "set", [], "Config override section.field=value (repeatable).", flag_values=fv
  )
  flags.DEFINE_string(
    "workdir", "runs/default", "Checkpoints, metrics.jsonl and the plot go here.", flag_values=fv
  )
  flags.DEFINE_enum("mode", None, ["replay", "naive"], "Override replay.mode.", flag_values=fv)
  flags.DEFINE_string(
    "mesh", None, "Device mesh, e.g. data:2,fsdp:2,context:2 (sets mesh=).", flag_values=fv
  )
  flags.DEFINE_string(
    "coordinator_address", None, "Multi-host: host:port of process 0.", flag_values=fv
  )
  flags.DEFINE_integer("num_processes", None, "Multi-host: how many processes.", flag_values=fv)
  flags.DEFINE_integer("process_id", None, "Multi-host: this process's index.", flag_values=fv)
  flags.DEFINE_string(
    "model_dir",
    None,
    "A Hugging Face folder (config.json, *.safetensors, "
    "optional tokenizer.json), a .gguf file, or a folder holding one .gguf "
    "(and no config.json) to train from instead of the experiment's model.",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "char_tokenizer",
    False,
    "With --model_dir: train on the shipped character "
    "tokenizer (only for a folder without tokenizer.json, or a GGUF without "
    "tokenizer metadata).",
    flag_values=fv,
  )
  flags.DEFINE_enum(
    "model_dtype",
    "float32",
    ["float32", "bfloat16"],
    "compute dtype of --model_dir; with LoRA (lora.rank > 0) also the frozen base's dtype "
    "(bfloat16: loaded as bf16, adapters and their AdamW state float32); without LoRA the "
    "parameters and AdamW state stay float32",
    flag_values=fv,
  )
  flags.DEFINE_bool(
    "merge",
    False,
    "LoRA (lora.rank > 0): also write base + adapters as full weights to WORKDIR/merged at the end",
    flag_values=fv,
  )
  flags.DEFINE_string(
    "adapter_dir",
    None,
    "LoRA: a PEFT adapter folder (adapter_config.json, "
    "adapter_model.safetensors) to continue training from",
    flag_values=fv,
  )
  return fv


def lora_options(fv, cfg):
  """(init_adapters, merge export kwargs) of --adapter_dir and --merge, checked before any
  compute (app.UsageError naming the flag or the file's field)."""
  if (fv.merge or fv.adapter_dir) and not cfg.lora.enabled:
    flag = "--merge" if fv.merge else "--adapter_dir"
    raise app.UsageError(
      f"{flag}: lora.rank=0 (LoRA off); {flag} needs a LoRA run, e.g. --set=lora.rank=16"
    )
  from models import gguf, hf
  from models import lora as lora_lib

  family, extra = None, None
  if fv.model_dir:
    extra = gguf.read_model_config(fv.model_dir)  # an HF folder's config.json or a GGUF's
    family = hf.family_of(extra)
  adapters = None
  if fv.adapter_dir:
    try:
      _, adapters = lora_lib.load_peft(fv.adapter_dir, cfg.model, cfg.lora, family=family)
    except ValueError as e:
      raise app.UsageError(f"--adapter_dir={fv.adapter_dir}: {e}")
  return adapters, dict(family=family, extra_config=extra)


def parse(argv):
  """In process (tests): argv (program name first) -> (flags, cfg, init_params, tokenizer),
  through a fresh set of flags; a bad flag, experiment or override raises app.UsageError."""
  fv = define_flags(flags.FlagValues())
  try:
    rest = fv(list(argv))
  except flags.Error as e:
    raise app.UsageError(str(e)) from None
  if len(rest) > 1:
    raise app.UsageError(f"unexpected arguments: {rest[1:]}")
  return (fv, *config_from(fv))


def config_from(fv):
  """(cfg, init_params, tokenizer) of parsed flags: the experiment's config with --set (and
  --mode, --mesh) applied; with --model_dir, the imported model, weights and tokenizer."""
  from branch_replay import config as config_lib
  from experiments import registry

  try:
    module = registry.config_module(fv.experiment)
  except ValueError as e:
    raise app.UsageError(str(e))
  overrides = list(fv.set) + ([f"replay.mode={fv.mode}"] if fv.mode else [])
  overrides += [f"mesh={fv.mesh}"] if fv.mesh is not None else []
  base, init_params, tokenizer = module.get_config(), None, None
  if fv.model_dir:  # an imported Hugging Face checkpoint (models/hf.py) replaces the model
    from branch_replay.data import tokenizer as tokenizer_lib
    from models import gguf  # an HF folder (models/hf.py) or a GGUF file (models/gguf.py)
    from models import hf

    try:  # the config first: the overrides decide the dtype the weights are loaded in
      hf_config = gguf.read_model_config(fv.model_dir)
      model_cfg = hf.config_from_hf(hf_config, fv.model_dtype)
      tokenizer = tokenizer_lib.from_model_dir(
        fv.model_dir, hf_config, char_tokenizer=fv.char_tokenizer
      )
    except ValueError as e:
      raise app.UsageError(f"--model_dir={fv.model_dir}: {e}")
    base = dataclasses.replace(base, model=model_cfg)
  try:
    cfg = config_lib.apply_overrides(base, overrides)
    if fv.model_dir:
      cfg = _lora_base_dtype(cfg, fv.model_dtype, overrides)
  except ValueError as e:
    raise app.UsageError(str(e))
  if fv.model_dir:
    try:  # tensor by tensor in cfg.model.param_dtype: a bf16 base never exists as float32
      _, init_params = gguf.load_model(
        fv.model_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype
      )
    except ValueError as e:
      raise app.UsageError(f"--model_dir={fv.model_dir}: {e}")
  return cfg, init_params, tokenizer


def _lora_base_dtype(cfg, model_dtype: str, overrides):
  """With LoRA the frozen base is stored in --model_dtype (bf16: half a float32 copy's
  memory; the adapters and their AdamW state stay float32, models/lora.py:adapter_dtype);
  full fine-tuning keeps float32 masters. An explicit --set=model.param_dtype wins."""
  if not cfg.lora.enabled or any(o.strip().startswith("model.param_dtype=") for o in overrides):
    return cfg
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, param_dtype=model_dtype))


def main(argv):
  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  FLAGS = flags.FLAGS
  if FLAGS.coordinator_address or FLAGS.num_processes:  # before JAX touches a device
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU runs
    jax.distributed.initialize(FLAGS.coordinator_address, FLAGS.num_processes, FLAGS.process_id)
  cfg, init_params, tokenizer = config_from(FLAGS)
  init_adapters, merge_kwargs = lora_options(FLAGS, cfg)
  from branch_replay import algorithms
  from branch_replay.train import checkpoint, preemption, trainer
  from branch_replay.train import summary as summary_lib
  from branch_replay.data import rewards

  algorithm = algorithms.for_config(cfg)
  try:
    summary = trainer.run(
      cfg,
      FLAGS.workdir,
      algorithm,
      init_params=init_params,
      tokenizer=tokenizer,
      init_adapters=init_adapters,
    )
    if FLAGS.merge:
      from models import lora as lora_lib

      merged = os.path.join(FLAGS.workdir, "merged")
      lora_lib.save_merged(
        merged, cfg.model, summary["base_params"], summary["final_params"], cfg.lora, **merge_kwargs
      )
  except preemption.Preempted as e:  # SIGTERM/SIGINT: checkpointed; 128 + the signal
    print(f"preempted: {e}", file=sys.stderr, flush=True)
    sys.exit(preemption.exit_code(e.signum))
  except (ValueError, FloatingPointError, checkpoint.StorageError, rewards.RewardTimeout) as e:
    sys.exit(f"error: {e}")
  except KeyboardInterrupt:
    sys.exit(
      f"interrupted: run again with --workdir={FLAGS.workdir} to resume from its latest checkpoint"
    )
  import jax

  if jax.process_index() == 0:  # multi-host: one summary
    print(summary_lib.render(summary))
    if summary.get("adapter"):
      print(
        f"LoRA adapter (PEFT): {summary['adapter']}"
        + (f"; merged weights: {os.path.join(FLAGS.workdir, 'merged')}" if FLAGS.merge else "")
      )


if __name__ == "__main__":  # (python run.py: the checkout is sys.path[0], no insert needed)
  from branch_replay.train import hugepages

  hugepages.reexec_with_hugepages()  # CPU steps: huge pages for XLA's buffers (-9%), once
  define_flags(flags.FLAGS)
  app.run(main)
