"""Every results table in README.md, docs/ and experiments/README.md is its rendering from the
results files (experiments/tables.py), every results file they cite exists, and
experiments/results/INDEX.md is current. Bad input names the file and line."""

import json
import os
import re

import pytest

from experiments import table_specs, tables
from experiments.table_specs import Source, Table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_committed_table_equals_its_rendering():
  problems = tables.check()
  assert not problems, "\n".join(problems)


def test_every_marker_names_a_spec_and_every_spec_is_shown():
  used = tables.used_tables()
  assert set(used) <= set(table_specs.TABLES), sorted(set(used) - set(table_specs.TABLES))
  assert set(table_specs.TABLES) <= set(used), sorted(set(table_specs.TABLES) - set(used))
  assert "headline" in used and "README.md" in used["headline"]


def test_every_cited_results_file_exists():
  cited = re.compile(
    r"(?:experiments/results/)?((?:superseded/)?[\w.-]+_20\d\d-\d\d-\d\d"
    r"[\w.-]*\.(?:jsonl|md|png|txt))"
  )
  missing = []
  for path in tables.documents():
    for n, line in enumerate(open(path), 1):
      for m in re.finditer(r"`([^`]*)`|\(([^)\s]*)\)", line):
        text = m.group(1) or m.group(2) or ""
        for f in cited.findall(text):
          base = os.path.join(ROOT, tables.RESULTS)
          if not (
            os.path.exists(os.path.join(base, f))
            or os.path.exists(os.path.join(base, "superseded", f))
          ):
            missing.append(f"{os.path.relpath(path, ROOT)}:{n}: {f}")
  assert not missing, missing


def test_index_is_current():
  with open(os.path.join(ROOT, tables.RESULTS, "INDEX.md")) as f:
    assert f.read() == tables.index_markdown(), "run python -m experiments.tables --index"


def test_index_lists_every_file_once_and_superseded_ones_under_superseded():
  rows = tables.index_rows()
  names = [r["file"] for r in rows]
  assert len(names) == len(set(names))
  for r in rows:
    if r["status"] != "current":
      assert r["file"].startswith("superseded/"), r
      later = table_specs.SUPERSEDED[os.path.basename(r["file"])]
      while later in table_specs.SUPERSEDED:  # superseded in turn: follow to the current one
        assert f"superseded/{later}" in names, (r["file"], later)
        later = table_specs.SUPERSEDED[later]
      assert later in names, (r["file"], later)
  for stem in table_specs.SUPERSEDED:
    assert f"superseded/{stem}" in names, stem


# ---- the renderer on files of the test's own ----


def _root(tmp_path, lines, md="<!-- table: t -->\n<!-- /table -->\n"):
  results = tmp_path / tables.RESULTS
  results.mkdir(parents=True)
  (results / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
  (tmp_path / "README.md").write_text("# x\n\n" + md)
  return str(tmp_path)


PROV = {"git_commit": "abcdef0123", "command": "python make.py", "hostname": "vm"}
TABLE = {"t": Table(("P", "s"), (Source("r.jsonl", ("{P}", "{s:.2f}")),))}


def test_render_fills_the_markers_and_cites_file_and_commit(tmp_path):
  root = _root(tmp_path, [{"P": 8, "s": 1.234, "provenance": PROV}])
  old, new = tables.rewrite(os.path.join(root, "README.md"), TABLE, root)
  assert "| 8 | 1.23 |" in new and "`experiments/results/r.jsonl` (commit abcdef0)" in new
  assert new.startswith(old.split("<!--")[0]) and new.rstrip().endswith("<!-- /table -->")
  (tmp_path / "README.md").write_text(new)
  assert tables.check(root, TABLE) == []


def test_a_typed_cell_that_differs_from_the_file_fails_the_check(tmp_path):
  root = _root(tmp_path, [{"P": 8, "s": 1.234, "provenance": PROV}])
  _, new = tables.rewrite(os.path.join(root, "README.md"), TABLE, root)
  (tmp_path / "README.md").write_text(new.replace("| 8 | 1.23 |", "| 8 | 1.20 |"))
  problems = tables.check(root, TABLE)
  assert len(problems) == 1 and problems[0].startswith("README.md: a table differs")
  assert "-| 8 | 1.20 |" in problems[0] and "+| 8 | 1.23 |" in problems[0]


def test_a_line_without_provenance_is_named_by_file_and_line(tmp_path):
  root = _root(
    tmp_path,
    [
      {"P": 8, "s": 1.0, "provenance": PROV},
      {"P": 16, "s": 2.0, "provenance": {"git_commit": "abc"}},
    ],
  )
  with pytest.raises(
    ValueError,
    match=r"experiments/results/r\.jsonl:2: no provenance .*"
    r"README\.md:3: table 't'",
  ):
    tables.rewrite(os.path.join(root, "README.md"), TABLE, root)


def test_top_level_provenance_is_accepted(tmp_path):
  root = _root(
    tmp_path, [{"P": 8, "s": 1.0, "git_commit": "1234567", "command": "x", "machine": "vm"}]
  )
  _, new = tables.rewrite(os.path.join(root, "README.md"), TABLE, root)
  assert "(commit 1234567)" in new


def test_a_column_naming_a_missing_field_is_named_by_file_and_line(tmp_path):
  root = _root(tmp_path, [{"P": 8, "s": 1.0, "provenance": PROV}, {"P": 16, "provenance": PROV}])
  with pytest.raises(
    ValueError,
    match=r"README\.md:3: table 't': column 's' reads field 's', "
    r"which experiments/results/r\.jsonl:2 does not have",
  ):
    tables.rewrite(os.path.join(root, "README.md"), TABLE, root)


def test_a_missing_results_file_is_named(tmp_path):
  root = _root(tmp_path, [{"P": 8, "s": 1.0, "provenance": PROV}])
  spec = {"t": Table(("P",), (Source("gone.jsonl", ("{P}",)),))}
  with pytest.raises(
    ValueError,
    match=r"README\.md:3: table 't': results file "
    r"experiments/results/gone\.jsonl does not exist",
  ):
    tables.rewrite(os.path.join(root, "README.md"), spec, root)


def test_unknown_table_unclosed_marker_and_bad_json_are_named(tmp_path):
  root = _root(
    tmp_path, [{"P": 8, "s": 1.0, "provenance": PROV}], md="<!-- table: nope -->\n<!-- /table -->\n"
  )
  with pytest.raises(ValueError, match=r"README\.md:3: table 'nope' is not in"):
    tables.rewrite(os.path.join(root, "README.md"), TABLE, root)
  (tmp_path / "README.md").write_text("<!-- table: t -->\n| typed |\n")
  with pytest.raises(ValueError, match=r"README\.md:1: table 't': no closing"):
    tables.rewrite(os.path.join(root, "README.md"), TABLE, root)
  (tmp_path / tables.RESULTS / "r.jsonl").write_text('{"P": 1}\n{oops\n')
  (tmp_path / "README.md").write_text("<!-- table: t -->\n<!-- /table -->\n")
  with pytest.raises(ValueError, match=r"r\.jsonl:2: not valid JSON"):
    tables.rewrite(os.path.join(root, "README.md"), TABLE, root)


def test_a_source_matching_the_wrong_number_of_rows_is_an_error(tmp_path):
  root = _root(
    tmp_path, [{"P": 8, "s": 1.0, "provenance": PROV}, {"P": 8, "s": 2.0, "provenance": PROV}]
  )
  spec = {"t": Table(("s",), (Source("r.jsonl", ("{s}",), ("P=8",), count=1),))}
  with pytest.raises(ValueError, match=r"r\.jsonl: 2 rows match \['P=8'\], expected 1"):
    tables.rewrite(os.path.join(root, "README.md"), spec, root)


def test_experiments_readme_lists_every_published_table_and_figure():
  path = os.path.join(ROOT, "experiments", "README.md")
  old, new = tables.rewrite_published(path)
  assert old == new, "run python -m experiments.tables --index"
  assert set(table_specs.CLAIMS) == set(table_specs.TABLES)
  for name in list(table_specs.TABLES) + list(table_specs.FIGURES):
    assert f"`show({name!r})`" in old, name
  for _, image, data in table_specs.FIGURES.values():
    for f in (image, data):
      assert os.path.exists(os.path.join(ROOT, tables.RESULTS, f)), f


def test_the_results_browser_has_a_cell_per_published_table_and_figure():
  with open(os.path.join(ROOT, "notebooks", "results_browser.ipynb")) as f:
    cells = ["".join(c["source"]) for c in json.load(f)["cells"] if c["cell_type"] == "code"]
  for name in list(table_specs.TABLES) + list(table_specs.FIGURES):
    assert f"show({name!r})" in cells, name


# Results lines that ran from standard input (`python -`) before commands were checked: no
# script reproduces them, and INDEX.md says so. Listed here so that no new one can appear;
# each goes when its file is re-measured by a script.
STDIN_LINES = {"cpu_frontier_compiled_2026-11-30.jsonl", "cpu_long_context_2026-11-30.jsonl"}


def test_every_current_files_commands_parse_with_their_scripts_flags():
  """INDEX.md lists every distinct command of each file; each is the command that made its
  lines, so each must parse with that script's flags today (a renamed or removed flag makes a
  file unreproducible: bench_hybrid's --out and --reps once were)."""
  import subprocess
  import sys

  out = subprocess.run(
    [sys.executable, "-m", "experiments.tables", "--check_commands"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  problems = [line for line in out.stdout.splitlines() if line.strip()]
  unexpected = [
    p for p in problems if not (p.split(":", 1)[0] in STDIN_LINES and "standard input" in p)
  ]
  assert not unexpected, "\n".join(unexpected) + out.stderr[-2000:]
  assert {p.split(":", 1)[0] for p in problems} <= STDIN_LINES


def test_a_wrong_flag_is_named():
  assert tables._parse_command("python run.py --workdir=/tmp/x") is None
  assert "nonexistent_flag" in tables._parse_command("python run.py --nonexistent_flag=1")
  assert "standard input" in tables._parse_command("python - --x=1")
  assert "no such script" in tables._parse_command("python experiments/no_such.py")


def test_headline_rows_state_their_conditions():
  """Every headline row names its conditions from its own fields: the load when it ran and
  whether the tree was clean (or says these were not recorded)."""
  rendered = tables.render("headline", table_specs.TABLES["headline"])
  rows = [r for r in rendered.splitlines() if r.startswith("| ") and "---" not in r][1:]
  assert rows
  header = rendered.splitlines()[0]
  assert "conditions" in header
  for row in rows:
    cond = row.split(" | ")[2]
    assert "load" in cond or "compiled" in cond, row
    assert "tree" in cond or "compiled" in cond, row


def test_conditions_come_from_the_row():
  row = {"preset": "small", "reps": 5, "provenance": {"load_avg_1m": 0.5, "git_dirty": True}}
  c = tables.conditions(row)
  assert c["_load"] == "0.50 when written" and c["_tree"] == "dirty tree" and c["_reps"] == "5"
  assert c["_model"].startswith("small (4 layers, d=256, ")
  waited = {**row, "wait": {"load_at_start": 0.56, "quiet": True}}  # bench_peer's quiet wait
  assert tables.conditions(waited)["_load"] == "0.56 at start"
  bare = tables.conditions({"provenance": {"command": "python x.py --reps=3"}})
  assert bare["_load"] == "-" and bare["_tree"] == "tree state not recorded"
  assert bare["_reps"] == "3" and bare["_model"] == "-"


def test_superseded_files_are_marked_so_everywhere():
  """A file under results/superseded/ is superseded in INDEX.md (names its successor, which
  exists) and a superseded file lives under superseded/."""
  for r in tables.index_rows():
    moved = r["file"].startswith("superseded/")
    assert moved == (r["status"] != "current"), r
    if moved:
      later = table_specs.SUPERSEDED[os.path.basename(r["file"])]
      assert any(
        os.path.exists(os.path.join(ROOT, tables.RESULTS, d, later)) for d in ("", "superseded")
      ), (r["file"], later)
