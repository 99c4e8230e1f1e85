"""The policy objective with LoRA: gradients for the adapters only, the base frozen.

The base weights are a constant of the differentiated function; the adapters are its only
argument, attached to the base (models/lora.py: attach) and merged into the targeted
projections inside each layer (transformer.run_layers, under the layer's remat): one layer's
merged weights at a time, never an [L, in, out] merged copy of the model. jax returns dA, dB
through the merge's VJP: dA = s dW' B^T, dB = s A^T dW', with dW' (a targeted weight's
gradient) one layer's, transient inside the backward, never stored or optimized.
The reference policy for KL / DPO is the base itself (adapters off): no copy.

  grads = lora.loss_and_grad(base, adapters, batch, model_cfg, loss_cfg, lora_cfg, "replay")

The trainer (lora.rank > 0) does the same through `steps.loss_and_grad(..., params_fn)`
(`steps.lora_params_fn`); `naive_loss_and_grad` here is the twin its test compares with.
"""

from __future__ import annotations

from typing import Optional

import jax
import optax

from branch_replay.core import policy
from models import lora as lora_lib


def replay_loss_and_grad(
  base,
  adapters,
  batch,
  model_cfg,
  loss_cfg,
  lora: lora_lib.LoraConfig,
  branch_chunk: Optional[int] = None,
  cache_constraint=None,
):
  """Branch replay over the adapters (the one engine, params = merge(base, adapters) inside
  each differentiated function): (loss, aux_BR, adapter grads)."""
  return policy.replay_loss_and_grad(
    adapters,
    batch,
    model_cfg,
    loss_cfg,
    branch_chunk,
    cache_constraint,
    lambda a: lora_lib.attach(base, a, lora),
  )


def naive_loss_and_grad(base, adapters, batch, model_cfg, loss_cfg, lora: lora_lib.LoraConfig):
  """The naive twin over the adapters: every branch as its own full sequence."""
  fn = lambda a: policy.naive_loss(lora_lib.attach(base, a, lora), batch, model_cfg, loss_cfg)
  (loss, aux), grads = jax.value_and_grad(fn, has_aux=True)(adapters)
  return loss, aux, grads


def loss_and_grad(
  base,
  adapters,
  batch,
  model_cfg,
  loss_cfg,
  lora: lora_lib.LoraConfig,
  mode: str = "replay",
  branch_chunk: Optional[int] = None,
  cache_constraint=None,
):
  """policy.loss_and_grad with params = merge(base, adapters); grads for the adapters."""
  if not lora.enabled:
    raise ValueError("lora.rank=0: LoRA is off; use policy.loss_and_grad")
  if mode == "replay":
    return replay_loss_and_grad(
      base, adapters, batch, model_cfg, loss_cfg, lora, branch_chunk, cache_constraint
    )
  if mode == "naive":
    return naive_loss_and_grad(base, adapters, batch, model_cfg, loss_cfg, lora)
  raise ValueError(f"replay.mode={mode!r}: expected one of {policy.MODES}")


def optimizer(tx: optax.GradientTransformation, lora: lora_lib.LoraConfig):
  """The optimizer of a LoRA run: `tx` over {'adapters': ...} only; the 'base' subtree gets
  no state (optax.set_to_zero) for callers that keep params = {'base', 'adapters'} in one
  tree. (A trainer that passes the adapters alone to `tx` needs no wrapper.)"""
  if not lora.enabled:
    return tx
  return optax.multi_transform(
    {"train": tx, "frozen": optax.set_to_zero()},
    lambda params: {k: ("train" if k == "adapters" else "frozen") for k in params},
  )
