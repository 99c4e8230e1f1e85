"""Side by side on one CPU: branch replay's step against PrefixGrouper's, same model, same weights,
timed the way a training run steps.

PrefixGrouper (`prefix-grouper`, PyTorch) packs a prompt and its R completions into one row
[prefix, tail_1, ..., tail_R]; in every layer it ungroups q/k/v, attends the prefix causally
and the R tails against the (repeated) prefix K/V plus their own, and regroups. Its own
transformers registration defaults to flash-attention-2, which a CPU lacks (and transformers'
`sdpa` would read its [b, S] padding masks as attention masks: no causality), so here its
attention function is `sdpa_bottom_right`, plugged into `PrefixGrouper.forward` and registered
with transformers' AttentionInterface the way PrefixGrouper registers its own, at full
strength: the square call over the prefix takes torch's causal fast path (is_causal=True, no
mask: the CPU flash kernel skips the key blocks above the diagonal and keeps no mask for the
backward), the tails torch's causal_lower_right (flash-attention's bottom-right alignment; no
per-branch mask); an explicit mask only where a key is padded (never here). The bench checks
that the peer's warm-up step took those paths in every layer, and exits unless the losses and
every gradient leaf agree (float32, rtol = atol = 1e-4 of the leaf's largest entry).

Both sides: the same decoder (our ModelConfig, exported with models/hf.py and loaded by
transformers' LlamaForCausalLM; the row carries the preset's size: layers, d_model, heads,
parameter count), the same tokens, float32, no remat on either side, GRPO on-policy loss
(-A * exp(logp - sg(logp)), token mean over the R*T completion tokens), completion-only logits,
forward + backward (no optimizer). Each framework lives in its own subprocess (its own RSS
baseline, taken after imports; after its warm-up step each hands the heap it freed back to the
OS, malloc_trim, so XLA's retained compiler heap is not counted as step memory).

The protocol: after the warm-ups, blocks alternate, ours x N steps back to back, then the
peer's x N, repeated --blocks times (N = --reps >= 5, --blocks >= 3). --gap_s puts the same idle
pause (a generation's seconds) before every step of both frameworks, in the stepping process,
untimed. Per framework the row reports each block's median, min and max (`*_block_s`,
`*_block_min_s`, `*_block_max_s`), the spread of the block medians, the median of the block
medians (`ours_s`, `peer_s`; `ratio` = peer / ours: > 1 means ours is faster; `block_ratios`
per round), CPU and kernel (sys) seconds, minor page faults, the steps after each block's first
(`*_warm_s`), peak RSS growth (per block and overall), useful-FLOP rates and both frameworks'
plain matmul rates. Before the workers start, the driver waits for a quiet machine: the 1-minute
load average below --max_load (polled every --wait_poll_s, for at most --wait_timeout_s; past
it the run stops, naming the load, unless --wait_timeout_action=run, which measures anyway and
records quiet=false). Every step records the load average, the cores other processes used
(psutil) and the MB the guest handed back to the host during it where this is a VM with free
page reporting (docs/performance.md). Both workers get the same malloc: with --hugepages (the
default, as run.py runs) glibc's `glibc.malloc.hugetlb=1` tunable
(branch_replay/train/hugepages.py), recorded as `glibc_tunables`.

  pip install -r requirements-peer.txt
  # on a quiet machine: the three shapes, back to back (--gap_s=0) and with a generation's
  # pause before every step of both (--gap_s=3); N=5 steps x 3 blocks each (the defaults)
  python experiments/bench_peer.py --prefix_len=2048 --tail_len=128 --branches=16 --gap_s=0 \\
      --out=experiments/results/peer_cpu_blocks_YYYY-MM-DD.jsonl
  python experiments/bench_peer.py --prefix_len=2048 --tail_len=128 --branches=16 --gap_s=3 \\
      --out=experiments/results/peer_cpu_blocks_YYYY-MM-DD.jsonl
  python experiments/bench_peer.py --prefix_len=8192 --tail_len=128 --branches=16 --gap_s=0 \\
      --out=experiments/results/peer_cpu_blocks_YYYY-MM-DD.jsonl
  python experiments/bench_peer.py --prefix_len=8192 --tail_len=128 --branches=16 --gap_s=3 \\
      --out=experiments/results/peer_cpu_blocks_YYYY-MM-DD.jsonl
  python experiments/bench_peer.py --prefix_len=1024 --tail_len=512 --branches=8 --gap_s=0 \\
      --out=experiments/results/peer_cpu_blocks_YYYY-MM-DD.jsonl
  python experiments/bench_peer.py --prefix_len=1024 --tail_len=512 --branches=8 --gap_s=3 \\
      --out=experiments/results/peer_cpu_blocks_YYYY-MM-DD.jsonl
  python experiments/bench_peer.py --preset=tiny --prefix_len=24 --tail_len=8 --branches=3 \\
      --gap_s=0.01 --max_load=0   # the smoke test's shape (no waiting)
"""

from __future__ import annotations

import collections
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

FLAGS = flags.FLAGS


def define_flags():
  """Defined when the script runs, not on import (tests import it beside other experiments)."""
  flags.DEFINE_integer("prefix_len", 2048, "P: shared prefix tokens")
  flags.DEFINE_integer("tail_len", 128, "T: tail tokens per branch")
  flags.DEFINE_integer("branches", 16, "R: branches of the one prompt")
  flags.DEFINE_string("preset", "small", "model size preset (models.config.PRESETS)")
  flags.DEFINE_integer("reps", 5, "N: timed steps per framework per block, back to back (>= 5)")
  flags.DEFINE_integer("blocks", 3, "blocks per framework, alternating ours x N, peer x N (>= 3)")
  flags.DEFINE_float(
    "gap_s", 0.0, "idle seconds before every timed step of both frameworks (a generation)"
  )
  flags.DEFINE_integer("threads", 2, "intra-op threads of both frameworks")
  flags.DEFINE_string("out", "", "also append the JSON line to this file")
  flags.DEFINE_float(
    "max_load",
    0.6,
    "wait until the 1-minute load average is below this before starting (0: do not wait)",
  )
  flags.DEFINE_integer("wait_timeout_s", 1800, "the most seconds to wait for --max_load")
  flags.DEFINE_integer("wait_poll_s", 10, "seconds between load readings while waiting")
  flags.DEFINE_enum(
    "wait_timeout_action",
    "stop",
    ["stop", "run"],
    "past --wait_timeout_s: stop (exit naming the load) or run anyway (recorded as quiet=false)",
  )
  flags.DEFINE_bool(
    "hugepages",
    True,
    "both workers with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (as run.py runs; "
    "branch_replay/train/hugepages.py): the same malloc for both frameworks",
  )
  flags.DEFINE_string("worker", "", "internal: 'ours' or 'peer', driven over stdin")
  flags.DEFINE_string("data", "", "internal: the folder holding the checkpoint and the batch")


PEER_NAME = "prefix_grouper(torch sdpa: is_causal on square calls, causal_lower_right on tails)"

# Which of sdpa_bottom_right's paths each call took, counted in this process (the peer worker
# reports its warm-up step's counts: every square call must be `causal`).
ATTENTION_CALLS = collections.Counter()


def sdpa_bottom_right(q_bNQH, k_bKSH, v_bKSH, key_valid_bS, scale=None, fast=True):
  """Attention as flash-attention-2 computes it for PrefixGrouper: causal, bottom-right aligned
  (query i of Tq sees keys up to i + S - Tq), padded keys (key_valid_bS False) hidden; the
  output as [b, Tq, N, H], the layout PrefixGrouper.group wants.

  fast=True takes torch's fast paths where the keys are all valid, as flash-attention's
  varlen kernel has no mask at all: a square call (Tq == S: the prefix) passes is_causal=True
  and no mask, so torch's CPU flash kernel skips the key blocks above the diagonal and keeps no
  mask for the backward; a tail call (Tq < S) passes torch's own causal_lower_right bias (on a
  CPU torch materialises it as one boolean [Tq, S], not one per branch). fast=False (or padded
  keys) is the naive twin: an explicit boolean [b, 1, Tq, S] mask."""
  import torch.nn.functional as F
  from torch.nn.attention.bias import causal_lower_right

  Tq, S = q_bNQH.shape[2], k_bKSH.shape[2]
  if Tq > S:
    raise ValueError(f"sdpa_bottom_right: {Tq} queries against {S} keys: expected Tq <= S")
  if fast and bool(key_valid_bS.all()):
    if Tq == S:
      ATTENTION_CALLS["causal"] += 1
      out = F.scaled_dot_product_attention(
        q_bNQH, k_bKSH, v_bKSH, is_causal=True, scale=scale, enable_gqa=True
      )
    else:
      ATTENTION_CALLS["lower_right"] += 1
      out = F.scaled_dot_product_attention(
        q_bNQH, k_bKSH, v_bKSH, attn_mask=causal_lower_right(Tq, S), scale=scale, enable_gqa=True
      )
  else:
    import torch

    ATTENTION_CALLS["masked"] += 1
    causal_QS = torch.arange(S)[None, :] <= torch.arange(Tq)[:, None] + (S - Tq)
    mask_b1QS = causal_QS[None, None] & key_valid_bS.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(
      q_bNQH, k_bKSH, v_bKSH, attn_mask=mask_b1QS, scale=scale, enable_gqa=True
    )
  return out.transpose(1, 2).contiguous()


def peer_attention(
  module,
  q_BNSH,
  k_BKSH,
  v_BKSH,
  attention_mask,
  *args,
  prefix_grouper,
  scaling=None,
  fast_attention=True,
  **kwargs,
):
  """transformers' attention interface -> PrefixGrouper.forward with sdpa_bottom_right as the
  attention function (PrefixGrouper hands it padding masks [b, S], flash-attention-2's varlen
  convention). PrefixGrouper's own registration (prefix_grouper_attention) defaults to
  transformers' flash_attention_2, which a CPU lacks; its `sdpa` would read the [b, S] padding
  mask as an attention mask (no causality), so this adapter is how it runs here.
  fast_attention=False: the explicit-mask twin throughout (profile_peer's before/after)."""

  def attn(q, k, v, key_valid_bS):
    return sdpa_bottom_right(q, k, v, key_valid_bS, scale=scaling, fast=fast_attention)

  return prefix_grouper.forward(attn, q_BNSH, k_BKSH, v_BKSH), None


def peer_step_fn(folder, batch, threads, fast_attention=True):
  import functools

  import numpy as np
  import torch
  import transformers
  from prefix_grouper import PrefixGrouper

  torch.set_num_threads(threads)
  transformers.AttentionInterface.register(
    "prefix_grouper_sdpa", functools.partial(peer_attention, fast_attention=fast_attention)
  )
  model = transformers.AutoModelForCausalLM.from_pretrained(
    folder, attn_implementation="prefix_grouper_sdpa", dtype=torch.float32
  )
  model.train()
  prefix_P, tails_RT, adv_R = batch["prefix_BP"][0], batch["tails_BRT"][0], batch["adv_BR"][0]
  P, (R, T) = prefix_P.shape[0], tails_RT.shape
  grouper = PrefixGrouper([[P] + [T] * R])
  input_ids = torch.tensor(np.concatenate([prefix_P, tails_RT.reshape(-1)]))[None]
  positions = torch.tensor(np.concatenate([np.arange(P), np.tile(np.arange(P, P + T), R)]))[None]
  # Completion-only logits: tail r's token t is predicted by the hidden state before it
  # (the prefix's last for t = 0).
  pred_RT = P + np.arange(R)[:, None] * T + np.arange(T)[None, :] - 1
  pred_RT[:, 0] = P - 1
  pred = torch.tensor(pred_RT.reshape(-1))
  targets = torch.tensor(tails_RT.reshape(-1))
  adv = torch.tensor(np.repeat(adv_R, T).astype(np.float32))

  def step():
    model.zero_grad(set_to_none=True)
    h = model.model(
      input_ids=input_ids, position_ids=positions, prefix_grouper=grouper, use_cache=False
    ).last_hidden_state[0]
    logits = model.lm_head(h[pred])
    logp = torch.gather(torch.log_softmax(logits.float(), -1), -1, targets[:, None])[:, 0]
    loss = (-adv * torch.exp(logp - logp.detach())).mean()
    loss.backward()
    return float(loss.detach())

  def grads():
    return {n: p.grad.numpy().astype(np.float64) for n, p in model.named_parameters()}

  step.remat = "none"  # no gradient checkpointing: transformers' default
  return step, grads


# ----------------------------------------------------------------------------- ours


def ours_step_fn(folder, batch, threads):
  del threads  # XLA's CPU client uses every core of this (2-core) machine
  import jax
  import jax.numpy as jnp
  import numpy as np
  from branch_replay.core import engine, losses, tree
  from models import hf

  cfg, params = hf.load(folder)
  B, R, T = batch["tails_BRT"].shape
  rb = tree.flat(
    prefix_BP=jnp.asarray(batch["prefix_BP"], jnp.int32),
    prefix_valid_BP=jnp.ones(batch["prefix_BP"].shape, bool),
    tails_BRT=jnp.asarray(batch["tails_BRT"], jnp.int32),
    tail_valid_BRT=jnp.ones((B, R, T), bool),
    advantages_BR=jnp.asarray(batch["adv_BR"], jnp.float32),
  )
  loss_cfg = losses.LossConfig("grpo")
  compiled = (
    jax.jit(lambda p, b: engine.loss_and_grad(p, b, cfg, loss_cfg, "replay")[::2])
    .lower(params, rb)
    .compile()
  )
  out = {}

  def step():
    loss, out["grads"] = jax.block_until_ready(compiled(params, rb))
    return float(loss)

  def grads():
    return {k: v.astype(np.float64) for k, v in hf.tensors_from_params(cfg, out["grads"]).items()}

  step.remat = cfg.remat
  return step, grads


def timed_step(step):
  """One step, measured from inside the worker: wall and CPU seconds, kernel (sys) seconds,
  minor page faults, the cores other processes kept busy, the load average after it and the MB
  the guest handed back to the host meanwhile (None: not such a VM)."""
  from experiments import measure

  u0 = resource.getrusage(resource.RUSAGE_SELF)
  rep0, busy0 = measure.page_reporting(), measure.busy_cpu_seconds()
  t0, c0 = time.perf_counter(), time.process_time()
  loss = step()
  seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
  busy1, u1 = measure.busy_cpu_seconds(), resource.getrusage(resource.RUSAGE_SELF)
  return dict(
    seconds=seconds,
    cpu_seconds=cpu_seconds,
    sys_seconds=u1.ru_stime - u0.ru_stime,
    loss=loss,
    page_faults=u1.ru_minflt - u0.ru_minflt,
    other_cores=round(measure.other_cores(busy0, busy1, cpu_seconds, seconds), 3),
    load=round(os.getloadavg()[0], 2),
    reported_mb=measure.reported_mb(rep0, measure.page_reporting()),
  )


def run_worker(kind, folder):
  """Load, warm up (one step), then answer commands on stdin: `step` (one timed step),
  `block N GAP_S` (N timed steps back to back, each after GAP_S idle seconds, as a training run
  steps between generations; with the block's peak RSS growth), `grads PATH`, `peak`."""
  import numpy as np
  import psutil
  from experiments.measure import PeakRSS, release_freed_heap

  if kind == "ours":
    import jax.numpy as jnp

    jnp.zeros(()).block_until_ready()
  else:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    import prefix_grouper  # noqa: F401
  rss0 = psutil.Process().memory_info().rss
  batch = dict(np.load(os.path.join(folder, "batch.npz")))
  make = ours_step_fn if kind == "ours" else peer_step_fn
  step, grads = make(folder, batch, FLAGS.threads)
  ATTENTION_CALLS.clear()
  loss = step()  # warm-up (compilation, allocator pools)
  # the warm-up step's attention calls by path (the peer's: sdpa_bottom_right)
  attention_calls = dict(ATTENTION_CALLS)
  release_freed_heap()  # what the warm-up freed (XLA's compiler heap), both frameworks alike
  ready = dict(ready=True, loss=loss, remat=step.remat, attention_calls=attention_calls)
  print(json.dumps(ready), flush=True)
  earlier_peak = 0  # the peak before the last block began (each block resets rss.peak)
  with PeakRSS() as rss:
    for line in sys.stdin:
      cmd = line.split()
      if cmd[0] == "step":
        reply = timed_step(step)
      elif cmd[0] == "block":
        n, gap_s = int(cmd[1]), float(cmd[2])
        earlier_peak = max(earlier_peak, rss.peak)
        rss.peak = psutil.Process().memory_info().rss
        steps = []
        for _ in range(n):
          time.sleep(gap_s)  # the generation between two updates: not timed
          steps.append(timed_step(step))
        reply = dict(steps=steps, peak_mb=(rss.peak - rss0) / 2**20)
      elif cmd[0] == "grads":
        np.savez(cmd[1], **grads())
        reply = dict(saved=cmd[1])
      elif cmd[0] == "peak":
        reply = dict(peak_mb=(max(earlier_peak, rss.peak) - rss0) / 2**20)
      else:
        break
      print(json.dumps(reply), flush=True)


# ----------------------------------------------------------------------------- driver


def worker_environ(env, hugepages: bool):
  """Both workers' environment: with `hugepages`, glibc's huge-page tunable added (where it
  applies: Linux/glibc, THP not `never`); without, removed, as a plain process has it."""
  from branch_replay.train import hugepages as hp

  env = dict(env)
  tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and t != hp.TUNABLE]
  if tunables:
    env["GLIBC_TUNABLES"] = ":".join(tunables)
  if hugepages and hp.wanted(env, platform.system(), platform.libc_ver()[0], hp.thp_mode()):
    env = hp.environ_with_tunable(env)
  return env


class Worker:
  def __init__(self, kind, folder, tunables=None, extra_env=None):
    """A worker subprocess; `tunables`: its GLIBC_TUNABLES exactly ("" none), else as
    --hugepages says (worker_environ); `extra_env`: more variables (e.g. LD_PRELOAD)."""
    argv = [
      sys.executable,
      os.path.abspath(__file__),
      f"--worker={kind}",
      f"--data={folder}",
      f"--threads={FLAGS.threads}",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu", OMP_NUM_THREADS=str(FLAGS.threads))
    env = worker_environ(env, FLAGS.hugepages)
    if tunables is not None:
      env.pop("GLIBC_TUNABLES", None)
      if tunables:
        env["GLIBC_TUNABLES"] = tunables
    env.update(extra_env or {})
    self.kind = kind
    self.proc = subprocess.Popen(
      argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    self.ready = self._read()

  def _read(self):
    for line in self.proc.stdout:
      if line.startswith("{"):
        return json.loads(line)
    raise RuntimeError(f"worker {self.kind} exited with {self.proc.wait()}")

  def ask(self, cmd):
    self.proc.stdin.write(cmd + "\n")
    self.proc.stdin.flush()
    return self._read()

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


def write_inputs(folder, P, T, R):
  """The shared checkpoint (our init, exported) and batch: both frameworks read these."""
  import jax
  import numpy as np
  from models import config, hf, transformer as tfm

  cfg = config.preset(FLAGS.preset)
  hf.save(folder, cfg, tfm.init_params(cfg, jax.random.key(0)))
  rng = np.random.default_rng(0)
  np.savez(
    os.path.join(folder, "batch.npz"),
    prefix_BP=rng.integers(0, cfg.vocab_size, (1, P)),
    tails_BRT=rng.integers(0, cfg.vocab_size, (1, R, T)),
    adv_BR=rng.normal(size=(1, R)).astype(np.float32),
  )
  return cfg


def model_size(cfg) -> dict:
  """The preset's size, for every row: its shape fields and its parameter count."""
  import jax
  import math
  from models import transformer as tfm

  shapes = jax.eval_shape(lambda: tfm.init_params(cfg, jax.random.key(0)))
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
  fields = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden", "vocab_size")
  return dict({f: getattr(cfg, f) for f in fields}, n_params=n_params)


def summarize_blocks(kind: str, blocks: list) -> dict:
  """One framework's blocks (each {steps: [timed_step dicts], peak_mb}) -> its row fields:
  the median of the per-block medians (`{kind}_s`), each block's median, min and max, the
  spread of the block medians ((max - min) / median), CPU and kernel (sys) seconds, page faults,
  the steps after each block's first (`{kind}_warm_s`), the peak RSS growth per block."""
  import numpy as np

  def med(xs):
    return round(float(np.median(xs)), 4)

  def per_step(key):
    return [[st[key] for st in b["steps"]] for b in blocks]

  times = per_step("seconds")
  every = [t for ts in times for t in ts]
  medians = [med(ts) for ts in times]
  warm = [t for ts in times for t in ts[1:]]
  return {
    f"{kind}_s": med(medians),
    f"{kind}_min_s": round(min(every), 4),
    f"{kind}_max_s": round(max(every), 4),
    f"{kind}_block_s": medians,
    f"{kind}_block_min_s": [round(min(ts), 4) for ts in times],
    f"{kind}_block_max_s": [round(max(ts), 4) for ts in times],
    f"{kind}_block_spread": round((max(medians) - min(medians)) / float(np.median(medians)), 4),
    f"{kind}_cpu_s": med([c for cs in per_step("cpu_seconds") for c in cs]),
    f"{kind}_sys_s": med([c for cs in per_step("sys_seconds") for c in cs]),
    f"{kind}_block_sys_s": [med(cs) for cs in per_step("sys_seconds")],
    f"{kind}_page_faults": int(np.median([f for fs in per_step("page_faults") for f in fs])),
    f"{kind}_warm_s": med(warm) if warm else None,
    f"{kind}_times": [[round(t, 4) for t in ts] for ts in times],
    f"{kind}_block_peak_mb": [round(b["peak_mb"], 1) for b in blocks],
    f"{kind}_sys_during_steps": [[round(x, 3) for x in xs] for xs in per_step("sys_seconds")],
    f"{kind}_load_during_steps": per_step("load"),
    f"{kind}_other_cores_during_steps": per_step("other_cores"),
    f"{kind}_reported_mb_during_steps": per_step("reported_mb"),
  }


def run_blocks(workers: dict, n_blocks: int, steps: int, gap_s: float) -> dict:
  """The protocol: ours x N, peer x N, repeated n_blocks times, each worker in its own process
  stepping back to back (after gap_s idle seconds before every step, both alike)."""
  blocks = {k: [] for k in workers}
  for _ in range(n_blocks):
    for kind in ("ours", "peer"):
      blocks[kind].append(workers[kind].ask(f"block {steps} {gap_s}"))
  return blocks


def grad_agreement(path_ours, path_peer):
  """max over leaves of max|ours - peer| / max|peer| (and the worst leaf)."""
  import numpy as np
  from experiments import compare

  errs = compare.npz_rel_errs(path_ours, path_peer)
  worst = max(errs, key=errs.get)
  a, b = np.load(path_ours), np.load(path_peer)
  close = all(
    np.allclose(a[k], b[k], rtol=GRAD_RTOL, atol=GRAD_RTOL * np.max(np.abs(b[k]))) for k in b.files
  )
  return errs[worst], worst, close


GRAD_RTOL = 1e-4  # float32, every leaf: rtol and atol (relative to the leaf's largest entry)
LOSS_RTOL = 1e-5


def check_protocol(reps: int, n_blocks: int, gap_s: float):
  """A clear error before any worker starts."""
  if reps < 5:
    raise SystemExit(f"bench_peer: --reps={reps}: expected >= 5 steps back to back per block")
  if n_blocks < 3:
    raise SystemExit(f"bench_peer: --blocks={n_blocks}: expected >= 3 blocks per framework")
  if gap_s < 0:
    raise SystemExit(f"bench_peer: --gap_s={gap_s}: expected >= 0 seconds")


def check_agreement(losses: dict, err: float, worst: str, close: bool, calls: dict, n_layers: int):
  """The comparison holds only where both frameworks compute the same thing: the same loss,
  every gradient leaf within GRAD_RTOL, and the peer on its fast attention paths (every square
  call causal, no explicit mask where no key is padded). Exits naming what differs."""
  o, p = losses["ours"], losses["peer"]
  if abs(o - p) > LOSS_RTOL * abs(p) + 1e-7:
    raise SystemExit(f"bench_peer: the losses differ: ours {o!r}, the peer's {p!r}")
  if not close:
    raise SystemExit(
      f"bench_peer: the gradients differ: max relative error {err:.2e} at {worst} "
      f"(expected every leaf within rtol=atol={GRAD_RTOL})"
    )
  want = {"causal": n_layers, "lower_right": n_layers}
  if calls != want:
    raise SystemExit(
      f"bench_peer: the peer's attention calls in one step were {calls}, expected {want} "
      "(the causal fast path on every square call, no explicit mask)"
    )


def torch_matmul_gflops(threads, n=2048, reps=5):
  import torch

  torch.set_num_threads(threads)
  a = torch.randn(n, n)
  a @ a
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    a @ a
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / sorted(times)[len(times) // 2] / 1e9


def main(argv):
  del argv
  if FLAGS.worker:
    run_worker(FLAGS.worker, FLAGS.data)
    return
  import importlib.util

  missing = [
    m for m in ("torch", "transformers", "prefix_grouper") if importlib.util.find_spec(m) is None
  ]
  if missing:  # before any worker starts
    raise SystemExit(
      f"bench_peer: the peer needs {', '.join(missing)} (not installed); run "
      "pip install -r requirements-peer.txt --extra-index-url "
      "https://download.pytorch.org/whl/cpu"
    )
  check_protocol(FLAGS.reps, FLAGS.blocks, FLAGS.gap_s)
  from experiments import flops, measure, provenance
  from experiments.measure import matmul_gflops

  P, T, R = FLAGS.prefix_len, FLAGS.tail_len, FLAGS.branches
  wait = measure.wait_for_quiet(FLAGS.max_load, FLAGS.wait_timeout_s, FLAGS.wait_poll_s)
  if not wait["quiet"] and FLAGS.wait_timeout_action == "stop":
    raise SystemExit(
      f"bench_peer: the 1-minute load average is {wait['load_at_start']} after "
      f"{wait['waited_s']} s, not below --max_load={FLAGS.max_load}: not a "
      "quiet machine (--wait_timeout_action=run measures anyway)"
    )
  with tempfile.TemporaryDirectory() as folder:
    cfg = write_inputs(folder, P, T, R)
    workers = {k: Worker(k, folder) for k in ("ours", "peer")}
    try:
      blocks = run_blocks(workers, FLAGS.blocks, FLAGS.reps, FLAGS.gap_s)
      peaks = {k: w.ask("peak")["peak_mb"] for k, w in workers.items()}
      paths = {k: os.path.join(folder, f"grads_{k}.npz") for k in workers}
      for k, w in workers.items():
        w.ask(f"grads {paths[k]}")
      ready = {k: w.ready for k, w in workers.items()}
    finally:
      for w in workers.values():
        w.close()
    err, worst, close = grad_agreement(paths["ours"], paths["peer"])
  losses = {k: r["loss"] for k, r in ready.items()}
  check_agreement(losses, err, worst, close, ready["peer"]["attention_calls"], cfg.n_layers)
  sides = {k: summarize_blocks(k, b) for k, b in blocks.items()}
  ours, peer = sides["ours"], sides["peer"]
  useful = flops.step_flops(cfg, flops.flat(1, R, P, T, "replay"))
  every = {k: [st for b in v for st in b["steps"]] for k, v in blocks.items()}
  row = dict(
    prefix_len=P,
    tail_len=T,
    branches=R,
    preset=FLAGS.preset,
    **model_size(cfg),
    dtype="float32",
    ours_remat=ready["ours"]["remat"],
    peer_remat=ready["peer"]["remat"],
    threads=FLAGS.threads,
    glibc_tunables=worker_environ(os.environ, FLAGS.hugepages).get("GLIBC_TUNABLES", ""),
    # another malloc for both workers, where the environment preloads one (e.g. mimalloc)
    malloc_env={
      k: v for k, v in os.environ.items() if k == "LD_PRELOAD" or k.startswith("MIMALLOC_")
    },
    protocol="blocks",
    order="ours x N, peer x N, repeated",
    reps=FLAGS.reps,
    blocks=FLAGS.blocks,
    gap_s=FLAGS.gap_s,
    peer=PEER_NAME,
    peer_attention_calls=ready["peer"]["attention_calls"],
    **{k: v for k, v in ours.items() if not k.endswith("_during_steps")},
    **{k: v for k, v in peer.items() if not k.endswith("_during_steps")},
    ratio=round(peer["peer_s"] / ours["ours_s"], 3),
    block_ratios=[round(p / o, 3) for o, p in zip(ours["ours_block_s"], peer["peer_block_s"])],
    cpu_ratio=round(peer["peer_cpu_s"] / ours["ours_cpu_s"], 3),
    # each side's steps after the first of each block (that one follows the other framework's
    # block, or the warm-up)
    warm_ratio=round(peer["peer_warm_s"] / ours["ours_warm_s"], 3),
    # kernel time inside each step (faults, zeroing, unmapping) and the memory the guest
    # handed back to the host meanwhile (free page reporting; None: not such a VM)
    sys_during_steps={k: sides[k][f"{k}_sys_during_steps"] for k in sides},
    page_reporting=measure.page_reporting(),
    reported_mb_during_steps={k: sides[k][f"{k}_reported_mb_during_steps"] for k in sides},
    wait=wait,
    load_during_steps={k: sides[k][f"{k}_load_during_steps"] for k in sides},
    other_cores_during_steps={k: sides[k][f"{k}_other_cores_during_steps"] for k in sides},
    max_other_cores=max(st["other_cores"] for v in every.values() for st in v),
    ours_peak_mb=round(peaks["ours"], 1),
    peer_peak_mb=round(peaks["peer"], 1),
    rss_note="peak RSS growth over the RSS after imports; both workers release "
    "freed heap (malloc_trim) after their warm-up step",
    useful_gflop=round(useful / 1e9, 2),
    ours_gflops=round(useful / ours["ours_s"] / 1e9, 1),
    peer_gflops=round(useful / peer["peer_s"] / 1e9, 1),
    xla_matmul_gflops=round(matmul_gflops(), 1),
    torch_matmul_gflops=round(torch_matmul_gflops(FLAGS.threads), 1),
    loss_ours=losses["ours"],
    loss_peer=losses["peer"],
    grad_max_rel_err=err,
    grad_worst_leaf=worst,
    grads_agree=close,
    grad_rtol=GRAD_RTOL,
    date=time.strftime("%Y-%m-%d"),
  )
  row["ours_matmul_frac"] = round(row["ours_gflops"] / row["xla_matmul_gflops"], 3)
  row["peer_matmul_frac"] = round(row["peer_gflops"] / row["torch_matmul_gflops"], 3)
  provenance.emit(row, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
