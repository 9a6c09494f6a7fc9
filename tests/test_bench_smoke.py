"""Every benchmark entry point at its smallest size, so that an import or API drift fails here and
not in the next full run of the suite.

* each part of ``python -m bench --smoke`` (throughput, collectives, accuracy, floor, pipeline,
  ps, optimizers;
  as root the cluster), ``--profile`` (its samples where py-spy is installed), and SIGTERM to the driver;
* every worker the parts launch: ``bench/workers/torch_loop.py``, ``bench/workers/tf_loop.py`` and
  ``bench/workers/rankexec.py`` (throughput, floor), ``bench/workers/coll_worker.py`` (collectives,
  floor, cluster, and its hierarchical mode here), ``bench/workers/bigmodel_torch.py`` and
  ``bench/workers/bigmodel_tf.py`` (here, with each wrapper that starts or exchanges differently,
  and in the cluster), ``bench/workers/linkprobe.py`` (here, and in the cluster);
* ``python -m bench.parts.cluster_cells`` (as root), ``python -m bench.reports.report``, and
  ``bench/workers/memlimit.py`` (in the pipeline part).

What is asserted is what the report needs and what the runs must get right (every record ok, each
rank accounted for, the sums an allreduce must produce, identical weights on every rank after an
exchange), never a speed.  Output goes to ``tmp_path``; ``bench/results`` and ``BENCHMARKS.md`` are
checked untouched.  Every launch runs in its own process group under a time limit (:func:`launch`:
SIGTERM, then SIGKILL to the group); the network-namespace hosts are checked removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import BIN, REPO, requires_horovod

from bench.common import netns_hosts, util
from bench.parts import smoke

PY = sys.executable
LIMIT = 300  # seconds for one launch (a smoke part runs several, each under smoke.TIMEOUT_S)
pytestmark = [requires_horovod, pytest.mark.timeout(LIMIT + 60)]  # tests that launch more say so
GUARDED = [REPO / "BENCHMARKS.md", *sorted((REPO / "bench" / "results").glob("*.json")),
           *sorted((REPO / "bench" / "results").glob("*.png"))]


def digest(paths: list[Path]) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.exists() else "" for p in paths}


@pytest.fixture(scope="module", autouse=True)
def results_untouched():
    """No smoke run may write into the committed results or the report."""
    before = digest(GUARDED)
    yield
    assert digest(GUARDED) == before, "a smoke run wrote into bench/results or BENCHMARKS.md"


def launch(cmd: list[str], tmp_path: Path, timeout: float = LIMIT) -> str:
    """Run ``cmd`` in its own process group; fail with its output's tail unless it exits 0.  Past
    ``timeout``: SIGTERM first (``python -m bench`` then kills its running job and tears its
    hosts down), SIGKILL to the group 30 s later; whatever is left in the group is killed."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=util.base_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        util.kill_group(proc, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            util.kill_group(proc)
            out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {' '.join(cmd)}\n{util.tail(out, 60)}")
    finally:
        util.kill_group(proc)
    (tmp_path / "launch.log").write_text(f"$ {' '.join(cmd)}\n{out}")
    if proc.returncode != 0:
        pytest.fail(f"rc={proc.returncode}: {' '.join(cmd)}\n{util.tail(out, 60)}")
    return out


def bench(tmp_path: Path, *args: str, timeout: float = LIMIT) -> tuple[Path, str]:
    """``python -m bench --smoke --out tmp_path/out ARGS``: the results folder and the report."""
    out = tmp_path / "out"
    launch([PY, "-m", "bench", "--smoke", "--out", str(out), *args], tmp_path, timeout)
    md = out / "BENCHMARKS.md"
    return out, md.read_text() if md.exists() else ""


def failed(records: list[dict]) -> str:
    return "\n".join(f"{r.get('name') or r.get('impl') or r.get('label')}: {r.get('error')}"
                     for r in records if not r.get("ok", True))


# -- the parts ---------------------------------------------------------------------------------

@pytest.mark.timeout(2 * LIMIT + 60)
def test_throughput_part(tmp_path):
    out, md = bench(tmp_path, "--only", "throughput", timeout=2 * LIMIT)
    runs = json.loads((out / "throughput.json").read_text())["runs"]
    assert [r["name"] for r in runs] == smoke.THROUGHPUT_RUNS
    assert all(r["ok"] for r in runs), failed(runs)
    for r in runs:
        assert r["images_per_second"] > 0, r
        # bench/workers/rankexec.py wrapped every rank of every launcher and recorded its peak memory
        assert len(r["peak_rss_mib"]) == r["np"] and min(r["peak_rss_mib"]) > 0, r
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["quick"] and results["throughput"]["runs"] == runs
    assert "## 1. Training throughput and scaling" in md and "QUICK MODE" in md


def test_collectives_part(tmp_path):
    out, md = bench(tmp_path, "--only", "collectives")
    runs = json.loads((out / "collectives.json").read_text())["runs"]
    assert {r["impl"] for r in runs} == {"horovod-mpi", "horovod-gloo", "mpi4py-allreduce", "torch-gloo",
                                         "mpi4py-param-server"}
    assert all(r["ok"] for r in runs), failed(runs)
    for r in runs:
        assert r["controller"] == ("gloo" if r["impl"] in ("horovod-gloo", "torch-gloo") else "mpi"), r
        (row,) = r["rows"]
        assert row["bytes"] == 4096 and row["seconds"] > 0 and row["busbw"] > 0
    ps = next(r for r in runs if r["impl"] == "mpi4py-param-server")["rows"][0]
    assert ps["moved_bytes_per_rank"][0] == [4096, 4096]  # the server's own count: (N-1) x K each way
    assert "## 4. Allreduce" in md


def test_accuracy_part(tmp_path):
    out, md = bench(tmp_path, "--only", "accuracy")
    acc = json.loads((out / "accuracy.json").read_text())
    assert [r["framework"] for r in acc["runs"]] == ["torch", "tf"]
    assert all(r["ok"] for r in acc["runs"]), failed(acc["runs"])
    for r in acc["runs"]:
        # the trainer's epoch line was parsed, and the job was stopped there: the target (0%) was met
        assert r["epoch_reached"] == 1 and r["stopped_at_target"], r
        assert [e["epoch"] for e in r["epochs"]] == [1] and 0 <= r["epochs"][0]["test_accuracy"] <= 1
    assert "## 5. Time to 0% test accuracy" in md


# The pipeline part in two launches of the driver (``--smoke --cells``: a subset alone, nothing
# to merge into): CI runs the first, which holds what the part exists to show; the second's cells
# measure flags whose behaviour CI proves elsewhere (tests/ci_share.py).
PIPELINE_CELLS = ("schedules-s2,versus_dp,memory", "largest,stage_memory,partition,link")


@pytest.mark.timeout(LIMIT + 60)
def test_pipeline_part(tmp_path):
    """A schedule run, pipeline against data parallel, and the memory cells (the same model under
    the same cap: S = 1 fails to allocate, S = 2 trains, each rank holding about half the
    weights); the part's section renders from them alone."""
    out, md = bench(tmp_path, "--only", "pipeline", "--cells", PIPELINE_CELLS[0])
    data = json.loads((out / "pipeline.json").read_text())
    assert data["config"]["cells"] == ["schedules-s2", "versus_dp", "memory"]
    (sched,) = data["schedules"]
    assert sched["ok"], sched.get("error")
    assert sched["formula_bubble"] == pytest.approx(1 / 3) and 0 <= sched["measured_bubble"] < 1
    assert [r["ok"] for r in data["versus_dp"]] == [True, True], failed(data["versus_dp"])
    s1, s2 = data["memory"]["cells"]
    assert not s1["ok"] and s1["allocation_failed"], s1.get("error")
    assert s2["ok"], s2.get("error")
    whole = data["memory"]["weight_bytes"]
    assert sum(s2["param_bytes"]) == whole and max(s2["param_bytes"]) < 0.6 * whole
    assert len(s2["ranks"]) == 2 and all(r["peak_rss_bytes"] > 0 for r in s2["ranks"])
    assert not {"largest", "stage_memory", "partition", "link"} & set(data)
    assert "## 10. Model parallelism" in md


@pytest.mark.timeout(2 * LIMIT + 60)
def test_pipeline_part_cells(tmp_path):
    """The rest of the pipeline part: the largest model under a cap (one probe at S = 1 and 2),
    the peak memory per stage, the partition by time against by parameters and, as root, the
    bytes on a link between two hosts."""
    out, md = bench(tmp_path, "--only", "pipeline", "--cells", PIPELINE_CELLS[1],
                    timeout=2 * LIMIT)
    data = json.loads((out / "pipeline.json").read_text())
    assert "schedules" not in data and "memory" not in data
    largest = data["largest"]["cells"]  # one probe each, which trained
    assert [c["stages"] for c in largest] == [1, 2] and all(c.get("largest_params") for c in largest), \
        largest
    assert all(c["ok"] for c in data["stage_memory"]["cells"]), failed(data["stage_memory"]["cells"])
    by_mode = {c["partition"]: c for c in data["partition"]["cells"]}
    assert sorted(by_mode) == ["params", "time"] and all(c["ok"] for c in by_mode.values()), \
        failed(data["partition"]["cells"])
    link = data.get("link")
    if link is not None and "skipped" not in link:
        assert [r["kind"] for r in link["rows"]] == ["data-parallel", "pipeline"]
        assert all(r["ok"] for r in link["rows"]), link["rows"]
        # The kernel counted the formula's bytes, within what time-proportional traffic (Horovod's
        # coordination, heartbeats) moves between two runs of 1 and 2 steps: the pipeline's cut
        # measured 0.94 of its formula in such a smoke run on a loaded machine, 1.01 over 5 and
        # 15 steps (the report's).  Off by 2x would be a wrong formula or a wrong counter.
        for r in link["rows"]:
            for counted in (r["tx_per_step"], r["rx_per_step"]):
                assert 0.5 * r["formula_each_way"] <= counted <= 2 * r["formula_each_way"], r
    assert "## 10. Model parallelism" in md


def test_floor_part(tmp_path):
    """Every cell kind of the floor part once: the allreduce on both loops (0.28.1's and the
    patched one) and mpi4py, fusion, a waiting rank, the trainer, the loop and DDP on the patched
    loop; section 7 renders."""
    out, md = bench(tmp_path, "--only", "floor")
    fl = json.loads((out / "floor.json").read_text())
    for key in ("collectives", "fusion", "wait", "training"):
        assert fl[key] and all(c["ok"] for c in fl[key]), failed(fl[key])
    assert {(c["impl"], c["loop"]) for c in fl["collectives"]} == {
        ("horovod-mpi", "upstream"), ("horovod-mpi", "patched"), ("mpi4py", "-")}
    for rec in fl["fusion"]:  # the counters saw the step's gradients go through allreduce calls
        for rank in rec["per_rank"]:
            assert rank["allreduce_calls_per_step"] >= 1
            assert rank["tensors_per_call"] * rank["allreduce_calls_per_step"] == rec["gradients"]
    assert {r["wrapper"] for r in fl["training"]} == {"horovod", "ddp"}
    assert all(r["images_per_second"] > 0 for r in fl["training"])
    assert "## 7." in md and "QUICK MODE" in md


@pytest.mark.timeout(3 * LIMIT + 60)
def test_ps_part(tmp_path):
    """Parameter servers: one staleness cell, the straggler wrapper around the servers, and (as
    root) the link cells, ring and servers, on two namespace hosts; section 9 renders."""
    out, md = bench(tmp_path, "--only", "ps", timeout=3 * LIMIT)
    part = json.loads((out / "ps.json").read_text())
    cells = part["staleness"] + part["straggler"] + part["link"].get("rows", [])
    assert all(c["ok"] for c in cells), failed(cells)
    (cell,) = part["staleness"]
    assert cell["applied"] == 2 * (256 // 2 // 32) and cell["staleness_max"] >= 0
    assert [r["label"] for r in part["straggler"]] == ["ps staleness 4"]
    assert all(r["seconds_to_target"] is not None for r in part["straggler"])  # the target is 0%
    if netns_hosts.why_unavailable() is None:
        assert {(r["strategy"], r["hosts"]) for r in part["link"]["rows"]} == {("ring", 2), ("ps", 2)}
        assert all(r["rx_per_step"] > 0 and r["tx_per_step"] > 0 for r in part["link"]["rows"])
    else:
        assert "skipped" in part["link"]
    assert "## 9. Parameter servers" in md and "### 9.3" in md


def test_optimizers_part(tmp_path):
    """Each kind of run once (PyTorch, a small MLP with AdamW unsharded and sharded at -np 2; the
    CNN in fp32 and bf16 at -np 1): every rank's peak memory recorded, the formula's state per
    rank halved by sharding at R = 2, and section 12 renders both tables."""
    out, md = bench(tmp_path, "--only", "optimizers", "--frameworks", "torch")
    data = json.loads((out / "optimizers.json").read_text())
    cells = data["update"]["cells"]
    assert [(c["optimizer"], c["np"], c["sharded"]) for c in cells] == [("adamw", 2, False),
                                                                        ("adamw", 2, True)]
    assert all(c["ok"] for c in cells), failed(cells)
    assert all(len(c["peak_rss_mib"]) == 2 and min(c["peak_rss_mib"]) > 0 for c in cells)
    plain, shard = cells
    assert shard["state_bytes_formula"] * 2 == plain["state_bytes_formula"] == \
        2 * data["update"]["weight_bytes"]
    assert "saved_bytes" in shard and shard["saved_bytes_formula"] == data["update"]["weight_bytes"]
    prec = data["precision"]["cells"]
    assert [c["precision"] for c in prec] == ["fp32", "bf16"] and all(c["ok"] for c in prec), \
        failed(prec)
    assert "## 12. Optimizers" in md and "### 12.1" in md and "### 12.2" in md


def test_fault_recovery_part_measures_and_renders(tmp_path):
    """The fault_recovery part without a process (its real run is ~1 min per strategy on 2 cores):
    each strategy's job is built as docs/fault-tolerance.md runs it (victim never rank 0), the
    arithmetic of :func:`bench.parts.fault_recovery.measure` on recorded events, and section 11
    renders every strategy's row, a failed one included."""
    from bench.parts import fault_recovery as fr
    from bench.reports.report_fault_recovery import section

    cfg = fr.smoke()
    assert cfg.strategies == ["ring"] and fr.quick().strategies == list(fr.STRATEGIES)
    for strategy in fr.STRATEGIES:
        cmd, env, victim = fr.command(cfg, strategy, tmp_path / strategy)
        assert victim != 0 and "--stall-timeout" in cmd and "--checkpoint-dir" in cmd
        assert ("--no-progress" in cmd) == (strategy == "elastic")  # the others strike on the bar
    assert "--enable-recovery" not in fr.command(cfg, "ps", tmp_path / "p")[0]  # the launcher adds it
    assert fr.command(cfg, "ps", tmp_path / "p")[0][2].endswith(".horovodrun")  # ringtrain's launcher
    assert fr.BAR.search("\x1b[0mepoch 2/4 [###.....] 5/48 loss 0.3").groups() == ("2", "4", "5", "48")
    # ring: killed at step 5 of epoch 2, resumed after epoch 1: 5 steps redone; from scratch: 53
    assert fr.fixed_lost_steps(2, 5, 48, 1) == 5 and fr.fixed_lost_steps(2, 5, 48, None) == 53
    assert fr.elastic_lost_steps(9.6, 8, 4) == 1.6 and fr.elastic_lost_steps(20, 8, 4) == 4.0
    assert fr.elastic_lost_steps(3, 8, 4) == 0.0
    r = fr.measure("ring", kill_t=30.0, clean_wall=50.0, clean_step_s=0.1, fault_wall=75.5,
                   recovered_t=48.25, lost_steps=5)
    assert (r["to_training_again_s"], r["lost_work_s"], r["seconds_lost"]) == (18.25, 0.5, 25.5)
    ps = fr.measure("ps", kill_t=30.0, clean_wall=50.0, clean_step_s=0.1, fault_wall=52.0,
                    recovered_t=30.5, lost_steps=0, applied=256, expected_applied=256, exactly_once=True)
    assert ps["no_update_lost"] and ps["lost_work_s"] == 0
    assert not fr.measure("ps", kill_t=1, clean_wall=1, clean_step_s=1, fault_wall=1, recovered_t=None,
                          lost_steps=0, applied=255, expected_applied=256,
                          exactly_once=True)["no_update_lost"]
    r.update(ok=True, kill_epoch=2, kill_step=5, resumed_from_epoch=1, job_end_after_kill_s=1.5,
             resume_start_up_s=16.8, victim=1)
    el = fr.measure("elastic", kill_t=20.0, clean_wall=40.0, clean_step_s=0.1, fault_wall=45.0,
                    recovered_t=22.0, lost_steps=1.6)
    el.update(ok=True, victim=1, rollback_step=8, lost_steps_bound=4,
              resizes=[{"world_size": 2}, {"world_size": 1}])
    ps.update(ok=True, victim=3, lost=[{"rank": 3, "epoch": 2}])
    part = {"config": cfg.to_dict(), "load_average_at_start": [1.0, 1.0, 1.0],
            "rows": [r, el, ps, {"strategy": "pipeline", "ok": False, "error": "x"}]}
    md = "\n".join(section({"fault_recovery": part, "machine": {"cores": 2}}))
    assert "## 11. Seconds lost to one killed rank" in md
    assert "| ring, fixed + `--resume` | 18.2 | 5 steps, 0.5 s | 50.0 | 75.5 | 25.5 |" in md
    assert "world 2 -> 1, rolled back to step 8" in md and "0 (every gradient applied once: 256/256)" in md
    assert "| pipeline S=2 + `--resume` | failed |" in md
    assert section({}) == []


def test_profile(tmp_path):
    """``--profile RUN`` runs that run alone, wrapped for py-spy on rank 0; without py-spy (not in
    the test extra) the run still goes through that path, and the test skips what needs samples."""
    out, _ = bench(tmp_path, "--profile", "torch/loop/none/synthetic/np1")
    prof = json.loads((out / "profile.json").read_text())
    assert prof["target"] == "torch/loop/none/synthetic/np1" and prof["run"]["ok"] and prof["run"]["profiled"]
    if (shutil.which("py-spy", path=str(BIN)) or shutil.which("py-spy")) is None:
        pytest.skip("py-spy is not installed (the bench extra: pip install -e '.[bench]'): the run went "
                    "through --profile but nothing was sampled")
    assert prof["pyspy"]["samples"] > 0 and prof["pyspy"]["categories"]


def processes_naming(folder: Path, but: int) -> dict[int, list[str]]:
    """Live processes (other than ``but``) whose command line names something under ``folder``."""
    found = {}
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        pid = int(cmdline.parent.name)
        if any(str(folder) in arg for arg in argv) and pid != but:
            found[pid] = argv
    return found


def test_sigterm_ends_the_running_job(tmp_path):
    """SIGTERM to ``python -m bench`` (a CI timeout, a scheduler) ends the job it is running too,
    ranks included, though jobs run in their own session, out of the signal's reach."""
    out = tmp_path / "out"
    proc = subprocess.Popen([PY, "-m", "bench", "--smoke", "--only", "collectives", "--out", str(out)],
                            cwd=REPO, env=util.base_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        def ranks() -> list[int]:
            return [pid for pid, argv in processes_naming(out, proc.pid).items()
                    if argv[1:3] == ["-m", "bench.workers.coll_worker"]]

        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline and not ranks():
            time.sleep(0.1)
        assert proc.poll() is None, "the part ended before a rank started"
        assert ranks(), "no rank started in 120 s"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30  # horovodrun's middleman gives mpirun 5 s to end its ranks
        while processes_naming(out, proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not processes_naming(out, proc.pid), processes_naming(out, proc.pid)
    finally:
        util.kill_group(proc)
        proc.wait()
        for pid in processes_naming(out, proc.pid):  # what the test failed over, ended all the same
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- the workers the cluster part launches, here on one host -------------------------------------

# float32 gradients: torchvision's ResNet-18, and bigmodel_tf's 4-tensor ``tiny``
# (3x3x3x8 + 8, 8 x 1000 + 1000)
GRADIENT_BYTES = {"resnet18": 11_689_512 * 4, "tiny": 9_224 * 4}


@pytest.mark.parametrize("framework,wrapper,model,np", [
    ("torch", "alone", "resnet18", 2), ("torch", "horovod", "resnet18", 2), ("torch", "ddp", "resnet18", 2),
    ("tf", "horovod", "tiny", 2)])
def test_bigmodel_worker(framework, wrapper, model, np, tmp_path):
    """Each wrapper that starts or exchanges differently (``none`` is ``alone`` without its TCP
    barrier; the barrier is shared code), on the cluster's ResNet-18 for PyTorch and on ``tiny``
    for Keras: tracing ResNet-50's step is a minute of CPU, Keras's part of the code is the same."""
    result = tmp_path / "result.json"
    inner = [PY, "-m", f"bench.workers.bigmodel_{framework}", "--wrapper", wrapper, "--model", model,
             "--batch-size", "2", "--warmup-steps", "1", "--steps", "1", "--out", str(result)]
    if wrapper == "horovod":
        launch([str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", *inner], tmp_path)
    elif wrapper == "ddp":
        launch(util.torchrun(np, inner), tmp_path)
    else:  # as the cluster starts them: one process per rank, env:// variables
        port = str(util.free_port())
        envs = [util.base_env(RANK=str(r), WORLD_SIZE=str(np), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                for r in range(np)]
        res = util.run_parallel([inner] * np, envs, timeout=LIMIT, log=tmp_path / "launch.log")
        assert res.ok, util.tail(res.output, 60)
    doc = json.loads(result.read_text())
    assert doc["world_size"] == np and doc["timed_steps"] == 1 and doc["seconds_per_step"] > 0
    assert doc["model"] == model and doc["gradient_bytes"] == GRADIENT_BYTES[model]
    if wrapper in ("none", "alone"):
        assert len(doc["weight_sums"]) == 1
    else:  # ranks start from different seeds and batches: the exchange made them equal
        assert len(doc["weight_sums"]) == np and len(set(doc["weight_sums"])) == 1, doc


@pytest.mark.parametrize("impl", ["hier", "mpi4py-negotiated"])
def test_coll_worker_cluster_only_impls(tmp_path, impl):
    """The implementations only the cluster's cells use: ``hier`` (2 ranks per host; on one host,
    the two-level allreduce is a reduce and a broadcast on that host) and ``mpi4py-negotiated``
    (Horovod's coordination round, then the data's allreduce).  The worker checks every sum and
    fails on a wrong one; each rank records its host and the cores it may run on."""
    result = tmp_path / "result.json"
    launch(util.mpirun(2, [PY, "-m", "bench.workers.coll_worker", "--impl", impl, "--sizes", "4096,65536",
                           "--warmup", "1", "--reps", "1", "--out", str(result)]), tmp_path)
    doc = json.loads(result.read_text())
    assert doc["world_size"] == 2 and [r["bytes"] for r in doc["rows"]] == [4096, 65536]
    assert all(len(r["cpu_per_rank"]) == 2 for r in doc["rows"])
    ranks = [rank for r in doc["rows"] for rank in r["cpu_per_rank"]]
    assert all(rank["cores"] and rank["host"].startswith("net:") for rank in ranks)


def test_linkprobe(tmp_path):
    port = str(util.free_port())
    server = subprocess.Popen([PY, "-m", "bench.workers.linkprobe", "server", "127.0.0.1", port], cwd=REPO,
                              env=util.base_env(), start_new_session=True)
    try:
        out = launch([PY, "-m", "bench.workers.linkprobe", "client", "127.0.0.1", port], tmp_path,
                     timeout=120)
        assert server.wait(timeout=30) == 0  # the server ends when the client hangs up
    finally:
        util.kill_group(server)
        server.wait()
    probe = json.loads(out.strip().splitlines()[-1])
    assert probe["stream_bytes"] == 64 << 20 and len(probe["streams_bytes_per_s"]) == 3
    assert probe["rtt_s"] > 0 and probe["stream_bytes_per_s"] == max(probe["streams_bytes_per_s"])


# -- the report ------------------------------------------------------------------------------------

def test_report_renders_the_committed_results_to_the_committed_report(tmp_path):
    """``python -m bench.reports.report`` on a copy of bench/results renders BENCHMARKS.md byte for byte:
    the report cannot drift from its generator or its data (after changing either, run
    ``python -m bench.reports.report``)."""
    results = tmp_path / "bench" / "results"
    results.mkdir(parents=True)
    for name in ("results.json", "profile.json"):
        if (REPO / "bench" / "results" / name).exists():
            shutil.copy(REPO / "bench" / "results" / name, results / name)
    launch([PY, "-m", "bench.reports.report", "--out", str(results),
            "--markdown", str(tmp_path / "BENCHMARKS.md")], tmp_path, timeout=120)
    rendered = (tmp_path / "BENCHMARKS.md").read_text()
    assert rendered == (REPO / "BENCHMARKS.md").read_text(), (
        "BENCHMARKS.md is not what `python -m bench.reports.report` renders from bench/results: re-render it")
    assert {p.name for p in results.glob("*.png")} >= {"scaling.png", "bandwidth.png", "accuracy.png"}


# -- as root: the emulated cluster -----------------------------------------------------------------

def namespaces() -> set[str]:
    proc = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


@pytest.fixture
def netns_root():
    """Skip where network-namespace hosts cannot be made; afterwards, none of the run's are left."""
    reason = netns_hosts.why_unavailable()
    if reason:
        pytest.skip(f"the emulated cluster cannot be made here: {reason}")
    before = namespaces()
    yield
    left = {ns for ns in namespaces() - before if ns.startswith(("rtc-", "rcc-"))}
    for prefix in ("rtc-", "rcc-"):  # a killed run's hosts must not outlive the test either
        netns_hosts.remove_stale(prefix)
    assert not left, f"network namespaces left behind: {left}"


@pytest.mark.timeout(2 * LIMIT + 60)
def test_cluster_part(tmp_path, netns_root):
    """The smoke cells rerun (``--cells collectives,tf``) over a copy of the committed cluster part:
    they replace its collectives and Keras rows, its PyTorch rows stay, the rerun is recorded."""
    committed = json.loads((REPO / "bench" / "results" / "cluster.json").read_text())
    (tmp_path / "out").mkdir()
    shutil.copy(REPO / "bench" / "results" / "cluster.json", tmp_path / "out" / "cluster.json")
    out, md = bench(tmp_path, "--only", "cluster", "--cells", "collectives,tf", timeout=2 * LIMIT)
    cl = json.loads((out / "cluster.json").read_text())
    assert "skipped" not in cl, cl.get("skipped")
    assert [r for r in cl["training"] if r["framework"] == "torch"] == [
        r for r in committed["training"] if r["framework"] == "torch"]
    rerun = cl["reruns"][-1]
    assert rerun["cells"] == ["collectives", "tf"] and "--cells collectives,tf" in rerun["command"]
    assert "The collective and Keras training cells were measured again" in md
    cl = {**cl, "profiles": rerun["profiles"]}  # the smoke run's own link probes
    assert set(cl["profiles"]) == {"unshaped", "1g"}
    for name, prof in cl["profiles"].items():
        assert prof["probe"].get("stream_bytes_per_s", 0) > 0, (name, prof["probe"])
    assert all(c["ok"] for c in cl["collectives"]), failed(cl["collectives"])
    assert {c["impl"] for c in cl["collectives"]} == set(smoke.cluster_config().coll_impls)
    for c in cl["collectives"]:
        (row,) = c["rows"]
        assert row["hosts_seen"] == 2  # one rank in each host's namespace
        assert row["busiest_link_bytes"] >= 64 * 1024  # counted by the kernel on the host's link
    (train,) = [r for r in cl["training"] if r["framework"] == "tf"]
    assert train["ok"], train.get("error")
    assert train["name"] == "tf/horovod/default/1g/h2x1"
    sums = train["result"]["weight_sums"]
    assert len(sums) == 2 and sums[0] == sums[1]
    assert "## 6. Emulated cluster" in md


def test_cluster_cells(tmp_path, netns_root):
    result = tmp_path / "cells.json"
    launch([PY, "-m", "bench.parts.cluster_cells", "--hosts", "2", "--sizes", "64K", "--impls", "mpi4py-ring",
            "--modes", "plain,nice,pinned", "--rounds", "1", "--out", str(result)], tmp_path)
    doc = json.loads(result.read_text())
    modes = [(c["mode"], c["ok"]) for c in doc["cells"]]
    assert modes == [("plain", True), ("nice", True), ("pinned", True)], doc["cells"]
    lines = {line["mode"]: line for line in doc["summary"]}
    # the nice mode really ran every rank at nice -15, the plain one at 0
    assert lines["nice"]["nice"] == [-15] and lines["plain"]["nice"] == [0]
    # the pinned mode ran each host's rank on a core of its own, round the cores it may use
    pinned = [rank["cores"] for rank in doc["cells"][2]["rows"][0]["cpu_per_rank"]]
    allowed = sorted(os.sched_getaffinity(0))
    assert sorted(pinned) == sorted([[allowed[h % len(allowed)]] for h in range(2)]), pinned
    assert (tmp_path / "tmp" / "cells").is_dir()  # its work files went next to --out
