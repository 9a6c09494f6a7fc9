"""Smoke test of the ``data`` benchmark part (bench/parts/owndata.py) at its smallest size.

A few dozen JPEGs, one step, -np 1, every kind of run once, per framework; output to a temporary
folder, never to bench/results/ or BENCHMARKS.md.  It checks that the part runs end to end and
records what the report needs (no figure is judged: benchmarks are never timed assertions).
"""

from __future__ import annotations

import json
import sys

import pytest
from conftest import REPO, requires_horovod, run


@requires_horovod
@pytest.mark.timeout(600)
@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_data_part_runs_end_to_end_at_the_smallest_size(tmp_path, framework):
    kept = {p: p.stat().st_mtime_ns for p in (REPO / "bench/results/data.json", REPO / "BENCHMARKS.md")
            if p.exists()}
    proc = run([sys.executable, "-m", "bench.parts.owndata", "--scale", "smoke", "--frameworks", framework,
                "--out", str(tmp_path)], timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "data.json").read_text())

    # every run finished and measured something
    runs = data["memory"] + data["throughput"]
    assert [r["name"] for r in runs if not r["ok"]] == []
    assert {(r["kind"], r["data"]) for r in data["throughput"]} == {("loop", "fixed"), ("trainer", "folder"),
                                                                   ("loop", "folder")}
    assert all(r["images_per_second"] > 0 and r["peak_rss_mib"] and min(r["peak_rss_mib"]) > 0 for r in runs)
    assert {r["framework"] for r in runs} == {framework}
    # the trainer ran with a decoded cache of the job's own (a file was made, and removed after
    # the job) and again with --no-decode-cache (none made)
    trainers = [r for r in runs if r["kind"] == "trainer"]
    assert sorted(r["cache"] for r in data["throughput"] if r["kind"] == "trainer") == [False, True]
    assert all((r["decoded_cache_bytes"] > 0) == r["cache"] for r in trainers), trainers
    assert not list((tmp_path / "tmp" / "data" / "runs").glob("*/decoded"))
    # the folders of both memory sizes were read by the trainer, through PyTorch's DataLoader
    # workers (started from a fork server).  The workers themselves are sampled every 0.5 s
    # (bench/workers/procs.py), which a smoke run's workers can outlive or not, depending on the machine:
    # what was seen must be whole, but seeing them is the full run's business.
    assert sorted(r["folder_key"] for r in data["memory"]) == ["mem-24", "mem-48"]
    # the rank's own resident set by kind (bench/workers/procs.py PeakParts): its heap is never empty
    assert all(q["peak_rss_parts_mib"]["anon"] > 0 for r in data["memory"] for q in r["ranks"])
    if framework == "torch":
        for r in data["memory"] + [r for r in data["throughput"] if r["data"] == "folder"]:
            assert r["workers_used"] >= 1, r
            assert all(q["forkserver_peak_rss_mib"] > 0 for q in r["ranks"]), r
            assert all(q["workers"] == 0 or q["workers_peak_rss_mib"] > 0 for q in r["ranks"]), r
    # both loops were timed over as many steps as the trainer's epoch: 24 images, batches of 8
    assert sorted(r["timed_steps"] for r in data["throughput"] if r["kind"] == "loop") == [3, 3]
    loop = next(r for r in data["throughput"] if (r["kind"], r["data"]) == ("loop", "folder"))
    assert loop["workers_used"] >= 1 and loop["rank0_cores_busy"] > 0
    if framework == "torch":
        assert loop["rank0_workers_cores_busy"] >= 0
    assert data["folders"]["mem-48"]["list_bytes"] > data["folders"]["mem-24"]["list_bytes"] > 0
    decode = data["decode"][0]
    assert decode["ok"] and all(decode[k]["cpu_us"] > 0 for k in ("load", "load_resize", "item", "batch",
                                                                 "cached_batch"))
    # the 200,000-file folders are never kept
    assert not (tmp_path / "tmp" / "data" / "folders").exists()

    from bench.reports import report_data

    md = "\n".join(report_data.section({"data": data}))
    for heading in ("## 8. Your own data", "### 8.1", "### 8.2", "### 8.4", "### 8.5", "SMOKE RUN"):
        assert heading in md
    fixed = next(r for r in data["throughput"] if r["data"] == "fixed")["images_per_second"]
    assert f"| 1 | {loop['workers_used']} | {fixed:.1f} |" in md  # the measured row, comparisons withheld
    assert "loop 1 + as many as the trainer's epoch (3 at -np 1) timed steps" in md
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
