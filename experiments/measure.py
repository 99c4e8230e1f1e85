"""Measuring helpers shared by the benchmarks (flag-free, importable anywhere): the machine's
matmul rate, a thread sampling this process's peak RSS, and the useful FLOPs of a step."""

from __future__ import annotations

import threading
import time


def matmul_gflops(n=2048, reps=5):
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  f = jax.jit(lambda x: x @ x)
  f(a).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n ** 3 / sorted(times)[len(times) // 2] / 1e9


def release_freed_heap() -> bool:
  """Hand the heap that freed allocations left in glibc's arenas back to the OS
  (malloc_trim(0)); True if it ran. After compiling and warming up, that is mostly the
  compiler's (~300 MB for the small preset's replay step): memory the process holds but no
  step uses. The benchmarks call it for every side alike before their timed steps."""
  import ctypes
  import ctypes.util
  name = ctypes.util.find_library("c")
  if not name:
    return False
  try:
    ctypes.CDLL(name).malloc_trim(0)
  except (OSError, AttributeError):  # not glibc
    return False
  return True


class PeakRSS:
  """Samples this process's RSS in a thread; .peak is the maximum seen."""

  def __init__(self, interval=0.002):
    import psutil
    self._proc, self._interval, self.peak, self._stop = psutil.Process(), interval, 0, False

  def __enter__(self):
    self.peak = self._proc.memory_info().rss
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def _run(self):
    while not self._stop:
      self.peak = max(self.peak, self._proc.memory_info().rss)
      time.sleep(self._interval)

  def __exit__(self, *exc):
    self._stop = True
    self._thread.join()


def step_flops(cfg, B, R, P, T, mode, value_head=False):
  """*Useful* matmul + attention FLOPs of one forward+backward (backward = 2x forward):
  causal attention counts each allowed query x key pair once (not the masked half), and
  remat's recomputation is not counted; linear-attention layers (hybrid models) cost per
  position, independent of length. value_head: a critic's D -> 1 head in place of the
  D -> V logits."""
  D, N, K, H, F, V = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                      cfg.mlp_hidden, 1 if value_head else cfg.vocab_size)
  kinds = [cfg.layer_type(i) for i in range(cfg.n_layers)]
  n_full, n_lin = kinds.count("full_attention"), kinds.count("linear_attention")
  gate = N * H * D if cfg.attn_output_gate else 0  # a gated attention output (Qwen3.5)
  full_tok = D * (N + 2 * K) * H + N * H * D + gate + 3 * D * F  # MACs per position
  lin_tok = 0
  if n_lin:  # a Gated DeltaNet layer: projections, short convolution, the recurrence, MLP
    Kl, Nl = cfg.linear_key_heads, cfg.linear_value_heads
    Hl, J, Wc = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel
    C = 2 * Kl * Hl + Nl * J
    lin_tok = (D * C + D * Nl * J + 2 * D * Nl + Nl * J * D + C * Wc + 3 * Nl * Hl * J
               + 3 * D * F)
  per_token = n_full * full_tok + n_lin * lin_tok
  pairs = lambda n: n * (n + 1) / 2  # causal query x key pairs of n positions
  attn = lambda n_pairs: n_full * 2 * n_pairs * N * H  # QK^T and PV MACs (full layers only)
  if mode == "naive":
    macs = B * R * ((P + T) * per_token + attn(pairs(P + T)) + T * D * V)
  else:
    macs = (B * (P * per_token + attn(pairs(P)))
            + B * R * (T * per_token + attn(T * P + pairs(T)) + T * D * V))
  return 3 * 2 * macs


def compile_replay_step(cfg, mesh, B: int, P: int, R: int, T: int):
  """The replay train step (GRPO loss + gradient + clipped AdamW, the trainer's moments) on
  `mesh`, compiled from abstract arguments only (no weights allocated, no step run). Returns
  (compiled, (param shapes, optimizer-state shapes) placed with their shardings), for
  `sharding.memory_report(compiled)` and `sharding.per_device_bytes(...)`."""
  import jax
  import jax.numpy as jnp
  import optax
  from branch_replay import losses, sharding
  from branch_replay.batch import ReplayBatch
  from models import transformer as tfm
  sds = jax.ShapeDtypeStruct
  batch = ReplayBatch(prefix_BP=sds((B, P), jnp.int32), prefix_valid_BP=sds((B, P), bool),
                      tails_BRT=sds((B, R, T), jnp.int32), tail_valid_BRT=sds((B, R, T), bool),
                      advantages_BR=sds((B, R), jnp.float32))
  loss_cfg = losses.LossConfig(name="grpo")
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-6))
  params = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  opt_state = jax.eval_shape(tx.init, params)
  p_sh = sharding.param_shardings(mesh, cfg)
  o_sh = sharding.opt_state_shardings(mesh, tx, opt_state, p_sh)
  place = lambda tree, sh: jax.tree.map(lambda x, s: sds(x.shape, x.dtype, sharding=s), tree, sh)
  params, opt_state = place(params, p_sh), place(opt_state, o_sh)
  batch = place(batch, sharding.batch_shardings(mesh, batch))

  def step(params, opt_state, batch):
    loss, _, grads = sharding.sharded_loss_and_grad(mesh, params, batch, cfg, loss_cfg)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  compiled = jax.jit(step, donate_argnums=(0, 1), out_shardings=(p_sh, o_sh, None)).lower(
      params, opt_state, batch).compile()
  return compiled, (params, opt_state)
