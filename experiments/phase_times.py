"""The default run's RL step by phase (phases.py: sample, reward, old_logp, ref_logp, update),
replay vs naive (and replay with replay.auto_tree=true): the default experiment
(experiments/configs/grpo_haystack.py) through trainer.run, shortened by flags, one run per mode in
one process, the same seed (so the same sampled groups, up to float32 drift). Per mode: the
median of every phase over the RL steps after the first (which compiles), the mean step,
and the totals; a results line per mode with provenance.

  python experiments/phase_times.py --out=experiments/results/phase_times_cpu.jsonl   # 100 + 20 steps
  python experiments/phase_times.py --sft_steps=600 --rl_steps=150   # the whole default run

old_logp_s is 0 on this path: the sampler returns the behaviour log-probs with the tokens
(part of sample_s). ref_logp_s is 0 unless loss.kl_coef > 0 (`--set=loss.kl_coef=0.05`).
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import tempfile
import time

if __name__ == "__main__" and not (glob.glob("/dev/nvidia*") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_integer(
    "sft_steps",
    100,
    "warm-up steps (the default run: 600; the policy then answers more alike, as in the default run)",
  )
  flags.DEFINE_integer("rl_steps", 20, "RL steps per mode (the default run: 150)")
  flags.DEFINE_list("modes", ["replay", "naive", "auto_tree"], "replay | naive | auto_tree")
  flags.DEFINE_multi_string("set", [], "extra config overrides, as run.py's --set")
  flags.DEFINE_string("out", "", "append JSON lines here")


PHASES = ("sample", "reward", "old_logp", "ref_logp", "update")
OVERRIDES = {"replay": [], "naive": ["replay.mode=naive"], "auto_tree": ["replay.auto_tree=true"]}


def summarize(records) -> dict:
  """Median seconds per phase over the RL steps after the first, and their totals."""
  rl = [r for r in records if r.get("kind") == "train" and r.get("phase") == "rl"]
  timed = rl[1:] if len(rl) > 1 else rl
  median = lambda key: statistics.median(r.get(key) or 0.0 for r in timed)
  row = {f"{p}_s": round(median(f"time/{p}_s"), 5) for p in PHASES}
  row["step_s"] = round(median("time/step_s"), 5)
  row["other_s"] = round(row["step_s"] - sum(row[f"{p}_s"] for p in PHASES), 5)
  row.update(
    {f"total_{p}_s": round(sum(r.get(f"time/{p}_s") or 0.0 for r in rl), 3) for p in PHASES}
  )
  row["total_rl_step_s"] = round(sum(r["time/step_s"] for r in rl), 3)
  row["rl_computed_tokens"] = int(sum(r["replay/computed_tokens"] for r in rl))
  row["reward_mean"] = round(statistics.mean(r["reward/mean"] for r in rl), 4)
  ratios = [r["replay/tree_token_ratio"] for r in rl if "replay/tree_token_ratio" in r]
  if ratios:
    row["tree_token_ratio_mean"] = round(statistics.mean(ratios), 4)
    row["trunk_len_mean"] = round(statistics.mean(r["replay/trunk_len"] for r in rl), 3)
    row["layout_s"] = round(median("time/layout_s"), 5)
  return row


def main(argv):
  del argv
  from branch_replay import config as config_lib
  from branch_replay.train import metrics, trainer
  from experiments import provenance
  from experiments.configs import grpo_haystack

  writer = provenance.ResultsWriter(FLAGS.out, experiment="phase_times")
  base = [
    f"train.sft_steps={FLAGS.sft_steps}",
    f"train.rl_steps={FLAGS.rl_steps}",
    "train.eval_size=0",
    "train.progress=false",
    "train.plot=false",
    f"train.checkpoint_every={FLAGS.sft_steps + FLAGS.rl_steps}",
    *FLAGS.set,
  ]
  with tempfile.TemporaryDirectory() as tmp:
    for mode in FLAGS.modes:
      if mode not in OVERRIDES:
        raise ValueError(f"--modes: {mode!r}: expected one of {sorted(OVERRIDES)}")
      cfg = config_lib.apply_overrides(grpo_haystack.get_config(), base + OVERRIDES[mode])
      t0, c0 = time.perf_counter(), time.process_time()
      summary = trainer.run(cfg, os.path.join(tmp, mode))
      wall, cpu = time.perf_counter() - t0, time.process_time() - c0
      row = dict(
        mode=mode,
        sft_steps=FLAGS.sft_steps,
        rl_steps=FLAGS.rl_steps,
        overrides=base + OVERRIDES[mode],
        **summarize(metrics.read(summary["metrics"])),
        run_wall_s=round(wall, 2),
        run_cpu_s=round(cpu, 2),
        load_avg_1m=round(os.getloadavg()[0], 2),
      )
      writer.write(row)


if __name__ == "__main__":
  define_flags()
  app.run(main)
