"""The fault matrix (docs/fault-tolerance.md): every fault ends in recovery (elastic) or in a
non-zero exit within --stall-timeout + 30 s, one line naming the rank or host and the fault, no
rank process left, and the newest checkpoint loadable.

Faults are real: SIGSTOP/SIGKILL of a rank, the veth link between two network-namespace hosts
taken down or DROPped with iptables mid-epoch, iptables random loss plus a tbf rate limit on one
host (tc netem where the kernel has it), a tmpfs too small for the next checkpoint.

CI runs the cells marked "ci" below (3.5 min here at load 5-7, with the fast checks of the
pieces); the full matrix (46 tests; the 38 that existed then took 47 min here at load 9-25,
the 6 elastic cross-host cells added later 5.4 min) runs with
``RINGTRAIN_FAULTS=all pytest tests/test_faults.py``.  ``RINGTRAIN_FAULT_LOG=FILE`` appends one
JSON line per cell with the measured time from the fault to the outcome (docs/fault-tolerance.md's
table comes from such a run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import BIN, REPO, launch_cmd, mounted_tmpfs, requires_horovod

from ringtrain.output import checkpoint

pytestmark = requires_horovod

FULL = os.environ.get("RINGTRAIN_FAULTS") == "all"
full_matrix = pytest.mark.skipif(not FULL, reason="full fault matrix only: RINGTRAIN_FAULTS=all")
MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
EXT = {"torch": "pt", "tf": "npz"}
STALL = 10  # --stall-timeout of every job here
BOUND = STALL + 30  # what the issue allows from the fault to the end of the job
# Long enough to still be training when we strike: many short epochs, a checkpoint after each.
LONG = ["--train-samples", "1024", "--test-samples", "200", "--batch-size", "32", "--epochs", "200",
        "--no-progress", "--stall-timeout", str(STALL)]


def cells(*specs):
    """Parameters for pytest: the CI cells as they are, the others behind RINGTRAIN_FAULTS=all."""
    return [spec if spec[-1] == "ci" else pytest.param(*spec, marks=full_matrix)
            for spec in specs]


def record(cell: str, outcome: str, seconds: float | None, detected: float | None = None) -> None:
    """Print (pytest -s) and log the measured time to the outcome (and to the first line that
    named the fault, where there is one)."""
    line = {"cell": cell, "outcome": outcome, "seconds": None if seconds is None else round(seconds, 1),
            "detected": None if detected is None else round(detected, 1)}
    print(f"MEASURED {json.dumps(line)}")
    if os.environ.get("RINGTRAIN_FAULT_LOG"):
        with open(os.environ["RINGTRAIN_FAULT_LOG"], "a") as fh:
            fh.write(json.dumps(line) + "\n")


class Job:
    """A running job whose output lines are collected as they arrive; its processes carry
    ``marker`` (the test's tmp folder) in their command line."""

    def __init__(self, cmd: list[str], marker: str, module: str, env: dict | None = None):
        self.marker, self.module = marker, module
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env, cwd=REPO, start_new_session=True,
                                     stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (time.monotonic())
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.rank_pids: set[int] = set()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def first_error_after(self, t0: float) -> float | None:
        """Seconds from ``t0`` to the first line that says ``error:``."""
        pairs = zip(self.times, self.lines, strict=False)  # the reader may be mid-line
        return next((t - t0 for t, ln in pairs if "error: " in ln and t >= t0), None)

    def ranks(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if self.module in cmd and any(self.marker in part for part in cmd):
                found.append(proc)
        self.rank_pids |= {p.pid for p in found}
        return found

    def rank(self, r: int) -> psutil.Process:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for proc in self.ranks():
                with contextlib.suppress(psutil.Error):
                    env = proc.environ()
                    if str(r) in (env.get("OMPI_COMM_WORLD_RANK"), env.get("HOROVOD_RANK")):
                        return proc
            time.sleep(0.5)
        self.kill()
        pytest.fail(f"rank {r} not found:\n{self.output()[-3000:]}")

    def guardians(self) -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            module = "ringtrain.faults.guardian"
            if module in cmd and int(cmd[cmd.index(module) + 1]) in self.rank_pids:
                found.append(proc)
        return found

    def wait_for_file(self, folder: Path, pattern: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not list(folder.glob(pattern)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never saw {folder}/{pattern}:\n{self.output()[-3000:]}")
            time.sleep(0.3)
        self.ranks()

    def wait_exit(self, limit: float) -> tuple[int, float]:
        """(exit status, seconds waited); fails (and kills the job) past ``limit``."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"job still running {limit:.0f} s after the fault:\n{self.output()[-3000:]}")
        self.reader.join(timeout=10)
        print(self.output())  # shown by pytest -s, or with a failure below
        return self.proc.returncode, time.monotonic() - t0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for proc in self.ranks() + self.guardians():
            with contextlib.suppress(psutil.Error):
                proc.kill()


@pytest.fixture
def jobs():
    """Every job a test starts is killed at its end, whatever happened."""
    started: list[Job] = []
    yield started
    for job in started:
        job.kill()


def error_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "error: " in ln]


def assert_one_line(job: Job, *needles: str) -> str:
    lines = error_lines(job.output())
    assert len(lines) == 1, job.output()[-4000:]
    for needle in needles:
        assert re.search(needle, lines[0]), lines[0]
    return lines[0]


def assert_nothing_left(job: Job, within: float = 15) -> None:
    """No rank and no guardian of this job is left (a rank cut off from the launcher must end
    itself: it gets ``within`` seconds)."""
    deadline = time.monotonic() + within
    while (job.ranks() or job.guardians()) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [(p.pid, " ".join(p.cmdline()[:4])) for p in job.ranks() + job.guardians()
            if p.is_running()]
    assert not left, f"processes left running: {left}"


def assert_newest_checkpoint_loads(ckpt: Path, framework: str) -> int:
    """The newest complete checkpoint parses and carries consistent metadata; returns its epoch."""
    assert not list(ckpt.glob(".*.tmp")), "a half-written checkpoint was left behind"
    path = checkpoint.latest(ckpt, EXT[framework])
    assert path is not None, f"no checkpoint in {ckpt}"
    if framework == "torch":
        import torch

        meta = torch.load(path, map_location="cpu", weights_only=True)["meta"]
    else:
        with np.load(path, allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
    epoch = checkpoint.check_metadata(meta, path, framework, "mnist-cnn-v1", 184_586)
    assert f"{epoch:04d}" in path.name
    return epoch


def training_job(framework: str, controller: str, tmp_path: Path, jobs: list) -> tuple[Job, Path]:
    """A long 2-rank job on this host, once its first checkpoint exists (it is training)."""
    module, ckpt = MODULES[framework], tmp_path / "ckpt"
    how = "horovodrun" if controller == "mpi" else "gloo"
    job = Job(launch_cmd(module, [*LONG, "--checkpoint-dir", str(ckpt)], np=2, how=how),
              str(tmp_path), module)
    jobs.append(job)
    job.wait_for_file(ckpt, f"ckpt-epoch*.{EXT[framework]}")
    return job, ckpt


# --- 1. a frozen rank (SIGSTOP) ------------------------------------------------------------------

@pytest.mark.parametrize("framework,controller,victim,tier", cells(
    ("torch", "mpi", 1, "ci"), ("torch", "gloo", 1, "ci"),
    ("tf", "mpi", 1, "full"), ("tf", "gloo", 1, "full"),
    ("torch", "mpi", 0, "full"), ("torch", "gloo", 0, "full")))
def test_frozen_rank_ends_the_job(framework, controller, victim, tier, tmp_path, jobs):
    """SIGSTOP one rank mid-training: under MPI the coordinator is blocked in MPI and Horovod's
    stall check never runs (the job ran forever before the watchdog); under Gloo Gloo's own 30 s
    timeout ended it with a traceback per rank.  Now: non-zero exit within --stall-timeout +
    30 s, one line naming the frozen rank, nothing left, the newest checkpoint loadable."""
    job, ckpt = training_job(framework, controller, tmp_path, jobs)
    job.rank(victim).send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    rc, took = job.wait_exit(BOUND + 30)
    record(f"frozen rank {victim}/{framework}/{controller}/fixed", f"exit {rc}", took,
           job.first_error_after(t0))
    assert rc != 0
    assert took <= BOUND, f"{took:.0f} s from SIGSTOP to the end of the job"
    assert_one_line(job, rf"rank {victim} \(", "frozen")
    assert_nothing_left(job)
    assert_newest_checkpoint_loads(ckpt, framework)


@pytest.mark.parametrize("framework,controller,fault,tier", cells(
    ("torch", "mpi", "sigkill", "full"), ("torch", "gloo", "sigkill", "full"),
    ("tf", "mpi", "sigkill", "full"), ("tf", "gloo", "sigkill", "full"),
    ("tf", "mpi", "exception", "full"), ("tf", "gloo", "exception", "full")))
def test_killed_rank_ends_the_job(framework, controller, fault, tier, tmp_path, jobs):
    """Rank 1 killed (SIGKILL) or raising (KeyboardInterrupt from SIGINT): the launcher ends the
    job at once.  (tests/test_fault_tolerance.py checks the torch cells in CI; these add TF and
    the measured times.)"""
    job, ckpt = training_job(framework, controller, tmp_path, jobs)
    job.rank(1).send_signal(signal.SIGKILL if fault == "sigkill" else signal.SIGINT)
    t0 = time.monotonic()
    rc, took = job.wait_exit(BOUND + 30)
    record(f"killed rank 1 ({fault})/{framework}/{controller}/fixed", f"exit {rc}", took,
           job.first_error_after(t0))
    assert rc != 0 and took <= BOUND
    out = job.output()
    if fault == "exception":
        assert "rank 1 interrupted" in out, out[-3000:]
    elif controller == "mpi":
        assert re.search(r"rank 1 .*exited on signal 9", out.replace("\n", " ")), out[-3000:]
    assert len(error_lines(out)) <= 1, out[-3000:]
    assert_nothing_left(job)
    assert_newest_checkpoint_loads(ckpt, framework)


@pytest.mark.parametrize("framework,fault,tier", cells(
    ("torch", "sigstop", "ci"), ("tf", "sigstop", "full"), ("torch", "sigkill", "full"),
    ("tf", "sigkill", "full")))
def test_frozen_worker_is_lost_and_the_elastic_job_recovers(framework, fault, tier, tmp_path):
    """SIGSTOP one of two elastic workers: its guardian kills it after --stall-timeout (Horovod's
    driver re-forms only once every worker has reported, and a stopped one never does), the
    survivor rolls back to its last commit and finishes alone.  (SIGKILL: the same without the
    wait; tests/test_elastic.py covers it with either rank killed.)"""
    from test_elastic import ElasticJob, check_trained, world_sizes

    job = ElasticJob(tmp_path, MODULES[framework], ["localhost:1", "127.0.0.1:1"], np=2, max_np=2,
                     epochs=3, extra=["--stall-timeout", str(STALL)])
    try:
        job.wait_for(r"epoch 1/3:")
        workers = job.workers("localhost") + job.workers("127.0.0.1")
        victim = [p for p in workers if p.environ().get("HOROVOD_RANK") == "1"]
        assert len(victim) == 1, [p.environ().get("HOROVOD_RANK") for p in workers]
        victim[0].send_signal(signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        t0 = time.monotonic()
        job.wait_for(r"elastic: 1 worker", timeout=BOUND + 60)
        what = "frozen worker" if fault == "sigstop" else "killed worker"
        record(f"{what}/{framework}/gloo/elastic", "recovered", time.monotonic() - t0)
        summary = job.finish()
    finally:
        job.kill()
    assert world_sizes(summary) == [2, 1]
    resumed = summary["elastic_resizes"][1]
    assert resumed["consumed"] % (4 * 32 * 2) == 0, "rolled back to a commit (every 4 steps)"
    check_trained(summary, 3)
    if fault == "sigstop":
        assert [ln for ln in error_lines(job.output()) if "is frozen" in ln and "rank 1 " in ln], \
            job.output()[-3000:]
    assert not victim[0].is_running() or victim[0].status() == psutil.STATUS_ZOMBIE


# --- 2. a network partition, 3. a lossy, slow link: two network-namespace hosts ------------------

def cross_host_job(hosts, controller: str, module: str, args: list[str], marker: str) -> Job:
    """``horovodrun -np 2 -H rt-hosta:1,rt-hostb:1`` started on host A, as tests/test_multihost.py
    does (--disable-cache: the ssh checks of an earlier, gone pair of hosts must not count)."""
    a, b = hosts.hosts
    cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", "2", "-H", f"{a.name}:1,{b.name}:1",
           "--ssh-identity-file", str(hosts.identity_file), "--disable-cache", "--start-timeout", "60",
           "--network-interfaces", hosts.iface, sys.executable, "-m", module, *args]
    return Job(hosts.cmd_in(a, cmd), marker, module, env={"PATH": hosts.env()["PATH"]})


def sh(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{' '.join(cmd)}: {proc.stderr}"


@contextlib.contextmanager
def partition(hosts, how: str):
    """Cut host B off: its veth end down, or every packet through it DROPped by iptables;
    undone on exit."""
    b = hosts.b
    if how == "link-down":
        undo = ["ip", "-n", b.netns, "link", "set", hosts.iface, "up"]
        sh(["ip", "-n", b.netns, "link", "set", hosts.iface, "down"])
    else:
        if shutil.which("iptables") is None:
            pytest.skip("iptables is not installed (apt-get install iptables)")
        rules = [["INPUT", "-i", hosts.iface, "-j", "DROP"], ["OUTPUT", "-o", hosts.iface, "-j", "DROP"]]
        for rule in rules:
            sh(hosts.cmd_in(b, ["iptables", "-A", *rule]))
        undo = None
    try:
        yield
    finally:
        if undo:
            subprocess.run(undo, capture_output=True, timeout=30)
        else:
            for rule in rules:
                subprocess.run(hosts.cmd_in(b, ["iptables", "-D", *rule]), capture_output=True,
                               timeout=30)
        hosts.kill_strays()


@pytest.mark.parametrize("framework,controller,how,tier", cells(
    ("torch", "mpi", "link-down", "ci"), ("torch", "gloo", "drop", "full"),
    ("torch", "mpi", "drop", "full"), ("torch", "gloo", "link-down", "full"),
    ("tf", "mpi", "link-down", "full"), ("tf", "gloo", "drop", "full")))
def test_partition_between_hosts_ends_the_job(hosts, framework, controller, how, tier, tmp_path,
                                              jobs):
    """Mid-epoch, host B (rank 1) is cut off from host A (rank 0, and the launcher).  TCP sees
    nothing (no reset, just silence), so every rank would wait forever; now rank 0 names rank 1
    on host B as unreachable and ends the job, and rank 1, which cannot reach anyone, ends
    itself."""
    module, ckpt = MODULES[framework], tmp_path / "ckpt"
    job = cross_host_job(hosts, controller, module, [*LONG, "--checkpoint-dir", str(ckpt)],
                         str(tmp_path))
    jobs.append(job)
    job.wait_for_file(ckpt, f"ckpt-epoch*.{EXT[framework]}")
    rank1 = job.rank(1)
    with partition(hosts, how):
        t0 = time.monotonic()
        rc, took = job.wait_exit(BOUND + 30)
        record(f"partition ({how})/{framework}/{controller}/fixed", f"exit {rc}", took,
               job.first_error_after(t0))
        # the rank on host B must end itself: nothing can reach it to kill it
        with contextlib.suppress(psutil.Error):
            rank1.wait(timeout=max(1, BOUND - (time.monotonic() - t0)))
        rank1_gone = time.monotonic() - t0
        assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE, \
            f"rank 1 on host B still running {rank1_gone:.0f} s after the partition"
        assert_nothing_left(job)
    assert rc != 0
    assert took <= BOUND, f"{took:.0f} s from the partition to the end of the job"
    assert_one_line(job, r"rank 1 \(", "unreachable", rf"{hosts.b.name}|{hosts.b.addr}")
    assert_newest_checkpoint_loads(ckpt, framework)


@contextlib.contextmanager
def lossy_slow_link(hosts):
    """10% loss and 200 ms delay on host B's side of the link: tc netem where the kernel has it;
    else (this machine's kernel has no sch_netem) iptables' random 10% DROP plus a tbf rate limit
    of 20 Mbit/s that queues up to 200 ms.  Undone on exit.  Returns a description."""
    b, dev = hosts.b, hosts.iface
    netem = subprocess.run(["tc", "-n", b.netns, "qdisc", "add", "dev", dev, "root", "netem",
                            "loss", "10%", "delay", "200ms"], capture_output=True, text=True)
    rule = None
    if netem.returncode == 0:
        what = "tc netem loss 10% delay 200ms"
    else:
        if shutil.which("iptables") is None:
            pytest.skip("no tc netem in this kernel and no iptables (apt-get install iptables)")
        sh(["tc", "-n", b.netns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "20mbit",
            "burst", "32kb", "latency", "200ms"])
        rule = ["OUTPUT", "-o", dev, "-m", "statistic", "--mode", "random", "--probability", "0.1",
                "-j", "DROP"]
        sh(hosts.cmd_in(b, ["iptables", "-A", *rule]))
        what = "iptables random 10% DROP + tc tbf 20mbit, 200 ms queue"
    try:
        yield what
    finally:
        subprocess.run(["tc", "-n", b.netns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        if rule:
            subprocess.run(hosts.cmd_in(b, ["iptables", "-D", *rule]), capture_output=True)


@pytest.mark.parametrize("framework,controller,tier", cells(
    ("torch", "gloo", "full"), ("torch", "mpi", "full"), ("tf", "mpi", "full"), ("tf", "gloo", "full")))
def test_lossy_slow_link_trains_on_to_the_same_weights(hosts, framework, controller, tier, tmp_path,
                                                       jobs):
    """A lossy, slow link to host B is not a dead rank: the job trains on, slower, and ends with
    bit for bit the weights of the same job over the clean link (TCP hides the loss; the math is
    the same)."""
    module = MODULES[framework]
    args = ["--train-samples", "512", "--test-samples", "200", "--batch-size", "32", "--epochs", "2",
            "--no-progress", "--stall-timeout", str(STALL)]
    results = {}
    for label in ("clean", "lossy"):
        out = tmp_path / f"{label}.json"
        job = cross_host_job(hosts, controller, module, [*args, "--metrics-out", str(out)],
                             str(tmp_path))
        jobs.append(job)
        with lossy_slow_link(hosts) if label == "lossy" else contextlib.nullcontext("clean") as what:
            rc, took = job.wait_exit(300)
        assert rc == 0 and not error_lines(job.output()), job.output()[-3000:]
        results[label] = json.loads(out.read_text())
        results[label]["wall"] = took
        hosts.kill_strays()
    clean, lossy = results["clean"], results["lossy"]
    record(f"lossy link ({what})/{framework}/{controller}/fixed",
           f"trained on, same weights; {clean['total_seconds']:.1f} s of training over the clean "
           f"link", lossy["total_seconds"])
    assert len(set(lossy["param_checksums"])) == 1
    assert lossy["param_checksums"] == clean["param_checksums"]
    assert [e["train_loss"] for e in lossy["epochs"]] == [e["train_loss"] for e in clean["epochs"]]


def elastic_cross_host_job(hosts, module: str, args: list[str], tmp_path: Path) -> tuple[Job, Path]:
    """An elastic job (``--min-np 1 --max-np 2``) with one worker on each host, started on host A
    with the discovery script listing both; returns it and its metrics file."""
    a, b = hosts.hosts
    tmp_path.mkdir(exist_ok=True)
    hosts_file, metrics = tmp_path / "hosts.txt", tmp_path / "metrics.json"
    hosts_file.write_text(f"{a.name}:1\n{b.name}:1\n")
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(REPO / "launch" / "discover_hosts.sh"),
           "--ssh-identity-file", str(hosts.identity_file), "--network-interfaces", hosts.iface,
           sys.executable, "-m", module, "--elastic", *args, "--metrics-out", str(metrics)]
    env = {"PATH": hosts.env()["PATH"], "RINGTRAIN_HOSTS": str(hosts_file),
           "OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // 2))}
    return Job(hosts.cmd_in(a, cmd), str(tmp_path), module, env=env), metrics


def wait_for_line(job: Job, pattern: str, timeout: float) -> float:
    """Seconds waited until a line of ``job`` matches ``pattern``; fails (and kills it) past
    ``timeout`` or if the job ends first."""
    t0 = time.monotonic()
    while not any(re.search(pattern, ln) for ln in list(job.lines)):
        if job.proc.poll() is not None or time.monotonic() - t0 > timeout:
            job.kill()
            pytest.fail(f"never saw {pattern!r}:\n{job.output()[-4000:]}")
        time.sleep(0.2)
    return time.monotonic() - t0


def worker_on(job: Job, host) -> psutil.Process:
    found = [p for p in job.ranks() if p.environ().get("HOROVOD_HOSTNAME") == host.name]
    assert len(found) == 1, (host.name, [p.environ().get("HOROVOD_HOSTNAME") for p in job.ranks()])
    return found[0]


ELASTIC_JOB = ["--train-samples", "1536", "--test-samples", "500", "--batch-size", "32",
               "--no-progress", "--commit-every", "4", "--seed", "3", "--stall-timeout", str(STALL)]


@pytest.mark.parametrize("framework,how,tier", cells(
    ("torch", "link-down", "ci"), ("tf", "drop", "full"), ("torch", "drop", "full"),
    ("tf", "link-down", "full")))
def test_partition_cuts_off_an_elastic_worker_and_the_job_recovers(hosts, framework, how, tier,
                                                                   tmp_path, jobs):
    """Host B is cut off from an elastic job mid-run.  Horovod's driver learns that a remote
    worker ended only when its ssh session ends, which a partition never made happen: the job
    was still running 120 s after the cut.  Now ssh's keepalive (our Horovod patch) ends the
    session, Gloo's timeout releases host A's worker from its collective, and the job re-forms
    on host A from its last commit and finishes; the worker on host B leaves by itself."""
    from test_elastic import check_trained, world_sizes

    job, metrics = elastic_cross_host_job(hosts, MODULES[framework], [*ELASTIC_JOB, "--epochs", "3"],
                                          tmp_path)
    jobs.append(job)
    wait_for_line(job, r"epoch 1/3:", timeout=300)
    victim = worker_on(job, hosts.b)
    with partition(hosts, how):
        t0 = time.monotonic()
        took = wait_for_line(job, r"elastic: 1 worker", timeout=BOUND + 60)
        record(f"partition ({how})/{framework}/gloo/elastic", "recovered", took)
        rc, _ = job.wait_exit(240)
        # nothing can reach host B to stop its worker: it must leave by itself (its watchdog)
        with contextlib.suppress(psutil.Error):
            victim.wait(timeout=max(1, 30 + 2 * BOUND - (time.monotonic() - t0)))
        assert not victim.is_running() or victim.status() == psutil.STATUS_ZOMBIE, \
            f"the worker on host B still runs {time.monotonic() - t0:.0f} s after the partition"
    assert rc == 0, job.output()[-4000:]
    summary = json.loads(metrics.read_text())
    assert world_sizes(summary) == [2, 1]
    assert summary["elastic_resizes"][1]["consumed"] % (4 * 32 * 2) == 0, "rolled back to a commit"
    check_trained(summary, 3)


@pytest.mark.parametrize("framework,tier", cells(("torch", "full"), ("tf", "full")))
def test_lossy_slow_link_does_not_shrink_an_elastic_job(hosts, framework, tier, tmp_path, jobs):
    """A lossy, slow link to host B is not a lost worker: the elastic job keeps both workers
    (never re-forms) and ends with bit for bit the weights of the same job over the clean link."""
    from test_elastic import world_sizes

    results = {}
    for label in ("clean", "lossy"):
        job, metrics = elastic_cross_host_job(
            hosts, MODULES[framework], [*ELASTIC_JOB, "--train-samples", "512", "--epochs", "2"],
            tmp_path / label)
        jobs.append(job)
        with lossy_slow_link(hosts) if label == "lossy" else contextlib.nullcontext("clean") as what:
            rc, took = job.wait_exit(300)
        assert rc == 0 and not error_lines(job.output()), job.output()[-3000:]
        results[label] = json.loads(metrics.read_text())
        hosts.kill_strays()
    clean, lossy = results["clean"], results["lossy"]
    record(f"lossy link ({what})/{framework}/gloo/elastic",
           f"trained on with 2 workers, same weights; {clean['total_seconds']:.1f} s of training "
           f"over the clean link", lossy["total_seconds"])
    assert world_sizes(lossy) == world_sizes(clean) == [2]
    assert len(set(lossy["param_checksums"])) == 1
    assert lossy["param_checksums"] == clean["param_checksums"]
    assert [e["train_loss"] for e in lossy["epochs"]] == [e["train_loss"] for e in clean["epochs"]]


# --- 4. a full disk during a checkpoint save ----------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs: room for one checkpoint (1.5 MB) but not for the next one's temp file."""
    with mounted_tmpfs(tmp_path / "ckpt", "2m") as folder:
        yield folder


@pytest.mark.parametrize("framework,mode,tier", cells(
    ("torch", "fixed", "ci"), ("tf", "fixed", "full"), ("torch", "elastic", "full"),
    ("tf", "elastic", "full")))
def test_full_disk_keeps_the_previous_checkpoint_and_trains_on(framework, mode, tier, small_disk,
                                                               tmp_path, jobs):
    """The disk fills up during the second save: one warning line per lost save naming the
    checkpoint that is still intact, the job trains on to the end (the choice documented in
    docs/fault-tolerance.md), no temp file is left and the previous checkpoint loads."""
    args = ["--train-samples", "512", "--test-samples", "200", "--batch-size", "32",
            "--no-progress", "--stall-timeout", str(STALL), "--checkpoint-dir", str(small_disk)]
    if mode == "fixed":
        job = Job(launch_cmd(MODULES[framework], [*args, "--epochs", "3"], np=2), str(tmp_path),
                  MODULES[framework])
        jobs.append(job)
        rc, _ = job.wait_exit(400)
        out = job.output()
        assert rc == 0, out[-3000:]
    else:
        from test_elastic import ElasticJob

        elastic = ElasticJob(tmp_path, MODULES[framework], ["localhost:2"], np=2, max_np=2, epochs=3,
                             extra=args)
        try:
            elastic.finish()
        finally:
            elastic.kill()
        out = elastic.output()
    warnings = [ln for ln in out.splitlines() if "warning: checkpoint" in ln]
    assert len(warnings) == 2, out[-3000:]  # epochs 2 and 3
    assert "ckpt-epoch0002" in warnings[0] and "No space left on device" in warnings[0], warnings[0]
    assert "ckpt-epoch0001" in warnings[0] and "intact" in warnings[0], warnings[0]
    assert not error_lines(out), out[-3000:]
    assert re.search(r"epoch 3/3: ", out), out[-3000:]
    assert assert_newest_checkpoint_loads(small_disk, framework) == 1
    record(f"full disk/{framework}/{'mpi' if mode == 'fixed' else 'gloo'}/{mode}",
           "warned at the failed save, trained on", None)


# --- 5. parameter servers (--strategy ps): a dead worker, a dead server ------------------------------

# With its progress bar (server 0 draws it; mpirun gives rank 0 a terminal): the test strikes at a
# step of epoch 2.  Striking a fixed time after epoch 1's checkpoint hit the epoch's end in 2 of
# 3 runs once an epoch took 1 s, and a worker dying in an epoch's end (its collectives) ends the
# job (docs/parameter-servers.md).
PS_JOB = ["--train-samples", "3072", "--test-samples", "200", "--batch-size", "32", "--epochs", "4",
          "--stall-timeout", str(STALL), "--strategy", "ps"]
PS_STRIKE = re.compile(r"epoch 2/4 \[[#.]*\] (\d+)/(\d+)")


def ps_job(tmp_path: Path, jobs: list, np_: int, args: list[str],
           launcher: str = "launch.horovodrun", strike: bool = True) -> tuple[Job, Path]:
    """A parameter-server job of ``np_`` ranks on this host, once its first checkpoint exists
    (``strike``: once a few steps of epoch 2 are trained; else as soon as it starts):
    through ringtrain's launcher as a user runs it (no extra flag: it passes mpirun what the
    servers need to outlive a worker), or plain ``horovodrun``."""
    module, ckpt, metrics = MODULES["torch"], tmp_path / "ckpt", tmp_path / "m.json"
    start = ([sys.executable, "-m", "launch.horovodrun"] if launcher == "launch.horovodrun"
             else [str(BIN / "horovodrun")])
    cmd = [*start, "-np", str(np_), "-H", f"localhost:{np_}", sys.executable, "-m", module, *PS_JOB,
           *args, "--checkpoint-dir", str(ckpt), "--metrics-out", str(metrics)]
    job = Job(cmd, str(tmp_path), module)
    jobs.append(job)
    deadline, seen = time.monotonic() + 300, 0
    while strike:  # a few steps into epoch 2, well before its end
        lines = job.lines[seen:]
        seen += len(lines)
        if any((m := PS_STRIKE.search(ln)) and 3 <= int(m.group(1)) <= int(m.group(2)) // 2
               for ln in lines):
            break
        if job.proc.poll() is not None or time.monotonic() > deadline:
            job.kill()
            pytest.fail(f"never saw epoch 2's first steps:\n{job.output()[-3000:]}")
        time.sleep(0.05)
    job.ranks()
    return job, metrics


def assert_trained_on_without(job: Job, metrics: Path, rank: int, staleness: str,
                              workers: int) -> dict:
    """Exit 0, no error line, one warning from server 0 naming the lost worker, every epoch
    trained, the summary naming it (and when), each pushed gradient applied once."""
    out = job.output()
    assert not error_lines(out), out[-3000:]
    warned = [ln for ln in out.splitlines() if f"warning: worker rank {rank} (" in ln]
    assert len(warned) == 1 and f"--staleness {staleness} trains on with {workers - 1} worker(s)" \
        in warned[0], out[-3000:]
    summary = json.loads(metrics.read_text())
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2, 3, 4]
    ps = summary["ps"]
    assert ps["lost_workers"] == [rank] and [x["rank"] for x in ps["lost"]] == [rank], ps
    assert ps["lost"][0]["epoch"] >= 2 and ps["exactly_once"], ps
    assert f"ps: lost worker rank {rank} in epoch {ps['lost'][0]['epoch']}" in out, out[-3000:]
    # every batch of the 4 epochs applied once (3072 samples in batches of 32, whatever the
    # shards): the lost worker's gradients that arrived, the batch it held trained by another
    assert ps["gradients_applied"] == [4 * 3072 // 32], ps
    assert summary["final_test_accuracy"] > 0.5
    return summary


@pytest.mark.parametrize("staleness,tier", cells(("4", "ci"), ("0", "full"), ("inf", "full")))
def test_a_dead_worker_is_trained_on_without_at_any_staleness(staleness, tier, tmp_path, jobs):
    """``python -m launch.horovodrun -np 4 ... --strategy ps --ps-servers 1 --staleness K`` with
    no extra flag, worker rank 3 SIGKILLed in epoch 2: server 0 hears its heartbeat stop, drops it
    from the staleness bound (the others, who may not run more than K steps ahead of it, go on),
    says so in one warning line, the others take its batches, the LR follows the 2 workers
    left, and the job ends normally (exit 0: rank 0's, which the launcher reports where mpirun's
    recovery would say 0 anyway) with every epoch trained and the lost worker named in the
    summary, with when."""
    job, metrics = ps_job(tmp_path, jobs, 4, ["--ps-servers", "1", "--staleness", staleness])
    job.rank(3).send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, took = job.wait_exit(240)
    warned = next((t - t0 for t, ln in zip(job.times, job.lines, strict=False)
                   if "warning: worker rank 3 (" in ln), None)
    record(f"killed worker/torch/launch.horovodrun/ps {staleness}", f"exit {rc}, trained on", took,
           warned)
    assert rc == 0, job.output()[-3000:]
    assert_trained_on_without(job, metrics, 3, staleness, 3)
    assert_nothing_left(job)


@pytest.mark.parametrize("staleness,launcher,tier", cells(
    ("0", "launch.horovodrun", "ci"), ("4", "horovodrun", "full")))
def test_a_frozen_worker_is_dropped_and_leaves_when_it_wakes_up(staleness, launcher, tier,
                                                                 tmp_path, jobs):
    """Worker rank 2 of 3 frozen (SIGSTOP) in epoch 2.  Through ``python -m launch.horovodrun``:
    server 0 drops it after half the --stall-timeout (one warning line), the others train on;
    continued (SIGCONT) once dropped, the worker is told so by the servers and leaves with a
    warning line of its own, without ending anyone; the job ends normally.  Under plain
    ``horovodrun`` (no --enable-recovery, so mpirun would end every rank once the frozen one's
    guardian kills it) the job ends within --stall-timeout + 30 s in one line naming it and
    saying what the launcher needs."""
    job, metrics = ps_job(tmp_path, jobs, 3, ["--staleness", staleness], launcher=launcher)
    victim = job.rank(2)
    victim.send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    if launcher == "horovodrun":
        rc, took = job.wait_exit(BOUND + 30)
        record(f"frozen worker/torch/mpi/ps {staleness}", f"exit {rc}", took,
               job.first_error_after(t0))
        assert rc != 0 and took <= BOUND, (rc, took)
        assert_one_line(job, r"worker rank 2 \(", "is dead, frozen or cut off",
                        "--enable-recovery", "python -m launch.horovodrun passes it")
        assert_nothing_left(job)
        return
    while not any("warning: worker rank 2 (" in ln for ln in job.lines):
        if time.monotonic() - t0 > BOUND or job.proc.poll() is not None:
            job.kill()
            pytest.fail(f"worker rank 2 not dropped {BOUND} s after it froze:\n{job.output()[-3000:]}")
        time.sleep(0.2)
    dropped = time.monotonic() - t0
    with contextlib.suppress(psutil.Error):
        victim.send_signal(signal.SIGCONT)
    rc, took = job.wait_exit(240)
    record(f"frozen worker, continued/torch/launch.horovodrun/ps {staleness}",
           f"exit {rc}, trained on", took, dropped)
    assert rc == 0, job.output()[-3000:]
    out = job.output()
    left = [ln for ln in out.splitlines() if "warning: worker rank 2 was dropped by the servers" in ln]
    assert len(left) == 1 and "so it leaves" in left[0], out[-3000:]
    assert_trained_on_without(job, metrics, 2, staleness, 2)
    assert_nothing_left(job)


PS_COMMIT = 8  # --commit-every of the server cell: 12 snapshots per server and epoch


def ps_marks(ckpt: Path) -> dict[int, tuple[int, int]]:
    """Each server's update mark (docs/parameter-servers.md): its epoch and its updates in it."""
    marks = {}
    for path in ckpt.glob("ps-server*.updates"):
        magic, epoch, updates = struct.unpack("<8sqq", path.read_bytes())
        marks[int(path.name[len("ps-server"):].split("of")[0])] = (epoch, updates)
    return marks


@pytest.mark.parametrize("tier", cells(("full",)))
def test_a_dead_server_ends_the_job_in_one_line(tier, tmp_path, jobs):
    """Server rank 1 of 2 killed (SIGKILL) in epoch 2, through ``python -m launch.horovodrun`` (so
    under mpirun --enable-recovery, whose own status would be 0 or 1): server 0 hears its
    heartbeat stop and ends the job in one line, its slice being gone; the launcher's status is
    3, the watchdog's, as without recovery.  Then the same command with ``--resume``: every server
    restarts from its newest snapshot of epoch 2 (one every --commit-every 8 updates), the epoch
    goes on with the batches no snapshot held, and the job finishes having lost at most 8 updates
    per server, as many as the servers' update marks show after their snapshots, every batch of
    epochs 2-4 applied once by each server over both launches."""
    args = ["--ps-servers", "2", "--staleness", "inf", "--commit-every", str(PS_COMMIT)]
    job, metrics = ps_job(tmp_path, jobs, 4, args)
    job.rank(1).send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, took = job.wait_exit(BOUND + 30)
    record("killed server/torch/launch.horovodrun/ps inf", f"exit {rc}", took,
           job.first_error_after(t0))
    assert rc == 3 and took <= BOUND, (rc, took)
    assert_one_line(job, r"server rank 1 \(", "its part of the parameters is gone")
    assert_nothing_left(job)
    ckpt = tmp_path / "ckpt"
    marks = ps_marks(ckpt)
    assert sorted(marks) == [0, 1] and all(m[0] == 2 for m in marks.values()), marks
    held: dict[int, int] = {}  # each server's newest snapshot of epoch 2: its updates
    for p in ckpt.glob("ps-server*-epoch0002-*.npz"):
        s = int(p.name.split("of")[0][len("ps-server"):])
        held[s] = max(held.get(s, 0), int(p.stem.split("-update")[1]))
    resumed = Job(job.proc.args + ["--resume"], str(tmp_path), MODULES["torch"])
    jobs.append(resumed)
    t1 = time.monotonic()
    rc, took = resumed.wait_exit(600)
    out = resumed.output()
    assert rc == 0 and not error_lines(out), out[-3000:]
    summary = json.loads(metrics.read_text())
    ps = summary["ps"]
    since = [held.get(s, 0) for s in (0, 1)]
    lost = [marks[s][1] - since[s] for s in (0, 1)]
    record("killed server, resumed/torch/launch.horovodrun/ps inf",
           f"exit {rc}, resumed from updates {since}, lost {lost}", time.monotonic() - t1)
    print(f"MEASURED snapshots: {ps['snapshots_written']} written, {ps['snapshot_seconds']} s "
          f"(mean, longest) per server")
    assert summary["resumed_from_epoch"] == 1 and [e["epoch"] for e in summary["epochs"]] == [2, 3, 4]
    assert ps["resumed_epoch"] == 2 and ps["resumed_from_update"] == since, ps
    assert ps["updates_lost"] == lost and max(lost) <= PS_COMMIT and min(lost) >= 0, ps
    assert ps["exactly_once"], ps
    # 96 gradients per epoch (3072 samples, batches of 32): each server applied epochs 2-4 once,
    # its snapshot's share of epoch 2 before the loss and the rest now
    assert [sum(a) + n for a, n in zip(ps["applied"], since, strict=True)] == [3 * 96] * 2, ps
    assert f"ps: resumed epoch 2 (--commit-every {PS_COMMIT}): server 0 from " in out, out[-3000:]
    assert summary["final_test_accuracy"] > 0.5
    assert_nothing_left(resumed)


def test_a_survivors_finalize_that_waits_for_a_lost_rank_is_bounded(tmp_path):
    """After a lost rank, MPI_Finalize's closing fence may wait for it for ever (seen once in 14
    runs of the cell above: the job printed its last line, then hung in
    ``ompi_mpi_finalize``).  Made certain here: rank 1 never finalizes and leaves only after
    rank 0 has, so rank 0's finalize can only end through the bound, with exit status 0."""
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--enable-recovery", "-np", "2",
           sys.executable, str(REPO / "tests" / "finalize_probe.py"), "2"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"rank 0 still waited in MPI_Finalize after 120 s:\n{out}")
    assert proc.returncode == 0, out
    assert "rank 0 done" in out and "rank 1 saw rank 0 leave" in out, out
    assert "MPI_Finalize still waited for the lost rank(s) after 2 s" in out, out


# --- 6. Horovod's start-up failures: python -m launch.horovodrun ---------------------------------

def wrapped_horovodrun(*argv: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "launch.horovodrun", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"})
    return proc, time.monotonic() - t0


@pytest.mark.parametrize("case", ["silent", "refused", "unresolvable"])
def test_unreachable_host_at_start_is_one_line(case):
    """horovodrun alone, with a host that does not answer: 53 s of silence here, then
    'RuntimeError: could not connect to some hosts via ssh' in a traceback.  The wrapper checks
    every host's ssh banner first (5 s at most).  Hosts: a port that accepts but never speaks (a
    hung host), a closed port, a name that does not resolve."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.2", 0))
        listener.listen()
        port = listener.getsockname()[1]
        host, why = {"silent": ("127.0.0.2", f"no answer on port {port} within 5 s"),
                     "refused": ("127.0.0.3", f"port {port}: Connection refused"),
                     "unresolvable": ("rt-no-such-host.invalid", "its name does not resolve")}[case]
        proc, took = wrapped_horovodrun("-np", "2", "-H", f"localhost:1,{host}:1", "-p", str(port),
                                        sys.executable, "-m", MODULES["torch"], "--epochs", "1")
    record(f"unreachable host in -H ({case})/any/any/fixed", f"exit {proc.returncode}", took)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and f"host {host} ({why})" in lines[0], proc.stderr
    assert "cannot be reached over ssh" in lines[0]


def test_missing_slot_at_start_is_one_line():
    """horovodrun alone: Open MPI's 20-line 'not enough slots' text after ~10 s."""
    proc, took = wrapped_horovodrun("-np", "3", "-H", "localhost:2", sys.executable, "-m",
                                    MODULES["torch"], "--epochs", "1")
    record("missing slot (-np 3 -H localhost:2)/any/mpi/fixed", f"exit {proc.returncode}", took)
    assert proc.returncode == 2, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "-np 3 needs 3 slots" in lines[0] and "localhost:2" in lines[0]


def test_horovodrun_traceback_becomes_one_line():
    """A failure horovodrun itself reports with a traceback (here: its ranks exit 3 under Gloo)
    comes out as the exception's one line, with horovodrun's exit status."""
    proc, _ = wrapped_horovodrun("--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-c",
                                 "import sys; sys.exit(3)")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: horovodrun: RuntimeError: Horovod "
                                                   "detected"), proc.stderr


# --- the pieces, without a job (fast) -----------------------------------------------------------

def test_heartbeats_name_the_silent_rank_and_rank_0_decides():
    """Two watchdogs exchange real UDP heartbeats through the start-up records; when rank 1 stops
    sending, rank 0's verdict names it, and rank 1, hearing rank 0, leaves the verdict to it."""
    from ringtrain.faults.watchdog import Watchdog

    dogs = [Watchdog(4, r, 2, "gloo", elastic=False) for r in range(2)]
    records, ready = [None, None], threading.Barrier(2)

    def allgather(record, name):
        records[record["rank"]] = record
        ready.wait()
        return list(records)

    openers = [threading.Thread(target=d.open_channel, args=(allgather,)) for d in dogs]
    for t in openers:
        t.start()
    for t in openers:
        t.join()
    for _ in range(3):  # three ticks of both: every heartbeat answered
        for d in dogs:
            d.exchange()
    assert all(abs(d.seen[1 - d.rank] - time.monotonic()) < 5 for d in dogs)
    assert dogs[0].check() is None  # progress is fresh
    for d in dogs:
        d.steps, d.last = 7, time.monotonic() - 5  # training, but no step for 5 s > 4 s
    assert dogs[1].check() is None  # rank 0 answers: it is rank 0's call (for GRACE seconds)
    dogs[0].seen[1] = time.monotonic() - 3  # rank 1 silent for 3 s > 4 / 2
    verdict = dogs[0].check()
    assert verdict and re.match(r"rank 1 \(.*\) is frozen, dead or unreachable \(no heartbeat",
                                verdict), verdict
    # Rank 0 ends the job itself (a parameter server's verdict, watchdog.end_job): its signed
    # datagram tells rank 1 to leave without a line of its own; from rank 1 it is refused.
    assert dogs[0].sources == {1: dogs[1].sock.getsockname()}
    for d in dogs:  # what the last tick left unread
        d.sock.settimeout(0.2)
        with contextlib.suppress(TimeoutError):
            while True:
                d.accept(d.sock.recv(4096))
    dogs[1]._send(end=True)
    dogs[0].sock.settimeout(2)
    assert dogs[0].accept(dogs[0].sock.recv(4096)) is None and not dogs[0].ended  # refused
    dogs[0].tell_the_end()
    dogs[1].sock.settimeout(2)
    assert not dogs[1].ended and dogs[1].accept(dogs[1].sock.recv(4096)) == 0 and dogs[1].ended
    for d in dogs:
        d.sock.close()


def test_only_a_training_step_ends_the_start_up_grace(monkeypatch):
    """Start-up collectives (data check, broadcast) keep the clock fresh but leave the grace for
    the first step, which traces the model; after one step the plain timeout applies."""
    from ringtrain.faults import watchdog

    dog = watchdog.Watchdog(4, 0, 1, "gloo", elastic=False)
    monkeypatch.setattr(watchdog, "_dog", dog)
    watchdog.progress()  # a collective
    dog.last = time.monotonic() - 5  # 5 s > 4 s, but no step yet
    assert dog.check() is None
    watchdog.progress(step=True)
    dog.last = time.monotonic() - 5
    assert dog.check() and "no training step or collective completed on rank 0" in dog.check()


def test_an_elastic_worker_waits_for_gloos_timeout_before_it_leaves(monkeypatch):
    """An elastic worker whose peer was cut off sits in a collective until Gloo's timeout
    releases it and the job re-forms; leaving at --stall-timeout + 30 s (10 + 30 < 30 + 30 here)
    would fail a job that was about to recover."""
    from ringtrain.faults import watchdog

    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "30")
    dog = watchdog.Watchdog(10, 0, 2, "gloo", elastic=True)
    dog.steps = 1
    dog.last = time.monotonic() - (10 + watchdog.ELASTIC_GRACE + 5)
    assert dog.check() is None
    dog.last = time.monotonic() - (30 + watchdog.ELASTIC_GRACE + 5)
    assert "this worker leaves the elastic job" in (dog.check() or "")
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "5")  # then --stall-timeout rules
    dog.last = time.monotonic() - (10 + watchdog.ELASTIC_GRACE + 5)
    assert "this worker leaves the elastic job" in (dog.check() or "")


GUARDED = """
import os, sys, time
from ringtrain.faults.watchdog import Watchdog
dog = Watchdog(2, 1, 2, "gloo", elastic=True)
dog.start_guardian()
print(dog.guard.pid, flush=True)
while True:
    dog.feed_guardian()
    time.sleep(0.2)
"""


def test_guardian_kills_its_frozen_rank_and_says_so():
    """A stopped process cannot act; its guardian, fed by the rank's watchdog thread, kills it
    after the limit (2 s here) with one line naming the rank and why."""
    proc = subprocess.Popen([sys.executable, "-c", GUARDED], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        guardian = psutil.Process(int(proc.stdout.readline()))
        time.sleep(1)
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        took = time.monotonic() - t0
        guardian.wait(timeout=10)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert 1.5 < took < 15, took  # 2 s after the last feed, which came <= 0.2 s before
    lines = error_lines(err)
    assert len(lines) == 1 and re.search(r"rank 1 \(.*pid \d+\) is frozen: stopped", lines[0]), err


GUARDIAN_GONE = """
from ringtrain.faults.watchdog import Watchdog
dog = Watchdog(2, 1, 2, "gloo", elastic=True)
dog.start_guardian()
dog.feed_guardian("bye")  # the guardian leaves on this line
dog.guard.wait(timeout=30)
for _ in range(3):  # the watchdog's next ticks (or the exit path) feed a guardian that is gone
    dog.feed_guardian()
assert dog.guard is None
print("fed", flush=True)
"""


def test_a_guardian_that_is_gone_leaves_no_traceback_at_exit():
    """Feeding a guardian that has already left (it read "bye", or the launcher killed it first)
    drops it quietly: no "Exception ignored ... BrokenPipeError" from the pipe at the rank's
    exit (seen on Debian 13 after the one error line of failing jobs, with a buffered
    pipe).  ``-X dev`` reports every error a file's finaliser meets; a plain interpreter reports
    them only at times (1 run in 28 here; in 4 jobs of one Debian 13 run, every rank), dev
    mode 5 in 5 on the old code."""
    proc = subprocess.run([sys.executable, "-X", "dev", "-c", GUARDIAN_GONE], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "fed", proc.stderr
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr


def test_horovodrun_flags_are_read_like_horovodrun(tmp_path):
    from launch.horovodrun import exception_line, hosts_and_slots

    assert hosts_and_slots(["-np", "4", "-H", "a:2,b", "python", "x.py"]) == [("a", 2), ("b", 1)]
    assert hosts_and_slots(["-np", "2", "--gloo", "python", "x.py", "-H", "theirs:9"]) == []
    assert hosts_and_slots(["--verbose", "-H=a:3", "--start-timeout", "9", "python"]) == [("a", 3)]
    assert hosts_and_slots(["--ssh-accept-new-hosts", "-H", "a:2", "python"]) == [("a", 2)]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# cluster\nnode1 slots=4\nnode2 slots=2  # two GPUs\n")
    assert hosts_and_slots(["--hostfile", str(hostfile)]) == [("node1", 4), ("node2", 2)]
    assert exception_line(["Traceback (most recent call last):\n", '  File "x", line 1\n',
                           "RuntimeError: first\n", "second line\n"]) == "RuntimeError: first second line"


def test_the_launcher_gives_a_parameter_server_job_recovery_and_its_real_status():
    """``python -m launch.horovodrun`` passes mpirun --enable-recovery to a --strategy ps job on
    MPI (merged into the user's --mpi-args; not twice; not for a ring job, nor under Gloo), keeps
    such a job on MPI across hosts, and returns rank 0's status where mpirun's says nothing."""
    from launch.horovodrun import job_status, with_controller, with_recovery

    cmd = ["python", "train.py", "--strategy", "ps", "--staleness", "4"]
    assert with_recovery(["-np", "4", *cmd]) == (["--mpi-args=--enable-recovery", "-np", "4", *cmd], True)
    assert with_recovery(["--mpi-args", "-x FOO", "-np", "4", *cmd]) == \
        (["--mpi-args=-x FOO --enable-recovery", "-np", "4", *cmd], True)
    given = ["--mpi-args=--enable-recovery --bind-to none", "-np", "4", *cmd]
    assert with_recovery(given) == (given, True)
    for kept in (["-np", "4", "python", "train.py"], ["--gloo", "-np", "4", *cmd],
                 ["-np", "4", "python", "train.py", "--strategy", "ring", "--staleness", "ps"]):
        assert with_recovery(kept) == (kept, False)
    spans = ["-np", "4", "-H", "node1:2,node2:2", "python", "train.py", "--strategy=ps"]
    assert with_controller(spans) == (spans, None)
    seen = {"rank_error": False, "status": None}
    assert job_status(0, True, {**seen, "status": 2}) == 2  # bad input on every rank
    assert job_status(0, True, {**seen, "status": 0}) == 0  # trained on without a worker
    assert job_status(1, True, {**seen, "status": 0}) == 0  # a straggler's guardian stopped mpirun
    assert job_status(0, True, {**seen, "rank_error": True}) == 3  # the watchdog's one line
    assert job_status(0, True, seen) == 1  # rank 0 gone without a word
    assert job_status(137, False, {**seen, "status": 0}) == 137  # no recovery: mpirun's own


def test_the_launcher_reads_rank_0s_status_line_and_keeps_it_out():
    """The status line as mpirun tags it, also with the next write glued to it (seen: a bare
    tag, "0[1,0]<stderr>:", which a whole-word parse missed and the job's 0 became 1)."""
    import io

    from launch.horovodrun import _pass_through

    token = "ringtrain-job-status 5eed"
    for lines, status, shown in (
            ([f"[1,0]<stderr>:{token} 0\n"], 0, ""),
            ([f"[1,0]<stderr>:{token} 2[1,0]<stderr>:\n"], 2, ""),
            ([f"[1,0]<stderr>:{token} 0[1,1]<stderr>:warning: x\n", "[1,0]<stdout>:done\n"], 0,
             "[1,1]<stderr>:warning: x\n[1,0]<stdout>:done\n"),
            (["[1,0]<stderr>:ringtrain-job-status other 5\n"], None,
             "[1,0]<stderr>:ringtrain-job-status other 5\n")):
        state, sink = {"held": [], "rank_error": False, "status": None, "token": token}, io.StringIO()
        _pass_through(io.StringIO("".join(lines)), sink, state, True)
        assert (state["status"], sink.getvalue()) == (status, shown), lines


def test_rank_0_tells_the_launcher_its_status_only_when_asked(monkeypatch, capsys):
    """Under the launcher's token, rank 0 writes its exit status on the token's line (bad input:
    2, after its one error line); any other rank, or without the token, writes nothing."""
    from launch import cli
    from ringtrain.errors import UserError

    def bad() -> int:
        raise UserError("bad flag")

    for rank, token, want in (("0", "ringtrain-job-status abc", "ringtrain-job-status abc 2"),
                              ("1", "ringtrain-job-status abc", None), ("0", None, None)):
        monkeypatch.setenv("OMPI_COMM_WORLD_RANK", rank)
        if token:
            monkeypatch.setenv(cli.STATUS_ENV, token)
        else:
            monkeypatch.delenv(cli.STATUS_ENV, raising=False)
        with pytest.raises(SystemExit) as done:
            cli.run_cli(bad)
        assert done.value.code == 2
        err = capsys.readouterr().err
        assert [ln for ln in err.splitlines() if "ringtrain-job-status" in ln] == ([want] if want else [])


def test_horovodrun_across_hosts_runs_gloo_unless_told():
    """``python -m launch.horovodrun`` picks Gloo where the hosts span machines (measured faster
    than MPI there: docs/clusters.md); a chosen controller, one host or an elastic job is left
    alone; the bench's "default" cells run what it picks."""
    from bench.parts.emulated_cluster import shipped_flags
    from launch.horovodrun import with_controller

    cmd = ["python", "-m", "launch.torch_mnist"]
    argv, note = with_controller(["-np", "4", "-H", "node1:2,node2:2", *cmd])
    assert argv == ["--gloo", "-np", "4", "-H", "node1:2,node2:2", *cmd]
    assert note.startswith("note: the job spans 2 hosts: running horovodrun --gloo") and "--mpi" in note
    for kept in (["--mpi", "-np", "2", "-H", "a:1,b:1", *cmd], ["--gloo", "-np", "2", "-H", "a,b", *cmd],
                 ["-np", "2", "-H", "localhost:1,127.0.0.1:1", *cmd],  # one machine by two names
                 ["-np", "2", *cmd, "-H", "a:1,b:1"],                  # the command's flag, not ours
                 ["-np", "2", "--host-discovery-script", "d.sh", *cmd]):
        assert with_controller(kept) == (kept, None)
    assert shipped_flags(2) == ("--gloo",) and shipped_flags(1) == ()
