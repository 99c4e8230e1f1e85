"""SmolLM2-135M-Instruct's greedy accuracy on the long-context tasks (branch_replay/data/longctx.py)
by prompt length and difficulty, through the trainer's own greedy evaluation
(train/evaluate.greedy_rewards: the chat template, the shared header prefilled once per chunk, the
task's reward), on held-out problems. One JSON line (with provenance) per point: n, correct,
accuracy and its Wilson 95% interval, the mean prompt tokens, seconds.

  python experiments/longctx_accuracy.py --task=needle --prompt_lens=1024,2048 \\
      --difficulties=n_keys=1,n_keys=4 --n=100 \\
      --out=experiments/results/longctx_accuracy_cpu_2026-12-05.jsonl

With --temperatures=1.0,0.5 (and --samples=R) it also samples R completions per held-out prompt
at each temperature through the RL sampler (kind=sampled lines): the per-sample accuracy, and
the fraction of prompts whose R rewards differ, the groups GRPO learns from (all equal: zero
advantages). A recipe's temperature needs both well above 0.

A long greedy evaluation (100 problems at 8K tokens: most of an hour on 2 cores) prints its
progress after every chunk, and with --progress=FILE appends the rewards so far to FILE; the
same command run again after a kill resumes each point from its last line there (the same
commit, model, task, options, seed, n and eval_batch), and its row says `resumed_from`.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_string("out", "", "Append the JSON lines here ('' prints only).")
  flags.DEFINE_enum("task", "needle", ["needle", "vartrack"], "The task.")
  flags.DEFINE_list("prompt_lens", ["1024"], "Target prompt tokens (task.prompt_len).")
  flags.DEFINE_list(
    "difficulties",
    ["n_keys=4"],
    "Task options per point, `;`-joined within one (e.g. hops=2;distractors=1).",
  )
  flags.DEFINE_integer("n", 100, "Held-out problems per point.")
  flags.DEFINE_integer("eval_batch", 10, "Prompts per greedy call (train.eval_batch).")
  flags.DEFINE_integer(
    "max_new_tokens", 0, "Greedy tokens per answer (0 = the task's longest answer + EOS)."
  )
  flags.DEFINE_integer("seed", 0, "train.seed: which held-out problems.")
  flags.DEFINE_string("model_dir", "", "A GGUF file or HF folder ('' = the packaged SmolLM2).")
  flags.DEFINE_list(
    "temperatures",
    [],
    "Also sample --samples completions per prompt at each of these temperatures (the RL "
    "sampler's): per-sample accuracy and the fraction of prompts whose group has reward "
    "variance (GRPO's signal). Empty: greedy only.",
  )
  flags.DEFINE_integer("samples", 8, "Completions per prompt at each --temperatures (R).")
  flags.DEFINE_bool("greedy", True, "Measure the greedy accuracy (false: the sampled rows only).")
  flags.DEFINE_string(
    "progress", "", "Append each greedy chunk's rewards so far here; a rerun resumes ('': off)."
  )


FLAGS = flags.FLAGS


def options(text: str) -> dict:
  """`n_keys=4;answer_prefix=false` -> {"n_keys": 4, "answer_prefix": False}."""
  out = {}
  for part in filter(None, text.split(";")):
    name, _, value = part.partition("=")
    low = value.lower()
    out[name] = low == "true" if low in ("true", "false") else int(value)
  return out


def _same(a: dict, b: dict) -> bool:
  return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def resume_point(path: str, key: dict) -> tuple[list, float]:
  """(rewards, seconds) of the last progress line of `path` for this point (`key`), ([], 0.0)
  where there is none (no file, another point; a line cut by a kill is skipped)."""
  from experiments.longctx_speed import read_lines  # a line cut by a kill is dropped

  found = [], 0.0
  for row in read_lines(path) if path else []:
    if isinstance(row, dict) and _same(row.get("key", {}), key):
      found = list(row["rewards"]), float(row["seconds"])
  return found


def progress_writer(path: str, key: dict, n: int, before_s: float):
  """on_chunk for evaluate.greedy_rewards: a progress line on stderr, and (with a path) the
  rewards so far appended and flushed to disk."""
  t0 = time.perf_counter()

  def on_chunk(rewards):
    seconds = round(before_s + time.perf_counter() - t0, 1)
    correct = int((rewards >= 1).sum())
    print(
      f"greedy P={key['prompt_len']} {key['options']}: {len(rewards)}/{n} done, {correct} "
      f"correct, {seconds:.0f} s",
      file=sys.stderr,
      flush=True,
    )
    if path:
      with open(path, "a") as f:
        line = dict(key=key, done=len(rewards), seconds=seconds, rewards=rewards.tolist())
        f.write(json.dumps(line) + "\n")
        f.flush()
        os.fsync(f.fileno())

  return on_chunk


def main(argv):
  del argv
  import dataclasses

  from branch_replay import rollout
  from branch_replay.train import evaluate
  from branch_replay.core.sampler import SamplerConfig
  from branch_replay.data import tasks
  from branch_replay.data import tokenizer as tokenizer_lib
  from branch_replay.train import metrics, runtime
  from experiments import provenance
  from experiments.configs import base
  from models import gguf

  path = FLAGS.model_dir or gguf.smollm2_path()
  model_cfg, params = gguf.load_model(path)
  tok = tokenizer_lib.from_model_dir(path, gguf.read_model_config(path))
  writer = provenance.ResultsWriter(FLAGS.out, "longctx_accuracy")
  for P in map(int, FLAGS.prompt_lens):
    for difficulty in FLAGS.difficulties:
      task_cfg = tasks.TaskConfig(name=FLAGS.task, prompt_len=P, **options(difficulty))
      task = tasks.make(task_cfg, tok)
      cfg = base.config(
        task_cfg,
        model=model_cfg,
        train=base.train(seed=FLAGS.seed, eval_size=FLAGS.n, eval_batch=FLAGS.eval_batch),
        sampler=SamplerConfig(max_new_tokens=FLAGS.max_new_tokens or task.max_answer_len + 1),
      )
      cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, eval_shared_prefix=True))
      task.check(cfg)
      examples = evaluate.eval_examples(task, cfg)
      common = dict(
        task=FLAGS.task,
        model=os.path.basename(path),
        prompt_len=P,
        options=dataclasses.asdict(task_cfg.options),
        mean_prompt_tokens=round(sum(len(e.prompt_ids) for e in examples) / len(examples), 1),
        max_new_tokens=cfg.sampler.max_new_tokens,
      )
      for temperature in map(float, FLAGS.temperatures):
        writer.write(
          dict(
            kind="sampled",
            **common,
            **sampled(
              cfg,
              task,
              tok,
              params,
              examples,
              temperature,
              samples=FLAGS.samples,
              batch=FLAGS.eval_batch,
              seed=FLAGS.seed,
            ),
          )
        )
      if not FLAGS.greedy:
        continue
      fns = rollout.compiled(runtime.Runtime(cfg, tok), task)
      key = dict(
        common,
        git_commit=provenance.git_info()["git_commit"],
        seed=FLAGS.seed,
        n=len(examples),
        eval_batch=FLAGS.eval_batch,
      )
      done, before_s = resume_point(FLAGS.progress, key)
      t = time.perf_counter()
      rewards_N = evaluate.greedy_rewards(
        fns,
        params,
        task,
        examples,
        cfg,
        tok,
        done=done,
        on_chunk=progress_writer(FLAGS.progress, key, len(examples), before_s),
      )
      seconds = before_s + time.perf_counter() - t
      n = len(rewards_N)
      record = metrics.eval_record(rewards_N)  # 0/1 rewards: the correct count, Wilson 95%
      writer.write(
        dict(
          **common,
          n=n,
          correct=record.get("eval/correct"),
          accuracy=record["eval/greedy_reward"],
          ci95_low=record.get("eval/ci95_low"),
          ci95_high=record.get("eval/ci95_high"),
          eval_batch=FLAGS.eval_batch,
          seconds=round(seconds, 1),
          **({"resumed_from": len(done)} if done else {}),
        )
      )


def sampled(
  cfg, task, tok, params, examples, temperature: float, *, samples: int, batch: int, seed: int
) -> dict:
  """R = `samples` completions of every example at `temperature` (the RL sampler, prompts
  padded to the task's length, `batch` prompts a call, 0: all): per-sample accuracy with its
  Wilson 95% interval (samples of one prompt are not independent: the interval is a lower
  bound on the uncertainty), and the fraction of prompts whose rewards are not all equal."""
  import dataclasses

  import jax
  import numpy as np

  from branch_replay import rollout
  from branch_replay.core import sampler
  from branch_replay.data import tasks
  from branch_replay.train import metrics, runtime

  R = samples
  cfg = dataclasses.replace(
    cfg,
    train=dataclasses.replace(cfg.train, n_branches=R),
    sampler=dataclasses.replace(cfg.sampler, temperature=temperature),
  )
  fns = rollout.compiled(runtime.Runtime(cfg, tok), task)
  n = batch or len(examples)
  t = time.perf_counter()
  rewards = []
  for i in range(0, len(examples), n):
    got = examples[i : i + n]
    chunk = got + [got[-1]] * (n - len(got))
    prompt_BP, valid_BP = tasks.encode_prompts(chunk, task.max_prompt_len, tok)
    key = jax.random.fold_in(jax.random.key(seed), i)
    s = fns.sample(params, prompt_BP=prompt_BP, prompt_valid_BP=valid_BP, key=key)
    r = np.asarray(task.rewards(got, sampler.completions(s, tok)[: len(got)]), np.float64)
    rewards.append(r.reshape(len(got), R))
  rewards_NR = np.concatenate(rewards)
  correct = int((rewards_NR >= 1).sum())  # the tasks' exact rewards are 0 or 1
  low, high = metrics.wilson_interval(correct, rewards_NR.size)
  return dict(
    temperature=temperature,
    n=len(examples),
    samples=R,
    correct=correct,
    accuracy=float(rewards_NR.mean()),
    ci95_low=low,
    ci95_high=high,
    informative_frac=float(rollout.informative(rewards_NR).mean()),
    prompts_with_any_correct=int((rewards_NR.max(1) > 0).sum()),
    eval_batch=batch,
    seconds=round(time.perf_counter() - t, 1),
  )


if __name__ == "__main__":
  define_flags()
  app.run(main)
