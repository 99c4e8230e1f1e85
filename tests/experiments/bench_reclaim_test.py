"""experiments/bench_reclaim.py: its flags' checks, its summary, the page-reporting readings it
takes (experiments/measure.py), and one tiny run end to end."""

import pytest
from helpers import run_script

from experiments import bench_reclaim, measure


def test_malloc_settings_and_their_tunables():
  assert bench_reclaim.malloc_tunables("plain") == ""
  assert bench_reclaim.malloc_tunables("huge") == "glibc.malloc.hugetlb=1"
  resident = bench_reclaim.malloc_tunables("resident").split(":")
  assert resident[0] == "glibc.malloc.hugetlb=1" and "glibc.malloc.mmap_max=0" in resident
  with pytest.raises(ValueError, match="--malloc: 'jemalloc' is not one of"):
    bench_reclaim.malloc_tunables("jemalloc")


def test_mimalloc_needs_its_library(tmp_path):
  assert bench_reclaim.malloc_env("huge", "") == {}
  with pytest.raises(ValueError, match="--malloc=mimalloc needs --mimalloc_lib"):
    bench_reclaim.malloc_env("mimalloc", str(tmp_path / "absent.so"))
  lib = tmp_path / "libmimalloc.so"
  lib.write_bytes(b"")
  env = bench_reclaim.malloc_env("mimalloc", str(lib))
  assert env == {"LD_PRELOAD": str(lib), "MIMALLOC_PURGE_DELAY": "-1"}


def test_gaps_parse_and_bad_gaps_are_named():
  assert bench_reclaim.parse_gaps("0, 3,0.5") == [0.0, 3.0, 0.5]
  for bad in ("", "a,1", "-1"):
    with pytest.raises(ValueError, match="--gaps"):
      bench_reclaim.parse_gaps(bad)


def test_summary_takes_medians_and_skips_missing_readings():
  steps = [
    dict(
      seconds=1.0, sys_seconds=0.1, page_faults=10, reported_mb_in_gap=None, reported_mb_in_step=0.0
    ),
    dict(
      seconds=3.0,
      sys_seconds=0.9,
      page_faults=30,
      reported_mb_in_gap=None,
      reported_mb_in_step=256.0,
    ),
    dict(
      seconds=2.0, sys_seconds=0.5, page_faults=20, reported_mb_in_gap=None, reported_mb_in_step=2.0
    ),
  ]
  s = bench_reclaim.summarize(steps)
  assert s == dict(
    step_s=2.0,
    step_max_s=3.0,
    sys_s=0.5,
    page_faults=20.0,
    reported_mb_in_gap=None,
    reported_mb_in_step=2.0,
  )


def test_page_reporting_reads_the_module_or_says_none(tmp_path):
  assert measure.page_reporting(str(tmp_path / "absent")) is None
  (tmp_path / "page_reporting_order").write_text("9\n")
  (tmp_path / "reported_kib").write_text("2048\n")
  before = measure.page_reporting(str(tmp_path))
  assert before == dict(order=9, reported_kib=2048)
  (tmp_path / "reported_kib").write_text("264192\n")
  assert measure.reported_mb(before, measure.page_reporting(str(tmp_path))) == 256.0
  assert measure.reported_mb(None, before) is None


def test_one_tiny_run_end_to_end():
  rows = run_script(
    "experiments/bench_reclaim.py",
    "--preset=tiny",
    "--prefix_len=16",
    "--tail_len=4",
    "--branches=2",
    "--gaps=0.1",
    "--malloc=plain,huge",
    "--steps=2",
    "--max_load=0",
  )
  assert [(r["malloc"], r["gap_s"]) for r in rows] == [("plain", 0.1), ("huge", 0.1)]
  for r in rows:
    assert len(r["steps"]) == 2 and r["step_s"] > 0 and r["sys_s"] >= 0 and r["peak_mb"] > 0
    assert r["glibc_tunables"] == bench_reclaim.malloc_tunables(r["malloc"])
    assert "provenance" in r
