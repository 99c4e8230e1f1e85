"""Render any results file (JSON lines under experiments/results/) as a markdown table.

  python experiments/results_table.py experiments/results/superseded/cpu_sweep_2026-11-30.jsonl
  python experiments/results_table.py experiments/results/default_run.jsonl --where=kind=summary
  python experiments/results_table.py FILE --columns=P,R,replay_s,naive_s --provenance

bench_replay.py lines get the benchmark columns; any other file gets its scalar
fields (first-seen order, or --columns). --provenance lists each distinct commit/command/date
below the table.
"""

from __future__ import annotations

import argparse
import json
import sys

BENCH_COLUMNS = [
  ("P", "prefix_len"),
  ("T", "tail_len"),
  ("R", "branches"),
  ("preset", "preset"),
  ("dtype", "dtype"),
  ("naive s", "naive_s"),
  ("replay s", "replay_s"),
  ("speedup", "speedup"),
  ("flop ratio", "flop_ratio"),
  ("token ratio", "token_ratio"),
  ("naive peak MB", "naive_peak_mb"),
  ("replay peak MB", "replay_peak_mb"),
  ("grad rel err", "grad_max_rel_err"),
  ("replay GFLOP/s", "replay_gflops"),
  ("matmul GFLOP/s", "matmul_gflops"),
]
COLUMNS = BENCH_COLUMNS  # the name older callers import
SKIP = ("provenance", "config", "run", "run_command", "experiment", "times")


def fmt(value):
  if value is None:
    return "-"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float):
    if value != value:
      return "nan"
    if value and abs(value) < 1e-3:
      return f"{value:.1e}"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
  if isinstance(value, (list, dict)):
    return json.dumps(value)
  return str(value).replace("|", "\\|").replace("\n", " ")


def is_bench(row: dict) -> bool:
  return "prefix_len" in row and "replay_s" in row and "naive_s" in row


def bench_row(row: dict) -> dict:
  row = dict(row)
  for side in ("naive", "replay"):  # on a GPU, device memory is what counts
    if f"{side}_device_peak_mb" in row or row.get(f"{side}_error", "").startswith("oom"):
      row[f"{side}_peak_mb"] = row.get(f"{side}_device_peak_mb", "oom")
    if row.get(f"{side}_error", "").startswith("oom"):
      row[f"{side}_s"] = "oom"
  return row


def matches(row: dict, where: list[str]) -> bool:
  for cond in where:
    key, _, value = cond.partition("=")
    if fmt(row.get(key)) != value and str(row.get(key)) != value:
      return False
  return True


def table(rows: list[dict], columns: list[str] | None = None) -> str:
  """Markdown for rows: bench columns if every row is a bench row, else `columns` or every
  scalar key in first-seen order."""
  if not rows:
    return "(no rows)"
  if columns is None and all(is_bench(r) for r in rows):
    header = [c for c, _ in BENCH_COLUMNS]
    keys = [k for _, k in BENCH_COLUMNS]
    rows = [bench_row(r) for r in rows]
  else:
    if columns is None:
      columns = []
      for r in rows:
        columns += [
          k
          for k, v in r.items()
          if k not in SKIP and k not in columns and not isinstance(v, (dict, list))
        ]
    header = keys = columns
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
  return "\n".join(lines)


def provenance_lines(rows: list[dict]) -> str:
  seen = []
  for r in rows:
    p = r.get("provenance")
    if not p:
      continue
    key = (p.get("git_commit"), p.get("git_dirty"), p.get("command"), p.get("date"))
    if key not in seen:
      seen.append(key)
  return (
    "\n".join(
      f"- commit {str(c)[:10]}{' (dirty)' if d else ''}, {date}: `{cmd}`"
      for c, d, cmd, date in seen
    )
    or "- (no provenance recorded in these lines)"
  )


def load(paths: list[str], where: list[str] = ()) -> list[dict]:
  rows = []
  for path in paths:
    with open(path) as f:
      rows += [json.loads(line) for line in f if line.strip()]
  return [r for r in rows if matches(r, list(where))]


def main(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("paths", nargs="+")
  parser.add_argument("--columns", default="", help="comma-separated keys (default: all)")
  parser.add_argument("--where", action="append", default=[], help="key=value filter")
  parser.add_argument("--provenance", action="store_true", help="list commits/commands below")
  args = parser.parse_args(argv)
  rows = load(args.paths, args.where)
  print(table(rows, args.columns.split(",") if args.columns else None))
  if args.provenance:
    print()
    print(provenance_lines(rows))


if __name__ == "__main__":
  main(sys.argv[1:])
