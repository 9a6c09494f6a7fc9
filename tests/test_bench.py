"""The benchmark suite's pure parts: formulas, byte counting, parsing and report rendering.

No multi-process job is started here: benchmarks print and save figures, they are never timed
assertions in tests.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench import metrics
from bench.accuracy import parse_epoch_line
from bench.coll_worker import PSCounter, ps_allreduce
from bench.profiling import summarize_pyspy, summarize_timeline


def test_busbw_is_ring_traffic_over_time():
    # 2(N-1)/N x bytes / time: 1 MiB in 1 ms at N=4 moves 1.5 MiB per rank
    assert metrics.busbw(1 << 20, 1e-3, 4) == pytest.approx(1.5 * (1 << 20) / 1e-3)
    assert metrics.busbw(1000, 1.0, 2) == pytest.approx(1000.0)  # N=2: busbw == algbw
    assert metrics.algbw(1000, 0.5) == 2000.0


def test_server_moves_n_over_2_times_a_ring_rank_each_way():
    for n in (2, 3, 4, 8):
        k = 4096
        each_way = metrics.ps_bytes_each_way_at_server(k, n)
        assert each_way == pytest.approx(n / 2 * metrics.ring_bytes_per_rank(k, n))
        assert metrics.ps_bytes_at_server(k, n) == 2 * each_way == 2 * (n - 1) * k
        assert metrics.ring_bytes_per_rank(k, n) < 2 * k
        assert metrics.ps_bytes_per_worker(k) == 2 * k


class FakeComm:
    """Enough of an mpi4py communicator for one rank of ps_allreduce; peers hold ``peer_value``."""

    def __init__(self, rank: int, size: int, peer_value: float = 1.0) -> None:
        self.rank, self.size, self.peer_value = rank, size, peer_value
        self.sent: list[tuple[int, int]] = []

    def Get_rank(self) -> int:
        return self.rank

    def Get_size(self) -> int:
        return self.size

    def Send(self, buf, dest, tag):
        self.sent.append((dest, buf.nbytes))

    def Recv(self, buf, source, tag):
        buf[...] = self.peer_value if self.rank == 0 else self.peer_value * self.size


@pytest.mark.parametrize("size", [2, 4])
def test_parameter_server_counts_its_bytes(size):
    k = 1024
    server, counter = FakeComm(0, size), PSCounter()
    buf = np.ones(k // 4, dtype=np.float32)
    ps_allreduce(server, buf, np.empty_like(buf), counter)
    assert np.all(buf == size)  # own ones + (size-1) peers' ones
    assert counter.sent == counter.received == metrics.ps_bytes_each_way_at_server(k, size)
    assert counter.sent + counter.received == metrics.ps_bytes_at_server(k, size)
    assert [d for d, _ in server.sent] == list(range(1, size))

    worker, counter = FakeComm(1, size), PSCounter()
    buf = np.ones(k // 4, dtype=np.float32)
    ps_allreduce(worker, buf, np.empty_like(buf), counter)
    assert counter.sent + counter.received == metrics.ps_bytes_per_worker(k)
    assert np.all(buf == size)


def test_median_of_slowest_rank():
    # 3 reps on 2 ranks: the slower rank counts, then the median over reps
    assert metrics.median_of_max([[1.0, 5.0, 2.0], [2.0, 1.0, 3.0]]) == 3.0


def test_efficiency_and_core_limit():
    assert metrics.scaling_efficiency(300.0, 100.0, 4) == 0.75
    assert metrics.core_limit(100.0, 4, 2) == 200.0  # 4 ranks cannot use more than 2 cores
    assert metrics.core_limit(100.0, 1, 2) == 100.0


def test_time_to_target():
    epochs = [{"epoch": 1, "seconds": 10.0, "test_accuracy": 0.98},
              {"epoch": 2, "seconds": 11.0, "test_accuracy": 0.991},
              {"epoch": 3, "seconds": 12.0, "test_accuracy": 0.995}]
    assert metrics.time_to_target(epochs, 0.99) == (21.0, 2)
    assert metrics.time_to_target(epochs, 0.999) == (None, None)


def test_parse_trainer_epoch_line():
    line = ("epoch 2/4: train loss 0.0512  test loss 0.0301  test acc 99.05%  lr 0.04  "
            "66.1s  908 img/s")
    rec = parse_epoch_line(line)
    assert rec == {"epoch": 2, "epochs": 4, "test_accuracy": pytest.approx(0.9905),
                   "seconds": 66.1, "images_per_second": 908.0}
    assert parse_epoch_line("final test accuracy 99.30% (908 img/s over 264.0s)") is None


def test_profile_summaries(tmp_path):
    raw = tmp_path / "pyspy.txt"
    raw.write_text("main (a.py:1);step (b.py:10);backward (c.py:5) 30\n"
                   "main (a.py:1);step (b.py:11);allreduce (d.py:7) 10\n")
    s = summarize_pyspy(raw)
    assert s["samples"] == 40
    assert s["self"][0] == {"function": "backward (c.py)", "share": 0.75}
    assert {"function": "step (b.py)", "share": 1.0} in s["inclusive"]
    tl = tmp_path / "timeline.json"  # Horovod leaves the array unclosed
    tl.write_text('[\n{"name": "ALLREDUCE", "ph": "B", "pid": 1, "ts": 0},\n'
                  '{"name": "", "ph": "E", "pid": 1, "ts": 250},\n')
    assert summarize_timeline(tl)["activities"][0]["total_ms"] == pytest.approx(0.25)


def fake_results(quick: bool) -> dict:
    def run(fw, kind, wrapper, data, np, ips, threads=None):
        return {"name": f"{fw}/{kind}/{wrapper}/{data}/np{np}", "framework": fw, "kind": kind,
                "wrapper": wrapper, "data": data, "np": np, "threads": threads, "ok": True,
                "images_per_second": ips, "peak_rss_mib": [700.0] * np}
    runs = [run("torch", "loop", "none", "synthetic", 1, 1000.0, threads=1),
            run("torch", "loop", "none", "synthetic", 1, 1500.0),
            run("torch", "loop", "horovod", "synthetic", 1, 1480.0),
            run("torch", "trainer", "horovod", "mnist", 1, 1200.0),
            run("torch", "trainer", "horovod", "mnist", 2, 1600.0),
            run("torch", "loop", "horovod", "synthetic", 2, 1800.0),
            run("torch", "loop", "ddp", "synthetic", 2, 1900.0)]
    rows = [{"bytes": 4096, "seconds": 1e-4, "busbw": 4.1e7, "busiest_rank_bytes": 4096,
             "busiest_rank_bw": 4.1e7, "moved_bytes_per_rank": None}]
    ps_rows = [{"bytes": 4096, "seconds": 2e-4, "busbw": 2.0e7, "busiest_rank_bytes": 4096,
                "busiest_rank_bw": 2.0e7, "moved_bytes_per_rank": [[4096, 4096], [4096, 4096]]}]
    return {
        "meta": {"quick": quick, "started": "2026-11-23 04:00 UTC", "duration_s": 60.0,
                 "command": "python -m bench", "plots_rel": "bench/results"},
        "machine": {"cpu_model": "Test CPU", "cores": 2, "logical_cpus": 2, "memory_gib": 8.0,
                    "os": "Linux", "versions": {"horovod": "0.28.1"},
                    "copy_bandwidth_1core": 5e9, "copy_bandwidth_all_cores": 6e9},
        "throughput": {"runs": runs},
        "collectives": {"sizes": [4096], "runs": [
            {"impl": "mpi4py-allreduce", "np": 2, "ok": True, "rows": rows},
            {"impl": "horovod-mpi", "np": 2, "ok": True, "rows": rows},
            {"impl": "mpi4py-param-server", "np": 2, "ok": True, "rows": ps_rows}]},
        "accuracy": {"target": 0.99, "trainer_args": [], "proxy": None, "runs": [
            {"framework": "torch", "np": 2, "ok": True, "seconds_to_target": 130.0, "epoch_reached": 2,
             "wall_seconds_to_target": 150.0, "epochs": [
                 {"epoch": 1, "test_accuracy": 0.985, "seconds": 65.0, "images_per_second": 900.0},
                 {"epoch": 2, "test_accuracy": 0.991, "seconds": 65.0, "images_per_second": 910.0}]}]},
    }


def test_report_renders_tables_ratios_and_machine():
    from bench.report import render

    md = render(fake_results(quick=False))
    assert "Test CPU, 2 cores" in md
    assert "QUICK MODE" not in md
    # trainer vs loop, efficiency (trainer, synthetic), core limit
    assert "| 2 | 1600 | n/a | 1800 | 0.89x | 67% | 61% | 80% |" in md
    assert "| 2 | 1800 | n/a | 1900 | 0.95x | n/a |" in md  # Horovod (MPI, Gloo) vs DDP
    assert "0.99x" in md  # Horovod cost at -np 1 (1480 / 1500)
    assert "epoch 2" in md and "| 130 | 150 |" in md
    assert "sent 4 KiB, received 4 KiB" in md  # counted PS bytes


def test_quick_report_says_so():
    from bench.report import render

    assert "**QUICK MODE.**" in render(fake_results(quick=True))


def test_plots_render(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.plots import render_all

    made = render_all(fake_results(quick=False), tmp_path)
    assert set(made) == {"scaling", "bandwidth", "accuracy"}
    assert all((tmp_path / f).stat().st_size > 1000 for f in made.values())
