"""``python -m bench --only floor`` (bench/parts/floor.py): the report's pure parts, and a smoke run of
the entry point at its smallest (-np 2, 4 KiB, one step) so that it cannot rot.  The smoke run
checks that every cell ran and produced its figures, never how fast anything was."""

from __future__ import annotations

import pytest

from bench.parts import floor
from bench.reports import report_floor
from bench.workers import loopcounters


def coll(np, impl, loop, seconds):
    return {"np": np, "impl": impl, "loop": loop, "ok": True, "load_average": [1.0, 1.0, 1.0],
            "seconds": {str(k): v for k, v in seconds.items()}}


def train_run(np, kind, wrapper, loop, ips, round_=0):
    return {"np": np, "kind": kind, "wrapper": wrapper, "loop": loop, "round": round_, "ok": True,
            "images_per_second": ips, "load_average": [1.5, 1.0, 1.0]}


def fake_floor() -> dict:
    collectives = [coll(2, "horovod-mpi", "upstream", {4096: 1.0e-3}),
                   coll(2, "horovod-mpi", "patched", {4096: 0.05e-3}),
                   coll(2, "mpi4py", "-", {4096: 0.01e-3})]
    training = [train_run(2, "loop", "horovod", "upstream", 1800.0),
                train_run(2, "loop", "horovod", "patched", 2000.0),
                train_run(2, "loop", "ddp", "-", 1900.0),
                train_run(2, "trainer", "horovod", "upstream", 1700.0),
                train_run(2, "trainer", "horovod", "patched", 1950.0),
                train_run(2, "loop", "horovod", "patched", 2100.0, 1),
                train_run(2, "loop", "horovod", "upstream", 1750.0, 1)]
    per_rank = {"allreduce_calls_per_step": 2.0, "tensors_per_call": 10.0, "bytes_per_call": 340.0 * 1024,
                "rounds_per_step": 3.0, "rounds_with_work_per_step": 2.0, "step_seconds": 0.004}
    cfg = floor.FloorConfig(sizes=[4096]).to_dict()
    return {"config": cfg, "load_average_start": [1.0, 1.0, 1.0], "load_average_end": [2.0, 1.0, 1.0],
            "collectives": collectives, "training": training,
            "fusion": [{"np": 2, "loop": "patched", "ok": True, "gradients": 20, "gradient_bytes": 680 * 1024,
                        "per_rank": [per_rank, per_rank], "load_average": [1.0, 1.0, 1.0]}],
            "wait": [{"op": "torch-allreduce", "loop": "upstream", "ok": True, "wall_seconds": 0.05,
                      "cpu_seconds": 0.1, "cores_busy": 2.0, "late_ms": 50.0}],
            "summary": floor.summary(collectives, training), "machine": {"cpu_model": "Test CPU", "cores": 2}}


def test_floor_summary_takes_medians_and_ratios():
    s = floor.summary(fake_floor()["collectives"], fake_floor()["training"])
    assert s["collectives"]["2"]["horovod_mpi_over_mpi4py"]["patched"]["4096"] == pytest.approx(5.0)
    assert s["collectives"]["2"]["horovod_mpi_over_mpi4py"]["upstream"]["4096"] == pytest.approx(100.0)
    t = s["training"]["2"]
    assert t["loop_patched"] == 2050.0 and t["loop_upstream"] == 1775.0  # medians of two rounds
    assert t["loop_patched_over_ddp"] == pytest.approx(2050 / 1900)
    assert t["trainer_patched_over_upstream"] == pytest.approx(1950 / 1700)


def test_floor_training_rounds_alternate_the_loops():
    first = [(loop, run.kind) for loop, run in floor.training_runs(2, 0)]
    second = [(loop, run.kind) for loop, run in floor.training_runs(2, 1)]
    assert first[0] == ("upstream", "loop") and second[0] == ("patched", "loop")
    assert ("-", "loop") in first  # the DDP loop
    assert {run.name for _, run in floor.training_runs(4, 0)} >= {
        "torch/loop/horovod/synthetic/np4~upstream", "torch/trainer/horovod/mnist/np4~patched"}


def test_loop_counters_per_step():
    before = dict.fromkeys(loopcounters.NAMES, 0)
    after = {**before, "rounds": 30, "allreduce_calls": 20, "allreduce_tensors": 200,
             "allreduce_bytes": 20 * 4096}
    d = loopcounters.delta(before, after, steps=10)
    assert d["allreduce_calls_per_step"] == 2.0 and d["tensors_per_call"] == 10.0
    assert d["bytes_per_call"] == 4096.0
    assert loopcounters.delta(before, before, 1)["bytes_per_call"] is None


def test_floor_report_renders_every_table():
    res = {"meta": {"quick": False}, "floor": fake_floor()}
    md = "\n".join(report_floor.section(res))
    assert "## 7." in md
    assert "| 4 KiB | 1 | 0.05 | 0.01 | 100.00x | 5.00x | 20.00x |" in md
    assert "| 2 | patched loop | 2.00 | 10.0 | 340 |" in md  # fusion
    assert "| `torch-allreduce` | 0.28.1 loop | 50 | 100 | 2.00 |" in md  # waiting
    assert "| 2 | 1700 | 1950 | 1.15x | 1775 | 2050 | 1900 |" in md  # training
    assert "over its cells 1.00-1.50" in md
    quick = "\n".join(report_floor.section({"meta": {"quick": True}, "floor": fake_floor()}))
    assert "100.00x" not in quick
