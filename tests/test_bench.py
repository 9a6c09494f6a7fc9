"""The benchmark suite's pure parts: formulas, byte counting, parsing and report rendering.

No multi-process job is started here: benchmarks print and save figures, they are never timed
assertions in tests.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from bench.common import metrics
from bench.parts.accuracy import parse_epoch_line
from bench.parts.profiling import summarize_pyspy, summarize_timeline
from bench.workers.coll_worker import PSCounter, ps_allreduce


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
    from bench.reports.report import render

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
    from bench.reports.report import render

    assert "**QUICK MODE.**" in render(fake_results(quick=True))


def test_plots_render(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.reports.plots import render_all

    made = render_all(fake_results(quick=False), tmp_path)
    assert set(made) == {"scaling", "bandwidth", "accuracy"}
    assert all((tmp_path / f).stat().st_size > 1000 for f in made.values())


# -- the emulated cluster's pure parts (bench/common/costmodel.py, projection.py, report_cluster.py) --------

from bench.common import costmodel  # noqa: E402
from bench.reports import projection  # noqa: E402
from bench.workers.coll_worker import iface_bytes  # noqa: E402


def test_ring_and_server_formulas():
    k = 1 << 20
    assert costmodel.ring_link_bytes(k, 4) == 1.5 * k
    assert costmodel.ps_link_bytes(k, 4) == 3 * k
    # two ranks per host on 2 hosts: a flat ring still sends one edge's traffic through each link;
    # the hierarchical one only the hosts' ring
    assert costmodel.formula_link_bytes("ring", k, 4, 2) == 1.5 * k
    assert costmodel.formula_link_bytes("hier", k, 4, 2) == k
    # the server's in and out phases add up; a ring's send and receive overlap
    assert costmodel.formula_seconds("ps", k, 4, 4, 1e6) == pytest.approx(6 * k / 1e6)
    assert costmodel.formula_seconds("ring", k, 4, 4, 1e6) == pytest.approx(1.5 * k / 1e6)


def test_busiest_link_counts_each_host_once():
    per_rank = [{"host": "net:[1]", "tx": 100.0, "rx": 90.0}, {"host": "net:[1]", "tx": 100.0, "rx": 90.0},
                {"host": "net:[2]", "tx": 80.0, "rx": 120.0}]
    link = costmodel.busiest_link(per_rank)
    assert link["hosts_seen"] == 2
    assert link["busiest_bytes"] == 120.0
    assert len(link["per_host"]) == 2


def test_alpha_beta_fit_recovers_its_parameters():
    c, alpha, bw = 1.2e-3, 80e-6, 110e6
    pts = [(k, n, c + 2 * (n - 1) * alpha + costmodel.ring_link_bytes(k, n) / bw)
           for k in (65536, 1 << 20, 16 << 20, 64 << 20) for n in (2, 3, 4)]
    m = costmodel.fit_alpha_beta(pts)
    assert (m.c, m.alpha, m.bandwidth) == (pytest.approx(c), pytest.approx(alpha), pytest.approx(bw))
    assert m.max_rel_error < 1e-9
    assert m.seconds(1 << 20, 4) == pytest.approx(c + 6 * alpha + 1.5 * (1 << 20) / bw)
    # the server's model: 2(N-1) x (alpha + K beta)
    ps = costmodel.fit_alpha_beta([(k, n, 2 * (n - 1) * (20e-6 + k / bw)) for k in (65536, 1 << 22)
                                   for n in (2, 4)], kind="ps")
    assert (ps.alpha, ps.bandwidth) == (pytest.approx(20e-6), pytest.approx(bw))


def test_alpha_beta_fit_with_one_host_count_and_negative_terms():
    # one N: c and alpha are the same term, alpha is left out
    m = costmodel.fit_alpha_beta([(k, 4, 2e-3 + 1.5 * k / 1e8) for k in (65536, 1 << 20, 1 << 24)])
    assert m.alpha == 0 and m.c == pytest.approx(2e-3) and m.bandwidth == pytest.approx(1e8)
    # pure bandwidth with a little noise: no negative fixed cost comes out
    m = costmodel.fit_alpha_beta([(k, n, costmodel.ring_link_bytes(k, n) / 1e8 * (1.01 if n == 3 else 1))
                                  for k in (1 << 20, 1 << 24) for n in (2, 3, 4)])
    assert m.c >= 0 and m.alpha >= 0 and m.bandwidth == pytest.approx(1e8, rel=0.02)


def test_training_step_prediction_and_projection():
    assert costmodel.predicted_step(1.0, 0.5) == 1.5
    assert costmodel.predicted_step(1.0, 0.5, overlap=1.0) == 1.0
    kw = dict(compute_s=0.5, grad_bytes=178e6, gpus_per_server=4, link_bits_per_s=25e9, alpha=50e-6,
              c=1e-3, fusion_bytes=128 * 2**20)
    one_server = costmodel.projected_efficiency(workers=4, **kw)
    assert one_server["efficiency"] == 1.0 and one_server["comm_s"] == 0
    effs = [costmodel.projected_efficiency(workers=w, **kw)["efficiency"] for w in (16, 64, 512)]
    assert effs == sorted(effs, reverse=True) and 0 < effs[-1] < 1
    r = costmodel.projected_efficiency(workers=512, **kw)
    # 128 servers: 2 x 127/128 x 178 MB at 25 Gbit/s x 1448/1514, 2 fusion buffers of 2 x 127 steps
    assert r["transfer_s"] == pytest.approx(2 * 127 / 128 * 178e6 / (25e9 / 8 * 1448 / 1514))
    assert r["latency_s"] == pytest.approx(2 * (1e-3 + 254 * 50e-6))


def test_implied_overlap_inverts_the_step_model():
    step = costmodel.predicted_step(0.5, 0.2, overlap=0.4)
    assert costmodel.implied_overlap(0.5, 0.2, 0.5 / step) == pytest.approx(0.4)
    assert costmodel.implied_overlap(0.5, 0.2, 0.5 / 0.7) == pytest.approx(0.0)


def test_projection_compute_times_from_the_cited_numbers():
    assert 1 / projection.seconds_per_image("vgg16") == pytest.approx(154.0)
    # ResNet-101 between ResNet-50 (219/s) and ResNet-152 (91.8/s), by FLOPs (7.6 of 3.8..11.3)
    assert 1 / projection.seconds_per_image("resnet101") == pytest.approx(128.7, abs=0.1)
    rows = projection.table({"resnet101": 44_549_160, "vgg16": 138_357_544}, alpha=50e-6, c=1e-3)
    assert len(rows) == 2 * len(projection.LINKS) * len(projection.WORKERS)
    for r in rows:
        assert 0 < r["efficiency_serial"] <= r["efficiency_overlapped"] <= 1


def test_iface_bytes_reads_proc_net_dev(tmp_path):
    dev = tmp_path / "dev"
    dev.write_text("Inter-|   Receive                                                |  Transmit\n"
                   " face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets\n"
                   "    lo:     100       2    0    0    0     0          0         0      100       2"
                   "    0    0    0     0       0          0\n"
                   "rtceth0: 5000  10    0    0    0     0          0         0     7000      12    0    0"
                   "    0     0       0          0\n")
    assert iface_bytes("rtceth0", str(dev)) == (7000, 5000)
    with pytest.raises(RuntimeError):
        iface_bytes("eth9", str(dev))


def fake_cluster(quick: bool = False) -> dict:
    """A small cluster.json: 1g profile measured at 2 and 4 hosts, unshaped at 4."""
    rate = 125e6
    drate = rate * costmodel.TCP_PAYLOAD_FRACTION

    def coll(impl, profile, n, formula="ring", eff=0.9, slots=1):
        rows = []
        for k in (65536, 1 << 20, 64 << 20):
            t = 1e-3 + 2 * (n * slots - 1) * 50e-6 + costmodel.formula_seconds(
                formula, k, n * slots, n, drate * eff)
            link = costmodel.formula_link_bytes(formula, k, n * slots, n) * 1.002
            rows.append({"bytes": k, "seconds": t, "busbw": costmodel.ring_link_bytes(k, n * slots) / t,
                         "busiest_link_bytes": link, "formula_link_bytes": link / 1.002, "hosts_seen": n})
        return {"profile": profile, "impl": impl, "hosts": n, "slots": slots, "ranks": n * slots,
                "formula": formula, "ok": True, "rows": rows}

    def train(fw, wrapper, profile, n, t, variant="default", slots=1):
        return {"name": f"{fw}/{wrapper}/{variant}/{profile}/h{n}x{slots}", "framework": fw,
                "wrapper": wrapper, "variant": variant, "profile": profile, "hosts": n, "slots": slots,
                "ok": True,
                "result": {"seconds_per_step": t, "gradient_bytes": 46_758_048, "fp16": "fp16" in variant,
                           "model": "resnet18", "batch_size_per_rank": 32}}

    colls = [coll(i, "1g", n, eff=0.85 if i != "horovod-mpi" else 0.45)
             for i in ("horovod-mpi", "horovod-mpi-ring", "torch-gloo") for n in (2, 4)]
    colls += [coll("mpi4py-param-server", "1g", n, "ps") for n in (2, 4)]
    colls += [coll("horovod-mpi-ring", "unshaped", 4), coll("mpi4py-hierarchical", "1g", 2, "hier", slots=2)]
    for c in colls:
        if c["profile"] == "unshaped":
            for r in c["rows"]:
                r["seconds"] /= 5
    training = [train("torch", "none", "unshaped", 1, 0.35), train("torch", "alone", "unshaped", 2, 0.6),
                train("torch", "alone", "unshaped", 4, 1.2), train("torch", "horovod", "unshaped", 2, 0.7),
                train("torch", "horovod", "unshaped", 4, 1.4), train("torch", "horovod", "1g", 2, 1.3),
                train("torch", "horovod", "1g", 4, 2.2), train("torch", "ddp", "1g", 4, 2.0),
                train("torch", "horovod", "1g", 4, 1.8, "mpi-ring"),
                train("torch", "horovod", "1g", 4, 1.5, "mpi-ring+fp16")]
    return {"quick": quick, "started": "2026-11-23 16:00 UTC", "duration_s": 1800, "hosts": 4,
            "netem_missing": "the kernel has no sch_netem",
            "tcp_payload_fraction": costmodel.TCP_PAYLOAD_FRACTION,
            "config": {"coll_sizes": [65536, 1 << 20, 64 << 20], "train_warmup": 3, "train_steps": 8,
                       "image_size": 32},
            "machine": {"cpu_model": "Test CPU", "cores": 2, "load_average_at_start": [1.0, 1.0, 1.0]},
            "profiles": {"unshaped": {"label": "unshaped (veth + bridge, no tc)", "rate_bit": None,
                                      "probe": {"rtt_s": 60e-6, "stream_bytes_per_s": 6e8}},
                         "1g": {"label": "1 Gbit/s + 0.2 ms", "rate_bit": 1e9, "delay_s_requested": 2e-4,
                                "delay_s_applied": 0.0,
                                "probe": {"rtt_s": 80e-6, "stream_bytes_per_s": 1.17e8}}},
            "models": {"resnet101": 44_549_160, "vgg16": 138_357_544},
            "collectives": colls, "training": training}


def test_cluster_report_renders_the_checks():
    from bench.reports.report import render

    res = fake_results(quick=False)
    res["cluster"] = fake_cluster()
    md = render(res)
    assert "## 6. Emulated cluster" in md
    assert "No delay or loss was applied" in md
    assert "Done-when check, 1 Gbit/s, 4 hosts, 64 MiB" in md
    assert "| mpi4py-param-server | 4 |" in md  # time vs N with its formula
    assert "1.00x" in md  # busiest link counted / formula
    assert "exchange efficiency (alone / step)" in md
    # horovod 1g at 4 hosts: alone 1.2 / 2.2; unshaped 1.4 / 2.2; one process 0.35 / 2.2
    assert "| 4 | horovod | 1 Gbit/s + 0.2 ms | 2.20 | 55% | 64% | 16% |" in md
    assert "The cost model against the training runs" in md
    assert "### 6.4 Projection to hundreds of workers" in md and "paper, 512 GPUs" in md
    assert "the paper's 90% inside that range" in md
    assert "NCCL or DDL" in md  # why --hierarchical-allreduce does nothing on CPU


def test_across_hosts_checks_judge_issue_41s_targets():
    import copy

    from bench.reports import report_cluster as rc

    cl = fake_cluster()
    # mpi4py's ring: what Horovod's ring takes, less half at 64 KiB (Horovod 2x there)
    for r in [c for c in cl["collectives"] if c["impl"] == "horovod-mpi-ring" and c["profile"] == "1g"]:
        theirs = copy.deepcopy(r)
        theirs["impl"] = "mpi4py-ring"
        theirs["rows"][0]["seconds"] /= 2
        cl["collectives"].append(theirs)
    ratios = rc.over_mpi4py(cl, "horovod-mpi-ring", 4)
    assert [k for k, _ in ratios] == [65536, 1 << 20, 64 << 20]
    assert [round(v, 6) for _, v in ratios] == [2.0, 1.0, 1.0]
    assert rc.within_from(ratios, 1.2) == 1 << 20
    assert rc.within_from([(65536, 1.0), (1 << 20, 1.3)], 1.2) is None  # the largest is over
    text = " ".join(rc.across_hosts(cl, 64 << 20))
    assert ("within 1.20x of `mpi4py-ring`'s time from 64 KiB up: **not met** (2 hosts: worst 2.00x "
            "(64 KiB), <= 1.20x from 1 MiB up; 4 hosts: worst 2.00x (64 KiB), <= 1.20x from 1 MiB "
            "up)") in text
    # ResNet-18 at 4 hosts: Horovod 2.2 s, DDP 2.0 s, Horovod on Open MPI's ring 1.8 s
    assert ("**not met** (as shipped (`launch.horovodrun`: Gloo across hosts) 0.91x at 4 hosts; "
            "with Open MPI's ring 1.11x at 4 hosts)" in " ".join(rc.ddp_check(cl)))
    ddp = next(r for r in cl["training"] if r["name"] == "torch/ddp/default/1g/h4x1")
    ddp["result"]["seconds_per_step"] = 2.2
    assert ": met (as shipped (`launch.horovodrun`: Gloo across hosts) 1.00x at 4 hosts;" in " ".join(
        rc.ddp_check(cl))
    # horovodrun's MPI default, where the run has it, is named beside the shipped (Gloo) one
    mpi = copy.deepcopy(next(r for r in cl["training"] if r["name"] == "torch/horovod/default/1g/h4x1"))
    mpi.update(variant="mpi", name="torch/horovod/mpi/1g/h4x1")
    mpi["result"]["seconds_per_step"] = 4.4
    cl["training"].append(mpi)
    assert "with horovodrun's MPI default 0.50x at 4 hosts;" in " ".join(rc.ddp_check(cl))
    from bench.reports.report import render

    res = fake_results(quick=False)
    res["cluster"] = cl
    md = render(res)
    assert md.index("Done-when check across hosts (issue 41), 1 Gbit/s") < md.index("### 6.2")
    check = md.index("Horovod's training step at >= 1.00x DDP's speed")
    assert md.index("### 6.3") < check < md.index("### 6.4")


def test_cluster_report_quick_and_skipped():
    from bench.reports.report import render

    res = fake_results(quick=True)
    res["cluster"] = fake_cluster(quick=True)
    md = render(res)
    assert "## 6. Emulated cluster" in md and "Projection" not in md
    assert "Done-when check" not in md and "exchange efficiency (alone / step)" not in md
    assert "| 2 | 1600 | n/a | 1800 | - | - | - | - |" in md  # section 1's ratios withheld
    res["cluster"] = {"skipped": "needs root"}
    assert "Not measured: needs root" in render(res)


def test_cluster_plots_render(tmp_path):
    pytest.importorskip("matplotlib")
    from bench.reports.plots import render_all

    res = fake_results(quick=False)
    res["cluster"] = fake_cluster()
    made = render_all(res, tmp_path)
    assert {"cluster_busbw", "cluster_time_vs_hosts", "cluster_training"} <= set(made)
    assert all((tmp_path / f).stat().st_size > 1000 for f in made.values())


# -- rerunning a few cluster cells, plain and prioritised (bench/parts/cluster_cells.py) ------------------

from bench.parts import cluster_cells  # noqa: E402
from bench.workers.coll_worker import parse_schedstat, sched_delta, sched_times  # noqa: E402


def test_schedstat_per_thread_and_the_busiest_thread():
    assert parse_schedstat("2500000000 500000000 42\n") == (2.5, 0.5)
    before = {"1": (1.0, 0.5), "2": (0.1, 0.1), "3": (9.0, 9.0)}
    after = {"1": (1.2, 0.6), "2": (1.0, 1.5), "4": (5.0, 5.0)}  # 3 ended, 4 started: neither counts
    d = sched_delta(before, after)
    assert d["threads"] == 2
    assert d["run_s"] == pytest.approx(1.1) and d["runqueue_wait_s"] == pytest.approx(1.5)
    assert (d["busiest_thread_run_s"], d["busiest_thread_wait_s"]) == pytest.approx((0.9, 1.4))
    live = sched_times()  # this process: its main thread at least, with time on a CPU
    assert live and max(run for run, _ in live.values()) > 0


def test_proc_stat_cpu_line():
    text = "cpu  100 5 50 1000 3 0 40 0 0 0\ncpu0 50 2 25 500 1 0 20 0 0 0\nintr 1\n"
    assert cluster_cells.parse_proc_stat(text) == {"user": 100, "nice": 5, "system": 50, "idle": 1000,
                                                   "iowait": 3, "irq": 0, "softirq": 40}
    with pytest.raises(ValueError):
        cluster_cells.parse_proc_stat("intr 1\n")
    now = cluster_cells.machine_cpu()
    assert now["user"] + now["system"] + now["idle"] > 0 and now["ksoftirqd"] >= 0


def test_cells_sizes_and_summary():
    assert cluster_cells.parse_size("64M") == 64 * 2 ** 20
    assert cluster_cells.parse_size("64KiB") == 65536 and cluster_cells.parse_size("4096") == 4096

    def cell(mode, rnd, seconds, ok=True):
        ranks = [{"wall_s": 2.0, "cpu_s": 1.0, "nice": -15 if mode == "nice" else 0,
                  "busiest_thread_run_s": 0.5 * (r + 1), "busiest_thread_wait_s": 0.2 * (r + 1)}
                 for r in range(2)]
        row = {"bytes": 2 ** 26, "seconds": seconds, "formula_seconds": 0.8, "busbw_of_link": 0.8 / seconds,
               "cpu_per_rank": ranks}
        return {"impl": "horovod-gloo", "hosts": 2, "mode": mode, "round": rnd, "ok": ok,
                "load_before": 15.0, "rows": [row] if ok else []}

    lines = cluster_cells.summarize([cell("plain", 0, 1.6), cell("nice", 0, 1.0), cell("plain", 1, 1.0),
                                     cell("nice", 1, 0.9, ok=False)])
    by_mode = {line["mode"]: line for line in lines}
    assert by_mode["plain"]["busbw_of_link"] == [0.5, 0.8]
    assert by_mode["plain"]["over_formula"] == [1.0, 0.25]
    assert by_mode["nice"]["busbw_of_link"] == [0.8]  # the failed round is left out, not zero
    assert by_mode["nice"]["nice"] == [-15]
    assert by_mode["plain"]["max_busiest_run_of_wall"] == [0.5, 0.5]
    assert by_mode["plain"]["max_busiest_wait_of_wall"] == [0.2, 0.2]
    assert by_mode["plain"]["ranks_cores"] == [1.0, 1.0]  # two ranks, each 1 CPU second in 2 s


def test_pinned_mode_gives_each_emulated_host_one_core_round_the_machine():
    """The ``pinned`` wrapper runs host hN's rank on the (N - 1)-th core it may use, round them
    (an emulated host's name is its hostname, in a UTS namespace of its own)."""
    import os
    import shutil
    import subprocess
    import sys

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a hostname of its own")
    allowed = sorted(os.sched_getaffinity(0))
    for n in (1, 2, 3):
        out = subprocess.run(["unshare", "--uts", "sh", "-c", f'hostname rcc-h{n} && exec "$@"', "sh",
                              *cluster_cells.MODES["pinned"], sys.executable, "-c",
                              "import os; print(sorted(os.sched_getaffinity(0)))"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        assert out.strip() == str([allowed[(n - 1) % len(allowed)]]), (n, out)


def test_cluster_cells_training_cells():
    run = cluster_cells.parse_train("horovod-gloo:HOROVOD_CYCLE_TIME=5;A=b=c", 4, "1g")
    assert (run.framework, run.wrapper, run.hosts, run.flags) == ("torch", "horovod", 4, ("--gloo",))
    assert run.env == (("HOROVOD_CYCLE_TIME", "5"), ("A", "b=c"))
    assert run.name == "torch/horovod/horovod-gloo+HOROVOD_CYCLE_TIME=5;A=b=c/1g/h4x1"
    ring = cluster_cells.parse_train("horovod-ring", 2, "1g")
    assert dict(ring.env)["OMPI_MCA_coll_tuned_allreduce_algorithm"] == "4" and ring.flags == ()
    assert cluster_cells.parse_train("ddp", 2, "1g").wrapper == "ddp"
    for bad in ("horovod-nccl", "horovod:NOVALUE", "horovod:=1"):
        with pytest.raises(ValueError):
            cluster_cells.parse_train(bad, 2, "1g")

    def cell(spec, hosts, rnd, seconds, ok=True):
        return {"spec": spec, "hosts": hosts, "round": rnd, "ok": ok,
                **({"result": {"seconds_per_step": seconds}} if ok else {})}

    lines = cluster_cells.summarize_training([
        cell("ddp", 2, 0, 0.6), cell("horovod", 2, 0, 0.75), cell("ddp", 2, 1, 0.5),
        cell("horovod", 2, 1, 0.5), cell("horovod", 4, 0, 1.0), cell("horovod", 2, 2, 0.4),
        cell("horovod-gloo", 2, 0, 0.1, ok=False)])
    by = {(line["spec"], line["hosts"]): line for line in lines}
    assert by["horovod", 2]["seconds_per_step"] == [0.75, 0.5, 0.4]
    # each round against that round's DDP; a round without DDP on as many hosts has no ratio
    assert by["horovod", 2]["speed_over_ddp"] == [0.8, 1.0]
    assert by["horovod", 4]["speed_over_ddp"] == [] and by["ddp", 2]["speed_over_ddp"] == [1.0, 1.0]
    assert by["horovod-gloo", 2]["seconds_per_step"] == []  # a failed cell is left out, not zero


# -- the headline and each section's date and build (bench/reports/report_headline.py, report_builds.py) -----

OLD, NEW = "0.28.1", "0.28.1+ringtrain.0123456789"


def dated_results(quick: bool = False) -> dict:
    """fake_results with each part's date and build: throughput on an older build, collectives on
    the newest, accuracy from before parts recorded theirs."""
    res = fake_results(quick)
    res["throughput"].update(started="2026-11-23 06:04 UTC", machine={"versions": {"horovod": OLD}})
    res["collectives"].update(started="2026-11-27 03:12 UTC", machine={"versions": {"horovod": NEW}})
    res["accuracy"]["started"] = "2026-11-23 08:23 UTC"
    return res


def section_text(md: str, number: str) -> str:
    """Section ``number`` of the report ("6.1": all of section 6), up to the next section."""
    start = md.index(f"\n## {number.split('.')[0]}. ")
    return md[start:md.index("\n## ", start + 1)]


def headline(md: str) -> dict[str, list[str]]:
    """The headline table: the cells after the first, by the first."""
    text = md[md.index("## Headline"):md.index("## Machine")]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines()
            if line.startswith("| ")]
    assert rows[0] == ["compared", "figure", "section", "measured", "Horovod build"]
    return {cells[0]: cells[1:] for cells in rows[1:]}


def test_headline_quotes_the_sections_figures_with_their_date_and_build():
    from bench.reports.report import render

    md = render(dated_results())
    assert md.index("# Benchmarks") < md.index("## Headline") < md.index("## Machine")
    rows = headline(md)
    # trainer 1600 img/s at -np 2 against 1200 at -np 1: 1600 / (2 x 1200); the section's cell
    assert rows["PyTorch trainer, scaling efficiency T(N) / (N x T(1))"] == [
        "67% at -np 2", "1", "2026-11-23", f"`{OLD}`"]
    assert "| 2 | 1600 | n/a | 1800 | 0.89x | 67% |" in md
    # Horovod's loop 1800 against DDP's 1900, as section 3 prints it
    assert rows["PyTorch: Horovod (MPI) / DDP (gloo, torchrun), images/s of the same loop"] == [
        "0.95x at -np 2", "3", "2026-11-23", f"`{OLD}`"]
    assert rows["Horovod (MPI) allreduce time / mpi4py's, 4 KiB, one host"] == [
        "1.00x at -np 2", "4", "2026-11-27", f"`{NEW}`"]
    assert "The current build is `0.28.1+ringtrain.0123456789`, that of the latest part measured " \
           "(collectives, 2026-11-27 03:12 UTC)" in md
    # parts missing from the results leave their rows out; TensorFlow was not measured
    assert {row[1] for row in rows.values()} == {"1", "3", "4"}
    assert not any(name.startswith("TensorFlow") for name in rows)


def test_headline_figures_are_in_their_sections_for_the_committed_results():
    """Every number the headline quotes from the committed results is printed in the section it
    names, with that part's date and build: the table is rendered by the sections' own functions
    from results.json, not typed in."""
    import re

    from bench.common import util
    from bench.reports import report, report_headline

    res = util.read_json(util.REPO / "bench" / "results" / "results.json")
    res["meta"]["plots_rel"] = "bench/results"  # what report.write adds
    md = report.render(res)
    table = headline(md)
    rows = report_headline.rows(res)
    assert len(table) == len(rows) and 8 <= len(rows) <= 18
    for r in rows:
        figure, number, measured, build = table[r.compared]
        part = res[r.part]
        assert measured == part["started"].split()[0]
        assert build == f"`{part['machine']['versions']['horovod']}`"
        numbers = re.findall(r"\d+\.\d+|\d+[x%]", figure)
        text = section_text(md, number)
        assert numbers and all(n in text for n in numbers), (r.compared, figure)


def test_a_section_on_an_older_build_says_so_and_one_on_the_newest_does_not():
    from bench.reports.report import render

    md = render(dated_results())
    older = (f"**Measured on an older build:** 2026-11-23 06:04 UTC, Horovod `{OLD}`; not rerun on "
             f"the current build, `{NEW}`.")
    for number in ("1", "2", "3"):  # the throughput part's three sections
        lines = section_text(md, number).splitlines()
        assert lines[3] == older, number  # heading, blank line, the note
    collectives = section_text(md, "4")
    assert f"Measured on the current build: 2026-11-27 03:12 UTC, Horovod `{NEW}`." in collectives
    assert "older build" not in collectives
    assert "Measured 2026-11-23 08:23 UTC, Horovod build not recorded." in section_text(md, "5")


def test_a_rerun_of_some_cells_dates_the_figures_it_holds():
    from bench.reports.report import render

    res = dated_results()
    res["cluster"] = fake_cluster()
    res["cluster"]["reruns"] = [{"cells": ["collectives"], "started": "2026-11-28 10:00 UTC", "command": "x",
                                 "machine": {"versions": {"horovod": "0.28.1+ringtrain.fedcba9876"}}}]
    md = render(res)
    row = headline(md)["Horovod's best ring, 64 MiB on 4 hosts' 1 Gbit/s + 0.2 ms links: busbw / "
                       "link rate (target >= 90%)"]
    assert row[1:] == ["6.1", "2026-11-28", "`0.28.1+ringtrain.fedcba9876`"]
    # the training cells were not rerun: their row keeps the part's own date
    ddp = headline(md)["PyTorch ResNet-18 on 1 Gbit/s + 0.2 ms links: Horovod's speed / DDP's (target >= "
                       "1.00x)"]
    assert ddp[1:3] == ["6.3", "2026-11-23"]
    assert ddp[0].startswith("as shipped (`launch.horovodrun`: Gloo across hosts) 0.91x at 4 hosts")
    assert row[0].endswith("(`horovod-mpi-ring`)") and row[0].split()[0] in section_text(md, "6")
    # the rerun's build is now the current one: the collectives part's build is older
    assert "**Measured on an older build:** 2026-11-27 03:12 UTC" in section_text(md, "4")
    assert ("Measured 2026-11-23 16:00 UTC, Horovod build not recorded (the collective cells again "
            "2026-11-28 10:00 UTC, Horovod `0.28.1+ringtrain.fedcba9876`).") in section_text(md, "6")


def test_quick_headline_withholds_its_figures():
    from bench.reports.report import render

    rows = headline(render(dated_results(quick=True)))
    assert rows and {row[0] for row in rows.values()} == {"-"}


def test_data_models_chooses_the_data_parts_models_and_refuses_the_unknown(capsys):
    from bench import __main__ as bench_main
    from bench.parts import owndata

    assert [m.name for m in owndata.full().only_models(["cnn"]).models] == ["cnn"]
    assert owndata.full().only_models(None).models == owndata.full().models
    assert owndata.full().with_rounds(5).rounds == 5 and owndata.full().with_rounds(None).rounds == 2
    for argv, needle in ((["--only", "data", "--data-models", "vgg"], "choose from cnn, resnet18"),
                         (["--only", "throughput", "--data-models", "cnn"], "use it with --only data"),
                         (["--only", "data", "--data-rounds", "0"], "a count of 1 or more"),
                         (["--only", "floor", "--data-rounds", "3"], "with --only data")):
        with pytest.raises(SystemExit) as ended:
            bench_main.main(argv)
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_cells_reruns_some_cells_of_the_pipeline_part_and_keeps_the_rest(tmp_path, capsys):
    """``--only pipeline --cells largest,schedules-s4``: only those cells are measured again;
    :func:`merge_rerun` puts them in place of the earlier run's (a schedule cell: the rows of its
    S), keeps the rest and records the rerun, which section 10 names with its load; a cell the
    part does not have, or --cells with more than one part, is one line."""
    from bench import __main__ as bench_main
    from bench.parts import model_parallel as mp
    from bench.reports.report_pipeline import reruns

    before = {"config": {"cells": list(mp.CELLS)}, "started": "2026-11-28 05:55 UTC",
              "schedules": [{"stages": 2, "micro": 1}, {"stages": 4, "micro": 1, "old": True}],
              "largest": {"old": True}, "memory": {"kept": True}}
    again = {"config": {"cells": ["schedules-s4", "largest"]}, "started": "2026-11-29 01:00 UTC",
             "schedules": [{"stages": 4, "micro": 1}], "largest": {"new": True},
             "load_before": [3.0, 2.0, 1.0], "load_after": [1.0, 1.0, 1.0]}
    merged = mp.merge_rerun(before, again, "python -m bench --only pipeline --cells x")
    assert merged["schedules"] == [{"stages": 2, "micro": 1}, {"stages": 4, "micro": 1}]
    assert merged["largest"] == {"new": True} and merged["memory"] == {"kept": True}
    (rerun,) = merged["reruns"]
    assert rerun["cells"] == ["schedules-s4", "largest"] and rerun["load_before"] == [3.0, 2.0, 1.0]
    said = reruns(merged, {"machine": {"cores": 2}})
    assert "S = 4 schedules, largest model tables are from a later run, 2026-11-29 01:00 UTC" in said
    assert "load above the 2 cores" in said
    (tmp_path / "pipeline.json").write_text("{}")
    for argv, needle in ((["--only", "pipeline", "--cells", "bubble"], "choose from schedules-s2"),
                         (["--only", "pipeline,ps", "--cells", "largest"],
                          "use it with --only cluster or --only pipeline"),
                         (["--only", "pipeline", "--cells", "largest", "--out",
                           str(tmp_path / "empty")], "holds no pipeline.json")):
        with pytest.raises(SystemExit) as ended:
            bench_main.main(argv)
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


# -- the output folder and the files bench writes (the cluster parts run as root) -------------------

def _entry_points(monkeypatch):
    """Every bench entry point that takes an output folder or file, as ``run(folder)``; whatever
    would start work past the argument checks is replaced by a failure, so that a folder that is
    not refused fails the test without launching anything."""
    import sys

    from bench import __main__ as bench_main
    from bench.parts import cluster_cells, owndata
    from bench.reports import report

    def started(*_args, **_kwargs):
        raise AssertionError("went past its argument checks into the run")

    monkeypatch.setattr(bench_main.machine, "describe", started)
    monkeypatch.setattr(owndata, "run_part", started)
    monkeypatch.setattr(cluster_cells.nh, "why_unavailable", started)
    monkeypatch.setattr(report, "write", started)

    def report_main(folder):
        monkeypatch.setattr(sys, "argv", ["report", "--out", str(folder)])
        return report.main()

    return {"bench": lambda d: bench_main.main(["--only", "collectives", "--out", str(d)]),
            "owndata": lambda d: owndata.main(["--scale", "smoke", "--out", str(d)]),
            "cluster_cells": lambda d: cluster_cells.main(["--out", str(d / "cells.json")]),
            "report": report_main}


def _refused(capsys, run, folder) -> str:
    with pytest.raises(SystemExit) as ended:
        run(folder)
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(folder) in err, err
    return err


@pytest.mark.skipif(os.geteuid() != 0, reason="another user's folder needs root")
@pytest.mark.parametrize("entry", ["bench", "owndata", "cluster_cells", "report"])
def test_another_users_folder_as_out_is_refused_in_one_line(tmp_path, monkeypatch, capsys, entry):
    """As root, --out in a folder another user made first (here ``nobody``'s, mode 0755) would let
    them plant symlinks where root writes, or the pictures the trainers read: exit 2, one line,
    nothing written into it."""
    import pwd

    try:
        nobody = pwd.getpwnam("nobody").pw_uid
    except KeyError:
        nobody = 65534
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chmod(theirs, 0o755)
    os.chown(theirs, nobody, nobody)
    err = _refused(capsys, _entry_points(monkeypatch)[entry], theirs)
    assert "belongs to nobody, not to you" in err or f"belongs to uid {nobody}" in err, err
    assert os.listdir(theirs) == []


@pytest.mark.parametrize("entry,mode", [("bench", "770"), ("bench", "757"), ("owndata", "775"),
                                        ("cluster_cells", "775"), ("report", "777")])
def test_a_folder_others_can_write_to_is_refused_as_out(tmp_path, monkeypatch, capsys, entry, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, int(mode, 8))
    err = _refused(capsys, _entry_points(monkeypatch)[entry], shared)
    assert f"is writable by others (mode {mode})" in err, err


def test_a_symlink_as_out_is_refused_and_a_missing_folder_is_made_private(tmp_path, monkeypatch, capsys):
    import stat

    from bench.common import util

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(mine)
    err = _refused(capsys, _entry_points(monkeypatch)["bench"], tmp_path / "link")
    assert "is a symlink" in err, err
    new = tmp_path / "a" / "b"
    assert util.private_dir(new) is None
    assert stat.S_IMODE(os.stat(new).st_mode) == stat.S_IMODE(os.stat(new.parent).st_mode) == 0o700


@pytest.mark.parametrize("writer", ["write_json", "run log", "write_bytes"])
def test_a_symlink_planted_at_a_results_file_is_replaced_not_followed(tmp_path, writer):
    """``<out>/machine.json`` planted as a symlink to another file: bench's write replaces the
    link with its own file (``mkstemp`` in the folder, ``os.replace``); the link's target is
    unchanged (``write_text`` wrote through the link)."""
    import json
    import stat
    import sys

    from bench.common import util

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    planted = out / "machine.json"
    planted.symlink_to(victim)
    if writer == "write_json":
        util.write_json(planted, {"cores": 2})
        assert json.loads(planted.read_text()) == {"cores": 2}
    elif writer == "run log":
        assert util.run([sys.executable, "-c", "print('hi')"], log=planted, timeout=60).ok
        assert "hi" in planted.read_text()
    else:
        util.write_bytes(planted, b"\x89PNG")
        assert planted.read_bytes() == b"\x89PNG"
    assert victim.read_text() == "precious\n"
    st = os.lstat(planted)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o644
    assert sorted(os.listdir(out)) == ["machine.json"]  # no temporary file left


def test_a_ratio_just_under_the_data_target_never_reads_as_the_target():
    """89.7% of the fixed batch misses a 90% target: the report says 89.7%, not 90%."""
    from bench.reports.report_data import pct_of_target

    assert pct_of_target(0.897) == "89.7%" and pct_of_target(0.9049) == "90%"
    assert pct_of_target(0.90) == "90%" and pct_of_target(0.84) == "84%" and pct_of_target(1.03) == "103%"


def test_a_part_says_whether_other_jobs_shared_the_cores_from_its_own_load():
    """Sections 9 and 10 ask readers to compare rows within the run; whether other jobs were
    running comes from the 1-minute load average the part recorded at its start, not a fixed
    sentence (a run on an idle machine was once reported as shared)."""
    import json
    from pathlib import Path

    from bench.common.tables import load_note
    from bench.reports import report_pipeline, report_ps

    busy = "load above the 2 cores at the start: other work ran beside it or just before"
    assert load_note([11.9, 9.6, 6.0], 2) == busy
    assert load_note([0.03, 0.8, 1.6], 2) == "no other job was running on the 2 cores"
    assert load_note(None, 2) == load_note([1.0], None) == "the load is not recorded"

    res = json.loads((Path(__file__).parent.parent / "bench/results/results.json").read_text())
    res["machine"]["cores"] = 2
    for part, key, render in (("pipeline", "load_before", report_pipeline.section),
                              ("ps", "load_average_at_start", report_ps.section)):
        res[part][key] = [0.5, 0.5, 0.5]
        assert "no other job was running on the 2 cores" in "\n".join(render(res)), part
        res[part][key] = [7.0, 5.0, 3.0]
        assert busy in "\n".join(render(res)), part


BENCH_FOLDERS = ("common", "parts", "workers", "reports")
LIBRARY = ("ringtrain", "launch", "torch_models", "tf_models")


def module_names(root) -> dict[str, list[str]]:
    """Every module (``x.py``) and package (a folder with ``__init__.py``) under ``root``, root
    included, by its name: ``{name: [paths]}`` (``__init__`` and ``__main__`` are not names)."""
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        if path.name == "__init__.py":
            name, where = path.parent.name, path.parent
        elif path.name == "__main__.py":
            continue
        else:
            name, where = path.stem, path
        found.setdefault(name, []).append(str(where.relative_to(root.parent)))
    return found


def test_bench_modules_live_in_their_folders_and_share_no_name_with_the_library():
    """bench/ is the entry point (``python -m bench``) and four folders; no module or package of
    it is named like one of ringtrain/, launch/, torch_models/ or tf_models/ (a ``bench/ps.py``
    beside ``ringtrain/strategies/ps/`` read as the same thing), nor like another of bench/."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    bench = repo / "bench"
    missing = [f for f in BENCH_FOLDERS if not (bench / f / "__init__.py").is_file()]
    assert not missing, f"bench/ lacks the packages {missing}"
    flat = sorted(p.name for p in bench.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not flat, f"put {flat} in one of bench/{{{','.join(BENCH_FOLDERS)}}}/ (bench/README.md)"
    ours = module_names(bench)
    library: dict[str, list[str]] = {}
    for top in LIBRARY:
        for name, paths in module_names(repo / top).items():
            library.setdefault(name, []).extend(paths)
    assert library.keys() >= {"cluster", "jobs", "ps", "pipeline", "collectives"}  # the check sees them
    clashes = {name: ours[name] + library[name] for name in sorted(ours.keys() & library.keys())}
    assert not clashes, f"bench modules named like library modules (rename them): {clashes}"
    twice = {name: paths for name, paths in ours.items() if len(paths) > 1}
    assert not twice, f"bench modules sharing a name: {twice}"


def test_an_optimizers_cell_is_its_median_launch_and_renders_the_range():
    """bench.parts.update_cost: a cell of N launches is the one whose largest rank's peak is the
    median (the lower middle of an even count), every launch's largest peak kept; a failed launch
    fails the cell; section 12.1 shows the median and the range."""
    from bench.parts.update_cost import median_run
    from bench.reports.report_optimizers import section

    def run(peaks, ips=10.0):
        return {"ok": True, "peak_rss_mib": peaks, "images_per_second": ips}

    cell = median_run([run([900, 1000], 1.0), run([1300, 1200], 2.0), run([1100, 1050], 3.0)])
    assert cell["peak_rss_mib"] == [1100, 1050] and cell["images_per_second"] == 3.0
    assert cell["largest_peaks_mib"] == [1000, 1300, 1100] and cell["runs"] == 3
    assert median_run([run([2]), run([1])])["peak_rss_mib"] == [1]
    bad = median_run([run([1]), {"ok": False, "error": "boom"}])
    assert not bad["ok"] and bad["error"] == "boom"
    cell.update(framework="tf", optimizer="adamw", np=2, sharded=True, state_bytes_formula=2**20)
    md = "\n".join(section({"optimizers": {"update": {
        "cells": [cell], "depth": 1, "width": 2, "params": 3, "weight_bytes": 2**20, "batch": 4,
        "steps": 5}}}))
    assert "| 1100 (1000-1300) |" in md and "median of 3 launches" in md
