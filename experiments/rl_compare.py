"""GRPO, Dr. GRPO, GSPO, RLOO, PPO and DPO on the haystack task, the same number of steps
after the same warm-up; one JSON line per algorithm (git commit, command, date, machine).

  python experiments/rl_compare.py --steps=100 --out=experiments/results/rl_compare.jsonl
  python experiments/rl_compare.py --only=gspo,rloo --steps=100 --out=...

Each run is `run.py --experiment=...` with its overrides (the `command` field of its line);
reward is the sampled reward/mean of the first/last 10 RL steps and the greedy eval reward
before/after (DPO: preference accuracy of the first/last 10 steps).
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

RUNS = {
  "grpo": ("grpo_haystack", []),
  "dr_grpo": ("grpo_haystack", ["algo.advantage=dr_grpo", "loss.aggregation=sum"]),
  "gspo": (
    "grpo_haystack",
    ["loss.name=gspo", "loss.aggregation=seq_mean", "loss.epsilon=3e-3", "loss.epsilon_high=4e-3"],
  ),
  "rloo": ("grpo_haystack", ["algo.advantage=rloo", "loss.name=pg"]),
  "dapo": ("grpo_haystack", ["algo.dynamic_sampling=true", "loss.epsilon_high=0.28"]),
  "ppo": ("ppo_haystack", []),
  "ppo_share": ("ppo_haystack", ["critic.share=true"]),  # a value head on the policy
  "dpo": ("dpo_haystack", []),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--only", default=",".join(RUNS))
  ap.add_argument("--out", default="experiments/results/rl_compare.jsonl")
  ap.add_argument("--workdir", default="/tmp/rl_compare")
  args = ap.parse_args()
  from branch_replay import config as config_lib
  from experiments import registry
  from branch_replay.train import trainer

  commit = subprocess.run(
    ["git", "rev-parse", "HEAD"], capture_output=True, text=True
  ).stdout.strip()
  for name in args.only.split(","):
    experiment, overrides = RUNS[name]
    overrides = overrides + [
      f"train.rl_steps={args.steps}",
      "train.progress=false",
      "train.plot=false",
    ]
    cfg = config_lib.apply_overrides(registry.get_config(experiment), overrides)
    workdir = os.path.join(args.workdir, name)
    t0 = time.time()
    s = trainer.run(cfg, workdir)
    s.pop("final_params", None)
    row = {
      "algorithm": name,
      "git_commit": commit,
      "command": f"python run.py --experiment={experiment} "
      + " ".join(f"--set={o}" for o in overrides)
      + f" --workdir={workdir}",
      "date": datetime.datetime.utcnow().isoformat(timespec="seconds") + "Z",
      "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
      f"load {os.getloadavg()[0]:.1f}",
      "wall_s": time.time() - t0,
      **{k: v for k, v in s.items() if isinstance(v, (int, float, str, type(None)))},
      **{k: s[k] for k in ("first", "last", "time_by_phase")},  # train/summary.py's metrics
    }
    with open(args.out, "a") as f:
      f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
  main()
