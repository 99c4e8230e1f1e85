"""Qwen3.5 text checkpoints (`Qwen3_5ForCausalLM`, model_type `qwen3_5_text`; dense, no MoE)
for models/hf.py: the config.json keys of the hybrid layout (`layer_types`, `linear_*`,
partial rotary) and the tensors of its Gated DeltaNet and gated-attention layers.

Qwen3.5's q_proj holds each head's query and output gate side by side ([N, 2, H] rows);
ours are two leaves (`q`, `q_gate`): `split_q_gate` / `merge_q_gate` convert.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

FAMILY = "qwen3_5_text"
ARCHITECTURE = "Qwen3_5ForCausalLM"
LAYER_TYPES = ("full_attention", "linear_attention")
GATE_SUFFIX = "#gate"  # a virtual tensor name: the gate half of a gated q_proj


def _unsupported(key, value, expected):
  return ValueError(f"config.json {key}={value!r}: unsupported ({expected})")


def config_kwargs(hf: dict) -> dict:
  """ModelConfig keyword arguments of the hybrid layout (ValueError naming the key)."""
  L = hf["num_hidden_layers"]
  types = hf.get("layer_types")
  if types is None:
    every = hf.get("full_attention_interval", 4)
    types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(L)]
  if len(types) != L:
    raise ValueError(
      f"config.json layer_types: {len(types)} entries, expected num_hidden_layers={L}"
    )
  for t in types:
    if t not in LAYER_TYPES:
      raise _unsupported("layer_types", t, f"expected one of {LAYER_TYPES}")
  rope = dict(hf.get("rope_parameters") or {})
  rope_type = rope.get("rope_type", "default")
  if rope_type != "default":
    raise _unsupported("rope_parameters.rope_type", rope_type, "expected default")
  for key in ("mlp_bias", "attn_output_gate_bias"):
    if hf.get(key):
      raise _unsupported(key, hf[key], "expected false")
  if hf.get("attn_output_gate", True) is not True:
    raise _unsupported("attn_output_gate", hf["attn_output_gate"], "expected true")
  return dict(
    layer_types=tuple(types),
    linear_key_heads=hf.get("linear_num_key_heads", 16),
    linear_value_heads=hf.get("linear_num_value_heads", 32),
    linear_key_head_dim=hf.get("linear_key_head_dim", 128),
    linear_value_head_dim=hf.get("linear_value_head_dim", 128),
    linear_conv_kernel=hf.get("linear_conv_kernel_dim", 4),
    rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
    rotary_fraction=float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
    attn_output_gate=True,
    qk_norm=True,
    norm_offset=1.0,
  )


def config_dict(cfg) -> dict:
  """The hybrid keys of config.json for `cfg`."""
  return dict(
    layer_types=list(cfg.layer_types or ("full_attention",) * cfg.n_layers),
    linear_num_key_heads=cfg.linear_key_heads,
    linear_num_value_heads=cfg.linear_value_heads,
    linear_key_head_dim=cfg.linear_key_head_dim,
    linear_value_head_dim=cfg.linear_value_head_dim,
    linear_conv_kernel_dim=cfg.linear_conv_kernel,
    attention_bias=False,
    hidden_act="silu",
    rope_parameters=dict(
      rope_type="default", rope_theta=cfg.rope_theta, partial_rotary_factor=cfg.rotary_fraction
    ),
  )


def hybrid_layout(cfg, layout: dict, Tensor) -> dict:
  """The common layout with every layer's token mixer replaced by its own kind's tensors."""
  out = {n: t for n, t in layout.items() if ".self_attn." not in n}
  for i in range(cfg.n_layers):
    out.update(layer_tensors(cfg, i, Tensor))
  return out


def layer_tensors(cfg, i: int, Tensor) -> dict:
  """HF name -> Tensor of layer i's token mixer (the MLP and norms are the common ones)."""
  pre, layer = f"model.layers.{i}.", f"layer_{i}"
  D, N, K, H = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  if cfg.layer_type(i) == "full_attention":
    out = {
      f"{pre}self_attn.{hf}.weight": Tensor((layer, ours), shape, True)
      for hf, ours, shape in (
        ("q_proj", "q", (N * H, D)),
        ("k_proj", "k", (K * H, D)),
        ("v_proj", "v", (K * H, D)),
        ("o_proj", "o", (D, N * H)),
      )
    }
    out[f"{pre}self_attn.q_proj.weight{GATE_SUFFIX}"] = Tensor((layer, "q_gate"), (N * H, D), True)
    for p in ("q", "k"):
      out[f"{pre}self_attn.{p}_norm.weight"] = Tensor((layer, f"{p}_norm", "scale"), (H,), False)
    return out
  Kl, Nl = cfg.linear_key_heads, cfg.linear_value_heads
  Hl, J, W = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
  C = 2 * Kl * Hl + Nl * J
  a = f"{pre}linear_attn."
  return {
    f"{a}in_proj_qkv.weight": Tensor((layer, "qkv"), (C, D), True),
    f"{a}in_proj_z.weight": Tensor((layer, "z"), (Nl * J, D), True),
    f"{a}in_proj_b.weight": Tensor((layer, "b"), (Nl, D), True),
    f"{a}in_proj_a.weight": Tensor((layer, "a"), (Nl, D), True),
    f"{a}conv1d.weight": Tensor((layer, "conv"), (C, 1, W), True),
    f"{a}dt_bias": Tensor((layer, "dt_bias"), (Nl,), False),
    f"{a}A_log": Tensor((layer, "A_log"), (Nl,), False),
    f"{a}norm.weight": Tensor((layer, "gated_norm", "scale"), (J,), False),
    f"{a}out_proj.weight": Tensor((layer, "out"), (D, Nl * J), True),
  }


def split_q_gate(cfg, get: Callable[[str], np.ndarray], names: set[str]):
  """(get, names) with each gated q_proj [N*2H, D] read as its query and gate halves."""
  N, H = cfg.n_heads, cfg.head_dim
  gated = {
    f"model.layers.{i}.self_attn.q_proj.weight"
    for i in range(cfg.n_layers)
    if cfg.layer_type(i) == "full_attention"
  } & names

  def halves(name):
    x = get(name)
    if x.shape != (N * 2 * H, x.shape[-1]):
      raise ValueError(
        f"checkpoint: tensor {name} has shape {tuple(x.shape)}, expected "
        f"{(N * 2 * H, x.shape[-1])} (query and gate per head)"
      )
    x = x.reshape(N, 2, H, -1)
    return x[:, 0].reshape(N * H, -1), x[:, 1].reshape(N * H, -1)

  def new_get(name):
    if name.endswith(GATE_SUFFIX):
      return halves(name[: -len(GATE_SUFFIX)])[1]
    return halves(name)[0] if name in gated else get(name)

  return new_get, names | {n + GATE_SUFFIX for n in gated}


def merge_q_gate(cfg, tensors: dict) -> dict:
  """The inverse of `split_q_gate` on a dict of HF tensors."""
  N, H = cfg.n_heads, cfg.head_dim
  out = {}
  for name, x in tensors.items():
    if name.endswith(GATE_SUFFIX):
      continue
    gate = tensors.get(name + GATE_SUFFIX)
    if gate is not None:
      D = x.shape[-1]
      x = np.ascontiguousarray(
        np.stack([x.reshape(N, H, D), gate.reshape(N, H, D)], 1).reshape(N * 2 * H, D)
      )
    out[name] = x
  return out
