"""Hugging Face checkpoints <-> (ModelConfig, params): import and export of local folders
(config.json + *.safetensors, sharded or not) for Llama, Qwen2, Qwen3, Mistral, Gemma 2 and
Gemma 3 (text). Anything the model cannot reproduce exactly is an error, never a silently
different model.

  cfg, params = hf.load("/path/to/Qwen2.5-0.5B", dtype="float32")
  hf.save("/tmp/policy", cfg, params)            # transformers.AutoModelForCausalLM loads it
  tokenizer = hf.load_tokenizer("/path/to/Qwen2.5-0.5B")  # tokenizers.Tokenizer, None if absent
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from models import hf_qwen35  # hybrid: Qwen3.5 text (Gated DeltaNet + gated attention)
from models import transformer as tfm

# architectures entry -> (model_type, family)
ARCHITECTURES = {
  "LlamaForCausalLM": "llama",
  "Qwen2ForCausalLM": "qwen2",
  "Qwen3ForCausalLM": "qwen3",
  "MistralForCausalLM": "mistral",
  "Gemma2ForCausalLM": "gemma2",
  "Gemma3ForCausalLM": "gemma3_text",
  hf_qwen35.ARCHITECTURE: hf_qwen35.FAMILY,  # hybrid
}
FAMILIES = {family: arch for arch, family in ARCHITECTURES.items()}  # model_type -> arch
GEMMA = ("gemma2", "gemma3_text")
DEFAULT_THETA = {"gemma3_text": 1_000_000.0}  # others: 10000
ROPE_TYPES = ("default",) + tfm.ROPE_SCALING_TYPES
IGNORED_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


def _unsupported(key, value, expected):
  return ValueError(f"config.json {key}={value!r}: unsupported ({expected})")


def family_of(hf: dict) -> str:
  """The family of a config.json dict, from `architectures` (else `model_type`)."""
  supported = f"supported architectures: {sorted(ARCHITECTURES)}"
  archs = hf.get("architectures") or []
  if archs:
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
      raise ValueError(f"config.json architectures={archs}: unsupported; {supported}")
    return ARCHITECTURES[archs[0]]
  model_type = hf.get("model_type")
  if model_type not in FAMILIES:
    raise ValueError(
      f"config.json model_type={model_type!r} (no architectures): unsupported; "
      f"{supported} (model_type one of {sorted(FAMILIES)})"
    )
  return model_type


# ----------------------------------------------------------------------------- config


def _rope_scaling(params: Optional[dict], where: str) -> Optional[tfm.RopeScaling]:
  """A rope_parameters / rope_scaling dict -> RopeScaling (None for 'default')."""
  if not params:
    return None
  rope_type = params.get("rope_type", params.get("type", "default"))
  if rope_type not in ROPE_TYPES:
    raise _unsupported(f"{where}.rope_type", rope_type, f"supported: {ROPE_TYPES}")
  factor = params.get("partial_rotary_factor", 1.0)
  if factor != 1.0:
    raise _unsupported(f"{where}.partial_rotary_factor", factor, "expected 1.0")
  if rope_type == "default":
    return None
  if rope_type == "linear":
    return tfm.RopeScaling("linear", float(params["factor"]))
  return tfm.RopeScaling(
    "llama3",
    float(params["factor"]),
    float(params["low_freq_factor"]),
    float(params["high_freq_factor"]),
    int(params["original_max_position_embeddings"]),
  )


def _rope(hf: dict, family: str):
  """(theta, scaling of the global layers, theta of the local layers or None) from either
  the transformers-5 `rope_parameters` or the older rope_theta/rope_scaling keys."""
  default = DEFAULT_THETA.get(family, 10000.0)
  params = hf.get("rope_parameters")
  if params is None:  # transformers 4 format
    glob_p = dict(hf.get("rope_scaling") or {})
    glob_p.setdefault("rope_theta", hf.get("rope_theta", default))
    local_p = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    where = "rope_scaling"
  elif "full_attention" in params or "sliding_attention" in params:  # per layer type
    glob_p = dict(params.get("full_attention") or {})
    glob_p.setdefault("rope_theta", hf.get("rope_theta", default))
    local_p = dict(params.get("sliding_attention") or {})
    local_p.setdefault("rope_theta", hf.get("rope_local_base_freq", 10000.0))
    where = "rope_parameters.full_attention"
    if family != "gemma3_text" and local_p != glob_p:
      raise _unsupported("rope_parameters", params, "per-layer-type RoPE only for Gemma 3")
  else:
    glob_p, local_p, where = dict(params), None, "rope_parameters"
    glob_p.setdefault("rope_theta", hf.get("rope_theta", default))
  scaling = _rope_scaling(glob_p, where)
  local_theta = None
  if family == "gemma3_text":
    if _rope_scaling(local_p, "rope_parameters.sliding_attention") is not None:
      raise _unsupported(
        "rope_parameters.sliding_attention", local_p, "local layers use plain RoPE"
      )
    local_theta = float(local_p["rope_theta"])
  return float(glob_p["rope_theta"]), scaling, local_theta


def _layer_types(hf: dict, family: str, n_layers: int) -> list[str]:
  if family in ("llama",):
    return ["full_attention"] * n_layers
  if family == "mistral":  # HF Mistral applies its window (if any) to every layer
    return ["sliding_attention" if hf.get("sliding_window") else "full_attention"] * n_layers
  types = hf.get("layer_types")
  if types is None:
    if family in ("qwen2", "qwen3"):
      sliding = hf.get("use_sliding_window", False) and hf.get("sliding_window") is not None
      first = hf.get("max_window_layers", 28)
      types = [
        "sliding_attention" if sliding and i >= first else "full_attention" for i in range(n_layers)
      ]
    else:
      every = (
        2
        if family == "gemma2"
        else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
      )
      types = [
        "sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)
      ]
  if len(types) != n_layers:
    raise ValueError(
      f"config.json layer_types: {len(types)} entries, expected num_hidden_layers={n_layers}"
    )
  for t in types:
    if t not in ("full_attention", "sliding_attention"):
      raise _unsupported("layer_types", t, "expected full_attention or sliding_attention")
  return types


def config_from_hf(
  hf: dict, dtype: str = "float32", param_dtype: Optional[str] = None
) -> tfm.ModelConfig:
  """A config.json dict -> ModelConfig (ValueError naming any value we cannot reproduce).

  dtype is the compute dtype; parameters (and so AdamW state) are float32 masters unless
  param_dtype says otherwise (float64 with a float64 compute dtype)."""
  if param_dtype is None:
    param_dtype = "float64" if dtype == "float64" else "float32"
  family = family_of(hf)
  for key in (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
  ):
    if key not in hf:
      raise ValueError(f"config.json: missing {key!r} (family {family})")
  D, N, L = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
  gemma = family in GEMMA
  act_key = "hidden_activation" if gemma and hf.get("hidden_activation") else "hidden_act"
  act = hf.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
  acts = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
  if act not in acts or (acts[act] == "gelu_tanh") != gemma:
    raise _unsupported(act_key, act, "expected " + ("gelu_pytorch_tanh" if gemma else "silu"))
  for key in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
    if hf.get(key):
      raise _unsupported(key, hf[key], "expected false")
  if family == hf_qwen35.FAMILY:  # hybrid: its own RoPE (partial) and layer types
    theta, scaling, local_theta, types = 0.0, None, None, ["full_attention"] * L
  else:
    theta, scaling, local_theta = _rope(hf, family)
    types = _layer_types(hf, family, L)
  local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
  window = hf.get("sliding_window") if local else None
  if local and window is None:
    local = ()
  kwargs = dict(
    vocab_size=hf["vocab_size"],
    d_model=D,
    n_layers=L,
    n_heads=N,
    n_kv_heads=hf.get("num_key_value_heads") or N,
    head_dim=hf.get("head_dim") or D // N,
    mlp_hidden=hf["intermediate_size"],
    rope_theta=theta,
    rope_scaling=scaling,
    norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
    dtype=dtype,
    param_dtype=param_dtype,
    qkv_bias=family == "qwen2",
    qk_norm=family in ("qwen3", "gemma3_text"),
    sliding_window=window,
    local_layers=None if len(local) in (0, L) else local,
  )
  if gemma:
    kwargs.update(
      post_norms=True,
      scale_embeddings=True,
      norm_offset=1.0,
      activation="gelu_tanh",
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
      attn_logit_softcap=hf.get("attn_logit_softcapping", 50.0 if family == "gemma2" else None),
      final_logit_softcap=hf.get("final_logit_softcapping", 30.0 if family == "gemma2" else None),
    )
    if family == "gemma3_text":
      kwargs["local_rope_theta"] = local_theta
  if family == hf_qwen35.FAMILY:  # hybrid
    kwargs.update(hf_qwen35.config_kwargs(hf))
  try:
    return tfm.ModelConfig(**kwargs)
  except ValueError as e:
    raise ValueError(f"config.json ({family}): {e}") from e


def family_for(cfg: tfm.ModelConfig) -> str:
  """The checkpoint family config.json names for a model config (llama, qwen2, qwen3_5, ...)."""
  if cfg.layer_types is not None or cfg.attn_output_gate:  # hybrid
    return hf_qwen35.FAMILY
  if cfg.norm_offset:
    return "gemma3_text" if cfg.qk_norm else "gemma2"
  if cfg.qk_norm:
    return "qwen3"
  if cfg.qkv_bias:
    return "qwen2"
  return "mistral" if cfg.sliding_window else "llama"


def _canonical(cfg: tfm.ModelConfig) -> dict:
  """Fields that decide the computation, with equivalent spellings made equal."""
  c = dataclasses.asdict(cfg)
  for key in (
    "dtype",
    "param_dtype",
    "remat",
    "attention",
    "attention_block_q",
    "attention_block_k",
    "logits_chunk",
    "logits_chunk_rows",
    "mlp_chunk",
    "scan_layers",
    "linear_chunk",
    "linear_remat",
  ):
    c.pop(key)
  if c["query_pre_attn_scalar"] is None:
    c["query_pre_attn_scalar"] = float(cfg.head_dim)
  if cfg.sliding_window is None or cfg.local_layers == tuple(range(cfg.n_layers)):
    c["local_layers"] = None
  if cfg.local_layers == ():
    c["sliding_window"] = None
  if not any(cfg.layer_window(i) for i in range(cfg.n_layers)) or (
    cfg.local_rope_theta == cfg.rope_theta and cfg.rope_scaling is None
  ):
    c["local_rope_theta"] = None
  return c


def _int_if_whole(x):
  return int(x) if float(x).is_integer() else x  # transformers' strict configs want an int


def config_to_hf(
  cfg: tfm.ModelConfig, family: Optional[str] = None, extra: Optional[dict] = None
) -> dict:
  """ModelConfig -> config.json dict in the transformers-4 spelling (which transformers 5
  also reads). `extra` keys (token ids, max_position_embeddings...) go in first."""
  family = family or family_for(cfg)
  if family not in FAMILIES:
    raise ValueError(f"family={family!r}: expected one of {sorted(FAMILIES)}")
  local = [i for i in range(cfg.n_layers) if cfg.layer_window(i)]
  types = ["sliding_attention" if i in local else "full_attention" for i in range(cfg.n_layers)]
  hf = dict(extra or {})
  hf.update(
    architectures=[FAMILIES[family]],
    model_type=family,
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.d_model,
    intermediate_size=cfg.mlp_hidden,
    num_hidden_layers=cfg.n_layers,
    num_attention_heads=cfg.n_heads,
    num_key_value_heads=cfg.n_kv_heads,
    head_dim=cfg.head_dim,
    rms_norm_eps=cfg.norm_eps,
    tie_word_embeddings=cfg.tie_embeddings,
    rope_theta=cfg.rope_theta,
    torch_dtype=cfg.dtype,
    dtype=cfg.dtype,
  )  # transformers 4 and 5 spellings
  hf.setdefault("max_position_embeddings", 8192)
  hf.pop("rope_parameters", None)
  s = cfg.rope_scaling
  hf["rope_scaling"] = (
    None
    if s is None
    else (
      {"rope_type": "linear", "factor": s.factor}
      if s.type == "linear"
      else {
        "rope_type": "llama3",
        "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_positions,
      }
    )
  )
  if family == hf_qwen35.FAMILY:  # hybrid
    hf.pop("rope_theta")
    hf.update(hf_qwen35.config_dict(cfg))
  elif family in GEMMA:
    hf.update(
      hidden_activation="gelu_pytorch_tanh",
      hidden_act="gelu_pytorch_tanh",
      query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
      attn_logit_softcapping=cfg.attn_logit_softcap,
      final_logit_softcapping=cfg.final_logit_softcap,
      attention_bias=False,
      sliding_window=cfg.sliding_window,
      layer_types=types,
    )
    if family == "gemma3_text":
      hf["rope_local_base_freq"] = cfg.local_rope_theta or cfg.rope_theta
  else:
    hf.update(hidden_act="silu")
    if family in ("llama", "qwen3"):
      hf.update(attention_bias=False)
    if family == "llama":
      hf.update(mlp_bias=False)
    if family == "mistral":
      hf.update(sliding_window=cfg.sliding_window)
    if family in ("qwen2", "qwen3"):
      hf.update(
        use_sliding_window=bool(local),
        sliding_window=cfg.sliding_window,
        max_window_layers=local[0] if local else cfg.n_layers,
        layer_types=types,
      )
  # Export only what re-imports as the same model: a combination of options the family
  # lacks (e.g. soft-capping on Llama) is an error naming the options.
  back = config_from_hf(hf, cfg.dtype, cfg.param_dtype)
  want, got = _canonical(cfg), _canonical(back)
  diff = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
  if diff:
    raise ValueError(
      f"model options {sorted(diff)} cannot be written as a {family} "
      f"config.json: (ours, as {family}) = {diff}"
    )
  return hf


# ----------------------------------------------------------------------------- tensors


class Tensor(NamedTuple):
  path: tuple[str, ...]  # the leaf in our parameter tree
  hf_shape: tuple[int, ...]
  linear: bool  # an HF Linear [out, in]: ours is its transpose, reshaped


def tensor_layout(cfg: tfm.ModelConfig, family: Optional[str] = None) -> dict[str, Tensor]:
  """HF tensor name -> where it lives in our parameter tree, for this config and family."""
  family = family or family_for(cfg)
  D, N, K, H, F, V = (
    cfg.d_model,
    cfg.n_heads,
    cfg.n_kv_heads,
    cfg.head_dim,
    cfg.mlp_hidden,
    cfg.vocab_size,
  )
  out = {
    "model.embed_tokens.weight": Tensor(("embed", "embedding"), (V, D), False),
    "model.norm.weight": Tensor(("final_norm", "scale"), (D,), False),
  }
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = Tensor(("lm_head",), (V, D), True)
  # Gemma's post_attention_layernorm is the attention output's norm; Llama's is the MLP's.
  norms = (
    {
      "input_layernorm": "attn_norm",
      "post_attention_layernorm": "post_attn_norm",
      "pre_feedforward_layernorm": "mlp_norm",
      "post_feedforward_layernorm": "post_mlp_norm",
    }
    if cfg.post_norms
    else {"input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm"}
  )
  for i in range(cfg.n_layers):
    pre, layer = f"model.layers.{i}.", f"layer_{i}"
    for hf_name, ours, shape in (
      ("self_attn.q_proj", "q", (N * H, D)),
      ("self_attn.k_proj", "k", (K * H, D)),
      ("self_attn.v_proj", "v", (K * H, D)),
      ("self_attn.o_proj", "o", (D, N * H)),
      ("mlp.gate_proj", "gate", (F, D)),
      ("mlp.up_proj", "up", (F, D)),
      ("mlp.down_proj", "down", (D, F)),
    ):
      out[f"{pre}{hf_name}.weight"] = Tensor((layer, ours), shape, True)
    if cfg.qkv_bias:
      for p, n in (("q", N), ("k", K), ("v", K)):
        out[f"{pre}self_attn.{p}_proj.bias"] = Tensor((layer, f"{p}_bias"), (n * H,), False)
    if cfg.qk_norm:
      for p in ("q", "k"):
        out[f"{pre}self_attn.{p}_norm.weight"] = Tensor((layer, f"{p}_norm", "scale"), (H,), False)
    for hf_name, ours in norms.items():
      out[f"{pre}{hf_name}.weight"] = Tensor((layer, ours, "scale"), (D,), False)
  if family == hf_qwen35.FAMILY:  # hybrid: each layer's own token mixer
    out = hf_qwen35.hybrid_layout(cfg, out, Tensor)
  return out


def _param_shapes(cfg):
  shapes = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  return {
    tuple(k.key for k in path): leaf.shape
    for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
  }


def params_from_tensors(
  cfg: tfm.ModelConfig, get: Callable[[str], np.ndarray], names: set[str], dtype: str = "float32"
):
  """Our parameter tree from HF tensors (`get(name)` reads one, `names` are all present)."""
  layout = tensor_layout(cfg)
  if family_for(cfg) == hf_qwen35.FAMILY:  # hybrid: q_proj holds query and gate
    get, names = hf_qwen35.split_q_gate(cfg, get, names)
  shapes = _param_shapes(cfg)
  assert set(shapes) == {t.path for t in layout.values()}, "tensor_layout out of date"
  missing = [n for n in layout if n not in names]
  if missing:
    raise ValueError(
      f"checkpoint: missing tensor {missing[0]} (expected shape "
      f"{layout[missing[0]].hf_shape}); {len(missing)} missing in all"
    )
  extra = sorted(
    n
    for n in names - set(layout)
    if not n.endswith(IGNORED_TENSOR_SUFFIXES)
    and not (n == "lm_head.weight" and cfg.tie_embeddings)
  )
  if extra:
    raise ValueError(
      f"checkpoint: unexpected tensors {extra[:5]} ({len(extra)} in all): "
      "this config would ignore them"
    )
  params: dict[str, Any] = {}
  for name, t in layout.items():
    x = get(name)
    if tuple(x.shape) != t.hf_shape:
      raise ValueError(
        f"checkpoint: tensor {name} has shape {tuple(x.shape)}, expected "
        f"{t.hf_shape} from config.json"
      )
    ours = x.T.reshape(shapes[t.path]) if t.linear else x.reshape(shapes[t.path])
    node = params
    for key in t.path[:-1]:
      node = node.setdefault(key, {})
    node[t.path[-1]] = jnp.asarray(ours, dtype=tfm.DTYPES[dtype])
  return params


def tensors_from_params(
  cfg: tfm.ModelConfig, params, dtype: Optional[str] = None
) -> dict[str, np.ndarray]:
  """HF tensors (numpy, in `dtype`, default the leaves' own) from our parameter tree. Works
  on any tree of the same structure (e.g. gradients)."""
  out = {}
  for name, t in tensor_layout(cfg).items():
    x = params
    for key in t.path:
      x = x[key]
    x = np.asarray(x if dtype is None else jnp.asarray(x, tfm.DTYPES[dtype]))
    x = x.reshape(t.hf_shape[::-1]).T if t.linear else x.reshape(t.hf_shape)
    out[name] = np.ascontiguousarray(x)
  if family_for(cfg) == hf_qwen35.FAMILY:  # hybrid
    out = hf_qwen35.merge_q_gate(cfg, out)
  return out


# ----------------------------------------------------------------------------- folders


def _safetensors_files(model_dir: str) -> list[str]:
  index = os.path.join(model_dir, "model.safetensors.index.json")
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted(set(weight_map.values()))
    for name in files:
      if not os.path.exists(os.path.join(model_dir, name)):
        raise ValueError(f"{index}: shard {name} is missing from {model_dir}")
    return [os.path.join(model_dir, name) for name in files]
  files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
  if not files:
    raise ValueError(
      f"{model_dir}: no weights: model.safetensors (or *.safetensors, or "
      "model.safetensors.index.json) is missing"
    )
  return files


def read_config(model_dir: str) -> dict:
  path = os.path.join(model_dir, "config.json")
  if not os.path.exists(path):
    raise ValueError(f"{path}: missing (a Hugging Face folder needs config.json)")
  with open(path) as f:
    return json.load(f)


def load(model_dir: str, dtype: str = "float32", param_dtype: Optional[str] = None):
  """A local Hugging Face folder -> (ModelConfig, params). `dtype` is the compute dtype
  ('float32', 'bfloat16' or 'float64', the latter needs jax x64); the parameters are float32
  "master weights" (exact for bf16 checkpoints) unless `param_dtype` says otherwise, so an
  optimizer update at a fine-tuning learning rate is not rounded away."""
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value is not None and value not in tfm.DTYPES:
      raise ValueError(f"{name}={value!r}: expected one of {sorted(tfm.DTYPES)}")
  cfg = config_from_hf(read_config(model_dir), dtype, param_dtype)
  where = {}
  for path in _safetensors_files(model_dir):
    with safetensors.safe_open(path, framework="numpy") as f:
      for name in f.keys():
        where[name] = path

  def get(name):
    with safetensors.safe_open(where[name], framework="numpy") as f:
      return f.get_tensor(name)

  return cfg, params_from_tensors(cfg, get, set(where), cfg.param_dtype)


def save(
  model_dir: str,
  cfg: tfm.ModelConfig,
  params,
  family: Optional[str] = None,
  extra_config: Optional[dict] = None,
  max_shard_bytes: Optional[int] = None,
) -> None:
  """Write config.json + safetensors (sharded with an index past max_shard_bytes) that
  `transformers` loads. `family` defaults to the one the options imply (a model with no
  Qwen/Gemma/window options is written as Llama); `extra_config` carries keys to keep
  (e.g. the imported config.json's token ids)."""
  hf = config_to_hf(cfg, family, extra_config)
  tensors = tensors_from_params(cfg, params, cfg.dtype)  # in the compute dtype
  os.makedirs(model_dir, exist_ok=True)
  shards, size = [[]], 0
  for name, x in tensors.items():
    if max_shard_bytes and shards[-1] and size + x.nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += x.nbytes
  if len(shards) == 1:
    files = ["model.safetensors"]
  else:
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = {
      "metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
      "weight_map": {n: f for f, names in zip(files, shards) for n in names},
    }
    with open(os.path.join(model_dir, "model.safetensors.index.json"), "w") as f:
      json.dump(index, f, indent=2)
  for file, names in zip(files, shards):
    safetensors.numpy.save_file(
      {n: tensors[n] for n in names}, os.path.join(model_dir, file), metadata={"format": "pt"}
    )
  with open(os.path.join(model_dir, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)


def load_tokenizer(model_dir: str):
  """The folder's tokenizer.json as a `tokenizers.Tokenizer` (a required dependency); None
  when the folder has no tokenizer.json."""
  path = os.path.join(model_dir, "tokenizer.json")
  if not os.path.exists(path):
    return None
  import tokenizers

  try:
    return tokenizers.Tokenizer.from_file(path)
  except Exception as e:  # the Rust library raises its own exception type
    raise ValueError(f"{path}: not a tokenizers file ({e})") from None


def generation_eos_ids(model_dir: str) -> tuple[int, ...]:
  """generation_config.json's eos_token_id (an int or a list: chat models often stop at
  several, e.g. <|im_end|> and <|endoftext|>); () when the folder has no such file."""
  path = os.path.join(model_dir, "generation_config.json")
  if not os.path.exists(path):
    return ()
  with open(path) as f:
    try:
      eos = json.load(f).get("eos_token_id")
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e})") from None
  eos = [] if eos is None else eos if isinstance(eos, list) else [eos]
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
    raise ValueError(f"{path}: eos_token_id={eos!r}: expected an int or a list of ints >= 0")
  return tuple(eos)
