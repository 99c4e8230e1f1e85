"""SmolLM2-135M-Instruct's greedy accuracy on the long-context tasks (branch_replay/data/longctx.py)
by prompt length and difficulty, through the trainer's own greedy evaluation
(rollout.greedy_rewards: the chat template, the shared header prefilled once per chunk, the
task's reward), on held-out problems. One JSON line (with provenance) per point: n, correct,
accuracy and its Wilson 95% interval, the mean prompt tokens, seconds.

  python experiments/longctx_accuracy.py --task=needle --prompt_lens=1024,2048 \\
      --difficulties=n_keys=1,n_keys=4 --n=100 \\
      --out=experiments/results/longctx_accuracy_cpu_2026-12-05.jsonl
"""

import os
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


FLAGS = flags.FLAGS


def options(text: str) -> dict:
  """`n_keys=4;answer_prefix=false` -> {"n_keys": 4, "answer_prefix": False}."""
  out = {}
  for part in filter(None, text.split(";")):
    name, _, value = part.partition("=")
    low = value.lower()
    out[name] = low == "true" if low in ("true", "false") else int(value)
  return out


def main(argv):
  del argv
  import dataclasses

  from branch_replay import rollout
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
      examples = rollout.eval_examples(task, cfg)
      fns = rollout.compiled(runtime.Runtime(cfg, tok), task)
      t = time.perf_counter()
      rewards_N = rollout.greedy_rewards(fns, params, task, examples, cfg, tok)
      seconds = time.perf_counter() - t
      n = len(rewards_N)
      record = metrics.eval_record(rewards_N)  # 0/1 rewards: the correct count, Wilson 95%
      writer.write(
        dict(
          task=FLAGS.task,
          model=os.path.basename(path),
          prompt_len=P,
          options=dataclasses.asdict(task_cfg.options),
          mean_prompt_tokens=round(sum(len(e.prompt_ids) for e in examples) / n, 1),
          n=n,
          correct=record.get("eval/correct"),
          accuracy=record["eval/greedy_reward"],
          ci95_low=record.get("eval/ci95_low"),
          ci95_high=record.get("eval/ci95_high"),
          max_new_tokens=cfg.sampler.max_new_tokens,
          eval_batch=FLAGS.eval_batch,
          seconds=round(seconds, 1),
        )
      )


if __name__ == "__main__":
  define_flags()
  app.run(main)
