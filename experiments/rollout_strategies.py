"""Does branch replay depend on how branches are sampled? The same prompts with rollouts from
  (a) sampler_t1     our sampler at temperature 1 (on-policy);
  (b) file_t07       our sampler at 0.7, written to a rollouts file with its log-probs and
                     trained off-policy from the file (top-p stays refused for RL);
  (c) greedy_noise   greedy decoding with 10% of tokens replaced at random (beam-like:
                     long shared runs until the first replaced token), a rollouts file
                     without log-probs;
  (d) shared_open    responses sharing a 64-token opening, then their own tokens (file).
For each: the automatic tree's shape (trie.py), tree_token_ratio, one loss+gradient step of
flat replay vs the automatic tree (median wall and CPU seconds, the two timed alternately),
their useful-FLOP ratio,
and the gradients' agreement (max relative error over leaves, tree vs flat).

  python experiments/rollout_strategies.py --out=experiments/results/rollout_strategies_cpu.jsonl
  python experiments/rollout_strategies.py --strategies=shared_open --prompt_len=1024 \
      --n_branches=16 --tail_len=128 --opening=64      # the issue's target shape

Target (issue 19, small preset): on (d) at P=1024, R=16, T=128, the tree's step is faster
than flat replay's by >= 0.85x their useful-FLOP ratio, with equal gradients.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import statistics
import tempfile
import time

if __name__ == "__main__" and not (os.path.exists("/dev/nvidia0") or shutil.which("nvidia-smi")):
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

from experiments import compare, flops  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_string("strategies", "sampler_t1,file_t07,greedy_noise,shared_open", "which")
  flags.DEFINE_string("preset", "small", "model preset")
  flags.DEFINE_integer("prompt_len", 256, "P")
  flags.DEFINE_integer("n_branches", 8, "R")
  flags.DEFINE_integer("tail_len", 64, "T: response tokens")
  flags.DEFINE_integer("opening", 32, "(d): shared opening tokens")
  flags.DEFINE_integer("prompts", 1, "B")
  flags.DEFINE_integer("reps", 3, "timed steps after a warm-up (median)")
  flags.DEFINE_string("out", "", "append JSON lines here")


def responses_of(strategy, params, cfg, prompts, rng, tmp):
  """-> (responses per prompt, logprobs per prompt or None, where they came from)."""
  import jax
  import numpy as np
  from branch_replay.core import sampler

  R, T = FLAGS.n_branches, FLAGS.tail_len
  B, P = len(prompts), len(prompts[0])
  prompt_BP = np.stack(prompts).astype(np.int32)
  valid_BP = np.ones((B, P), bool)

  def sample(temperature, n):
    s = sampler.sample(
      params,
      cfg,
      sampler.SamplerConfig(max_new_tokens=T, temperature=temperature),
      prompt_BP,
      valid_BP,
      key=jax.random.key(1),
      n_branches=n,
      stop_tokens=(-1,),
    )
    return np.asarray(s.tokens_BRT), np.asarray(s.logp_BRT)

  if strategy == "sampler_t1":
    tokens, logp = sample(1.0, R)
    return [list(t) for t in tokens], [list(l) for l in logp], "sampler"
  if strategy == "file_t07":
    tokens, logp = sample(0.7, R)
    lines = [
      dict(prompt=p.tolist(), responses=t.tolist(), rewards=[0.0] * R, logprobs=l.tolist())
      for p, t, l in zip(prompt_BP, tokens, logp)
    ]
  elif strategy == "greedy_noise":
    tokens, _ = sample(0.0, 1)
    noisy = np.repeat(tokens, R, axis=1)
    flip = rng.random(noisy.shape) < 0.1
    noisy = np.where(flip, rng.integers(3, cfg.vocab_size, noisy.shape), noisy)
    lines = [
      dict(prompt=p.tolist(), responses=t.tolist(), rewards=[0.0] * R)
      for p, t in zip(prompt_BP, noisy)
    ]
  elif strategy == "shared_open":
    O = FLAGS.opening
    lines = []
    for p in prompt_BP:
      opening = rng.integers(3, cfg.vocab_size, O).tolist()
      lines.append(
        dict(
          prompt=p.tolist(),
          rewards=[0.0] * R,
          responses=[opening + rng.integers(3, cfg.vocab_size, T - O).tolist() for _ in range(R)],
        )
      )
  else:
    raise ValueError(f"--strategies: unknown {strategy!r}")
  path = os.path.join(tmp, f"{strategy}.jsonl")
  with open(path, "w") as f:
    for i, line in enumerate(lines):
      line["rewards"] = rng.normal(size=R).tolist()
      f.write(json.dumps(line) + "\n")
  from branch_replay.data import rollouts
  from branch_replay.data.tokenizer import CharTokenizer

  tok = CharTokenizer()
  tok_vocab = type(
    "Vocab",
    (),
    {
      "vocab_size": cfg.vocab_size,
      "eos_id": tok.eos_id,
      "bos_id": tok.bos_id,
      "encode": tok.encode,
    },
  )()
  opts = rollouts.RolloutsTask.Options(path=path, stop="none")
  loaded = rollouts.load(path, tok_vocab, opts)
  return (
    [list(l.responses) for l in loaded],
    None if loaded[0].logprobs is None else [list(l.logprobs) for l in loaded],
    path,
  )


def timed_pair(fn_a, args_a, fn_b, args_b):
  """Both steps compiled and warmed up, then timed alternately (a, b, a, b, ...) so a load
  that changes during the run (the machine is shared) falls on both alike: (out_a, wall_a,
  cpu_a, out_b, wall_b, cpu_b), medians over FLAGS.reps."""
  import jax

  outs = [jax.block_until_ready(fn_a(*args_a)), jax.block_until_ready(fn_b(*args_b))]
  times = [([], []), ([], [])]
  for _ in range(FLAGS.reps):
    for i, (fn, args) in enumerate(((fn_a, args_a), (fn_b, args_b))):
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      times[i][0].append(time.perf_counter() - t0)
      times[i][1].append(time.process_time() - c0)
  med = statistics.median
  return (outs[0], med(times[0][0]), med(times[0][1]), outs[1], med(times[1][0]), med(times[1][1]))


def main(argv):
  del argv
  import jax
  import numpy as np
  from branch_replay.core import engine, losses, trie
  from experiments import provenance
  from models import transformer as tfm

  cfg = tfm.preset(FLAGS.preset)
  params = tfm.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  B, R, P, T = FLAGS.prompts, FLAGS.n_branches, FLAGS.prompt_len, FLAGS.tail_len
  prompts = [rng.integers(3, cfg.vocab_size, P) for _ in range(B)]
  loss_cfg = losses.LossConfig()
  writer = (
    provenance.ResultsWriter(FLAGS.out, experiment="rollout_strategies") if FLAGS.out else None
  )
  flat_fn = jax.jit(functools.partial(engine.loss_and_grad, model_cfg=cfg, loss_cfg=loss_cfg))
  tree_fn = jax.jit(functools.partial(engine.loss_and_grad, model_cfg=cfg, loss_cfg=loss_cfg))
  with tempfile.TemporaryDirectory() as tmp:
    for strategy in FLAGS.strategies.split(","):
      responses, logps, source = responses_of(strategy, params, cfg, prompts, rng, tmp)
      adv = rng.normal(size=(B, R)).astype(np.float32)
      logps = None if logps is None else [[np.asarray(x, np.float32) for x in rs] for rs in logps]
      flat = trie.flat_batch(prompts, responses, adv, old_logps=logps)
      t_build = time.perf_counter()
      tree_batch, stats = trie.layout(prompts, responses, adv, old_logps=logps)
      t_build = time.perf_counter() - t_build
      (lf, _, gf), flat_s, flat_cpu, (lt, _, gt), tree_s, tree_cpu = timed_pair(
        flat_fn, (params, flat), tree_fn, (params, tree_batch)
      )
      levels = [
        (int(np.prod(stats["fanouts"][: d + 1])), l.tokens_BRT.shape[2])
        for d, l in enumerate(tree_batch.levels)
      ]
      # as executed (dense: every score of a segment), the tree's levels against flat's tails
      flop_ratio = flops.useful_flop_ratio(
        cfg,
        flops.flat(B, R, P, T, "replay"),
        flops.levels(B, tree_batch.root_BP.shape[1], levels),
        dense=True,
      )
      row = dict(
        strategy=strategy,
        source=os.path.basename(source),
        preset=FLAGS.preset,
        B=B,
        R=R,
        P=P,
        T=T,
        fanouts="x".join(map(str, stats["fanouts"])),
        trunk_len=stats["trunk_len"],
        tree_token_ratio=round(stats["tree_token_ratio"], 4),
        trie_token_ratio=round(stats["trie_token_ratio"], 4),
        layout_s=round(t_build, 4),
        flat_replay_s=round(flat_s, 4),
        tree_s=round(tree_s, 4),
        flat_replay_cpu_s=round(flat_cpu, 4),
        tree_cpu_s=round(tree_cpu, 4),
        speedup=round(flat_s / tree_s, 3),
        speedup_cpu=round(flat_cpu / tree_cpu, 3),
        flop_ratio=round(flop_ratio, 3),
        speedup_over_flop_ratio=round(flat_s / tree_s / flop_ratio, 3),
        speedup_cpu_over_flop_ratio=round(flat_cpu / tree_cpu / flop_ratio, 3),
        loss_rel_err=float(abs(lt - lf) / max(abs(lf), 1e-30)),
        grad_max_rel_err=compare.tree_max_rel_err(gt, gf),
        reps=FLAGS.reps,
      )
      if writer:
        writer.write(row)
      else:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
  define_flags()
  app.run(main)
