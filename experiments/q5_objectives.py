"""Q5: does branch replay extend to other objectives? One loss+gradient step of each
objective, replay vs naive, at long prompts: the step speedup and the gradient agreement
(bench_replay.py with --loss, each path in its own process).

  python experiments/q5_objectives.py --out=experiments/results/q5_cpu_$(date +%F).jsonl
  python experiments/q5_objectives.py --objective=dpo --prefix_len=4096

  python experiments/q5_objectives.py --model_from=grpo_haystack --prefix_len=256 \
      --tail_len=3 --branches=8 --prompts=8      # the haystack task's own shapes

DPO scores a (chosen, rejected) pair: R=2, so replay saves at most 2(P+T)/(P+2T) ~ 2x;
GRPO/GSPO/PPO use --branches. PPO is two steps per minibatch: the policy's clipped token
objective (`ppo`, advantages given) and the critic's clipped value loss (`value`: a second
transformer with a value head, its prefix forward once per prompt as well). Dr. GRPO and
RLOO change only the advantages, so their step is GRPO's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile


from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Flags of the command line (defined only when run as a script, so the tests can
  import several experiments)."""
  flags.DEFINE_multi_string(
    "objective",
    ["grpo", "gspo", "ppo", "value", "dpo"],
    "objectives (losses.OBJECTIVES, or 'value': PPO's critic step)",
  )
  flags.DEFINE_string(
    "model_from", "", "the model of this experiment (e.g. grpo_haystack) instead of --preset"
  )
  flags.DEFINE_multi_integer("prefix_len", [2048], "P")
  flags.DEFINE_integer("tail_len", 128, "T")
  flags.DEFINE_integer("branches", 16, "R for the group objectives (DPO always 2)")
  flags.DEFINE_integer("prompts", 1, "B")
  flags.DEFINE_integer("reps", 3, "timed repetitions (median)")
  flags.DEFINE_string("preset", "small", "model preset")
  flags.DEFINE_string("dtype", "float32", "dtype")
  flags.DEFINE_float("memory_cap_mb", 16000, "see bench_replay.py")
  flags.DEFINE_string("out", "", "append JSON lines here")


BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_replay.py")


def measure(objective, P, opts) -> list[dict]:
  R = 2 if objective == "dpo" else opts["branches"]
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "rows.jsonl")
    argv = [
      sys.executable,
      BENCH,
      f"--loss={objective}",
      f"--prefix_len={P}",
      f"--tail_len={opts['tail_len']}",
      f"--branches={R}",
      f"--prompts={opts['prompts']}",
      f"--reps={opts['reps']}",
      f"--preset={opts['preset']}",
      f"--dtype={opts['dtype']}",
      f"--memory_cap_mb={opts['memory_cap_mb']}",
      f"--out={out}",
      f"--model_from={opts.get('model_from', '')}",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode or not os.path.exists(out):
      return [dict(objective=objective, P=P, R=R, error=(proc.stderr or proc.stdout)[-1500:])]
    with open(out) as f:
      return [dict(objective=objective, **json.loads(l)) for l in f if l.strip()]


def main(argv):
  del argv
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, "q5_objectives", with_jax=False)
  opts = {
    k: getattr(FLAGS, k)
    for k in (
      "tail_len",
      "branches",
      "prompts",
      "reps",
      "preset",
      "dtype",
      "memory_cap_mb",
      "model_from",
    )
  }
  for P in FLAGS.prefix_len:
    for objective in FLAGS.objective:
      for row in measure(objective, P, opts):
        row.pop("provenance", None)  # the bench's own; this line gets this command's
        writer.write(row)


if __name__ == "__main__":
  define_flags()
  app.run(main)
