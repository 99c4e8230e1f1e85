"""A character-level tokenizer shipped with the code (no downloads): three specials + printable chars.

Small on purpose: a tiny vocabulary keeps the embedding and softmax cheap on a CPU.
"""

from __future__ import annotations

import string
from typing import Iterable, Sequence

PAD, BOS, EOS = 0, 1, 2
SPECIALS = ("<pad>", "<bos>", "<eos>")
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " =;:?+-*.,|#()"


class CharTokenizer:
  """encode(text) -> ids (optionally with BOS/EOS); decode(ids) -> text (specials dropped)."""

  pad_id, bos_id, eos_id = PAD, BOS, EOS

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
        raise ValueError(f"tokenizer.encode: character {c!r} at index {i} is not in the "
                         f"vocabulary {self.chars!r}")
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
