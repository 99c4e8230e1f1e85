"""The first-step self-check (`replay.verify=first`): the first training batch with a learning
signal (`has_signal`: not every advantage zero) runs through
branch replay and through its naive twin on the user's own model and data, and the run stops
if they differ beyond a tolerance for the compute dtype, naming the worst gradient leaf.

  stats = verify.check(params, batch, model_cfg, loss_cfg)   # a flat batch or a tree
  stats = verify.check(adapters, batch, model_cfg, loss_cfg, base=base, lora=lora_cfg)  # LoRA

With LoRA the check differentiates what the trainer differentiates: the adapters, attached to
the frozen base inside each layer (`lora.attach`, as `steps.lora_params_fn`), so it compares
the adapters' gradients, the ones the optimizer applies. (Comparing the merged model's full
gradient instead would judge leaves nobody trains: on SmolLM2 with a bf16 base a frozen norm
scale's gradient read 3.0 relative while every adapter agreed; experiments/verify_tolerance.py.)

Where the run computes in a half dtype (bfloat16, float16) the check computes in float32 over
the same stored weights (a bf16 base is exact in float32; `check_config`): in bf16 the two
paths round differently and a GRPO gradient is a sum over group-centred advantages that
cancel, so a right engine's bf16 gradients can differ by more than their own size. Measured on
SmolLM2-135M with LoRA over a bf16 base (experiments/verify_tolerance.py and the step's batch
re-run in both dtypes): bf16 replay against bf16 naive 1.94 at the worst adapter leaf, and each
of the two is 72-83% (global norm) away from the float32 gradient of the same weights, while in
float32 replay and naive agree to 4.9e-5. The check therefore judges the engine (masks,
positions, cotangent sums) on the user's model and data, not bf16 rounding; its activations
are float32 (twice a bf16 step's).

Its cost (one replay and one naive loss-and-gradient, compiled once) is returned for the log.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from branch_replay.core import engine
from models import lora as lora_lib

MODES = ("auto", "first", "off")  # auto: first for imported checkpoints (run.py --model_dir)

# Largest error a correct engine shows, relative to each gradient leaf's largest entry: the
# two paths sum the same terms in a different order (prefix cotangents summed over branches).
# Keyed by the check's compute dtype (half-precision runs are checked in float32). float32:
# measured at every RL step of the default run (7.7e-6), a tree run (1.0e-5) and SmolLM2 with
# LoRA (1.7e-4; 4.9e-5 over a bf16 base): 2e-3 keeps 12x to 260x (docs/training.md).
TOLERANCE = {"float64": 1e-8, "float32": 2e-3}
HALF = ("bfloat16", "float16")


class MismatchError(ValueError):
  """Replay and the naive twin disagree on this model and batch."""


def enabled(mode: str, imported: bool) -> bool:
  if mode not in MODES:
    raise ValueError(f"replay.verify={mode!r}: expected one of {MODES}")
  return mode == "first" or (mode == "auto" and imported)


def check_config(model_cfg):
  """The model config the check computes in: the run's, or float32 where the run computes in a
  half dtype (the weights as stored: a bf16 base is upcast layer by layer, exactly)."""
  if str(jnp.dtype(model_cfg.compute_dtype)) in HALF:
    return dataclasses.replace(model_cfg, dtype="float32")
  return model_cfg


def tolerance(model_cfg) -> float:
  """The check's compute dtype decides (the stored weights are exact in it)."""
  return TOLERANCE[str(jnp.dtype(check_config(model_cfg).compute_dtype))]


def leaf_errors(fast, slow):
  """Per leaf: (path, max |fast - slow| / max |slow|, fast value, slow value) at the worst entry."""
  out = []
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(fast)[0], jax.tree.leaves(slow)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    diff = np.abs(a - b)
    i = np.unravel_index(np.argmax(diff), diff.shape) if diff.size else ()
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    err = float(diff[i]) / (scale + 1e-30) if diff.size else 0.0
    if not np.isfinite(a).all() or not np.isfinite(b).all():
      err = float("inf")
    out.append((jax.tree_util.keystr(path), err, float(a[i]), float(b[i]), i))
  return out


def has_signal(batch) -> bool:
  """False when the batch carries advantages and every one of them is zero (a first GRPO batch
  whose groups all drew equal rewards): its policy gradient is then zero by construction (and
  KL's too at the first step, the policy being the reference), so replay and its naive twin
  would differ only by rounding noise relative to a gradient of noise, which proves nothing
  either way (measured: a bf16 run's first batch failed so). The trainer checks the first
  batch that has signal instead."""
  advantages = [
    x
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
    if "advantages" in jax.tree_util.keystr(path) and x is not None
  ]
  return not advantages or any(bool(np.any(np.asarray(x) != 0)) for x in advantages)


def loss_error(fast, slow) -> float:
  """|fast - slow| relative to max(|slow|, 1): relative for losses of size 1 and above,
  absolute below. A GRPO loss is near 0 by construction (group-centred advantages: the
  on-policy surrogate sums to ~0), where a relative error is ill-conditioned: on the default
  run a correct engine's loss read 0.92 relative (measured, experiments/verify_tolerance.py)."""
  fast, slow = float(fast), float(slow)
  if not (np.isfinite(fast) and np.isfinite(slow)):
    return float("inf")
  return abs(fast - slow) / max(abs(slow), 1.0)


def loss_and_grad(params, base, batch, *, model_cfg, loss_cfg, mode, branch_chunk, lora):
  """engine.loss_and_grad of `params`, or with LoRA (`base` given) of the adapters `params`
  attached to the frozen base (a jit argument, not a constant baked into the program)."""
  params_fn = None if base is None else functools.partial(_attach, base, lora=lora)
  return engine.loss_and_grad(
    params, batch, model_cfg, loss_cfg, mode, branch_chunk, params_fn=params_fn
  )


def _attach(base, adapters, lora):
  return lora_lib.attach(base, adapters, lora)


def check(
  params, batch, model_cfg, loss_cfg, *, branch_chunk=None, tol=None, base=None, lora=None
) -> dict:
  """Run `batch` through replay and the naive twin; raise MismatchError naming the worst
  leaf and both values if the loss (`loss_error`) or any gradient leaf differs by more than
  `tol` (default: `tolerance(model_cfg)`). With LoRA, `params` are the adapters, `base` the
  frozen base and `lora` its LoraConfig: the gradients compared are the adapters'. Returns
  metrics: verify/max_rel_err, verify/loss_rel_err, both losses, verify/worst_leaf,
  time/verify_s (both paths, compilation included)."""
  if (base is None) != (lora is None):
    raise ValueError(
      f"verify.check: base and lora go together (LoRA adapters over a frozen base); got "
      f"base={'set' if base is not None else None}, lora={lora!r}"
    )
  tol = tolerance(model_cfg) if tol is None else tol
  run_cfg, model_cfg = model_cfg, check_config(model_cfg)
  run = lambda mode: jax.block_until_ready(
    jax.jit(
      functools.partial(
        loss_and_grad,
        model_cfg=model_cfg,
        loss_cfg=loss_cfg,
        mode=mode,
        branch_chunk=branch_chunk if mode == "replay" else None,
        lora=lora,
      )
    )(params, base, batch)
  )
  t0 = time.perf_counter()
  loss_fast, _, grads_fast = run("replay")
  t1 = time.perf_counter()
  loss_slow, _, grads_slow = run("naive")
  t2 = time.perf_counter()
  leaves = leaf_errors(grads_fast, grads_slow)
  name, err, fast, slow, index = max(leaves, key=lambda e: e[1])
  loss_err = loss_error(loss_fast, loss_slow)
  if not err <= tol:
    raise MismatchError(
      f"replay.verify: branch replay and the naive twin disagree on the first batch: "
      f"gradient leaf {name}{list(index)} is {fast!r} through replay and {slow!r} through "
      f"the naive twin (relative error {err:.3g} > tolerance {tol:g} for "
      f"{_dtypes(run_cfg, model_cfg)}); loss {float(loss_fast)!r} vs {float(loss_slow)!r}. Train with "
      "replay.mode=naive, or report the model config and batch shapes"
    )
  if not loss_err <= tol:
    raise MismatchError(
      f"replay.verify: the loss is {float(loss_fast)!r} through replay and "
      f"{float(loss_slow)!r} through the naive twin (relative error "
      f"{loss_err:.3g} > tolerance {tol:g} for {_dtypes(run_cfg, model_cfg)})"
    )
  return {
    "verify/max_rel_err": err,
    "verify/loss_rel_err": loss_err,
    "verify/loss_replay": float(loss_fast),
    "verify/loss_naive": float(loss_slow),
    "verify/worst_leaf": name,
    "verify/dtype": model_cfg.dtype,  # the check's compute dtype (float32 for a bf16 run)
    "time/verify_s": t2 - t0,
    "time/verify_replay_s": t1 - t0,
    "time/verify_naive_s": t2 - t1,
  }


def _dtypes(run_cfg, check_cfg) -> str:
  if run_cfg.dtype == check_cfg.dtype:
    return run_cfg.dtype
  return f"{check_cfg.dtype} (the check's compute dtype; the run computes in {run_cfg.dtype})"
