"""Q2: does training converge the same? Reward and loss curves of replay vs naive over
seeds (each a whole `trainer.run` of the default experiment, warm-up included), plotted with
seed bands, and the per-step gradient cosine of the two modes on identical batches.

  python experiments/q2_convergence.py --out=experiments/results/q2_cpu_$(date +%F).jsonl \
      --plot=experiments/results/q2_cpu_$(date +%F).png          # 3 seeds x 150 RL steps
  python experiments/q2_convergence.py --seeds=0 --rl_steps=5 --cosine_steps=3 \
      --set=train.sft_steps=20 --workdir_root=/tmp/q2
  python experiments/q2_convergence.py --nocurves --seeds=0 --cosine_steps=5   # cosine only
  python experiments/q2_convergence.py --from_results=A.jsonl --from_results=B.jsonl \
      --out=C.jsonl --plot=C.png   # the verdict and plot over runs of several files

Lines: kind=curve (mode, seed, step, reward/mean, loss/policy, eval/greedy_reward when
evaluated), kind=cosine (step, grad_cosine, grad_rel_diff, both losses: replay's and naive's
gradient at the same parameters on the same sampled batch, along a replay trajectory that
starts from a replay warm-up), kind=verdict (how much of each mode's seed-mean reward curve,
smoothed over --smooth steps, lies inside the other's min..max seed band). Expected: cosine 1
to float32 rounding; curves inside each other's bands. Measured: docs/reproduction.md, Q2
(experiments/results/q2_cpu_5seeds_2026-11-30.jsonl and the two runs' files).
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
  flags.DEFINE_multi_integer("seeds", [0, 1, 2], "training seeds")
  flags.DEFINE_integer("rl_steps", 150, "RL steps per run (after the experiment's warm-up)")
  flags.DEFINE_multi_string("mode", ["replay", "naive"], "paths to train")
  flags.DEFINE_bool(
    "curves",
    True,
    "train every (mode, seed) for the curves (--nocurves: "
    "only the identical-batch gradient comparison)",
  )
  flags.DEFINE_integer("cosine_steps", 20, "RL steps of the identical-batch gradient comparison")
  flags.DEFINE_integer("smooth", 10, "running-mean window of the reward curves")
  flags.DEFINE_string("experiment", "grpo_haystack", "module in experiments/ with get_config()")
  flags.DEFINE_multi_string("set", [], "config overrides section.field=value")
  flags.DEFINE_string("workdir_root", "/tmp/q2_convergence", "one workdir per (mode, seed) here")
  flags.DEFINE_string("out", "", "append JSON lines here")
  flags.DEFINE_string("plot", "", "write the curves with seed bands to this PNG")
  flags.DEFINE_multi_string(
    "from_results",
    [],
    "train nothing: read the curve and cosine "
    "lines of these results files (e.g. two runs over different seeds) "
    "and write the verdict over all of them (and --plot)",
  )


def curves(experiment, overrides, seeds, modes, rl_steps, root, writer) -> list[dict]:
  from branch_replay.train import metrics
  from branch_replay.train import trainer
  from experiments import rl_step

  rows = []
  for mode in modes:
    for seed in seeds:
      cfg = rl_step.config_for(experiment, overrides, mode=mode, seed=seed, rl_steps=rl_steps)
      cfg = rl_step.replace_train(cfg, progress=False, plot=False)
      workdir = os.path.join(root, f"{mode}_seed{seed}")
      summary = trainer.run(cfg, workdir)
      for rec in metrics.read(summary["metrics"]):
        keep = {
          k: rec.get(k)
          for k in (
            "step",
            "phase",
            "reward/mean",
            "loss/policy",
            "eval/greedy_reward",
            "time/step_s",
          )
          if k in rec
        }
        rows.append(
          writer.write(
            {"kind": "curve", "mode": mode, "seed": seed, "sft_steps": cfg.train.sft_steps, **keep}
          )
        )
  return rows


def cosines(experiment, overrides, seed, steps, root, writer) -> list[dict]:
  from branch_replay.train import state as train_state
  from branch_replay.train import trainer
  from experiments import rl_step

  cfg = rl_step.config_for(experiment, overrides, mode="replay", seed=seed, rl_steps=0)
  cfg = rl_step.replace_train(cfg, progress=False, plot=False, eval_size=0)
  warm = trainer.run(cfg, os.path.join(root, f"warmup_seed{seed}"))["final_params"]
  cfg = rl_step.replace_train(cfg, sft_steps=0, rl_steps=steps)
  stepper = rl_step.Stepper(cfg, train_state.init_state(cfg, init_params=warm))
  rows = []
  for k in range(steps):
    batch, _, reward = stepper.batch(k)
    cmp = rl_step.compare_grads(rl_step.grads_both_modes(stepper.state.params, batch, cfg))
    one_minus = None if cmp["grad_cosine"] is None else 1.0 - cmp["grad_cosine"]
    rows.append(
      writer.write(
        {
          "kind": "cosine",
          "seed": seed,
          "step": k,
          "reward/mean": reward,
          **cmp,
          "one_minus_cosine": one_minus,
        }
      )
    )
    stepper.update(batch)
  return rows


def from_results(paths) -> tuple[list[dict], list[dict]]:
  """(curve rows, cosine rows) of earlier runs' results files; a (mode, seed) that appears
  in two files is an error (the bands would count it twice)."""
  from experiments import provenance

  rows, cos_rows, owner = [], [], {}
  for i, path in enumerate(paths):
    for r in provenance.read(path):
      if r.get("kind") == "curve":
        key = (r["mode"], r["seed"])
        if owner.setdefault(key, (i, path))[0] != i:
          raise ValueError(
            f"--from_results: mode={key[0]} seed={key[1]} is in both "
            f"{owner[key][1]} and {path}; expected each run in one file"
          )
        rows.append(r)
      elif r.get("kind") == "cosine":
        cos_rows.append(r)
  return rows, cos_rows


def smoothed(values, window):
  import numpy as np

  v = np.asarray(values, float)
  return np.array([v[max(0, i - window + 1) : i + 1].mean() for i in range(len(v))])


def bands(rows, key, window):
  """{mode: (steps, mean, lo, hi)} of the smoothed per-seed curves of `key` (RL steps)."""
  import numpy as np

  out = {}
  for mode in sorted({r["mode"] for r in rows}):
    per_seed = {}
    for r in rows:
      if r["mode"] == mode and r.get(key) is not None and r.get("phase", "rl") == "rl":
        per_seed.setdefault(r["seed"], []).append((r["step"], r[key]))
    if not per_seed:
      continue
    n = min(len(v) for v in per_seed.values())
    steps = np.array([s for s, _ in sorted(next(iter(per_seed.values())))[:n]])
    curves_ = np.stack([smoothed([x for _, x in sorted(v)][:n], window) for v in per_seed.values()])
    out[mode] = (steps, curves_.mean(0), curves_.min(0), curves_.max(0))
  return out


def verdict(rows, window) -> dict:
  b = bands(rows, "reward/mean", window)
  if set(b) != {"replay", "naive"}:
    return {"kind": "verdict", "note": "needs both modes"}
  (_, mr, lr, hr), (_, mn, ln, hn) = b["replay"], b["naive"]
  n = min(len(mr), len(mn))
  inside_naive = float(((mr[:n] >= ln[:n]) & (mr[:n] <= hn[:n])).mean())
  inside_replay = float(((mn[:n] >= lr[:n]) & (mn[:n] <= hr[:n])).mean())
  return {
    "kind": "verdict",
    "steps_compared": n,
    "smooth": window,
    "replay_mean_inside_naive_band": inside_naive,
    "naive_mean_inside_replay_band": inside_replay,
    "final_reward_replay": float(mr[n - 1]),
    "final_reward_naive": float(mn[n - 1]),
  }


def plot(rows, cos_rows, path, window):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for ax, key in zip(axes[:2], ("reward/mean", "loss/policy")):
    for mode, (steps, mean, lo, hi) in bands(rows, key, window).items():
      ax.plot(steps, mean, label=f"{mode} (mean of seeds)")
      ax.fill_between(steps, lo, hi, alpha=0.25, label=f"{mode} seed min..max")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{key} (running mean, {window} steps)")
    ax.legend()
  cos_rows = [r for r in cos_rows if r["grad_cosine"] is not None]
  if cos_rows:
    axes[2].semilogy(
      [r["step"] for r in cos_rows],
      [max(abs(r["one_minus_cosine"]), 1e-17) for r in cos_rows],
      "o-",
      label="1 - cos(g_replay, g_naive)",
    )
    axes[2].semilogy(
      [r["step"] for r in cos_rows],
      [r["grad_rel_diff"] for r in cos_rows],
      "s--",
      label="|g_replay - g_naive| / |g_naive|",
    )
    axes[2].set_xlabel("RL step (identical batches)")
    axes[2].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def main(argv):
  del argv
  from absl import logging

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  from experiments import provenance

  writer = provenance.ResultsWriter(FLAGS.out, "q2_convergence", echo=False)
  if FLAGS.from_results:
    rows, cos_rows = from_results(FLAGS.from_results)
    seeds = sorted({(r["mode"], r["seed"]) for r in rows})
    print(
      writer.write(
        {
          **verdict(rows, FLAGS.smooth),
          "sources": FLAGS.from_results,
          "runs": [f"{m}:{s}" for m, s in seeds],
        }
      )
    )
  else:
    rows = (
      curves(
        FLAGS.experiment,
        FLAGS.set,
        FLAGS.seeds,
        FLAGS.mode,
        FLAGS.rl_steps,
        FLAGS.workdir_root,
        writer,
      )
      if FLAGS.curves
      else []
    )
    cos_rows = (
      cosines(
        FLAGS.experiment, FLAGS.set, FLAGS.seeds[0], FLAGS.cosine_steps, FLAGS.workdir_root, writer
      )
      if FLAGS.cosine_steps
      else []
    )
    if rows:
      print(writer.write(verdict(rows, FLAGS.smooth)))
  measured = [abs(r["one_minus_cosine"]) for r in cos_rows if r["one_minus_cosine"] is not None]
  print(
    f"1 - cosine: max {max(measured) if measured else None} over {len(measured)} of "
    f"{len(cos_rows)} steps (the others had a zero gradient)"
  )
  if FLAGS.plot:
    print("plot:", plot(rows, cos_rows, FLAGS.plot, FLAGS.smooth))


if __name__ == "__main__":
  define_flags()
  app.run(main)
