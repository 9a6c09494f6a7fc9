"""Elastic training: a real ``horovodrun`` elastic job keeps training while workers come and go.

The two "hosts" are ``localhost`` and ``127.0.0.1``: Horovod's driver tells hosts apart by name but
runs both locally (both addresses belong to this machine), so host membership changes need no
second machine.  The tests edit the discovery file or SIGKILL a worker mid-run, then check the
job's own account of it (the summary's ``elastic_resizes``) and the result.

The grow, shrink and kill tests wait for the event they test instead of racing it.  Horovod's
driver polls the discovery script every second and notifies rank 0, which acts at its next
commit; a job that finishes first never sees the change (``world_sizes == [2]`` on a fresh, fast
machine).  So these jobs run the unchanged trainer under ``tests/elastic_gate.py``, which holds
rank 0 at its first commit (epoch 1, step 4 of 48 per worker) until Horovod's worker has received
the host-update notification (grow, shrink), or until the test has killed a worker and released
it (kill).  Training cannot outrun the event, whatever the machine's speed: the first commit is
reached before the test changes anything, and no further step runs until the change is seen.  A
slow machine only waits longer for the same commit; the gate gives up after 240 s and fails the
job rather than hang.  And since the change always lands at that commit, the tests also know
exactly where the job re-formed: epoch 1, after 4 steps of every worker.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import BIN, REPO, requires_horovod, run, train

pytestmark = requires_horovod

MODULES = ["launch.torch_mnist", "launch.tf_mnist"]
DISCOVER = REPO / "launch" / "discover_hosts.sh"
GATE = REPO / "tests" / "elastic_gate.py"
JOB = ["--train-samples", "1536", "--test-samples", "500", "--batch-size", "32", "--no-progress",
       "--commit-every", "4", "--seed", "3"]


class ElasticJob:
    """A running elastic job whose output lines are collected as they arrive."""

    def __init__(self, tmp_path: Path, module: str, hosts: list[str], np: int, max_np: int,
                 epochs: int, extra: list[str] = (), gate_until: str | None = None,
                 env: dict[str, str] | None = None):
        """``gate_until``: run under tests/elastic_gate.py, rank 0 held at its first commit until
        ``host-update`` arrives or the test calls :meth:`release`."""
        self.module = module
        self.hosts_file = tmp_path / "hosts.txt"
        self.set_hosts(hosts)
        self.metrics_path = tmp_path / "metrics.json"
        self.gate = tmp_path / "gate"
        trainer = ["-m", module]
        if gate_until:
            trainer = [str(GATE), str(self.gate), gate_until, module]
        # A re-formed world waits at Horovod's rendezvous for a newcomer, which is started only
        # then and must first import its framework: 30 s (Gloo's default) once ran out here for a
        # TF newcomer, under a load average of 25 on 2 cores.  A slow machine should only be slower.
        cmd = [str(BIN / "horovodrun"), "-np", str(np), "--min-np", "1", "--max-np", str(max_np),
               "--host-discovery-script", str(DISCOVER), "--network-interface", "lo",
               "--gloo-timeout-seconds", "180", sys.executable, *trainer, "--elastic", *JOB, *extra,
               "--epochs", str(epochs), "--metrics-out", str(self.metrics_path)]
        # Horovod sees each "host" as having one worker, which would then take every core of the
        # machine: two workers, four busy threads on two cores, 5x slower.
        self.threads = str(max(1, len(os.sched_getaffinity(0)) // 2))
        env = {**os.environ, "PYTHONPATH": str(REPO), "RINGTRAIN_HOSTS": str(self.hosts_file),
               "OMP_NUM_THREADS": self.threads, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd=tmp_path, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def set_hosts(self, hosts: list[str]) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")  # the driver reads it every second: swap whole
        tmp.write_text("".join(f"{h}\n" for h in hosts))
        tmp.replace(self.hosts_file)

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not any(re.search(pattern, line) for line in self.lines):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"never saw {pattern!r}:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait_until_held(self, timeout: float = 150) -> None:
        """Until the gate holds rank 0 at its first commit: the first world has formed and trained."""
        deadline = time.monotonic() + timeout
        while not (self.gate / "held").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"the gate never held rank 0:\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def release(self) -> None:
        (self.gate / "release").write_text("")

    def finish(self, timeout: float = 240) -> dict:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"elastic job did not finish in {timeout}s:\n{self.output()[-4000:]}")
        self._reader.join(timeout=10)
        print(self.output())  # shown by pytest -s, or with a failure below
        assert self.proc.returncode == 0, self.output()[-4000:]
        return json.loads(self.metrics_path.read_text())

    def workers(self, host: str) -> list[psutil.Process]:
        """The job's worker processes that the driver placed on ``host``."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            cmd = proc.info["cmdline"] or []
            if self.module in cmd and str(self.metrics_path) in cmd:
                try:
                    if proc.environ().get("HOROVOD_HOSTNAME") == host:
                        found.append(proc)
                except psutil.Error:
                    pass
        return found

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for proc in self.workers("localhost") + self.workers("127.0.0.1"):
            proc.kill()


def world_sizes(summary: dict) -> list[int]:
    return [r["world_size"] for r in summary["elastic_resizes"]]


def check_trained(summary: dict, epochs: int) -> None:
    assert [r["epoch"] for r in summary["epochs"]] == list(range(1, epochs + 1))
    losses = [r["train_loss"] for r in summary["epochs"]]
    assert losses[-1] < losses[0]
    assert summary["final_test_accuracy"] > 0.8
    assert len(set(summary["param_checksums"])) == 1, summary["param_checksums"]


def resized_at(summary: dict) -> tuple[int, int]:
    """(epoch, samples consumed in it) where the job re-formed: the gate's commit, by design."""
    resize = summary["elastic_resizes"][1]
    return resize["epoch"], resize["consumed"]


FIRST_COMMIT = 4 * 32  # --commit-every 4 steps of --batch-size 32, per worker


@pytest.mark.parametrize("module", MODULES)
def test_elastic_grows_when_a_host_is_added(module, tmp_path):
    """1 worker, then a second host appears in the discovery output: the job re-forms at the
    commit where the notification reached it, the newcomer gets rank 0's weights and optimizer
    state, the LR doubles, and both workers end with identical weights."""
    job = ElasticJob(tmp_path, module, ["localhost:1"], np=1, max_np=2, epochs=3,
                     gate_until="host-update")
    job.wait_until_held()
    job.set_hosts(["localhost:1", "127.0.0.1:1"])
    summary = job.finish()
    assert world_sizes(summary) == [1, 2]
    assert resized_at(summary) == (1, FIRST_COMMIT), "joined mid-epoch, at the held commit"
    base = summary["base_lr"]
    assert [r["target_lr"] for r in summary["elastic_resizes"]] == pytest.approx([base, 2 * base])
    assert summary["world_size"] == 2 and len(summary["param_checksums"]) == 2
    check_trained(summary, 3)


@pytest.mark.parametrize("module", MODULES)
def test_elastic_shrinks_when_a_host_is_removed(module, tmp_path):
    """A host leaves the discovery output: its worker is stopped, the other carries on alone
    from that commit with the single-worker LR."""
    job = ElasticJob(tmp_path, module, ["localhost:1", "127.0.0.1:1"], np=2, max_np=2, epochs=3,
                     gate_until="host-update")
    job.wait_until_held()
    job.set_hosts(["localhost:1"])
    summary = job.finish()
    assert world_sizes(summary) == [2, 1]
    assert resized_at(summary) == (1, 2 * FIRST_COMMIT)
    assert summary["elastic_resizes"][1]["target_lr"] == pytest.approx(summary["base_lr"])
    check_trained(summary, 3)


@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("victim_rank", [0, 1])
def test_elastic_survives_a_killed_worker(module, victim_rank, tmp_path):
    """SIGKILL one of two workers mid-epoch (rank 0 too: the survivor becomes rank 0 and its own
    committed state is what the job continues from): the survivor rolls back to the last commit,
    carries on alone with the single-worker LR, finishes every epoch and exits 0.  The kill lands
    while rank 0 is held at the first commit and rank 1 waits for it in a broadcast."""
    job = ElasticJob(tmp_path, module, ["localhost:1", "127.0.0.1:1"], np=2, max_np=2, epochs=3,
                     gate_until="release")
    job.wait_until_held()
    workers = job.workers("localhost") + job.workers("127.0.0.1")
    victims = [p for p in workers if p.environ().get("HOROVOD_RANK") == str(victim_rank)]
    assert len(workers) == 2 and len(victims) == 1, [p.environ().get("HOROVOD_RANK") for p in workers]
    victims[0].send_signal(signal.SIGKILL)
    psutil.wait_procs(victims, timeout=30)
    job.release()
    job.wait_for(r"elastic: 1 worker")
    summary = job.finish()
    assert world_sizes(summary) == [2, 1]
    assert resized_at(summary) == (1, 2 * FIRST_COMMIT), "rolled back to the held commit"
    assert summary["elastic_resizes"][1]["target_lr"] == pytest.approx(summary["base_lr"])
    check_trained(summary, 3)
    assert not job.workers("127.0.0.1") and not job.workers("localhost")


@pytest.mark.parametrize("k", [1, 2], ids=["k1", "k2"])
@pytest.mark.parametrize("module", MODULES)
def test_elastic_without_changes_trains_exactly_like_the_fixed_job(module, k, tmp_path):
    """With no worker lost or added, the elastic loop (its commits, its sample-count position, its
    per-step LR) is the same training as the fixed-size trainer over the same controller (Gloo):
    same per-epoch losses and accuracies, same final weights.  2000 samples on 2 ranks at batch 32
    leave a partial last batch (1000 per rank = 31 full batches + 8), and with
    --backward-passes-per-step 2 the last optimizer step is 32 + 8 images: the elastic loop must
    count the same steps and run the same LR clock as the fixed trainers (it once dropped that
    last step and ended with other weights).  (TF's fixed trainer computes the LR in the graph: it
    must be lr_at's float32 value exactly, or the two drift apart by epoch 2.)"""
    flags = ["--train-samples", "2000", "--backward-passes-per-step", str(k)]
    job = ElasticJob(tmp_path, module, ["localhost:2"], np=2, max_np=2, epochs=2, extra=flags)
    elastic = job.finish()
    fixed_out = tmp_path / "fixed.json"
    plain = [a for a in JOB if a not in ("--commit-every", "4")]
    train(module, [*plain, *flags, "--epochs", "2", "--metrics-out", str(fixed_out)], np=2,
          how="gloo", env={"OMP_NUM_THREADS": job.threads})
    fixed = json.loads(fixed_out.read_text())
    assert world_sizes(elastic) == [2]
    for key in ("train_loss", "test_loss", "test_accuracy", "lr"):
        assert [e[key] for e in elastic["epochs"]] == pytest.approx(
            [e[key] for e in fixed["epochs"]], rel=1e-6), key
    assert elastic["param_checksums"] == fixed["param_checksums"]  # bit for bit


# What rank 0 of a TF elastic job saw when its peer was SIGKILLed mid-allreduce (3 kills in 35 here):
# no Horovod op name, so Horovod's own TF elastic wrapper returned None and the job "succeeded".
GLOO_PEER_DIED = """Graph execution error:

Detected at node DistributedGradients defined at (most recent call last):
  File "/work/main/tf_models/horovod_keras.py", line 169, in allreduce_gradients
  File ".../site-packages/horovod/tensorflow/mpi_ops.py", line 176, in _grouped_allreduce
  File "<string>", line 263, in horovod_grouped_allreduce

[.../third_party/compatible17_gloo/gloo/transport/tcp/pair.cc:598] Connection closed by peer
\t [[{{node DistributedGradients}}]] [Op:__inference_train_step_568]"""

TELL_APART = """
import sys
import horovod.tensorflow as hvd, keras, tensorflow as tf
from horovod.common.exceptions import HorovodInternalError
from tf_models.horovod_keras import DistributedModel, peer_failures_roll_back
from tf_models.model import build_cnn
hvd.init()
model = DistributedModel(build_cnn(0.0, None))
model.compile(optimizer=keras.optimizers.SGD(0.01))
step = tf.function(model.train_step, jit_compile=False)
try:  # a model error (a label out of range) inside the real train step
    with peer_failures_roll_back():
        step((tf.zeros((4, 28, 28, 1)), tf.constant([0, 1, 2, 12])))
except tf.errors.InvalidArgumentError:
    print("model error passed through")
try:
    with peer_failures_roll_back():
        raise tf.errors.UnknownError(None, None, sys.stdin.read())
except HorovodInternalError:
    print("peer failure rolls back")
"""


def test_tf_peer_failure_rolls_back_but_a_model_error_ends_the_job():
    """The TF glue must tell a collective whose peer died (roll back, re-form the world) from the
    model's own error (no rollback cures it: re-raise, the job fails)."""
    proc = run([sys.executable, "-c", TELL_APART], timeout=120, stdin=GLOO_PEER_DIED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("\n")[:2] == ["model error passed through", "peer failure rolls back"]


@pytest.mark.parametrize("n,k,max_steps", [(2000, 1, None), (2000, 2, None), (1536, 1, None),
                                           (1800, 2, None), (2000, 3, 5)])
def test_elastic_counts_steps_and_runs_the_lr_clock_like_the_fixed_trainers(n, k, max_steps):
    """The pure part of the test above, for more shapes: per epoch the elastic loop runs
    ``optimizer_steps`` steps, and its sample-count clock equals the fixed trainers' step / steps
    bit for bit at every step."""
    from ringtrain.data.sharding import optimizer_steps, remaining_shard
    from ringtrain.training.elastic import epoch_progress

    size, batch = 2, 32
    steps = optimizer_steps(n, size, batch, k, max_steps)
    shard = remaining_shard(n, 0, 0, size, 1, 1)
    assert min(optimizer_steps(len(shard), 1, batch, k, strict=False), max_steps or steps) == steps
    for s in range(steps):
        consumed = s * batch * k * size
        assert epoch_progress(3, consumed, n, size, batch, k, max_steps) == 2 + s / steps
