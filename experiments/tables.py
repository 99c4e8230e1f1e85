"""Every results table of README.md and docs/, rendered from the results files.

  python -m experiments.tables            # rewrite every table between its markers
  python -m experiments.tables --check    # exit 1 naming each table that differs (the test)
  python -m experiments.tables --index    # rewrite experiments/results/INDEX.md
  python -m experiments.tables --check_commands  # every current file's commands parse

A table in a markdown file sits between two marker comments; what lies between them is this
module's rendering of the table of that name in `TABLES` (experiments/table_specs.py), never
typed by hand:

  <!-- table: default_run -->
  | | before RL | after RL |
  ...
  <!-- /table -->

A table is a header and one or more sources; a source is a results file, a filter
(`key=value`, as results_table.py's --where) and one cell template per column: a
`str.format` string over the row's fields (`{replay_s:.3g}`, `{provenance[git_commit]:.7}`;
a bare `{field}` is formatted as results_table.fmt does; `{_file}` is the results file;
`{_load}`, `{_tree}` and `{_machine}` are the row's conditions from its provenance:
`conditions`). Every row rendered must carry its
provenance (git commit, command, machine: in its `provenance` dict or at its top level), and
every field a template names must be in the row: otherwise a ValueError naming the results
file and line (and the markdown file and line of the table).
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import string
import sys

from experiments.table_specs import Source, Table  # noqa: F401 (the specs are written in them)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = "experiments/results"
DOCS = ("README.md", "docs/*.md", "experiments/README.md")
OPEN = re.compile(r"^<!-- table: ([\w.-]+) -->\s*$")
CLOSE = "<!-- /table -->"


class _Cells(string.Formatter):
  def format_field(self, value, spec):
    from experiments import results_table

    if not spec:
      return results_table.fmt(value)
    if value is None or isinstance(value, str):  # "oom", null: as is, whatever the spec
      return results_table.fmt(value)
    return format(value, spec)


def read_rows(path: str) -> list[tuple[int, dict]]:
  """(line number, row) of every JSON line of a results file; a line that is not a JSON
  object is a ValueError naming the file and line (tasks.jsonl_records, the task files'
  reader)."""
  from branch_replay.data import tasks

  return [(int(where.rsplit(":", 1)[1]), row) for where, row in tasks.jsonl_records(path, path)]


def provenance_of(row: dict) -> dict | None:
  """{commit, command, machine} of a row (its `provenance` dict, else its top-level fields;
  the commit of its `run` when it names one: a workdir converted later), None when any of
  the three is missing."""
  p = row.get("provenance") if isinstance(row.get("provenance"), dict) else row
  run = row.get("run") if isinstance(row.get("run"), dict) else {}
  commit = run.get("git_commit") or p.get("git_commit") or p.get("commit")  # the run's first
  command = p.get("command") or row.get("command")
  machine = p.get("hostname") or p.get("machine") or p.get("platform")
  if not (commit and command and machine):
    return None
  return {
    "commit": str(commit),
    "command": command,
    "machine": machine,
    "date": str(p.get("date") or row.get("date") or ""),
  }


_UNITS = ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1))


def model_size(row: dict) -> str:
  """A row's model as 'NAME (L layers, d=D, N params)': its own n_layers/d_model/n_params when
  it records them, else from its `preset` field through models.transformer.preset and
  cost_model.param_count; '-' when the row names no model."""
  name = row.get("preset") or row.get("model_preset")
  layers, d, n = row.get("n_layers"), row.get("d_model"), row.get("n_params")
  if name and (layers is None or d is None or n is None):
    from experiments import cost_model
    from models import transformer as tfm

    try:
      cfg = tfm.preset(str(name))
    except (ValueError, KeyError):
      return str(name)
    layers, d, n = cfg.n_layers, cfg.d_model, cost_model.param_count(cfg)
  if layers is None or d is None:
    return "-" if not name else str(name)
  size = ""
  if n:
    size = next(f"{n / u:.{k}f}{s} params" for u, s, k in _UNITS if n >= u or s == "K")
  return f"{name or 'model'} ({layers} layers, d={d}" + (f", {size})" if size else ")")


def repetitions(row: dict) -> str:
  """How many timed repetitions a row's numbers are: its `reps` field, the length of its
  `rounds`, else the --reps of the command that made it; '-' when none says."""
  if isinstance(row.get("reps"), int):
    return str(row["reps"])
  if isinstance(row.get("rounds"), list):
    return str(len(row["rounds"]))
  p = row.get("provenance") if isinstance(row.get("provenance"), dict) else row
  m = re.search(r"--reps=(\d+)", str(p.get("command") or ""))
  return m.group(1) if m else "-"


def conditions(row: dict) -> dict:
  """The conditions every row can state from its own fields: `_model` (model_size), `_reps`
  (repetitions), `_load` (the 1-minute load average before the run started where the row
  records it, from a wait for a quiet machine: 'X at start'; else as the row was written, the
  run's own work included: 'X when written'; '-' if not recorded), `_tree` ('clean tree',
  'dirty tree' or 'tree state not recorded') and `_machine` (the CPU model, or the device)."""
  p = row.get("provenance") if isinstance(row.get("provenance"), dict) else row
  wait = row.get("wait") if isinstance(row.get("wait"), dict) else {}
  start, load = wait.get("load_at_start"), p.get("load_avg_1m")
  dirty = p.get("git_dirty")
  machine = p.get("cpu_model") or p.get("device_kind") or p.get("platform") or "-"
  return {
    "_model": model_size(row),
    "_reps": repetitions(row),
    "_load": f"{start:.2f} at start"
    if start is not None
    else ("-" if load is None else f"{load:.2f} when written"),
    "_tree": {True: "dirty tree", False: "clean tree"}.get(dirty, "tree state not recorded"),
    "_machine": machine,
  }


def _lookup(row: dict, field: str):
  """row[field], or for "a.b" row[a][b] (None when missing)."""
  value = row
  for key in field.split("."):
    value = value.get(key) if isinstance(value, dict) else None
  return value


def _matches(row: dict, where: tuple[str, ...]) -> bool:
  from experiments import results_table

  return results_table.matches(row, list(where))


def render(name: str, table: Table, root: str = ROOT, at: str = "") -> str:
  """The markdown of one table (its rows, its note, the files and commits behind it). `at`
  (e.g. README.md:40) prefixes every error."""
  where_md = f"{at}: table {name!r}" if at else f"table {name!r}"
  lines = ["| " + " | ".join(table.header) + " |", "|" + "---|" * len(table.header)]
  cited = {}
  for src in table.sources:
    if len(src.cells) != len(table.header):
      raise ValueError(
        f"{where_md}: a source of {src.file} has {len(src.cells)} cells for "
        f"{len(table.header)} columns"
      )
    path = os.path.join(root, RESULTS, src.file)
    if not os.path.exists(path):
      raise ValueError(f"{where_md}: results file {RESULTS}/{src.file} does not exist")
    rows = [(n, r) for n, r in read_rows(path) if _matches(r, src.where)]
    rel = f"{RESULTS}/{src.file}"
    if not rows or (src.count is not None and len(rows) != src.count):
      raise ValueError(
        f"{where_md}: {rel}: {len(rows)} rows match {list(src.where)}, "
        f"expected {src.count or 'at least 1'}"
      )
    for n, row in rows:
      row = dict({k: None for k in src.optional}, **row, _file=src.file, **conditions(row))
      all_rows = None
      for join, join_where in src.joins:
        all_rows = read_rows(path) if all_rows is None else all_rows
        hits = [r for _, r in all_rows if _matches(r, join_where)]
        if len(hits) != 1:
          raise ValueError(
            f"{where_md}: {rel}: {len(hits)} rows match join {join!r} {list(join_where)}, "
            "expected 1"
          )
        row[join] = hits[0]
      for name, a, b in src.ratios:  # b: a field, or a number (e.g. 2**20 for bytes -> MB)
        den = _lookup(row, b) if isinstance(b, str) else b  # "a.b": a nested field
        num = _lookup(row, a)
        if isinstance(num, (int, float)) and den:
          row[name] = num / den
      prov = provenance_of(row)
      if prov is None:
        raise ValueError(
          f"{rel}:{n}: no provenance (expected git commit, command and machine "
          f"in its 'provenance' or at its top level), cited by {where_md}"
        )
      cells = []
      for header, template in zip(table.header, src.cells):
        try:
          cells.append(_Cells().format(template, **row))
        except (KeyError, IndexError) as e:
          raise ValueError(
            f"{where_md}: column {header!r} reads field {e.args[0]!r}, which "
            f"{rel}:{n} does not have"
          ) from None
      lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
      cited.setdefault(rel, [])
      if prov["commit"][:7] not in cited[rel]:
        cited[rel].append(prov["commit"][:7])
  out = "\n".join(lines) + "\n"
  if table.note:
    out += "\n" + table.note + "\n"
  return (
    out
    + "\nResults: "
    + "; ".join(f"`{f}` (commit {', '.join(c)})" for f, c in cited.items())
    + "\n"
  )


def documents(root: str = ROOT) -> list[str]:
  out = []
  for pattern in DOCS:
    out += sorted(glob.glob(os.path.join(root, pattern)))
  return out


def rewrite(path: str, tables: dict, root: str = ROOT) -> tuple[str, str]:
  """(current text, text with every marked table rendered) of one markdown file; an unknown
  table name or an unclosed marker is a ValueError naming the file and line."""
  rel = os.path.relpath(path, root)
  with open(path) as f:
    text = f.read()
  lines = text.split("\n")
  out, i = [], 0
  while i < len(lines):
    m = OPEN.match(lines[i])
    out.append(lines[i])
    if not m:
      i += 1
      continue
    name, start = m.group(1), i + 1
    j = i + 1
    while j < len(lines) and lines[j].strip() != CLOSE:
      if OPEN.match(lines[j]):
        break
      j += 1
    if j == len(lines) or lines[j].strip() != CLOSE:
      raise ValueError(
        f"{rel}:{start}: table {name!r}: no closing {CLOSE} before the next "
        "table or the end of the file"
      )
    if name not in tables:
      raise ValueError(
        f"{rel}:{start}: table {name!r} is not in experiments/table_specs.py "
        f"(known: {sorted(tables)})"
      )
    out += render(name, tables[name], root, f"{rel}:{start}").rstrip("\n").split("\n")
    out.append(lines[j])
    i = j + 1
  return text, "\n".join(out)


def check(root: str = ROOT, tables: dict | None = None) -> list[str]:
  """One message (with a diff) per markdown file whose committed tables differ from their
  rendering; [] when every table is current."""
  tables = _tables() if tables is None else tables
  problems = []
  for path in documents(root):
    old, new = rewrite(path, tables, root)
    if old != new:
      rel = os.path.relpath(path, root)
      diff = "".join(
        difflib.unified_diff(
          old.splitlines(True), new.splitlines(True), rel, rel + " (rendered)", n=1
        )
      )
      problems.append(
        f"{rel}: a table differs from its rendering (python -m "
        f"experiments.tables rewrites it):\n{diff}"
      )
  return problems


def used_tables(root: str = ROOT) -> dict[str, list[str]]:
  """table name -> the markdown files (relative) that show it."""
  out = {}
  for path in documents(root):
    with open(path) as f:
      for line in f:
        m = OPEN.match(line)
        if m:
          out.setdefault(m.group(1), []).append(os.path.relpath(path, root))
  return out


def _tables() -> dict:
  from experiments import table_specs

  return table_specs.TABLES


# ---- experiments/results/INDEX.md ----


def index_rows(root: str = ROOT) -> list[dict]:
  """One row per file under experiments/results/ (and results/superseded/): the experiment,
  command, commit, engine and date of its first line with provenance, every distinct command
  of its lines (`commands`: a file that several runs appended to lists each), and whether it is
  current or superseded (table_specs.SUPERSEDED, table_specs.ENGINE)."""
  from experiments import table_specs

  base = os.path.join(root, RESULTS)
  rows = []
  for path in sorted(
    glob.glob(os.path.join(base, "*")) + glob.glob(os.path.join(base, "superseded", "*"))
  ):
    name = os.path.relpath(path, base)
    if os.path.isdir(path) or name == "INDEX.md":
      continue
    row = {"file": name, "experiment": "-", "command": "-", "commit": "-", "date": "-"}
    if name.endswith(".jsonl"):
      rows_ = read_rows(path)
      row["commands"] = list(
        dict.fromkeys(
          r.get("run_command") or p["command"]
          for _, r in rows_
          if (p := provenance_of(r)) is not None
        )
      )
      for _, r in rows_:
        prov = provenance_of(r)
        if prov:
          command = r.get("run_command") or prov["command"]
          run = r.get("run") if isinstance(r.get("run"), dict) else {}  # a run.py workdir
          script = re.search(r"experiments/(\w+)\.py", command)
          row.update(
            experiment=r.get("experiment")
            if r.get("experiment") not in (None, "run")
            else r.get("algorithm") or (script.group(1) if script else "run"),
            command=command,
            date=prov["date"][:10] or "-",
            commit=str(run.get("git_commit") or prov["commit"])[:7],
            engine=r.get("attention") or "-",
          )
          break
      else:
        row["commit"] = "(no provenance recorded)"
    else:
      row["experiment"] = table_specs.COMPANIONS.get(os.path.basename(name), "-")
    stem = os.path.basename(name)
    row["engine"] = table_specs.ENGINE.get(stem, row.get("engine", "-"))
    later = table_specs.SUPERSEDED.get(stem)
    row["status"] = f"superseded by `{later}`" if later else "current"
    rows.append(row)
  return rows


def index_markdown(root: str = ROOT) -> str:
  lines = [
    "# experiments/results: every results file",
    "",
    "Generated by `python -m experiments.tables --index` (do not edit; "
    "`tests/experiments/readme_tables_test.py` checks it is current). Which table or figure cites "
    "each file: `experiments/README.md`. Superseded files live under `superseded/`.",
    "",
    "| file | experiment | command | commit | engine | date | status |",
    "|---|---|---|---|---|---|---|",
  ]
  for r in index_rows(root):
    cmds = r.get("commands") or []
    cmd = "<br>".join("`" + c.replace("|", "\\|") + "`" for c in cmds) if cmds else "-"
    lines.append(
      f"| `{r['file']}` | {r['experiment']} | {cmd} | {r['commit']} | "
      f"{r['engine']} | {r['date']} | {r['status']} |"
    )
  return "\n".join(lines) + "\n"


def _parse_command(command: str) -> str | None:
  """None if `command` (python SCRIPT FLAGS... as a results line records it) parses with its
  script's own flags, else what is wrong. run.py: a fresh set of its flags; any other script
  runs as __main__ with absl's app.run and argparse's parse_args stopped right after they
  parsed (nothing else runs: every script's main block only defines flags and calls one of
  them), then its flags and the experiments modules it imported are removed again."""
  import argparse
  import runpy
  import shlex

  from absl import app, flags

  argv = shlex.split(command)
  if len(argv) < 2 or not argv[0].startswith("python"):
    return "not a python command"
  if argv[1] == "-":
    return "ran from standard input (python -): no script reproduces it"
  if argv[1] == "-m":
    path, args = os.path.join(ROOT, *argv[2].split(".")) + ".py", argv[3:]
  else:
    path, args = os.path.join(ROOT, argv[1]), argv[2:]
  if not path.endswith(".py") or not os.path.exists(path):
    return f"{argv[1]}: no such script in the checkout"
  if os.path.abspath(path) == os.path.join(ROOT, "run.py"):
    from experiments import registry

    fv = registry.run_module().define_flags(flags.FlagValues())
    try:
      fv([argv[1], *args])
    except flags.Error as e:
      return str(e)
    return None

  class _Parsed(Exception):
    pass

  def parse_absl(main, argv=None, **kwargs):
    del main, kwargs
    flags.FLAGS(argv or sys.argv)
    raise _Parsed

  def parse_argparse(self, a=None, namespace=None):
    real_parse(self, a, namespace)
    raise _Parsed

  before_flags, before_modules = set(flags.FLAGS), set(sys.modules)
  real_run, real_parse, real_argv = app.run, argparse.ArgumentParser.parse_args, sys.argv
  app.run, argparse.ArgumentParser.parse_args = parse_absl, parse_argparse
  sys.argv = [path, *args]
  try:
    runpy.run_path(path, run_name="__main__")
  except _Parsed:
    return None
  except flags.Error as e:
    return str(e)
  except SystemExit as e:
    return f"its parser refused it (exit {e.code})"
  finally:
    app.run, argparse.ArgumentParser.parse_args, sys.argv = real_run, real_parse, real_argv
    flags.FLAGS.unparse_flags()
    for name in set(flags.FLAGS) - before_flags:
      delattr(flags.FLAGS, name)
    for name in set(sys.modules) - before_modules:
      if name.startswith("experiments."):
        del sys.modules[name]
  return "its main block never parsed the arguments"


def command_problems(root: str = ROOT) -> list[str]:
  """One line per command of a current results file (INDEX.md's) that does not parse with
  its script's flags: a command that cannot reproduce its file."""
  out = []
  for r in index_rows(root):
    if r["status"] != "current":
      continue
    for command in r.get("commands") or []:
      problem = _parse_command(command)
      if problem:
        out.append(f"{r['file']}: `{command}`: {problem}")
  return out


# ---- experiments/README.md: one row per published table or figure ----

PUBLISHED = (
  "<!-- published: generated by python -m experiments.tables --index -->",
  "<!-- /published -->",
)


def published_markdown(root: str = ROOT) -> str:
  """The rows of experiments/README.md's table: each table and figure the docs show, the
  claim it supports, where it is shown, its results files with their commands, and the
  notebook cell that renders and plots it."""
  from experiments import table_specs

  commands = {r["file"]: r["command"] for r in index_rows(root)}
  cell = "`notebooks/results_browser.ipynb`: `show({!r})`"
  lines = ["| claim | shown in | results file: command | notebook cell |", "|---|---|---|---|"]

  def files_cell(files):
    return "<br>".join(f"`{f}`: `{commands.get(f, '-')}`".replace("|", "\\|") for f in files)

  for name, docs in used_tables(root).items():
    files = list(dict.fromkeys(src.file for src in table_specs.TABLES[name].sources))
    lines.append(
      f"| {table_specs.CLAIMS[name]} | table `{name}` in {', '.join(docs)} | "
      f"{files_cell(files)} | {cell.format(name)} |"
    )
  for name, (claim, image, data) in table_specs.FIGURES.items():
    lines.append(f"| {claim} | figure `{image}` | {files_cell([data])} | {cell.format(name)} |")
  return "\n".join(lines)


def rewrite_published(path: str, root: str = ROOT) -> tuple[str, str]:
  with open(path) as f:
    text = f.read()
  start, end = text.index(PUBLISHED[0]), text.index(PUBLISHED[1])
  new = text[: start + len(PUBLISHED[0])] + "\n" + published_markdown(root) + "\n" + text[end:]
  return text, new


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="report, do not rewrite")
  parser.add_argument("--index", action="store_true", help="(re)write results/INDEX.md only")
  parser.add_argument(
    "--check_commands",
    action="store_true",
    help="exit 1 naming each current results file's command that does not parse",
  )
  args = parser.parse_args(argv)
  if args.check_commands:
    problems = command_problems()
    for p in problems:
      print(p)
    return 1 if problems else 0
  index_path = os.path.join(ROOT, RESULTS, "INDEX.md")
  if args.index:
    with open(index_path, "w") as f:
      f.write(index_markdown())
    readme = os.path.join(ROOT, "experiments", "README.md")
    _, new = rewrite_published(readme)
    with open(readme, "w") as f:
      f.write(new)
    print(f"wrote {os.path.relpath(index_path, ROOT)} and experiments/README.md's table")
    return 0
  if args.check:
    problems = check()
    for p in problems:
      print(p)
    return 1 if problems else 0
  for path in documents():
    old, new = rewrite(path, _tables())
    if old != new:
      with open(path, "w") as f:
        f.write(new)
      print(f"rendered {os.path.relpath(path, ROOT)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
