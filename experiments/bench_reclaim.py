"""Our replay step in one process, with idle gaps between steps: what the host's page reclaim
costs where the machine is a VM with free page reporting.

XLA's CPU backend takes a step's temporaries (about 650 MB for the small preset at P=1024,
T=512, R=8) from malloc and frees them when the step ends; glibc returns blocks that large to
the kernel at once (munmap). On a VM whose balloon device reports free pages
(`/sys/module/page_reporting`, virtio-balloon), free 2 MB blocks that stay free for about two
seconds are handed to the host, which takes the memory back; the next step's faults then
wait for the host to supply and zero it again. PrefixGrouper's PyTorch keeps its freed
tensors in glibc's heap, so the host takes nothing from it. bench_peer's ABBA alternation
gives our worker exactly such a gap: the other framework's step.

For each malloc setting (--malloc: `plain` none, `huge` glibc.malloc.hugetlb=1 as run.py runs,
`resident` huge pages with nothing returned to the kernel: no mmap, one arena, a 64 GB trim
threshold; `mimalloc` the mimalloc library given by --mimalloc_lib, preloaded, never purging
its freed memory: not a requirement of this project, e.g. from the `cmeel-mimalloc` wheel) and
each gap (--gaps, seconds), a fresh worker (bench_peer's `ours`, the same
compiled step) warms up, then sleeps the gap before each of --steps timed steps. One JSON line
per (malloc, gap): each step's wall, kernel (sys) seconds and minor faults, the MB the guest
reported to the host during the gap and during the step, and the worker's peak RSS growth.

  python experiments/bench_reclaim.py --prefix_len=1024 --tail_len=512 --branches=8 \\
      --gaps=0,3 --malloc=huge,resident --out=experiments/results/reclaim_cpu_2026-12-05.jsonl
"""

from __future__ import annotations

import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402

from experiments import bench_peer  # noqa: E402

FLAGS = flags.FLAGS

RESIDENT = (
  "glibc.malloc.mmap_max=0:glibc.malloc.arena_max=1:glibc.malloc.trim_threshold=68719476736"
)


def malloc_tunables(name: str) -> str:
  """GLIBC_TUNABLES for a --malloc setting."""
  from branch_replay.train import hugepages as hp

  table = {"plain": "", "huge": hp.TUNABLE, "resident": f"{hp.TUNABLE}:{RESIDENT}", "mimalloc": ""}
  if name not in table:
    raise ValueError(f"--malloc: {name!r} is not one of {sorted(table)}")
  return table[name]


def malloc_env(name: str, mimalloc_lib: str) -> dict:
  """Variables beyond GLIBC_TUNABLES for a --malloc setting: mimalloc preloaded, never
  purging (its freed memory stays with the process)."""
  if name != "mimalloc":
    return {}
  if not mimalloc_lib or not os.path.isfile(mimalloc_lib):
    raise ValueError(
      f"--malloc=mimalloc needs --mimalloc_lib, the path of libmimalloc.so; got {mimalloc_lib!r}"
    )
  return {"LD_PRELOAD": os.path.abspath(mimalloc_lib), "MIMALLOC_PURGE_DELAY": "-1"}


def parse_gaps(text: str) -> list[float]:
  """--gaps: comma-separated seconds, each >= 0."""
  try:
    gaps = [float(g) for g in text.split(",") if g.strip()]
  except ValueError:
    raise ValueError(f"--gaps: {text!r} is not a comma-separated list of seconds") from None
  if not gaps or min(gaps) < 0:
    raise ValueError(f"--gaps: {text!r}: expected one or more seconds, each >= 0")
  return gaps


def summarize(steps: list[dict]) -> dict:
  """Medians over a run's timed steps (the per-step lists stay in the row)."""
  import numpy as np

  def med(key):
    vals = [s[key] for s in steps if s[key] is not None]
    return round(float(np.median(vals)), 4) if vals else None

  return dict(
    step_s=med("seconds"),
    step_max_s=round(max(s["seconds"] for s in steps), 4),
    sys_s=med("sys_seconds"),
    page_faults=med("page_faults"),
    reported_mb_in_gap=med("reported_mb_in_gap"),
    reported_mb_in_step=med("reported_mb_in_step"),
  )


def run_one(folder: str, malloc: str, gap: float, steps: int, mimalloc_lib: str = "") -> dict:
  from experiments import measure

  worker = bench_peer.Worker(
    "ours", folder, tunables=malloc_tunables(malloc), extra_env=malloc_env(malloc, mimalloc_lib)
  )
  try:
    out = []
    for _ in range(steps):
      r0 = measure.page_reporting()
      time.sleep(gap)
      r1 = measure.page_reporting()
      reply = worker.ask("step")
      r2 = measure.page_reporting()
      out.append(
        dict(
          seconds=round(reply["seconds"], 4),
          sys_seconds=round(reply["sys_seconds"], 4),
          page_faults=reply["page_faults"],
          reported_mb_in_gap=measure.reported_mb(r0, r1),
          reported_mb_in_step=measure.reported_mb(r1, r2),
        )
      )
    peak = worker.ask("peak")["peak_mb"]
  finally:
    worker.close()
  return dict(steps=out, peak_mb=round(peak, 1), **summarize(out))


def main(argv):
  del argv
  from experiments import measure, provenance

  gaps = parse_gaps(FLAGS.gaps)
  mallocs = [m for m in FLAGS.malloc.split(",") if m]
  for m in mallocs:  # a clear error before anything runs
    malloc_tunables(m)
    malloc_env(m, FLAGS.mimalloc_lib)
  if FLAGS.steps < 1:
    raise ValueError(f"--steps: {FLAGS.steps}: expected >= 1")
  wait = measure.wait_for_quiet(FLAGS.max_load, FLAGS.wait_timeout_s, FLAGS.wait_poll_s)
  P, T, R = FLAGS.prefix_len, FLAGS.tail_len, FLAGS.branches
  with tempfile.TemporaryDirectory() as folder:
    bench_peer.write_inputs(folder, P, T, R)
    for gap in gaps:
      for malloc in mallocs:
        row = dict(
          prefix_len=P,
          tail_len=T,
          branches=R,
          preset=FLAGS.preset,
          malloc=malloc,
          glibc_tunables=malloc_tunables(malloc),
          malloc_env=malloc_env(malloc, FLAGS.mimalloc_lib),
          gap_s=gap,
          page_reporting=measure.page_reporting(),
          wait=wait,
          **run_one(folder, malloc, gap, FLAGS.steps, FLAGS.mimalloc_lib),
          date=time.strftime("%Y-%m-%d"),
        )
        provenance.emit(row, FLAGS.out)


if __name__ == "__main__":
  bench_peer.define_flags()
  flags.DEFINE_string("gaps", "0,3", "idle seconds before each timed step, comma-separated")
  flags.DEFINE_string("malloc", "huge,resident", "malloc settings: plain, huge, resident, mimalloc")
  flags.DEFINE_string("mimalloc_lib", "", "libmimalloc.so for --malloc=mimalloc")
  flags.DEFINE_integer("steps", 6, "timed steps per (malloc, gap)")
  app.run(main)
