"""Your own prompts: a JSON-lines file, one object per line, scored by a reward named in the
config (branch_replay/data/rewards.py).

  {"prompt": "reverse: abc=", "answer": "cba"}
  {"prompt": "what is 0.1+0.2?", "answer": "0.3", "any_field": "the reward may read it"}

  --set=task.name=jsonl --set=task.path=data.jsonl --set=task.reward=exact_match

Held-out prompts for the greedy evaluation: `task.eval_path`, else a seeded `eval_fraction`
of the file. Prompts longer than `prompt_len` tokens are cut from the left (keeping BOS; the
count is logged) or rejected (`overlong=reject`). The supervised warm-up trains on the
`answer` field. With a checkpoint's chat template (`run.py --model_dir`), prompts are
rendered through it (`chat_template=auto`). Every problem with the file is a ValueError
naming the file and line, raised when the task is built: before any compute.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from absl import logging

from branch_replay.data import rewards
from branch_replay.data.tasks import Example, Task, jsonl_records, register

OVERLONG = ("truncate", "reject")
CHAT_TEMPLATE = ("auto", "none")


@register("jsonl")
class JsonlTask(Task):
  @dataclasses.dataclass(frozen=True)
  class Options:
    path: str = ""  # the JSON-lines file of training (and, without eval_path, eval) prompts
    eval_path: str = ""  # held-out prompts; "" = a seeded eval_fraction of `path`
    eval_fraction: float = 0.1
    split_seed: int = 0
    prompt_field: str = "prompt"
    answer_field: str = "answer"  # the reference completion (warm-up and answer rewards)
    prompt_len: int = 64  # prompt tokens, BOS (and chat template) included
    answer_len: int = 0  # warm-up tail tokens (EOS excluded); 0 = the longest answer
    overlong: str = "truncate"  # truncate (from the left) | reject
    reward: str = "exact_match"  # a name in rewards.REWARDS or module:function
    reward_options: str = ""  # JSON object of the reward's keyword arguments
    chat_template: str = "auto"  # auto (the tokenizer's, when it has one) | none

    def __post_init__(self):
      if not 0 <= self.eval_fraction < 1:
        raise ValueError(f"task.eval_fraction={self.eval_fraction!r}: expected 0 <= x < 1")
      for name, low in (("prompt_len", 2), ("answer_len", 0)):
        value = getattr(self, name)
        if not isinstance(value, int) or value < low:
          raise ValueError(f"task.{name}={value!r}: expected an int >= {low}")
      for name, allowed in (("overlong", OVERLONG), ("chat_template", CHAT_TEMPLATE)):
        if getattr(self, name) not in allowed:
          raise ValueError(f"task.{name}={getattr(self, name)!r}: expected one of {allowed}")
      if ":" not in self.reward:
        rewards.get(self.reward)  # an unknown name fails here, with the list
      self.reward_kwargs()

    def reward_kwargs(self) -> dict:
      try:
        kwargs = json.loads(self.reward_options) if self.reward_options else {}
      except json.JSONDecodeError as e:
        raise ValueError(f"task.reward_options={self.reward_options!r}: not JSON ({e})") from None
      if not isinstance(kwargs, dict):
        raise ValueError(
          f"task.reward_options={self.reward_options!r}: expected a JSON object "
          'such as {"tolerance": 0.01}'
        )
      return kwargs

  def __init__(self, cfg, tokenizer):
    super().__init__(cfg, tokenizer)
    if not cfg.path:
      raise ValueError("task.path='': expected a JSON-lines file of prompts (task.name=jsonl)")
    self.reward = rewards.get(cfg.reward)
    self.reward_name, self.reward_options = cfg.reward, cfg.reward_kwargs()
    template = getattr(tokenizer, "chat_template", None)
    self.template = template if cfg.chat_template == "auto" else None
    self.n_truncated = 0
    train = self._load(cfg.path)
    if cfg.eval_path:
      self.train, self.eval = train, self._load(cfg.eval_path)
    else:
      order = np.random.default_rng(cfg.split_seed).permutation(len(train))
      n_eval = int(round(cfg.eval_fraction * len(train)))
      if cfg.eval_fraction and len(train) - n_eval < 1:
        raise ValueError(
          f"{cfg.path}: {len(train)} prompts leave none for training with "
          f"task.eval_fraction={cfg.eval_fraction}"
        )
      self.eval = [train[i] for i in order[:n_eval]]
      self.train = [train[i] for i in sorted(order[n_eval:])]
    if self.n_truncated:
      logging.warning(
        "task %s: %d prompt(s) longer than task.prompt_len=%d tokens were cut "
        "from the left (task.overlong=reject refuses them instead)",
        cfg.path,
        self.n_truncated,
        cfg.prompt_len,
      )
    self.max_prompt_len = cfg.prompt_len
    self.sft_prompt_len = cfg.prompt_len
    answers = [len(self.tokenizer.encode(e.answer)) for e in self.train if e.answer]
    longest = max(answers, default=0)
    if cfg.answer_len and longest > cfg.answer_len:
      ex = next(e for e in self.train if len(self.tokenizer.encode(e.answer)) == longest)
      raise ValueError(
        f"{ex.source}: answer is {longest} tokens, expected <= "
        f"task.answer_len={cfg.answer_len} (0 = the longest answer)"
      )
    self.max_answer_len = cfg.answer_len or max(longest, 1)
    self.sft_tail_len = self.max_answer_len + 1  # EOS

  def _load(self, path: str) -> list:
    cfg = self.cfg
    needs = {cfg.prompt_field, *self.reward.needs}
    needs = {cfg.answer_field if n == "answer" else n for n in needs}
    out = []
    for where, record in jsonl_records(path, f"task file {path!r}"):
      missing = sorted(needs - set(record))
      if missing:
        raise ValueError(
          f"{where}: missing field {missing[0]!r} (expected fields "
          f"{sorted(needs)}; reward {cfg.reward!r})"
        )
      for name in (cfg.prompt_field, cfg.answer_field):
        if name in record and not isinstance(record[name], str):
          raise ValueError(
            f"{where}: field {name!r} is {type(record[name]).__name__} "
            f"{record[name]!r}, expected a string"
          )
      if not record[cfg.prompt_field]:
        raise ValueError(f"{where}: field {cfg.prompt_field!r} is empty")
      out.append(self._example(record, where))
    if not out:
      raise ValueError(f"task file {path!r}: no prompts (expected one JSON object per line)")
    return out

  def _example(self, record: dict, where: str) -> Example:
    cfg = self.cfg
    prompt, answer = record[cfg.prompt_field], record.get(cfg.answer_field, "")
    try:
      if self.template is not None:
        text, bos = self.template.render(prompt)
        ids = ([self.tokenizer.bos_id] if bos else []) + self.tokenizer.encode(text)
      else:
        ids = self.tokenizer.encode(prompt, bos=True)
      if answer:
        self.tokenizer.encode(answer)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    if len(ids) > cfg.prompt_len:
      if cfg.overlong == "reject":
        raise ValueError(
          f"{where}: prompt is {len(ids)} tokens, expected <= "
          f"task.prompt_len={cfg.prompt_len} (task.overlong=truncate cuts it "
          "from the left instead)"
        )
      keep = cfg.prompt_len - 1
      ids = ids[:1] + ids[-keep:] if ids[0] == self.tokenizer.bos_id else ids[-cfg.prompt_len :]
      self.n_truncated += 1
    return Example(prompt, answer, fields=record, source=where, prompt_ids=tuple(ids))

  def sample(self, rng: np.random.Generator) -> Example:
    return self.train[int(rng.integers(len(self.train)))]

  def eval_examples(self, seed: int, n: int) -> list:
    return self.eval[:n]

  def check(self, cfg) -> None:
    if self.max_answer_len + 1 > cfg.sampler.max_new_tokens and self.reward.needs:
      logging.warning(
        "task %s: answers are up to %d tokens + EOS, but sampler.max_new_tokens="
        "%d: longer completions are cut off",
        self.cfg.path,
        self.max_answer_len,
        cfg.sampler.max_new_tokens,
      )
    if cfg.train.sft_steps:
      for ex in self.train:
        if not ex.answer:
          raise ValueError(
            f"{ex.source}: no {self.cfg.answer_field!r} field: the supervised "
            f"warm-up (train.sft_steps={cfg.train.sft_steps}) trains on it"
          )
    if cfg.train.eval_size and not self.eval:
      raise ValueError(
        f"train.eval_size={cfg.train.eval_size}: task {self.cfg.path} has no "
        "held-out prompts (set task.eval_fraction > 0 or task.eval_path)"
      )
