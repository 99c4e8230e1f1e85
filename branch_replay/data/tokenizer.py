"""A character-level tokenizer shipped with the code (no downloads): three specials + printable chars.

Small on purpose: a tiny vocabulary keeps the embedding and softmax cheap on a CPU.
"""

from __future__ import annotations

import os
import string
from typing import Iterable, Sequence

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " =;:?+-*.,|#()"


class CharTokenizer:
  """encode(text) -> ids (optionally with BOS/EOS); decode(ids) -> text (specials dropped)."""

  pad_id, bos_id, eos_id = PAD, BOS, EOS
  stop_ids = (EOS,)  # the sampler stops a branch at any of these

  def __init__(self, chars: str = CHARS):
    if len(set(chars)) != len(chars):
      raise ValueError(f"tokenizer chars: expected no duplicates, got {chars!r}")
    self.chars = chars
    self._id = {c: i + len(SPECIALS) for i, c in enumerate(chars)}

  @property
  def vocab_size(self) -> int:
    return len(SPECIALS) + len(self.chars)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = [BOS] if bos else []
    for i, c in enumerate(text):
      if c not in self._id:
        raise ValueError(
          f"tokenizer.encode: character {c!r} at index {i} is not in the vocabulary {self.chars!r}"
        )
      ids.append(self._id[c])
    return ids + ([EOS] if eos else [])

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True, strict: bool = True) -> str:
    """Text of the ids; stops at the first EOS (a completion ends there); skips PAD/BOS.
    strict=False renders ids past the vocabulary (a model with a larger softmax) as U+FFFD."""
    out = []
    for i in ids:
      i = int(i)
      if i == EOS and stop_at_eos:
        break
      if i < len(SPECIALS):
        continue
      if i >= self.vocab_size and not strict:
        out.append("\ufffd")
        continue
      if i >= self.vocab_size:
        raise ValueError(f"tokenizer.decode: id {i} out of range [0, {self.vocab_size})")
      out.append(self.chars[i - len(SPECIALS)])
    return "".join(out)

  def decode_batch(self, ids_NT: Sequence[Sequence[int]]) -> list[str]:
    return [self.decode(row, strict=False) for row in ids_NT]


TOKENIZER = CharTokenizer()


class HFTokenizer:
  """A Hugging Face `tokenizer.json` (through the `tokenizers` library) behind the
  CharTokenizer interface, so the tasks, the sampler's stop tokens and the rewards use the
  imported checkpoint's own vocabulary. Special ids come from the checkpoint's config.json;
  stop ids: eos_id plus generation_config.json's eos ids."""

  def __init__(
    self,
    tokenizer,
    bos_id: int,
    eos_id: int,
    pad_id: int | None = None,
    chat_template=None,
    stop_ids: Sequence[int] = (),
  ):
    self._tok = tokenizer
    self.bos_id, self.eos_id = int(bos_id), int(eos_id)
    self.pad_id = self.eos_id if pad_id is None else int(pad_id)
    self.stop_ids = tuple(dict.fromkeys([self.eos_id, *map(int, stop_ids)]))
    self.chat_template = chat_template  # branch_replay.data.chat.ChatTemplate or None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=False).ids
    return ([self.bos_id] if bos else []) + list(ids) + ([self.eos_id] if eos else [])

  def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True, strict: bool = True) -> str:
    out = []
    for i in ids:
      i = int(i)
      if i in self.stop_ids and stop_at_eos:
        break
      if i >= self.vocab_size:
        if strict:
          raise ValueError(f"tokenizer.decode: id {i} out of range [0, {self.vocab_size})")
        continue
      if i in (self.bos_id, self.pad_id, *self.stop_ids):  # as CharTokenizer: specials dropped
        continue
      out.append(i)
    return self._tok.decode(out, skip_special_tokens=True)

  def decode_batch(self, ids_NT: Sequence[Sequence[int]]) -> list[str]:
    return [self.decode(row, strict=False) for row in ids_NT]


def from_model_dir(model_dir: str, hf_config: dict, *, char_tokenizer: bool = False):
  """The checkpoint's tokenizer.json as an HFTokenizer. A folder without one is an error
  unless `char_tokenizer` asks for the shipped CharTokenizer explicitly (then returned);
  a vocabulary larger than the checkpoint's embedding rows is an error."""
  from models import gguf
  from models import hf  # the only place that imports `tokenizers`

  gguf_path = gguf.gguf_file(model_dir)  # a GGUF file: the tokenizer in its metadata
  path = gguf_path or os.path.join(model_dir, "tokenizer.json")
  if char_tokenizer:
    if gguf.has_tokenizer(gguf_path) if gguf_path else os.path.exists(path):
      raise ValueError(
        f"{path}: the folder has its own tokenizer; the character tokenizer "
        "(--char_tokenizer) would train on other ids than it was trained on"
      )
    return TOKENIZER
  tok = gguf.load_tokenizer(gguf_path) if gguf_path else hf.load_tokenizer(model_dir)
  if tok is None:
    raise ValueError(
      f"{path}: missing; the checkpoint's text needs its tokenizer (pass "
      "--char_tokenizer to train on the shipped character tokenizer instead)"
    )
  rows = hf_config.get("vocab_size")
  vocab = tok.get_vocab_size(with_added_tokens=True)
  if rows is not None and vocab > rows:
    raise ValueError(
      f"{path}: vocabulary of {vocab} tokens exceeds {model_dir}/config.json "
      f"vocab_size={rows} (the embedding's rows): not this checkpoint's tokenizer"
    )
  first = lambda v: v[0] if isinstance(v, (list, tuple)) else v
  eos = first(hf_config.get("eos_token_id"))
  bos = first(hf_config.get("bos_token_id"))
  if eos is None:
    raise ValueError(
      f"{model_dir}/config.json: eos_token_id is missing; the sampler needs a stop token"
    )
  from branch_replay.data import chat

  bos = eos if bos is None else bos
  template = gguf.chat_template(gguf_path) if gguf_path else chat.load(model_dir)
  if template is not None and template.eos_token:  # a chat model's turns end with its EOS
    eos_id = tok.token_to_id(template.eos_token)
    if eos_id is None:
      raise ValueError(f"{template.where}: eos_token {template.eos_token!r} is not in {path}")
    eos = eos_id
  config_eos = hf_config.get("eos_token_id")
  config_eos = list(config_eos) if isinstance(config_eos, (list, tuple)) else [config_eos]
  stops = [*config_eos, *(() if gguf_path else hf.generation_eos_ids(model_dir))]
  for i in stops:
    if not 0 <= int(i) < (rows or vocab):
      raise ValueError(
        f"{model_dir}: eos_token_id {i} is outside the vocabulary [0, {rows or vocab})"
      )
  return HFTokenizer(
    tok, bos, eos, first(hf_config.get("pad_token_id")), chat_template=template, stop_ids=stops
  )
