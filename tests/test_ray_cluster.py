"""``python -m launch.ray`` on a real two-node Ray cluster: a head (``ray start --head``) in one
network-namespace host and a worker node (``ray start --address``) in the other (bench/common/netns_hosts.py:
each with its own address and hostname), the job started on the head's host with ``--address``.

Both frameworks train across the two nodes with identical ranks; then the worker node dies
mid-run as a lost machine does (every process on its host SIGKILLed, its raylet and the job's
worker included): an ``--elastic`` job re-forms on the head and finishes (and says so), a
fixed-size job ends within ``--stall-timeout`` + 30 s with one line naming the lost node.  Bad
input against the cluster: more workers than its CPUs, an address where nothing answers.

Ray's nodes use token authentication with a token of the test's own, and a Ray folder each (the
two hosts share one file system: with one folder, both nodes' log monitors forwarded every
worker's lines, so each line arrived twice).  Every process in the two namespaces but their
sshd is killed when the module ends; nothing is started outside them.  Needs root (namespaces);
skipped with the reason elsewhere.  CI runs the torch fault cells; ``RINGTRAIN_FAULTS=all`` adds TF's.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import pytest
from conftest import BIN, SMALL, requires_horovod
from test_ray import RayJob, error_lines, metrics, requires_ray

from bench.common import netns_hosts

pytestmark = [requires_horovod, requires_ray]

FULL = os.environ.get("RINGTRAIN_FAULTS") == "all"
full_matrix = pytest.mark.skipif(not FULL, reason="full fault matrix only: RINGTRAIN_FAULTS=all")
STALL = 10  # --stall-timeout of the fault jobs
BOUND = STALL + 30  # what the issue allows from the fault to the end of a fixed-size job
PORT = 6379
OBJECT_STORE = 80 * 2**20  # Ray's minimum is 75 MiB; the trainers put nothing there
TIMEOUT = 300


def cells(*specs):
    """The CI cells as they are, the others behind RINGTRAIN_FAULTS=all (as tests/test_faults.py)."""
    return [spec if spec[-1] == "ci" else pytest.param(*spec, marks=full_matrix) for spec in specs]


class RayCluster:
    """A Ray head on host A and a worker node on host B, one CPU each."""

    def __init__(self, hosts: netns_hosts.TwoHosts) -> None:
        self.hosts = hosts
        self.head, self.worker = hosts.hosts
        self.address = f"{self.head.addr}:{PORT}"
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
                    "RAY_COLOR_PREFIX": "0"}
        self.dirs = {h.name: tempfile.mkdtemp(prefix=f"rtray-{h.name[-1]}-") for h in hosts.hosts}
        self.nodes: dict[str, subprocess.Popen] = {}

    def start_node(self, host) -> None:
        cmd = [str(BIN / "ray"), "start", "--block", "--node-ip-address", host.addr, "--num-cpus", "1",
               "--object-store-memory", str(OBJECT_STORE), "--temp-dir", self.dirs[host.name],
               "--disable-usage-stats"]
        if host is self.head:
            cmd += ["--head", "--port", str(PORT), "--include-dashboard", "false"]
        else:
            cmd += ["--address", self.address]
        log = open(os.path.join(self.dirs[host.name], f"ray-start-{len(self.nodes)}.log"), "a")
        self.nodes[host.name] = subprocess.Popen(
            self.hosts.cmd_in(host, cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=self.hosts.env({**os.environ, **self.env}), start_new_session=True)
        log.close()

    def alive(self, want: list[str], timeout: float = 120) -> None:
        """Wait until the cluster's live nodes are exactly ``want`` (addresses, each once)."""
        code = ("import sys, time, ray; ray.init(address=sys.argv[1], logging_level='ERROR')\n"
                "want, deadline = sorted(sys.argv[3:]), time.time() + float(sys.argv[2])\n"
                "while True:\n"
                "    now = sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive'])\n"
                "    if now == want or time.time() > deadline: print('LIVE', now); break\n"
                "    time.sleep(0.5)\n")
        proc = self.hosts.run_in(self.head, [sys.executable, "-c", code, self.address,
                                             str(timeout - 10), *want], timeout=timeout, env=self.env)
        live = [ln[5:] for ln in proc.stdout.splitlines() if ln.startswith("LIVE ")]
        if live != [str(sorted(want))]:
            pytest.fail(f"the Ray cluster's live nodes are {live or proc.stdout}, not {sorted(want)}: "
                        f"{proc.stderr[-2000:]}\n{self.logs()}")

    def logs(self) -> str:
        out = []
        for name, folder in self.dirs.items():
            for log in sorted(os.listdir(folder)):
                if log.startswith("ray-start"):
                    with open(os.path.join(folder, log), errors="replace") as fh:
                        out.append(f"--- {name} {log}:\n{fh.read()[-2000:]}")
        return "\n".join(out)

    def raylet_pids(self, host) -> list[int]:
        pids = []
        for pid in netns_hosts._netns_pids(host.netns):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/comm") as fh:
                if fh.read().strip() == "raylet":
                    pids.append(pid)
        return pids

    def kill_worker_node(self) -> float:
        """Host B dies as a lost machine does: every process on it but its sshd (its raylet, the
        job's worker, ``ray start``) SIGKILLed at once; returns when.  (Killed alone, the raylet
        takes its workers with it only once they notice, and ``ray start --block`` sees it only
        later still: a short job could end before it lost anything, and a test right after it
        found the dead node still listed as alive.)"""
        assert len(self.raylet_pids(self.worker)) == 1, "host B runs no raylet"
        when = time.monotonic()
        self.hosts.kill_host(self.worker)
        return when

    def both_nodes(self) -> None:
        """Both nodes up; the worker node started again if a test took it down (after the head
        has seen the old one die, so that each address is one live node)."""
        if self.nodes[self.worker.name].poll() is not None:
            self.alive([self.head.addr])
            self.start_node(self.worker)
        self.alive([self.head.addr, self.worker.addr])

    def job(self, args: list[str]) -> RayJob:
        return RayJob(["--address", self.address, *args], cmd_prefix=self.hosts.cmd_in(self.head, []),
                      env=self.env)

    def stop(self) -> None:
        self.hosts.kill_strays()
        for proc in self.nodes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for folder in self.dirs.values():
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(hosts):
    made = RayCluster(hosts)
    try:
        made.start_node(made.head)
        made.alive([made.head.addr])
        made.start_node(made.worker)
        made.alive([made.head.addr, made.worker.addr])
        yield made
    finally:
        made.stop()


def job_processes(cluster: RayCluster) -> list[str]:
    """The job's Ray workers still running on either host (by their process title)."""
    found = []
    for host in cluster.hosts.hosts:
        for pid in netns_hosts._netns_pids(host.netns):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as fh:
                title = fh.read().replace(b"\0", b" ").decode(errors="replace")
                if "BaseHorovodWorker" in title:
                    found.append(f"{pid} on {host.name}: {title[:80]}")
    return found


def assert_no_job_left(cluster: RayCluster, within: float = 20) -> None:
    deadline = time.monotonic() + within
    while job_processes(cluster) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not job_processes(cluster), job_processes(cluster)


QUICK = [*SMALL, "--epochs", "1"]
# Long enough to still be training when the node goes; --commit-every 4: the rollback is short.
LONG = ["--train-samples", "1024", "--test-samples", "500", "--batch-size", "32", "--no-progress",
        "--stall-timeout", str(STALL), "--commit-every", "4"]


def test_more_workers_than_the_cluster_has_cpus_is_one_line(cluster):
    cluster.both_nodes()
    job = cluster.job(["--framework", "torch", "--num-workers", "3", *QUICK])
    try:
        rc, took = job.wait(120)
    finally:
        job.close()
    assert rc == 2, job.output()
    assert error_lines(job.output()) == [
        "error: 3 worker(s) x 1 CPU (--cpus-per-worker) need 3 CPUs, but the Ray cluster at "
        f"{cluster.address} has 2 (2 free) on 2 node(s): run at most 2 worker(s), or add nodes"], job.output()
    assert "Traceback" not in job.output()


def test_address_that_does_not_answer_is_one_line_within_seconds(cluster):
    """An address in the hosts' subnet where no host is: no refusal comes back (the kernel gives
    up on the address after its ARP tries, ~3 s, or the launcher's 5 s run out first), and the
    job says so then, not after Ray's minutes of retrying."""
    silent = f"{cluster.hosts.hosts[0].addr.rsplit('.', 1)[0]}.9:{PORT}"
    job = RayJob(["--address", silent, "--framework", "torch", "--num-workers", "2", *QUICK],
                 cmd_prefix=cluster.hosts.cmd_in(cluster.head, []), env=cluster.env)
    try:
        rc, took = job.wait(60)
    finally:
        job.close()
    assert rc == 2, job.output()
    lines = error_lines(job.output())
    assert len(lines) == 1 and re.fullmatch(
        rf"error: --address {re.escape(silent)}: nothing answers there \((No route to host|no answer "
        rf"within 5 s)\); start the cluster first \(ray start --head on the head node\) or correct "
        rf"the address", lines[0]), job.output()
    assert took < 30, f"{took:.0f} s"


@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_two_nodes_train_with_identical_ranks(cluster, fw, tmp_path):
    cluster.both_nodes()
    out = tmp_path / "m.json"
    job = cluster.job(["--framework", fw, "--num-workers", "2", *QUICK, "--metrics-out", str(out)])
    try:
        rc, _ = job.wait(TIMEOUT)
    finally:
        job.close()
    text = job.output()
    assert rc == 0, text[-4000:]
    placed = re.search(r"ray: 2 worker\(s\) on 2 node\(s\): rank 0 on (\S+), rank 1 on (\S+)", text)
    assert placed and sorted(placed.groups()) == [cluster.head.addr, cluster.worker.addr], text
    m = metrics(out)
    assert m["framework"] == fw and m["world_size"] == 2 and m["controller"] == "gloo"
    assert len(m["param_checksums"]) == 2 and len(set(m["param_checksums"])) == 1, m["param_checksums"]
    assert text.count("final test accuracy") == 1 and not error_lines(text), text
    assert_no_job_left(cluster)


@pytest.mark.parametrize("fw,tier", cells(("torch", "ci"), ("tf", "full")))
def test_elastic_job_survives_losing_a_node(cluster, fw, tier, tmp_path):
    """The worker node dies mid-run: the job re-forms on the head from its last commit, says so,
    and finishes; the summary shows the two worlds.

    The node dies as soon as epoch 1's checkpoint is on disk, not when the test reads rank 0's
    "epoch 1" line: that line comes through Ray's log forwarding, a second or more late, and on
    Debian 13 (0.5 s epochs) the whole 5-epoch job had finished by then and lost nothing."""
    from test_elastic import check_trained, world_sizes

    EPOCHS = 10  # the node dies within 0.1 s of epoch 1's end; 9 epochs are left to lose it in

    cluster.both_nodes()
    out, ckpt = tmp_path / "m.json", tmp_path / "ckpt"
    job = cluster.job(["--framework", fw, "--elastic", "--min-workers", "1", "--max-workers", "2", *LONG,
                       "--epochs", str(EPOCHS), "--checkpoint-dir", str(ckpt), "--metrics-out", str(out)])
    try:
        deadline = time.monotonic() + TIMEOUT
        while not list(ckpt.glob("ckpt-epoch0001.*")):
            if job.proc.poll() is not None or time.monotonic() > deadline:
                job.kill()
                pytest.fail(f"no checkpoint of epoch 1 in {ckpt}:\n{job.output()[-4000:]}")
            time.sleep(0.05)
        cluster.kill_worker_node()
        took = job.wait_for(r"^elastic: 1 worker\(s\) from epoch", timeout=BOUND + 60)
        rc, _ = job.wait(TIMEOUT)
        print(f"MEASURED elastic job, {fw}: {took:.1f} s from the node's SIGKILL to the job "
              f"re-formed on the head")
    finally:
        job.close()
    text = job.output()
    assert rc == 0, text[-4000:]
    assert re.search(rf"^ray: lost the worker {re.escape(cluster.worker.addr)}\[\d\] \(its Ray actor "
                     rf"ended\); the elastic job goes on without it$", text, re.M), text
    summary = metrics(out)
    assert world_sizes(summary) == [2, 1]
    assert summary["elastic_resizes"][1]["consumed"] % (4 * 32 * 2) == 0, "rolled back to a commit"
    check_trained(summary, EPOCHS)
    assert not error_lines(text), text


@pytest.mark.parametrize("fw,tier", cells(("torch", "ci"), ("tf", "full")))
def test_fixed_job_ends_in_one_line_when_a_node_is_lost(cluster, fw, tier, tmp_path):
    cluster.both_nodes()
    job = cluster.job(["--framework", fw, "--num-workers", "2", *LONG, "--epochs", "200",
                       "--checkpoint-dir", str(tmp_path / "ckpt")])
    try:
        job.wait_for(r"^epoch 1/200:", timeout=TIMEOUT)
        t0 = cluster.kill_worker_node()
        rc, _ = job.wait(BOUND + 60)
        took = time.monotonic() - t0
    finally:
        job.close()
    text = job.output()
    print(f"MEASURED fixed job, {fw}: {took:.1f} s from the node's SIGKILL to the job's end")
    assert rc == 1, text[-4000:]
    assert took <= BOUND, f"{took:.0f} s from losing the node to the end of the job"
    lines = error_lines(text)
    assert len(lines) == 1, text[-4000:]
    assert f"Ray node {cluster.worker.addr} (rank " in lines[0] and "is gone" in lines[0], lines[0]
    assert "--elastic" in lines[0] and "Traceback" not in text, text
    assert_no_job_left(cluster)
