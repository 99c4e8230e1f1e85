"""LoRA adapters on the transformer's projections, and their PEFT files.

The base parameter tree stays as it is (frozen, stored once); adapters are a second tree,
{layer_i: {target: {a: A [in, r], b: B [r, out]}}}, and `merge` gives the weights the model
runs: W + (alpha / rank) * A @ B, reshaped to W's einsum layout (q: D->NH, o: NH->D, ...).
On gated attention (Qwen3.5's full-attention layers) `q` is one adapter over the fused
query+gate projection, as transformers' q_proj is: B [r, N*2*H] with columns in q_proj's
row order (head n's query, then its output gate), so the update reaches both leaves (`q`,
`q_gate`) and the file is peft's own layout (`_fused_gate`).
Merging inside the differentiated function makes jax return gradients for A and B only (the
base is a closed-over constant: no gradient, no optimizer state). Training attaches the
adapters to the base (`attach`) and the model merges each layer's weights inside that layer. With B = 0 at init the
adapted model starts as the base.

PEFT: `save_peft` writes adapter_config.json + adapter_model.safetensors with the module
names transformers' Llama/Qwen2/Qwen3/Mistral/Gemma 2/Gemma 3/Qwen3.5 use (lora_A.weight [r, in],
lora_B.weight [out, r]); `load_peft` reads one back to continue training; `save_merged`
writes the full merged checkpoint (`--merge`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy

from models import hf
from models import transformer as tfm

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
# our target -> the PEFT / transformers module name (the same in every supported family)
PEFT_MODULES = {
  "q": "q_proj",
  "k": "k_proj",
  "v": "v_proj",
  "o": "o_proj",
  "gate": "gate_proj",
  "up": "up_proj",
  "down": "down_proj",
}
# Qwen3.5's linear-attention (Gated DeltaNet) modules: real layers, no target of ours
LINEAR_ATTENTION_MODULES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """rank 0: LoRA off (full fine-tuning). Embeddings and the head are never adapted."""

  rank: int = 0
  alpha: float = 16.0  # the update is (alpha / rank) * A @ B
  dropout: float = 0.0  # only 0 (dropout would make replay's prefix and tails differ)
  targets: tuple[str, ...] = TARGETS

  def __post_init__(self):
    if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
      raise ValueError(f"lora.rank={self.rank!r}: expected an int >= 0 (0: LoRA off)")
    if not (isinstance(self.alpha, (int, float)) and self.alpha > 0):
      raise ValueError(f"lora.alpha={self.alpha!r}: expected a number > 0")
    if self.dropout != 0:
      raise ValueError(f"lora.dropout={self.dropout!r}: expected 0 (no adapter dropout)")
    targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
    object.__setattr__(self, "targets", targets)
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets or len(set(targets)) != len(targets):
      raise ValueError(
        f"lora.targets={targets!r}: {bad or 'empty or repeated'} names no layer "
        f"of the supported families; expected distinct names among {TARGETS} "
        "(embeddings and the head are not adapted)"
      )

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _in_ndim(target: str) -> int:
  return 2 if target == "o" else 1  # o: [N, H, D]; the others have one input axis


def _fused_gate(layer, target: str) -> bool:
  """Whether `target` of this layer's params is the query of a gated attention: its adapter
  covers transformers' fused q_proj, [N, 2, H] outputs (query, gate per head), and trains
  the gate half too (peft's LoRA on q_proj does: the same parameterization both ways)."""
  return target == "q" and "q_gate" in layer


def adapter_shapes(cfg: tfm.ModelConfig, lora: LoraConfig) -> dict:
  """{layer_i: {target: {a: (in, r), b: (r, out)}}} from the base's weight shapes (a layer
  without a target, e.g. a hybrid's linear-attention layer for q/k/v/o, gets none of it).
  ValueError naming lora.targets when a target is on no layer of the model."""
  return {layer: {t: dict(ab) for t, ab in targets} for layer, targets in _shapes(cfg, lora)}


@functools.lru_cache(maxsize=32)
def _shapes(cfg: tfm.ModelConfig, lora: LoraConfig):
  base = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  out, found = [], set()
  for i in range(cfg.n_layers):
    layer = base[f"layer_{i}"]
    targets = []
    for t in lora.targets:
      if t not in layer:
        continue
      found.add(t)
      shape = layer[t].shape
      n_in = math.prod(shape[: _in_ndim(t)])
      n_out = math.prod(shape[_in_ndim(t) :]) * (2 if _fused_gate(layer, t) else 1)
      targets.append((t, (("a", (n_in, lora.rank)), ("b", (lora.rank, n_out)))))
    out.append((f"layer_{i}", tuple(targets)))
  missing = [t for t in lora.targets if t not in found]
  if missing:
    raise ValueError(
      f"lora.targets={lora.targets!r}: {missing} names no layer of this model "
      f"(family {hf.family_for(cfg)}, {cfg.n_layers} layers); expected targets "
      "among the projections its layers have"
    )
  return tuple(out)


def adapter_dtype(cfg: tfm.ModelConfig):
  """The adapters' (and so their AdamW state's) dtype: the base's param_dtype, at least
  float32. A bf16 base (the frozen weights stored as the checkpoint holds them) trains float32
  adapter masters: a bf16 update at a fine-tuning learning rate would round away; a float64
  base (the equivalence tests) keeps float64 adapters."""
  return jnp.promote_types(tfm.DTYPES[cfg.param_dtype], jnp.float32)


def init_adapters(cfg: tfm.ModelConfig, lora: LoraConfig, key: jax.Array):
  """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform default), B = 0: the adapted
  model starts as the base. In `adapter_dtype(cfg)` (float32 masters over a bf16 base)."""
  if not lora.enabled:
    raise ValueError("lora.rank=0: LoRA is off; set lora.rank > 0 to build adapters")
  shapes = adapter_shapes(cfg, lora)
  dtype = adapter_dtype(cfg)
  keys = iter(jax.random.split(key, cfg.n_layers * len(lora.targets)))
  out = {}
  for layer, targets in shapes.items():
    out[layer] = {}
    for t, s in targets.items():
      bound = s["a"][0] ** -0.5
      out[layer][t] = {
        "a": jax.random.uniform(next(keys), s["a"], dtype, -bound, bound),
        "b": jnp.zeros(s["b"], dtype),
      }
  return out


def delta(adapter, shape, scale: float):
  """(alpha / rank) * A @ B in the base weight's layout `shape`."""
  return (scale * (adapter["a"] @ adapter["b"])).reshape(shape)


def add_delta(w, d, dtype=None):
  """W + delta, the sum in the wider of the two dtypes (a bf16 base with float32 adapters:
  W + delta rounded once), stored in the wider of W's dtype and `dtype` (the compute dtype;
  None: W's). For equal dtypes the plain sum."""
  return (w + d).astype(w.dtype if dtype is None else jnp.promote_types(w.dtype, dtype))


def merge(base, adapters, lora: LoraConfig, dtype=None):
  """The weights the adapted model runs: base with W + scale * A @ B at every target (a
  gated attention's q adapter split into its query and gate halves). dtype: the compute
  dtype; the merged weights in the wider of it and the base's (as the model merges them in
  each layer, transformer.merge_adapters: a bf16 base under bf16 compute stays bf16, no
  float32 copy of the model); None: the base's dtype."""
  out = dict(base)
  for layer, targets in adapters.items():
    out[layer] = dict(base[layer])
    for t, adapter in targets.items():
      w = base[layer][t]
      if _fused_gate(base[layer], t):
        D, N, H = w.shape
        d_DN2H = delta(adapter, (D, N, 2, H), lora.scale)
        g = base[layer]["q_gate"]
        out[layer]["q_gate"] = add_delta(g, d_DN2H[:, :, 1], dtype)
        out[layer][t] = add_delta(w, d_DN2H[:, :, 0], dtype)
      else:
        out[layer][t] = add_delta(w, delta(adapter, w.shape, lora.scale), dtype)
  return out


def attach(base, adapters, lora: LoraConfig):
  """The base with each layer's adapters beside its weights, under `transformer.ADAPTERS`
  ({target: {a, b, scale}}): the model merges W + scale * A @ B inside each layer
  (`transformer.run_layers`, under the layer's remat), so the merged weights live one layer
  at a time and their cotangent never exists for the whole model at once; the same
  arithmetic as `merge` (the scale in the adapters' dtype, as a Python float would be)."""
  out = dict(base)
  for layer, targets in adapters.items():
    out[layer] = dict(base[layer])
    out[layer][tfm.ADAPTERS] = {
      t: dict(a=ab["a"], b=ab["b"], scale=jnp.asarray(lora.scale, ab["a"].dtype))
      for t, ab in targets.items()
    }
  return out


def check_adapters(cfg: tfm.ModelConfig, lora: LoraConfig, adapters, where: str = "adapters"):
  """ValueError naming the first leaf whose path or shape differs from (cfg, lora)'s."""
  want = adapter_shapes(cfg, lora)
  got = jax.tree.map(lambda x: tuple(x.shape), adapters)
  flat = lambda tree: {
    "/".join(k.key for k in path): leaf
    for path, leaf in jax.tree_util.tree_leaves_with_path(
      tree, is_leaf=lambda x: isinstance(x, tuple)
    )
  }
  want, got = flat(want), flat(got)
  for name in sorted(set(want) | set(got)):
    if want.get(name) != got.get(name):
      raise ValueError(
        f"{where}: {name} has shape {got.get(name)}, expected {want.get(name)} "
        f"(lora.rank={lora.rank}, targets={lora.targets})"
      )


# ----------------------------------------------------------------------------- PEFT files


def _peft_names(cfg: tfm.ModelConfig, family: str) -> dict[tuple[str, str], str]:
  """(layer_i, target) -> the PEFT module name, from models/hf.py's tensor layout."""
  out = {}
  for name, t in hf.tensor_layout(cfg, family).items():
    if len(t.path) == 2 and t.path[1] in TARGETS and name.endswith(".weight"):
      out[t.path] = PEFT_PREFIX + name[: -len(".weight")]
  return out


def save_peft(
  adapter_dir: str,
  cfg: tfm.ModelConfig,
  lora: LoraConfig,
  adapters,
  family: Optional[str] = None,
  base_model: str = "",
) -> None:
  """adapter_config.json + adapter_model.safetensors that `peft.PeftModel.from_pretrained`
  loads onto the matching transformers model (float32 tensors)."""
  family = family or hf.family_for(cfg)
  check_adapters(cfg, lora, adapters)
  names = _peft_names(cfg, family)
  tensors = {}
  for layer, targets in adapters.items():
    for t, adapter in targets.items():
      module = names[(layer, t)]
      tensors[f"{module}.lora_A.weight"] = np.ascontiguousarray(
        np.asarray(adapter["a"], np.float32).T
      )
      tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(
        np.asarray(adapter["b"], np.float32).T
      )
  config = dict(
    peft_type="LORA",
    task_type="CAUSAL_LM",
    r=lora.rank,
    lora_alpha=lora.alpha,
    lora_dropout=0.0,
    target_modules=sorted(PEFT_MODULES[t] for t in lora.targets),
    bias="none",
    fan_in_fan_out=False,
    use_rslora=False,
    use_dora=False,
    init_lora_weights=True,
    inference_mode=True,
    modules_to_save=None,
    layers_to_transform=None,
    rank_pattern={},
    alpha_pattern={},
    base_model_name_or_path=base_model or None,
  )
  os.makedirs(adapter_dir, exist_ok=True)
  safetensors.numpy.save_file(
    tensors, os.path.join(adapter_dir, WEIGHTS_FILE), metadata={"format": "pt"}
  )
  with open(os.path.join(adapter_dir, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)


def _peft_config(adapter_dir: str) -> tuple[LoraConfig, str]:
  path = os.path.join(adapter_dir, CONFIG_FILE)
  if not os.path.exists(path):
    raise ValueError(f"{path}: missing (a PEFT adapter folder needs {CONFIG_FILE})")
  with open(path) as f:
    c = json.load(f)
  bad = lambda key, expected: ValueError(
    f"{path}: {key}={c.get(key)!r}: unsupported (expected {expected})"
  )
  if c.get("peft_type") != "LORA":
    raise bad("peft_type", "LORA")
  for key in ("use_rslora", "use_dora", "fan_in_fan_out"):
    if c.get(key):
      raise bad(key, "false")
  for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save"):
    if c.get(key):
      raise bad(key, "none: one rank and alpha for every adapted layer")
  if c.get("bias", "none") != "none":
    raise bad("bias", "'none'")
  modules = c.get("target_modules")
  if isinstance(modules, str) or not modules:
    raise bad("target_modules", f"a list of module names among {sorted(PEFT_MODULES.values())}")
  ours = {v: k for k, v in PEFT_MODULES.items()}
  unknown = [m for m in modules if m not in ours]
  linear = [m for m in unknown if m in LINEAR_ATTENTION_MODULES]
  if linear:
    raise ValueError(
      f"{path}: target_modules {linear}: Qwen3.5's Gated DeltaNet projections, "
      f"which lora.targets cannot adapt (expected among {sorted(ours)}: the "
      "gated attention's and every layer's MLP)"
    )
  if unknown:
    raise ValueError(
      f"{path}: target_modules {unknown} name no layer of the supported "
      f"families (expected among {sorted(ours)}): an adapter for another "
      "architecture"
    )
  if c.get("lora_dropout", 0.0):
    logging.warning(
      "%s: lora_dropout=%s: training continues without dropout", path, c["lora_dropout"]
    )
  targets = tuple(t for t in TARGETS if PEFT_MODULES[t] in modules)
  return LoraConfig(
    rank=int(c.get("r", 0)), alpha=float(c.get("lora_alpha", 8)), targets=targets
  ), path


def load_peft(
  adapter_dir: str,
  cfg: tfm.ModelConfig,
  lora: Optional[LoraConfig] = None,
  family: Optional[str] = None,
):
  """A PEFT LoRA folder -> (LoraConfig, adapters) for the base model `cfg`. With `lora`
  (the run's options) its rank, alpha and targets must agree with the file's."""
  found, config_path = _peft_config(adapter_dir)
  if lora is not None and lora.enabled:
    for key in ("rank", "alpha", "targets"):
      if getattr(found, key) != getattr(lora, key):
        peft_key = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules"}[key]
        raise ValueError(
          f"{config_path}: {peft_key}={getattr(found, key)!r} but lora.{key}={getattr(lora, key)!r}"
        )
  weights = os.path.join(adapter_dir, WEIGHTS_FILE)
  if not os.path.exists(weights):
    raise ValueError(f"{weights}: missing (a PEFT adapter folder needs {WEIGHTS_FILE})")
  tensors = safetensors.numpy.load_file(weights)
  names = _peft_names(cfg, family or hf.family_for(cfg))
  shapes = adapter_shapes(cfg, found)
  expected = set()
  adapters = {}
  dtype = adapter_dtype(cfg)
  for (layer, t), module in names.items():
    if t not in found.targets:
      continue
    adapters.setdefault(layer, {})[t] = {}
    for ours, peft_name in (("a", "lora_A"), ("b", "lora_B")):
      name = f"{module}.{peft_name}.weight"
      expected.add(name)
      want = shapes[layer][t][ours][::-1]  # PEFT's [r, in] / [out, r]
      if name not in tensors:
        raise ValueError(
          f"{weights}: module {module}: missing tensor {name} (expected shape "
          f"{want}, found none): the adapter disagrees: it lacks a module the "
          f"base has (target_modules lists {PEFT_MODULES[t]}; an adapter for "
          f"another architecture, or fewer layers than the base's "
          f"{cfg.n_layers})"
        )
      _check_peft_shape(
        weights, module, peft_name, tuple(tensors[name].shape), want, found.rank, cfg, layer, t
      )
      adapters[layer][t][ours] = jnp.asarray(tensors[name].T, dtype)
  extra = sorted(set(tensors) - expected)
  if extra:
    shown = ", ".join(f"{n} {tuple(tensors[n].shape)}" for n in extra[:3])
    raise ValueError(
      f"{weights}: unexpected tensors {shown} ({len(extra)} in all; expected "
      "none): the base disagrees: it has no such module (an adapter for another "
      "architecture or a larger model, or targets outside adapter_config.json's "
      "target_modules)"
    )
  return found, adapters


def _check_peft_shape(weights, module, peft_name, got, want, rank, cfg, layer, target):
  """ValueError naming the module, both shapes and the side that disagrees: the adapter
  (its rank axis is not adapter_config.json's r) or the base (its in / out features)."""
  if got == want:
    return
  head = (
    f"{weights}: module {module}: tensor {module}.{peft_name}.weight has shape {got}, "
    f"expected {want} ({'[r, in]' if peft_name == 'lora_A' else '[out, r]'})"
  )
  r_axis = 0 if peft_name == "lora_A" else 1
  if len(got) != 2 or got[r_axis] != rank:
    raise ValueError(
      f"{head}: the adapter disagrees: its rank axis is not r={rank} of "
      f"{CONFIG_FILE} (a damaged or mixed adapter)"
    )
  what, n_base, n_found = (
    ("input", want[1], got[1]) if peft_name == "lora_A" else ("output", want[0], got[0])
  )
  why = " (an adapter for another base model)"
  if target == "q" and peft_name == "lora_B" and cfg.attn_output_gate:
    why = (
      f"; this gated attention's q_proj holds each head's query and output gate, 2*N*H "
      f"= {want[0]} outputs (an adapter over the query half alone has "
      f"{cfg.n_heads * cfg.head_dim} rows: not peft's layout)"
    )
  raise ValueError(
    f"{head}: the base disagrees: its {module.rsplit('.', 1)[-1]} of {layer} "
    f"has {n_base} {what} features, the adapter's {n_found}{why}"
  )


def save_merged(
  model_dir: str, cfg: tfm.ModelConfig, base, adapters, lora: Optional[LoraConfig], **save_kwargs
) -> None:
  """`--merge`: the full checkpoint W + scale * A @ B (hf.save's folder)."""
  if lora is None or not lora.enabled or adapters is None:
    raise ValueError(
      "--merge: lora.rank=0 (no adapters to merge); --merge exports a LoRA "
      "run's base + adapters as full weights"
    )
  check_adapters(cfg, lora, adapters)
  hf.save(model_dir, cfg, merge(base, adapters, lora), **save_kwargs)


def main(argv=None) -> str:
  """python -m models.lora --base=HF_DIR --adapter=PEFT_DIR --merge --out=DIR: the adapted
  model as one full checkpoint (config.json kept from the base)."""
  import argparse

  parser = argparse.ArgumentParser(description="merge a PEFT LoRA adapter into its base")
  parser.add_argument("--base", required=True, help="the base model's Hugging Face folder")
  parser.add_argument("--adapter", default="", help="the PEFT adapter folder")
  parser.add_argument("--merge", action="store_true", help="write base + adapter as full weights")
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  if not args.merge:
    raise ValueError("--merge: expected (the only export of this command)")
  config = hf.read_config(args.base)
  cfg, base = hf.load(args.base)
  lora, adapters = (
    load_peft(args.adapter, cfg, family=hf.family_of(config)) if args.adapter else (None, None)
  )
  save_merged(args.out, cfg, base, adapters, lora, family=hf.family_of(config), extra_config=config)
  return args.out


if __name__ == "__main__":
  print(main())
