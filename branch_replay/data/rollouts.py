"""Bring your own rollouts: train on completions sampled anywhere (vLLM, SGLang, a file).

One JSON object per line, R responses of one prompt (R the same on every line):

  {"prompt": "What is 2+3?", "responses": ["5", "6"], "rewards": [1.0, 0.0]}
  {"prompt": [1, 17, 42], "responses": [[7, 8, 2], [7, 9, 2]], "rewards": [0.5, -1],
   "logprobs": [[-0.1, -2.3, -0.01], [-0.1, -1.2, -0.3]],
   "turns": [[0, 0, 0], [0, 1, 0]]}

  --set=task.name=rollouts --set=task.path=rollouts.jsonl

`prompt`: text (rendered through the run's chat template when it has one, after BOS) or
token ids as given. `responses`: texts (tokenized with the run's tokenizer; `stop=eos`
appends EOS, as the sampler keeps the stop token it drew) or token id lists as given.
`rewards`: R finite numbers. `logprobs` (optional): the behaviour policy's per-token
log-probs, one per token of the tokenized response (EOS included); without them the first
pass's ratio is taken against our own scoring, which is recorded and reused for every
later epoch. `turns` (optional): per token, 1 marks tool/observation text (read, not
scored). Advantages: the configured group estimator (`algo.advantage`). Every problem is
a ValueError naming file:line and the field, raised when the task is built (before any
compute): nothing is trained on a partial line. Training: branch_replay/algorithms/rollouts.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Optional

import jax
import numpy as np

from branch_replay.core import trie
from branch_replay.data.tasks import Task, jsonl_records, register

STOPS = ("eos", "none")


@dataclasses.dataclass(frozen=True)
class Rollout:
  source: str  # file:line
  prompt_ids: np.ndarray  # int32, BOS (and chat template) included
  responses: tuple  # R int32 arrays (>= 1 token each)
  rewards: np.ndarray  # [R] float64
  logprobs: Optional[tuple] = None  # R float64 arrays, one per response token
  scored: Optional[tuple] = None  # R bool arrays (False: tool/observation tokens)


@register("rollouts")
class RolloutsTask(Task):
  algorithm = "rollouts"  # its lines are trained by algorithms/rollouts.py alone

  @dataclasses.dataclass(frozen=True)
  class Options:
    path: str = ""  # the JSON-lines file of rollouts
    epochs: int = 1  # passes over the file (steps = epochs * (lines // train.batch_size))
    prompt_len: int = 0  # the longest prompt accepted, in tokens (0: no limit)
    response_len: int = 0  # the longest response accepted, in tokens (0: no limit)
    stop: str = "eos"  # eos: a text response ends with EOS, as a sampled one does | none
    chat_template: str = "auto"  # auto (the tokenizer's, when it has one) | none
    auto_tree: bool = True  # shared openings as a prefix tree (trie.py); False: flat
    max_depth: int = 2  # tree levels below the root: 1 (a shared trunk) or 2 (+ groups)
    min_shared: int = 1  # shared runs shorter than this stay unshared
    bucket: int = 16  # pad lengths to multiples of this (fewer compilations)

    def __post_init__(self):
      for name, low in (
        ("epochs", 1),
        ("prompt_len", 0),
        ("response_len", 0),
        ("max_depth", 1),
        ("min_shared", 1),
        ("bucket", 1),
      ):
        value = getattr(self, name)
        if not isinstance(value, int) or value < low:
          raise ValueError(f"task.{name}={value!r}: expected an int >= {low}")
      if self.max_depth > 2:
        raise ValueError(f"task.max_depth={self.max_depth}: expected 1 or 2")
      for name, allowed in (("stop", STOPS), ("chat_template", ("auto", "none"))):
        if getattr(self, name) not in allowed:
          raise ValueError(f"task.{name}={getattr(self, name)!r}: expected one of {allowed}")

  max_prompt_len = sft_prompt_len = sft_tail_len = 0

  def __init__(self, cfg, tokenizer):
    super().__init__(cfg, tokenizer)
    if not cfg.path:
      raise ValueError("task.path='': expected a JSON-lines file of rollouts (task.name=rollouts)")
    template = getattr(tokenizer, "chat_template", None)
    self.template = template if cfg.chat_template == "auto" else None
    self.lines = load(cfg.path, tokenizer, cfg, self.template)
    self.n_branches = len(self.lines[0].responses)

  def sample(self, rng):
    raise ValueError(
      "task.name=rollouts: the rollouts come from task.path; there are no "
      "prompts to sample (train.sft_steps and train.eval_size need another task)"
    )

  def check(self, cfg) -> None:
    if cfg.train.sft_steps:
      raise ValueError(
        f"train.sft_steps={cfg.train.sft_steps}: expected 0 with "
        "task.name=rollouts (no reference answers to warm up on)"
      )
    if len(self.lines) < cfg.train.batch_size:
      raise ValueError(
        f"train.batch_size={cfg.train.batch_size}: {self.cfg.path} holds only "
        f"{len(self.lines)} lines"
      )

  def steps_per_epoch(self, batch_size: int) -> int:
    return len(self.lines) // batch_size  # a partial last batch is left out of each epoch

  def batch_lines(self, step: int, batch_size: int) -> list:
    """The lines of a step: epoch after epoch, in file order (a resumed run continues at the
    same line)."""
    i = step % self.steps_per_epoch(batch_size)
    return self.lines[i * batch_size : (i + 1) * batch_size]


# ----------------------------------------------------------------------------- the file


def _ints(value, where, field, vocab):
  if not isinstance(value, list) or not all(
    isinstance(v, int) and not isinstance(v, bool) for v in value
  ):
    raise ValueError(
      f"{where}: field {field} is {type(value).__name__}, expected text or a list of token ids"
    )
  ids = np.asarray(value, np.int64)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab):
    raise ValueError(
      f"{where}: field {field}: token ids in [0, {vocab}) expected (found {ids.min()}..{ids.max()})"
    )
  return ids.astype(np.int32)


def _numbers(value, n, where, field):
  if not isinstance(value, list) or not all(
    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
  ):
    raise ValueError(f"{where}: field {field} is not a list of numbers")
  if len(value) != n:
    raise ValueError(f"{where}: field {field} has {len(value)} entries, expected {n}")
  out = np.asarray(value, np.float64)
  if not np.all(np.isfinite(out)):
    raise ValueError(
      f"{where}: field {field} holds a non-finite value ({out[~np.isfinite(out)][0]!r})"
    )
  return out


def parse(record, where: str, tokenizer, cfg, template=None) -> Rollout:
  """One line, fully checked (fields, lengths, values, token ids) before anything trains."""
  if not isinstance(record, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
  for field in ("prompt", "responses", "rewards"):
    if field not in record:
      raise ValueError(
        f"{where}: missing field {field!r} (expected prompt, responses, "
        "rewards; optional logprobs, turns)"
      )
  vocab = tokenizer.vocab_size
  prompt = record["prompt"]
  try:
    if isinstance(prompt, str):
      if not prompt:
        raise ValueError(f"{where}: field 'prompt' is empty")
      if template is not None:
        text, bos = template.render(prompt)
        ids = ([tokenizer.bos_id] if bos else []) + list(tokenizer.encode(text))
      else:
        ids = list(tokenizer.encode(prompt, bos=True))
      prompt_ids = np.asarray(ids, np.int32)
    else:
      prompt_ids = _ints(prompt, where, "'prompt'", vocab)
  except ValueError as e:
    raise ValueError(str(e) if str(e).startswith(where) else f"{where}: field 'prompt': {e}")
  if not prompt_ids.size:
    raise ValueError(f"{where}: field 'prompt' is empty")
  if cfg.prompt_len and prompt_ids.size > cfg.prompt_len:
    raise ValueError(
      f"{where}: field 'prompt' is {prompt_ids.size} tokens, expected <= "
      f"task.prompt_len={cfg.prompt_len}"
    )
  texts = record["responses"]
  if not isinstance(texts, list) or not texts:
    raise ValueError(f"{where}: field 'responses' must be a non-empty list")
  responses = []
  for i, text in enumerate(texts):
    field = f"'responses'[{i}]"
    if isinstance(text, str):
      if not text:
        raise ValueError(f"{where}: field {field} is empty")
      try:
        ids = np.asarray(
          list(tokenizer.encode(text)) + ([tokenizer.eos_id] if cfg.stop == "eos" else []), np.int32
        )
      except ValueError as e:
        raise ValueError(f"{where}: field {field}: {e}") from None
    else:
      ids = _ints(text, where, field, vocab)
    if not ids.size:
      raise ValueError(f"{where}: field {field} is empty")
    if cfg.response_len and ids.size > cfg.response_len:
      raise ValueError(
        f"{where}: field {field} is {ids.size} tokens, expected <= "
        f"task.response_len={cfg.response_len}"
      )
    responses.append(ids)
  R = len(responses)
  rewards = _numbers(record["rewards"], R, where, "'rewards'")
  logprobs = scored = None
  if record.get("logprobs") is not None:
    value = record["logprobs"]
    if not isinstance(value, list) or len(value) != R:
      raise ValueError(f"{where}: field 'logprobs' must be a list of {R} lists (one per response)")
    logprobs = tuple(
      _numbers(
        lp,
        len(ids),
        where,
        f"'logprobs'[{i}] (the tokenized response{', EOS included' if cfg.stop == 'eos' else ''})",
      )
      for i, (lp, ids) in enumerate(zip(value, responses))
    )
  if record.get("turns") is not None:
    value = record["turns"]
    if not isinstance(value, list) or len(value) != R:
      raise ValueError(f"{where}: field 'turns' must be a list of {R} masks (one per response)")
    scored = []
    for i, (mask, ids) in enumerate(zip(value, responses)):
      tool = _numbers(mask, len(ids), where, f"'turns'[{i}]")
      if not np.isin(tool, (0, 1)).all():
        raise ValueError(
          f"{where}: field 'turns'[{i}]: expected 0 (scored) or 1 (tool or "
          "observation text) per token"
        )
      if tool.all():
        raise ValueError(f"{where}: field 'turns'[{i}]: every token is tool text: nothing to score")
      scored.append(tool == 0)
    scored = tuple(scored)
  return Rollout(where, prompt_ids, tuple(responses), rewards, logprobs, scored)


def load(path: str, tokenizer, cfg, template=None) -> list:
  out = []
  for where, record in jsonl_records(path, f"task.path={path!r}"):
    rollout = parse(record, where, tokenizer, cfg, template)
    if out and len(rollout.responses) != len(out[0].responses):
      raise ValueError(
        f"{where}: field 'responses' has {len(rollout.responses)} entries, "
        f"expected {len(out[0].responses)} as on {out[0].source} (one group "
        "size per file)"
      )
    out.append(rollout)
  if not out:
    raise ValueError(f"task.path={path!r}: no rollouts (expected one JSON object per line)")
  return out


# ----------------------------------------------------------------------------- batches


def make_batch(lines, advantages_BR, cfg, *, old_logps=None, pad_id: int = 0):
  """The lines as one TreeBatch (the trie with cfg.auto_tree, else flat: depth 1, nothing
  shared) -> (batch, stats). old_logps: per line per response (None: the file's, if every
  line has them, else on-policy)."""
  if old_logps is None and all(l.logprobs is not None for l in lines):
    old_logps = [list(l.logprobs) for l in lines]
  scored = None
  if any(l.scored is not None for l in lines):
    scored = [
      list(l.scored) if l.scored is not None else [np.ones(len(r), bool) for r in l.responses]
      for l in lines
    ]
  shared = (
    dict(max_depth=cfg.max_depth, min_shared=cfg.min_shared)
    if cfg.auto_tree
    else dict(max_depth=1, min_shared=math.inf)
  )
  return trie.layout(
    [l.prompt_ids for l in lines],
    [list(l.responses) for l in lines],
    advantages_BR,
    scored=scored,
    old_logps=old_logps,
    pad_id=pad_id,
    bucket=cfg.bucket,
    **shared,
  )


# ----------------------------------------------------------------------------- behaviour log-probs


class Recorded:
  """Our own scoring of lines without logprobs, kept across epochs and runs (JSON lines;
  `path=None`: in memory only, as on every process but the first)."""

  def __init__(self, path):
    self.path, self.logps = path, {}
    if path and os.path.exists(path):
      with open(path) as f:
        for line in f:
          rec = json.loads(line)
          self.logps[rec["source"]] = [np.asarray(x, np.float64) for x in rec["logprobs"]]

  def add(self, source, logps):
    self.logps[source] = logps
    if self.path:
      with open(self.path, "a") as f:
        f.write(json.dumps({"source": source, "logprobs": [x.tolist() for x in logps]}) + "\n")


def old_logps(lines, recorded: Recorded, score_fn, params, cfg, adv_BR, pad_id):
  """Behaviour log-probs per line: the file's, else recorded, else scored now (score_fn(params,
  batch) -> (per-level log-probs, trunk's)) on the lines' tree (this task's `cfg`: max_depth,
  min_shared)."""
  missing = [l for l in lines if l.logprobs is None and l.source not in recorded.logps]
  if missing:
    probe, stats = trie.layout(
      [l.prompt_ids for l in lines],
      [list(l.responses) for l in lines],
      adv_BR,
      max_depth=cfg.max_depth,
      min_shared=cfg.min_shared,
      pad_id=pad_id,
    )
    per_level, trunk_BW = jax.device_get(score_fn(params, probe))
    scored = trie.unroll(probe, stats["order"], per_level, trunk_BW)
    for b, l in enumerate(lines):
      if l.logprobs is None and l.source not in recorded.logps:
        recorded.add(l.source, scored[b])
  return [list(l.logprobs) if l.logprobs is not None else recorded.logps[l.source] for l in lines]
