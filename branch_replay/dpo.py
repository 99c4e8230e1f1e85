"""DPO end to end through branch replay: preference pairs that share a long prompt.

Each prompt is one shared prefix; its two tails are the chosen (branch 0) and the rejected
(branch 1) completion, so R = 2. The reference log-probs of both come from one
shared-prefix forward of the frozen reference policy (`sampler.score`), the loss is the
objective `dpo` of losses.py, and the step is the trainer's jitted replay step.

Pairs come from the task (haystack: chosen = the right value, rejected = a wrong one) or
from a JSON-lines file (`dpo.pairs_file`), one {"prompt", "chosen", "rejected"} per line.
Metrics per step: dpo/accuracy (implicit reward of chosen > rejected), dpo/margin,
rewards/chosen, rewards/rejected (beta * log pi/ref summed over the completion).
"""

from __future__ import annotations

import dataclasses
import json
import os
import string
import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay import tasks
from branch_replay.batch import ReplayBatch, validate
from branch_replay.tokenizer import TOKENIZER

FIELDS = ("prompt", "chosen", "rejected")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  pairs_file: str = ""  # JSON lines {"prompt", "chosen", "rejected"}; "" = pairs from the task

  def __post_init__(self):
    if self.pairs_file and not os.path.isfile(self.pairs_file):
      raise ValueError(f"dpo.pairs_file={self.pairs_file!r}: no such file")


@dataclasses.dataclass(frozen=True)
class Pair:
  prompt: str
  chosen: str
  rejected: str
  prompt_ids: Optional[tuple] = None  # token ids (BOS included) when the task tokenized it


def load_pairs(path: str) -> list[Pair]:
  """Preference pairs from a JSON-lines file; a bad line is named."""
  pairs = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{i}: expected an object with fields {FIELDS}")
      for name in FIELDS:
        if not isinstance(row.get(name), str):
          raise ValueError(f"{path}:{i}: field {name!r} missing or not a string; expected "
                           f"fields {FIELDS}")
      pairs.append(Pair(row["prompt"], row["chosen"], row["rejected"]))
  if not pairs:
    raise ValueError(f"{path}: no preference pairs")
  return pairs


def task_pair(task, rng: np.random.Generator) -> Pair:
  """A haystack prompt, its right value (chosen) and a wrong value of the same length."""
  ex = task.sample(rng)
  while True:
    wrong = "".join(rng.choice(list(string.digits), size=len(ex.answer)))
    if wrong != ex.answer:
      return Pair(ex.prompt, ex.answer, wrong, getattr(ex, "prompt_ids", None))


def make_batch(pairs, prompt_len: int, answer_len: int, tok=TOKENIZER) -> ReplayBatch:
  """Prefix = BOS + prompt (left-padded), tails = [chosen, rejected] + EOS (right-padded)."""
  prefix_BP, prefix_valid_BP = tasks.encode_prompts(pairs, prompt_len, tok)
  tails = [tasks.encode_right([p.chosen, p.rejected], answer_len + 1, tok) for p in pairs]
  tails_BRT = np.stack([t for t, _ in tails])
  valid_BRT = np.stack([v for _, v in tails])
  return ReplayBatch(prefix_BP=prefix_BP, prefix_valid_BP=prefix_valid_BP, tails_BRT=tails_BRT,
                     tail_valid_BRT=valid_BRT,
                     advantages_BR=np.zeros(tails_BRT.shape[:2], np.float32))


def preference_metrics(policy_logp_BR, ref_logp_BR, beta: float) -> dict:
  """Implicit rewards beta * (log pi - log ref) of chosen (0) and rejected (1)."""
  r_BR = beta * (np.asarray(policy_logp_BR, np.float64) - np.asarray(ref_logp_BR, np.float64))
  margin_B = r_BR[:, 0] - r_BR[:, 1]
  return {"dpo/accuracy": float(np.mean(margin_B > 0)), "dpo/margin": float(margin_B.mean()),
          "rewards/chosen": float(r_BR[:, 0].mean()),
          "rewards/rejected": float(r_BR[:, 1].mean())}


def run(cfg, workdir: str, *, init_params=None, tokenizer=None) -> dict:
  """The DPO loop (train.run dispatches here for loss.name=dpo): the optional supervised
  warm-up of the trainer, then train.rl_steps DPO steps of train.batch_size pairs."""
  from branch_replay import checkpoint, metrics, sharding, train  # (they import config, which
  # imports us)

  tok = TOKENIZER if tokenizer is None else tokenizer
  if tok.vocab_size > cfg.model.vocab_size:
    raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: expected >= the tokenizer's "
                     f"{tok.vocab_size}")
  t_start = time.time()
  workdir = checkpoint.check_workdir(workdir)
  task = tasks.make(cfg.task, tok)  # the run's tokenizer; a task that reads files checks them
  task.check(cfg)
  file_pairs = load_pairs(cfg.dpo.pairs_file) if cfg.dpo.pairs_file else None
  if file_pairs is not None:
    prompt_len = 1 + max(len(tok.encode(p.prompt, bos=False, eos=False)) for p in file_pairs)
    answer_len = max(len(tok.encode(x, bos=False, eos=False))
                     for p in file_pairs for x in (p.chosen, p.rejected))
  else:
    prompt_len, answer_len = task.max_prompt_len, task.max_answer_len
  ckpt = checkpoint.Checkpointer(workdir, cfg)
  ckpt.check_config()
  state = train.init_state(cfg, init_params)
  start = 0
  keys = train._state_dict(state)
  if ckpt.latest_step() is not None:
    start = ckpt.latest_step()
    if start > cfg.train.sft_steps:  # the reference exists once DPO has begun
      keys["ref_params"] = state.params
    restored = ckpt.restore(start, keys)
    state = train.TrainState(**restored)
  chief = jax.process_index() == 0  # only process 0 writes metrics (multi-host)
  writer = metrics.MetricsWriter(os.path.join(workdir, "metrics.jsonl") if chief else os.devnull,
                                 tensorboard=cfg.train.tensorboard and chief)
  host = sharding.to_host if cfg.mesh else np.asarray  # global arrays -> every process
  fns = train._compiled(train._compile_key(cfg), tok.eos_id)
  t = cfg.train
  for step in range(start, t.total_steps):
    t0 = time.time()
    rec = {"step": step, "kind": "train"}
    if step < t.sft_steps:
      rec["phase"] = "sft"
      batch = train.sft_batch(task, np.random.default_rng([t.seed, step]), cfg, tok)
      validate(batch, cfg.model.vocab_size)
      state, out = fns.sft_step(state, train.place(batch, "batch", cfg))
    else:
      rec["phase"] = "dpo"
      if state.ref_params is None:  # the reference: the policy as DPO begins
        state = state.replace(ref_params=jax.tree.map(jnp.copy, state.params))
      rng = np.random.default_rng([t.seed, step])
      if file_pairs is not None:
        pairs = [file_pairs[i] for i in rng.integers(0, len(file_pairs), t.batch_size)]
      else:
        pairs = [task_pair(task, rng) for _ in range(t.batch_size)]
      batch = make_batch(pairs, prompt_len, answer_len, tok)
      # 1. Reference log-probs of chosen and rejected: one shared-prefix forward per prompt.
      ref_BRT, _ = fns.score(state.ref_params, batch=train.place(batch, "batch", cfg))
      batch = batch.replace(ref_logp_BRT=np.asarray(host(ref_BRT)))
      validate(batch, cfg.model.vocab_size)
      # 2. The policy's log-probs (for the metrics, before the update) and the DPO step.
      pol_BRT, _ = fns.score(state.params, batch=train.place(batch, "batch", cfg))
      rec.update(preference_metrics(np.asarray(host(pol_BRT)).sum(-1),
                                    np.asarray(host(ref_BRT)).sum(-1), cfg.loss.beta))
      state, out = fns.rl_step(state, train.place(batch, "batch", cfg))
    out = {k: float(v) for k, v in jax.device_get(out).items()
           if k in ("loss/policy", "grad/norm", "logp/mean", "entropy")}
    train._finite_or_stop(out, step, ckpt)
    rec.update(out)
    prefix, tails, naive = batch.token_counts()
    rec.update({"replay/prefix_tokens": prefix, "replay/tail_tokens": tails,
                "replay/naive_equiv_tokens": naive, "replay/computed_tokens": prefix + tails,
                "time/step_s": time.time() - t0})
    writer.write(rec)
    if (step + 1) % t.checkpoint_every == 0 or step + 1 == t.total_steps:
      ckpt.save(step + 1, train._state_dict(state))
  writer.close()
  ckpt.close()
  records = metrics.read(writer.path)
  dpo_recs = [r for r in records if r.get("phase") == "dpo"]
  k = max(1, min(10, len(dpo_recs) // 4))
  mean = lambda key, rs: float(np.mean([r[key] for r in rs])) if rs else float("nan")
  return {"accuracy_before": mean("dpo/accuracy", dpo_recs[:k]),
          "accuracy_after": mean("dpo/accuracy", dpo_recs[-k:]),
          "margin_after": mean("dpo/margin", dpo_recs[-k:]), "window": k,
          "steps": len(records), "wall_s": time.time() - t_start, "workdir": workdir,
          "metrics": writer.path, "final_params": state.params}


def format_summary(s: dict) -> str:
  return (f"dpo/accuracy (mean of first/last {s['window']} DPO steps): "
          f"{s['accuracy_before']:.3f} -> {s['accuracy_after']:.3f}; "
          f"margin {s['margin_after']:.3f}\ntime: {s['wall_s']:.0f} s\nmetrics: {s['metrics']}")
