"""LoRA adapters on the transformer's projections, and their PEFT files.

The base parameter tree stays as it is (frozen, stored once); adapters are a second tree,
{layer_i: {target: {a: A [in, r], b: B [r, out]}}}, and `merge` gives the weights the model
runs: W + (alpha / rank) * A @ B, reshaped to W's einsum layout (q: D->NH, o: NH->D, ...).
Merging inside the differentiated function makes jax return gradients for A and B only (the
base is a closed-over constant: no gradient, no optimizer state). Training attaches the
adapters to the base (`attach`) and the model merges each layer's weights inside that layer. With B = 0 at init the
adapted model starts as the base.

PEFT: `save_peft` writes adapter_config.json + adapter_model.safetensors with the module
names transformers' Llama/Qwen2/Qwen3/Mistral/Gemma 2/Gemma 3 use (lora_A.weight [r, in],
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
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj",
                "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
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
      raise ValueError(f"lora.targets={targets!r}: {bad or 'empty or repeated'} names no layer "
                       f"of the supported families; expected distinct names among {TARGETS} "
                       "(embeddings and the head are not adapted)")

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def _in_ndim(target: str) -> int:
  return 2 if target == "o" else 1  # o: [N, H, D]; the others have one input axis


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
      n_in = math.prod(shape[:_in_ndim(t)])
      n_out = math.prod(shape[_in_ndim(t):])
      targets.append((t, (("a", (n_in, lora.rank)), ("b", (lora.rank, n_out)))))
    out.append((f"layer_{i}", tuple(targets)))
  missing = [t for t in lora.targets if t not in found]
  if missing:
    raise ValueError(f"lora.targets={lora.targets!r}: {missing} names no layer of this model "
                     f"(family {hf.family_for(cfg)}, {cfg.n_layers} layers); expected targets "
                     "among the projections its layers have")
  return tuple(out)


def init_adapters(cfg: tfm.ModelConfig, lora: LoraConfig, key: jax.Array):
  """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform default), B = 0: the adapted
  model starts as the base. In the model's param_dtype (float32 masters)."""
  if not lora.enabled:
    raise ValueError("lora.rank=0: LoRA is off; set lora.rank > 0 to build adapters")
  shapes = adapter_shapes(cfg, lora)
  dtype = tfm.DTYPES[cfg.param_dtype]
  keys = iter(jax.random.split(key, cfg.n_layers * len(lora.targets)))
  out = {}
  for layer, targets in shapes.items():
    out[layer] = {}
    for t, s in targets.items():
      bound = s["a"][0] ** -0.5
      out[layer][t] = {"a": jax.random.uniform(next(keys), s["a"], dtype, -bound, bound),
                       "b": jnp.zeros(s["b"], dtype)}
  return out


def delta(adapter, shape, scale: float):
  """(alpha / rank) * A @ B in the base weight's layout `shape`."""
  return (scale * (adapter["a"] @ adapter["b"])).reshape(shape)


def merge(base, adapters, lora: LoraConfig):
  """The weights the adapted model runs: base with W + scale * A @ B at every target."""
  out = dict(base)
  for layer, targets in adapters.items():
    out[layer] = dict(base[layer])
    for t, adapter in targets.items():
      w = base[layer][t]
      out[layer][t] = w + delta(adapter, w.shape, lora.scale).astype(w.dtype)
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
        for t, ab in targets.items()}
  return out


def check_adapters(cfg: tfm.ModelConfig, lora: LoraConfig, adapters, where: str = "adapters"):
  """ValueError naming the first leaf whose path or shape differs from (cfg, lora)'s."""
  want = adapter_shapes(cfg, lora)
  got = jax.tree.map(lambda x: tuple(x.shape), adapters)
  flat = lambda tree: {"/".join(k.key for k in path): leaf for path, leaf in
                       jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(
                           x, tuple))}
  want, got = flat(want), flat(got)
  for name in sorted(set(want) | set(got)):
    if want.get(name) != got.get(name):
      raise ValueError(f"{where}: {name} has shape {got.get(name)}, expected {want.get(name)} "
                       f"(lora.rank={lora.rank}, targets={lora.targets})")


# ----------------------------------------------------------------------------- PEFT files


def _peft_names(cfg: tfm.ModelConfig, family: str) -> dict[tuple[str, str], str]:
  """(layer_i, target) -> the PEFT module name, from models/hf.py's tensor layout."""
  out = {}
  for name, t in hf.tensor_layout(cfg, family).items():
    if len(t.path) == 2 and t.path[1] in TARGETS and name.endswith(".weight"):
      out[t.path] = PEFT_PREFIX + name[:-len(".weight")]
  return out


def save_peft(adapter_dir: str, cfg: tfm.ModelConfig, lora: LoraConfig, adapters,
              family: Optional[str] = None, base_model: str = "") -> None:
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
          np.asarray(adapter["a"], np.float32).T)
      tensors[f"{module}.lora_B.weight"] = np.ascontiguousarray(
          np.asarray(adapter["b"], np.float32).T)
  config = dict(peft_type="LORA", task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha,
                lora_dropout=0.0, target_modules=sorted(PEFT_MODULES[t] for t in lora.targets),
                bias="none", fan_in_fan_out=False, use_rslora=False, use_dora=False,
                init_lora_weights=True, inference_mode=True, modules_to_save=None,
                layers_to_transform=None, rank_pattern={}, alpha_pattern={},
                base_model_name_or_path=base_model or None)
  os.makedirs(adapter_dir, exist_ok=True)
  safetensors.numpy.save_file(tensors, os.path.join(adapter_dir, WEIGHTS_FILE),
                              metadata={"format": "pt"})
  with open(os.path.join(adapter_dir, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)


def _peft_config(adapter_dir: str) -> tuple[LoraConfig, str]:
  path = os.path.join(adapter_dir, CONFIG_FILE)
  if not os.path.exists(path):
    raise ValueError(f"{path}: missing (a PEFT adapter folder needs {CONFIG_FILE})")
  with open(path) as f:
    c = json.load(f)
  bad = lambda key, expected: ValueError(f"{path}: {key}={c.get(key)!r}: unsupported "
                                         f"(expected {expected})")
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
  if unknown:
    raise ValueError(f"{path}: target_modules {unknown} name no layer of the supported "
                     f"families (expected among {sorted(ours)}): an adapter for another "
                     "architecture")
  if c.get("lora_dropout", 0.0):
    logging.warning("%s: lora_dropout=%s: training continues without dropout", path,
                    c["lora_dropout"])
  targets = tuple(t for t in TARGETS if PEFT_MODULES[t] in modules)
  return LoraConfig(rank=int(c.get("r", 0)), alpha=float(c.get("lora_alpha", 8)),
                    targets=targets), path


def load_peft(adapter_dir: str, cfg: tfm.ModelConfig, lora: Optional[LoraConfig] = None,
              family: Optional[str] = None):
  """A PEFT LoRA folder -> (LoraConfig, adapters) for the base model `cfg`. With `lora`
  (the run's options) its rank, alpha and targets must agree with the file's."""
  found, config_path = _peft_config(adapter_dir)
  if lora is not None and lora.enabled:
    for key in ("rank", "alpha", "targets"):
      if getattr(found, key) != getattr(lora, key):
        peft_key = {"rank": "r", "alpha": "lora_alpha", "targets": "target_modules"}[key]
        raise ValueError(f"{config_path}: {peft_key}={getattr(found, key)!r} but "
                         f"lora.{key}={getattr(lora, key)!r}")
  weights = os.path.join(adapter_dir, WEIGHTS_FILE)
  if not os.path.exists(weights):
    raise ValueError(f"{weights}: missing (a PEFT adapter folder needs {WEIGHTS_FILE})")
  tensors = safetensors.numpy.load_file(weights)
  names = _peft_names(cfg, family or hf.family_for(cfg))
  shapes = adapter_shapes(cfg, found)
  expected = set()
  adapters = {}
  dtype = tfm.DTYPES[cfg.param_dtype]
  for (layer, t), module in names.items():
    if t not in found.targets:
      continue
    adapters.setdefault(layer, {})[t] = {}
    for ours, peft_name in (("a", "lora_A"), ("b", "lora_B")):
      name = f"{module}.{peft_name}.weight"
      expected.add(name)
      if name not in tensors:
        raise ValueError(f"{weights}: missing tensor {name} (an adapter for another "
                         f"architecture, or fewer layers than config's {cfg.n_layers})")
      x = tensors[name].T
      if x.shape != shapes[layer][t][ours]:
        raise ValueError(f"{weights}: tensor {name} has shape {tensors[name].shape}, expected "
                         f"{shapes[layer][t][ours][::-1]} (r={found.rank} in {CONFIG_FILE}, "
                         "the base model's dimensions)")
      adapters[layer][t][ours] = jnp.asarray(x, dtype)
  extra = sorted(set(tensors) - expected)
  if extra:
    raise ValueError(f"{weights}: unexpected tensors {extra[:3]} ({len(extra)} in all): an "
                     "adapter for another architecture or a larger model")
  return found, adapters


def save_merged(model_dir: str, cfg: tfm.ModelConfig, base, adapters,
                lora: Optional[LoraConfig], **save_kwargs) -> None:
  """`--merge`: the full checkpoint W + scale * A @ B (hf.save's folder)."""
  if lora is None or not lora.enabled or adapters is None:
    raise ValueError("--merge: lora.rank=0 (no adapters to merge); --merge exports a LoRA "
                     "run's base + adapters as full weights")
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
  lora, adapters = (load_peft(args.adapter, cfg, family=hf.family_of(config)) if args.adapter
                    else (None, None))
  save_merged(args.out, cfg, base, adapters, lora, family=hf.family_of(config),
              extra_config=config)
  return args.out


if __name__ == "__main__":
  print(main())
