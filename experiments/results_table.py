"""Render bench_replay.py JSON lines as the README's markdown table.

  python experiments/results_table.py experiments/results/cpu_sweep_2026-11-30.jsonl
"""

import json
import sys

COLUMNS = [("P", "prefix_len"), ("T", "tail_len"), ("R", "branches"), ("preset", "preset"),
           ("dtype", "dtype"), ("naive s", "naive_s"), ("replay s", "replay_s"),
           ("speedup", "speedup"), ("flop ratio", "flop_ratio"), ("token ratio", "token_ratio"),
           ("naive peak MB", "naive_peak_mb"), ("replay peak MB", "replay_peak_mb"),
           ("grad rel err", "grad_max_rel_err"), ("replay GFLOP/s", "replay_gflops"),
           ("matmul GFLOP/s", "matmul_gflops")]


def fmt(value):
  if value is None:
    return "-"
  if isinstance(value, float):
    if value and abs(value) < 1e-3:
      return f"{value:.1e}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
  return str(value)


def main(paths):
  print("| " + " | ".join(c for c, _ in COLUMNS) + " |")
  print("|" + "---|" * len(COLUMNS))
  for path in paths:
    for line in open(path):
      row = json.loads(line)
      for side in ("naive", "replay"):  # on a GPU, device memory is what counts
        if f"{side}_device_peak_mb" in row or row.get(f"{side}_error", "").startswith("oom"):
          row[f"{side}_peak_mb"] = row.get(f"{side}_device_peak_mb", "oom")
        if row.get(f"{side}_error", "").startswith("oom"):
          row[f"{side}_s"] = "oom"
      print("| " + " | ".join(fmt(row.get(k)) for _, k in COLUMNS) + " |")


if __name__ == "__main__":
  main(sys.argv[1:])
