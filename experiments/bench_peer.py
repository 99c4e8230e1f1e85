"""Side by side on one CPU: branch replay's step against PrefixGrouper's, same model, same weights.

PrefixGrouper (`prefix-grouper`, PyTorch) packs a prompt and its R completions into one row
[prefix, tail_1, ..., tail_R]; in every layer it ungroups q/k/v, attends the prefix causally
and the R tails against the (repeated) prefix K/V plus their own, and regroups. Its attention
backend is pluggable; this CPU has no flash-attention, so the peer's attention function here
is torch's `scaled_dot_product_attention` with a bottom-right-aligned causal mask (the
flash-attention-2 semantics PrefixGrouper expects), plugged into `PrefixGrouper.forward` and
registered with transformers' AttentionInterface the way PrefixGrouper registers its own.

Both sides: the same decoder (our ModelConfig, exported with models/hf.py and loaded by
transformers' LlamaForCausalLM), the same tokens, float32, GRPO on-policy loss
(-A * exp(logp - sg(logp)), token mean over the R*T completion tokens), completion-only
logits, forward + backward (no optimizer). Each framework lives in its own subprocess (its own
RSS baseline, taken after imports; after its warm-up step each hands the heap it freed back
to the OS, malloc_trim, so XLA's retained compiler heap is not counted as step memory); the
timed steps alternate ABBA between them. Before the workers start, the driver waits for a
quiet machine: the 1-minute load average below --max_load (polled every --wait_poll_s,
for at most --wait_timeout_s; past it the run stops, naming the load, unless
--wait_timeout_action=run, which measures anyway and records quiet=false). During every timed
step it records the load: the load average and the cores other processes used (the
machine's busy CPU seconds over the step minus the stepping worker's own, per wall second;
psutil), per side. Both workers get the same malloc: with --hugepages (the default, as run.py
runs) glibc's `glibc.malloc.hugetlb=1` tunable (branch_replay/train/hugepages.py), recorded as
`glibc_tunables`; each step's minor page faults and kernel (sys) seconds are recorded per
side, and the MB the guest handed back to the host during it where this is a VM with free page
reporting (`reported_mb_during_steps`: our freed step memory, taken back while the other
framework steps, is what our next step faults in again; docs/performance.md). One JSON line:
both times (median, min; wall and CPU; `*_warm_s`: the median of each side's steps that follow
its own step, the second of an ABBA pair), both peak RSS growths, the ratio (peer / ours: > 1
means ours is faster), useful-FLOP rates and the gradient agreement (every leaf, float32).

  pip install -r requirements-peer.txt
  python experiments/bench_peer.py --out=experiments/results/peer_cpu_2026-12-01.jsonl
  python experiments/bench_peer.py --prefix_len=8192 --tail_len=128 --branches=16
  python experiments/bench_peer.py --preset=tiny --prefix_len=32 --tail_len=8 --branches=2 \
      --reps=2 --max_load=0   # the smoke test's shape (no waiting)
"""

from __future__ import annotations

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
  flags.DEFINE_integer("reps", 6, "timed steps per framework (even: ABBA pairs)")
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


PEER_NAME = "prefix_grouper(torch sdpa, bottom-right causal)"


# ----------------------------------------------------------------------------- the peer


def peer_attention(
  module, q_BNSH, k_BKSH, v_BKSH, attention_mask, *args, prefix_grouper, scaling=None, **kwargs
):
  """transformers' attention interface -> PrefixGrouper.forward with an sdpa attention
  function. PrefixGrouper hands the function padding masks [b, S] (flash-attention-2's
  varlen convention): the causal part is bottom-right aligned, the prefix keys of a tail all
  visible."""
  import torch
  import torch.nn.functional as F

  def attn(q, k, v, key_valid_bS):
    Tq, S = q.shape[2], k.shape[2]
    causal = torch.arange(S)[None, :] <= torch.arange(Tq)[:, None] + (S - Tq)
    mask = causal[None, None] & key_valid_bS.bool()[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()  # [b, S, N, H], as PrefixGrouper.group wants

  return prefix_grouper.forward(attn, q_BNSH, k_BKSH, v_BKSH), None


def peer_step_fn(folder, batch, threads):
  import numpy as np
  import torch
  import transformers
  from prefix_grouper import PrefixGrouper

  torch.set_num_threads(threads)
  transformers.AttentionInterface.register("prefix_grouper_sdpa", peer_attention)
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

  return step, grads


def run_worker(kind, folder):
  """Load, warm up (one step), then answer commands on stdin: step | grads PATH | peak."""
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
  loss = step()  # warm-up (compilation, allocator pools)
  release_freed_heap()  # what the warm-up freed (XLA's compiler heap), both frameworks alike
  print(json.dumps(dict(ready=True, loss=loss)), flush=True)
  with PeakRSS() as rss:
    for line in sys.stdin:
      cmd = line.split()
      if cmd[0] == "step":
        u0 = resource.getrusage(resource.RUSAGE_SELF)
        t0, c0 = time.perf_counter(), time.process_time()
        loss = step()
        seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        u1 = resource.getrusage(resource.RUSAGE_SELF)
        reply = dict(
          seconds=seconds,
          cpu_seconds=cpu_seconds,
          sys_seconds=u1.ru_stime - u0.ru_stime,
          loss=loss,
          page_faults=u1.ru_minflt - u0.ru_minflt,
        )
      elif cmd[0] == "grads":
        np.savez(cmd[1], **grads())
        reply = dict(saved=cmd[1])
      elif cmd[0] == "peak":
        reply = dict(peak_mb=(rss.peak - rss0) / 2**20)
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


def grad_agreement(path_ours, path_peer):
  """max over leaves of max|ours - peer| / max|peer| (and the worst leaf)."""
  import numpy as np
  from experiments import compare

  errs = compare.npz_rel_errs(path_ours, path_peer)
  worst = max(errs, key=errs.get)
  a, b = np.load(path_ours), np.load(path_peer)
  close = all(np.allclose(a[k], b[k], rtol=1e-4, atol=1e-4 * np.max(np.abs(b[k]))) for k in b.files)
  return errs[worst], worst, close


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
  import numpy as np
  from experiments import provenance
  from experiments import flops, measure
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
      times = {k: [] for k in workers}
      cpu = {k: [] for k in workers}
      load = {k: [] for k in workers}
      others = {k: [] for k in workers}
      faults = {k: [] for k in workers}
      sys_s = {k: [] for k in workers}
      reclaimed = {k: [] for k in workers}
      order = ["ours", "peer", "peer", "ours"]
      for i in range(FLAGS.reps * 2):  # ABBA ABBA ...
        kind = order[i % 4]
        rep0 = measure.page_reporting()
        busy0, t0 = measure.busy_cpu_seconds(), time.perf_counter()
        reply = workers[kind].ask("step")
        wall, busy1 = time.perf_counter() - t0, measure.busy_cpu_seconds()
        reclaimed[kind].append(measure.reported_mb(rep0, measure.page_reporting()))
        sys_s[kind].append(round(reply["sys_seconds"], 3))
        times[kind].append(reply["seconds"])
        cpu[kind].append(reply["cpu_seconds"])
        faults[kind].append(reply["page_faults"])
        load[kind].append(round(os.getloadavg()[0], 2))
        others[kind].append(round(measure.other_cores(busy0, busy1, reply["cpu_seconds"], wall), 3))
      peaks = {k: w.ask("peak")["peak_mb"] for k, w in workers.items()}
      paths = {k: os.path.join(folder, f"grads_{k}.npz") for k in workers}
      for k, w in workers.items():
        w.ask(f"grads {paths[k]}")
      losses = {k: w.ready["loss"] for k, w in workers.items()}
    finally:
      for w in workers.values():
        w.close()
    err, worst, close = grad_agreement(paths["ours"], paths["peer"])
  useful = flops.step_flops(cfg, flops.flat(1, R, P, T, "replay"))
  med = {k: float(np.median(v)) for k, v in times.items()}
  warm = {k: times[k][2::2] if k == "ours" else times[k][1::2] for k in times}
  warm = {k: round(float(np.median(v)), 4) if v else None for k, v in warm.items()}
  row = dict(
    prefix_len=P,
    tail_len=T,
    branches=R,
    preset=FLAGS.preset,
    dtype="float32",
    threads=FLAGS.threads,
    glibc_tunables=worker_environ(os.environ, FLAGS.hugepages).get("GLIBC_TUNABLES", ""),
    # another malloc for both workers, where the environment preloads one (e.g. mimalloc)
    malloc_env={
      k: v for k, v in os.environ.items() if k == "LD_PRELOAD" or k.startswith("MIMALLOC_")
    },
    reps=FLAGS.reps,
    order="ABBA",
    peer=PEER_NAME,
    ours_s=round(med["ours"], 4),
    ours_min_s=round(min(times["ours"]), 4),
    peer_s=round(med["peer"], 4),
    peer_min_s=round(min(times["peer"]), 4),
    ours_cpu_s=round(float(np.median(cpu["ours"])), 4),
    peer_cpu_s=round(float(np.median(cpu["peer"])), 4),
    ratio=round(med["peer"] / med["ours"], 3),
    cpu_ratio=round(float(np.median(cpu["peer"]) / np.median(cpu["ours"])), 3),
    ours_page_faults=int(np.median(faults["ours"])),
    peer_page_faults=int(np.median(faults["peer"])),
    # kernel time inside each step (faults, zeroing, unmapping) and the memory the guest
    # handed back to the host meanwhile (free page reporting; None: not such a VM)
    ours_sys_s=round(float(np.median(sys_s["ours"])), 4),
    peer_sys_s=round(float(np.median(sys_s["peer"])), 4),
    sys_during_steps=sys_s,
    page_reporting=measure.page_reporting(),
    reported_mb_during_steps=reclaimed,
    # each side's steps that follow its own step (the second of an ABBA pair): no switch from
    # the other framework just before (cold caches, its memory touched last)
    ours_warm_s=warm["ours"],
    peer_warm_s=warm["peer"],
    warm_ratio=round(warm["peer"] / warm["ours"], 3) if warm["ours"] and warm["peer"] else None,
    ours_times=[round(t, 4) for t in times["ours"]],
    peer_times=[round(t, 4) for t in times["peer"]],
    wait=wait,
    load_during_steps=load,
    other_cores_during_steps=others,
    max_other_cores=max(max(v) for v in others.values()),
    ours_peak_mb=round(peaks["ours"], 1),
    peer_peak_mb=round(peaks["peer"], 1),
    rss_note="peak RSS growth over the RSS after imports; both workers release "
    "freed heap (malloc_trim) after their warm-up step",
    useful_gflop=round(useful / 1e9, 2),
    ours_gflops=round(useful / med["ours"] / 1e9, 1),
    peer_gflops=round(useful / med["peer"] / 1e9, 1),
    xla_matmul_gflops=round(matmul_gflops(), 1),
    torch_matmul_gflops=round(torch_matmul_gflops(FLAGS.threads), 1),
    loss_ours=losses["ours"],
    loss_peer=losses["peer"],
    grad_max_rel_err=err,
    grad_worst_leaf=worst,
    grads_agree=close,
    grad_rtol=1e-4,
    date=time.strftime("%Y-%m-%d"),
  )
  row["ours_matmul_frac"] = round(row["ours_gflops"] / row["xla_matmul_gflops"], 3)
  row["peer_matmul_frac"] = round(row["peer_gflops"] / row["torch_matmul_gflops"], 3)
  provenance.emit(row, FLAGS.out)


if __name__ == "__main__":
  define_flags()
  app.run(main)
