"""Time-to-accuracy against TRL (issue 47 item 5): TRL's GRPOTrainer and ours from the same start
(the recipe's base, fresh LoRA adapters), each given the same wall-clock budget on this machine,
then every adapter scored by our greedy evaluation on the same held-out problems.

  1. TRL: `bench_trl.py --side=trl --budget_s=B --save_adapter=W/trl` in its own process, the
     matched settings of bench_trl (LoRA targets, R, T, temperature, optimizer, KL, reward; TRL's
     gradient checkpointing on where our remat is): it stops after the step during which B
     seconds of training passed, and saves its adapter (PEFT) with trainer.save_model. k: the
     steps it reached.
  2. Ours: `bench_trl.py --side=ours --budget_s=B --save_adapter=W/ours --save_at=k` in its own
     process: the same budget (our compile is inside it), the adapter saved at TRL's step count
     k and at the end.
  3. Evaluation in this process: the base (no adapter), TRL's adapter (through
     models/lora.load_peft, PEFT's import), ours at k steps and ours at the budget, each on the
     recipe's held-out problems (train/evaluate.greedy_rewards: the trainer's own greedy
     evaluation), with Wilson 95% intervals.

The summary line: accuracy at equal wall time (ours at the budget vs TRL) and at equal steps
(ours after k steps vs TRL), each with both intervals and whether they overlap, and paired
problem by problem (each eval line keeps its per-problem rewards): the problems only one side
solved and the exact McNemar p-value. --rescore with the --workdir of an earlier run trains
nothing and scores its adapters again (the greedy evaluation is deterministic: the same counts).

  python experiments/time_to_accuracy.py --experiment=math_smollm2 --budget_s=1800 \\
      --remat=full --out=experiments/results/time_to_accuracy_cpu_$(date +%F).jsonl
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "experiments", "bench_trl.py")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("experiment", "math_smollm2", "the recipe (experiments/registry.py)")
  flags.DEFINE_float("budget_s", 1800.0, "training wall time each side is given")
  flags.DEFINE_integer("max_steps", 400, "a bound on either side's steps (the budget stops first)")
  flags.DEFINE_string("remat", "full", "model.remat for ours; TRL checkpoints unless none")
  flags.DEFINE_integer("eval_size", 0, "held-out problems scored (0: the recipe's train.eval_size)")
  flags.DEFINE_multi_string("set", [], "more overrides of the recipe, on both sides")
  flags.DEFINE_string("workdir", "", "where the adapters go (default: a temporary folder)")
  flags.DEFINE_string("out", "", "append the JSON lines to this file")
  flags.DEFINE_bool(
    "rescore", False, "train nothing: score the adapters an earlier run left in --workdir again"
  )


def side_command(side: str, workdir: str, hf_folder: str, opts: dict, save_at: int = 0) -> list:
  """bench_trl.py's command line for one side's budgeted run."""
  if side not in ("ours", "trl"):
    raise ValueError(f"side={side!r}: expected 'ours' or 'trl'")
  cmd = [
    sys.executable,
    BENCH,
    f"--side={side}",
    f"--experiment={opts['experiment']}",
    f"--hf_folder={hf_folder}",
    f"--steps={opts['max_steps']}",
    "--warmup=0",
    f"--remat={opts['remat']}",
    f"--budget_s={opts['budget_s']}",
    f"--save_adapter={os.path.join(workdir, side)}",
    f"--out={os.path.join(workdir, side + '.jsonl')}",
  ]
  if save_at:
    if side != "ours":
      raise ValueError("save_at: ours only (TRL's count of steps is what it names)")
    cmd.append(f"--save_at={save_at}")
  return cmd + [f"--set={s}" for s in opts.get("sets", ())]


def side_summary(path: str) -> dict:
  """The summary line a side's bench_trl.py wrote (steps_run, train_wall_s, medians)."""
  from experiments.longctx_speed import read_lines  # a line cut by a kill is dropped

  found = [r for r in read_lines(path) if r.get("summary")]
  if not found:
    raise RuntimeError(f"{path}: no summary line (the side did not finish)")
  return found[-1]


def compare(evals: dict, key_a: str, key_b: str) -> dict:
  """Two evaluations side by side: accuracies, intervals, and whether the intervals overlap."""
  a, b = evals[key_a], evals[key_b]
  lo_a, hi_a = a["eval/ci95_low"], a["eval/ci95_high"]
  lo_b, hi_b = b["eval/ci95_low"], b["eval/ci95_high"]
  return {
    key_a: [a["eval/greedy_reward"], lo_a, hi_a],
    key_b: [b["eval/greedy_reward"], lo_b, hi_b],
    "difference": a["eval/greedy_reward"] - b["eval/greedy_reward"],
    "intervals_overlap": not (lo_a > hi_b or lo_b > hi_a),
  }


def paired(evals: dict, key_a: str, key_b: str) -> dict:
  """Two adapters problem by problem: how many each alone solved, and the exact two-sided
  McNemar p-value (the discordant problems as fair coin flips under no difference)."""
  import math

  a, b = evals[key_a]["rewards"], evals[key_b]["rewards"]
  if len(a) != len(b):
    raise ValueError(f"paired: {key_a} has {len(a)} rewards, {key_b} {len(b)}: the same problems?")
  both = sum(x >= 1 and y >= 1 for x, y in zip(a, b))
  only_a = sum(x >= 1 > y for x, y in zip(a, b))
  only_b = sum(y >= 1 > x for x, y in zip(a, b))
  n = only_a + only_b
  tail = sum(math.comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2**n
  return {
    "a": key_a,
    "b": key_b,
    "both": both,
    "only_a": only_a,
    "only_b": only_b,
    "neither": len(a) - both - only_a - only_b,
    "mcnemar_p": min(1.0, 2 * tail),
  }


def load_recipe(experiment: str, model_dir: str, eval_size: int, sets) -> tuple:
  """(cfg, params, tokenizer) of the recipe on model_dir, as run.py builds them."""
  from absl import flags as absl_flags

  from experiments import registry

  run = registry.run_module()
  fv = run.define_flags(absl_flags.FlagValues())
  over = ["train.progress=False", "train.plot=False", "replay.verify=off"] + list(sets)
  if eval_size:
    over.append(f"train.eval_size={eval_size}")
  fv(
    ["run.py", f"--experiment={experiment}", f"--model_dir={model_dir}"]
    + [f"--set={s}" for s in over]
  )
  return run.config_from(fv)


def evaluate_adapters(recipe: tuple, adapters: dict, on_done=None) -> dict:
  """{name: eval_record} of our greedy evaluation (the trainer's, on the recipe's held-out
  problems) for each PEFT adapter folder (None: the base alone), each record with its
  per-problem `rewards` (two adapters compared problem by problem). on_done(name, record)
  after each adapter: its line is written then, and a kill keeps the adapters done."""
  from branch_replay import algorithms
  from branch_replay.data import tasks
  from branch_replay.train import metrics
  from branch_replay.train import state as train_state
  from models import lora as lora_lib

  cfg, params, tok = recipe
  task = tasks.make(cfg.task, tok)
  algo = algorithms.for_config(cfg)(cfg, task, tok)
  examples = algo.eval_examples()
  out = {}
  for name, folder in adapters.items():
    init = None
    if folder is not None:
      _, init = lora_lib.load_peft(folder, cfg.model, cfg.lora)
    state = algo.start(train_state.init_state(cfg, params, init))
    t = time.perf_counter()
    rewards = algo.evaluate(state, examples)
    rec = metrics.eval_record(rewards)
    out[name] = {
      "adapter": folder,
      **rec,
      "rewards": [float(r) for r in rewards],
      "seconds": round(time.perf_counter() - t, 1),
    }
    print(
      f"evaluated {name}: {rec.get('eval/correct')}/{len(rewards)} correct, "
      f"{out[name]['seconds']:.0f} s",
      file=sys.stderr,
      flush=True,
    )
    if on_done is not None:
      on_done(name, out[name])
  return out


def main(argv):
  del argv
  from experiments import bench_trl
  from experiments.provenance import ResultsWriter

  bench_trl.require_peers()
  opts = dict(
    experiment=FLAGS.experiment,
    max_steps=FLAGS.max_steps,
    remat=FLAGS.remat,
    budget_s=FLAGS.budget_s,
    sets=FLAGS.set,
  )
  if FLAGS.rescore and not FLAGS.workdir:
    raise app.UsageError("--rescore: give --workdir, the folder of the run to score again")
  work = FLAGS.workdir or tempfile.mkdtemp(prefix="time_to_accuracy_")
  os.makedirs(work, exist_ok=True)
  writer = ResultsWriter(FLAGS.out, "time_to_accuracy", argv=sys.argv, with_jax=False)
  hf = os.path.join(work, "hf")
  if not FLAGS.rescore:
    subprocess.run([sys.executable, BENCH, f"--export_only={hf}"], cwd=ROOT, check=True)
  writer.write({"kind": "header", "opts": opts, "workdir": work, "rescore": FLAGS.rescore})

  if not FLAGS.rescore:
    subprocess.run(side_command("trl", work, hf, opts), cwd=ROOT, check=True)
  trl = side_summary(os.path.join(work, "trl.jsonl"))
  k = trl["steps_run"]
  if not FLAGS.rescore:
    subprocess.run(side_command("ours", work, hf, opts, save_at=k), cwd=ROOT, check=True)
  ours = side_summary(os.path.join(work, "ours.jsonl"))
  for name, s in (("trl", trl), ("ours", ours)):
    writer.write_plain(
      {
        "kind": "side",
        "side": name,
        "steps_run": s["steps_run"],
        "train_wall_s": s["train_wall_s"],
        "median_s": s["median_s"],
        "peak_rss_mb": s.get("peak_rss_mb"),
        "shape": s.get("shape"),
        "trl_settings": s.get("trl_settings"),
      }
    )
  adapters = {
    "base": None,
    "trl": os.path.join(work, "trl", "final"),
    "ours_equal_steps": os.path.join(work, "ours", f"step_{k}"),
    "ours_equal_time": os.path.join(work, "ours", "final"),
  }
  if ours["steps_run"] < k:  # ours reached fewer steps than TRL: no adapter at k
    del adapters["ours_equal_steps"]
  recipe = load_recipe(FLAGS.experiment, hf, FLAGS.eval_size, FLAGS.set)
  evals = evaluate_adapters(
    recipe, adapters, lambda name, rec: writer.write_plain({"kind": "eval", "who": name, **rec})
  )
  summary = {
    "kind": "summary",
    "budget_s": FLAGS.budget_s,
    "steps": {"trl": k, "ours": ours["steps_run"]},
    "equal_time": compare(evals, "ours_equal_time", "trl"),
    "paired_equal_time": paired(evals, "ours_equal_time", "trl"),
  }
  if "ours_equal_steps" in evals:
    summary["equal_steps"] = compare(evals, "ours_equal_steps", "trl")
    summary["paired_equal_steps"] = paired(evals, "ours_equal_steps", "trl")
  writer.write(summary)


if __name__ == "__main__":
  define_flags()
  app.run(main)
