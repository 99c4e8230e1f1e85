"""Branch replay: the shared prefix forward once under `jax.vjp`, every branch's tail
forward+backward against its cache, one prefix backward with the branch-summed cotangent.

The gradient equals running every branch as its own full sequence; the work is P + R*T
token positions instead of R*(P+T). This file knows nothing about Flax or the model: it
takes two pure functions,

  prefill_fn(params, prefix) -> cache            (float arrays only: it is vjp'd)
  branch_loss_fn(params, cache, branch) -> (value, aux)   (one branch of every prompt)

where `branch` is a pytree whose leaves carry a leading branch axis R (vmapped away).
With `batched=True` the function instead takes every branch at once,
  branch_loss_fn(params, cache, branches) -> (values_R, aux_R)    (leading axis R kept)
for models that fold the branches into one computation (the transformer folds all R*T tail
queries of a prompt against its one prefix K/V, so the cache's K/V cotangent comes out of
the attention contraction already summed over branches; a vmapped custom-VJP kernel would
build an [R, S, K, H] cotangent first). The method is the same.
No `@jax.jit` here: callers jit, vmap and grad these functions as they need.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

Combine = Optional[Callable[[jax.Array], jax.Array]]


def prefix_forward(prefill_fn, params, prefix):
  """Step 1. The prefix forward, once. `prefix_vjp` holds its residuals; it is a pytree
  (`jax.tree_util.Partial`), so it may be returned from one jit and consumed by another."""
  return jax.vjp(lambda p: prefill_fn(p, prefix), params)


def tails_value_and_grad(
  branch_loss_fn,
  params,
  cache,
  branches_R,
  *,
  branch_chunk: Optional[int] = None,
  combine: Combine = None,
  batched: bool = False,
):
  """Step 2. Forward+backward of all tails against the cache.

  Returns (loss, aux_R, dparams_tail, dcache). The branches are vmapped *inside* the grad,
  so the cache is one unbatched input and its cotangent arrives already summed over R (as
  do the parameter gradients: R parameter gradients are never materialised).

  branch_chunk=C streams the R branches in R/C chunks under `lax.scan`, accumulating the
  cache and parameter cotangents: peak tail memory scales with C, the gradient is the same.
  Only additive objectives (combine=None) can stream.
  """
  R = jax.tree.leaves(branches_R)[0].shape[0]

  all_branches_fn = branch_loss_fn if batched else jax.vmap(branch_loss_fn, (None, None, 0))

  def loss_of_branches(params, cache, branches):
    values_R, aux_R = all_branches_fn(params, cache, branches)
    loss = values_R.sum() if combine is None else combine(values_R)
    return loss, aux_R

  grad_fn = jax.value_and_grad(loss_of_branches, argnums=(0, 1), has_aux=True)
  if branch_chunk is None or branch_chunk == R:
    (loss, aux_R), (dparams, dcache) = grad_fn(params, cache, branches_R)
    return loss, aux_R, dparams, dcache

  if R % branch_chunk:
    raise ValueError(f"replay.branch_chunk={branch_chunk}: expected a divisor of R={R}")
  if combine is not None:
    raise ValueError(
      f"replay.branch_chunk={branch_chunk}: streaming needs an additive "
      "objective (this one combines branches non-linearly); use branch_chunk=R"
    )
  n_chunks = R // branch_chunk
  # Chunk k holds branches k, k + n_chunks, ...: a branch axis split over devices (sharding.py)
  # stays split within every chunk.
  chunks = jax.tree.map(
    lambda x: jnp.swapaxes(x.reshape(branch_chunk, n_chunks, *x.shape[1:]), 0, 1), branches_R
  )

  def body(carry, chunk):
    loss_sum, dparams_sum, dcache_sum = carry
    (loss, aux_C), (dparams, dcache) = grad_fn(params, cache, chunk)
    carry = (
      loss_sum + loss,
      jax.tree.map(_add, dparams_sum, dparams),
      jax.tree.map(_add, dcache_sum, dcache),
    )
    return carry, aux_C

  # Sums over chunks run in float32 at least (bfloat16 leaves would round every chunk away).
  zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(x.shape, _acc(x.dtype)), tree)
  init = (jnp.zeros((), _loss_dtype(params)), zeros(params), zeros(cache))
  (loss, dparams, dcache), aux = jax.lax.scan(body, init, chunks)
  aux_R = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1).reshape(R, *x.shape[2:]), aux)
  return loss, aux_R, dparams, dcache


def _acc(dtype):
  return jnp.promote_types(dtype, jnp.float32)


def _add(a, b):
  """a + b in float32 at least (gradient sums: bf16 halves would lose the smaller one)."""
  acc = jnp.promote_types(_acc(a.dtype), _acc(b.dtype))
  return a.astype(acc) + b.astype(acc)


def _loss_dtype(params):
  leaves = jax.tree.leaves(params)
  return jnp.float64 if leaves and leaves[0].dtype == jnp.float64 else jnp.float32


def tree_value_and_grad(
  root_fn,
  level_fns,
  leaf_loss_fn,
  params,
  leaves_R,
  *,
  branch_chunk: Optional[int] = None,
  combine: Combine = None,
  cache_constraint: Optional[Callable[[int, Any], Any]] = None,
):
  """The method: returns (loss, aux_R, grads), grads equal to the naive gradient. At depth 1
  (no level_fns: a prompt and its R branches) it runs the README's four steps; deeper, step 2
  repeats per inner level and step 4 climbs the levels.

  root_fn(params) -> cache; level_fns[d-1](params, caches of levels < d) -> level d's cache;
  leaf_loss_fn(params, caches, leaves_R) -> (values_R, aux_R) for every leaf at once (leading
  axis R = the last fan-out). cache_constraint(level, cache) -> cache where a cache crosses
  to the levels below.
  """
  constrain = cache_constraint or (lambda level, cache: cache)
  # 1. The root forward, once; its vjp keeps the residuals alive.
  cache, root_vjp = jax.vjp(root_fn, params)
  caches, vjps = [constrain(0, cache)], [root_vjp]
  # 2. Each inner level forward once (all its nodes as rows) against its ancestors, under vjp.
  for d, level_fn in enumerate(level_fns, start=1):
    cache, level_vjp = jax.vjp(level_fn, params, tuple(caches))
    caches.append(constrain(d, cache))
    vjps.append(level_vjp)
  # 3. The leaves: forward+backward inside the grad; each ancestor's cotangent arrives summed
  #    over the leaves below it (streamed over the last fan-out in float32 at least).
  loss, aux_R, grads, dcaches = tails_value_and_grad(
    leaf_loss_fn,
    params,
    tuple(caches),
    leaves_R,
    branch_chunk=branch_chunk,
    combine=combine,
    batched=True,
  )
  dcaches = list(dcaches)
  as_dtype_of = lambda dcache, cache: jax.tree.map(lambda d, c: d.astype(c.dtype), dcache, cache)
  # 4. Climb: each inner level's VJP once with its children's summed cotangent, handing its
  #    ancestors' share upward (summed in float32 at least); the root's VJP last.
  for d in reversed(range(1, len(caches))):
    dparams, danc = vjps[d](as_dtype_of(dcaches[d], caches[d]))
    grads = jax.tree.map(_add, grads, dparams)
    dcaches[:d] = [jax.tree.map(_add, a, b) for a, b in zip(dcaches[:d], danc)]
  (dparams,) = vjps[0](as_dtype_of(dcaches[0], caches[0]))
  return loss, aux_R, jax.tree.map(_add, grads, dparams)
