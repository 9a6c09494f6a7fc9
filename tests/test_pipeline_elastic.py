"""The elastic pipeline (``--elastic --pipeline-stages 2``, docs/pipeline.md "Elastic pipeline"):
real ``horovodrun`` elastic jobs on the two "hosts" ``localhost`` and ``127.0.0.1`` (both this
machine; tests/test_elastic.py says why), both frameworks.

* A rank of the second replica is SIGKILLed while rank 0 is held at the first commit
  (tests/elastic_gate.py): the job rolls back to that commit, re-forms at R = 1, finishes every
  epoch and exits 0, and the ranks of each stage hold the same weights.
* With no fault, the elastic pipeline at S = 2, R = 1 (-np 2) and R = 2 (-np 4) trains the float64
  CNN exactly as one process accumulating the same micro-batches (tests/test_pipeline.py's
  reference runs and tolerances).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from conftest import BIN, REPO, requires_horovod, train
from test_elastic import DISCOVER, GATE, ElasticJob
from test_pipeline import ENV, PLAIN, B, assert_same, load_params, model

pytestmark = [requires_horovod, pytest.mark.timeout(900)]

MODULE = "launch.torch_mnist"
FRAMEWORKS = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
STAGES = ["--pipeline-stages", "2"]
JOB = ["--train-samples", "1536", "--test-samples", "500", "--batch-size", "32", "--no-progress",
       "--commit-every", "4", "--seed", "3", *STAGES, "--microbatches", "4"]


class PipelineJob(ElasticJob):
    """tests/test_elastic.py's job with the pipeline's command line: ``--min-np 2`` (one whole
    replica), ``np`` workers on ``hosts``."""

    def __init__(self, tmp_path: Path, hosts: list[str], np: int, flags: list[str],
                 gate_until: str | None = None, env: dict[str, str] | None = None,
                 gloo_timeout: int = 180, module: str = MODULE, max_np: int | None = None):
        self.module = module
        self.hosts_file = tmp_path / "hosts.txt"
        self.set_hosts(hosts)
        self.metrics_path = tmp_path / "metrics.json"
        self.gate = tmp_path / "gate"
        trainer = [str(GATE), str(self.gate), gate_until, module] if gate_until else ["-m", module]
        cmd = [str(BIN / "horovodrun"), "-np", str(np), "--min-np", "2", "--max-np", str(max_np or np),
               "--host-discovery-script", str(DISCOVER), "--network-interface", "lo",
               "--gloo-timeout-seconds", str(gloo_timeout), sys.executable, *trainer, "--elastic", *flags,
               "--metrics-out", str(self.metrics_path)]
        self.threads = "1"  # four workers on a small machine: one thread each
        env = {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}",
               "RINGTRAIN_HOSTS": str(self.hosts_file), "OMP_NUM_THREADS": self.threads,
               **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=tmp_path, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()


def stage_checksums(summary: dict) -> list[set[str]]:
    """The final world's checksums, per stage (rank = replica x S + stage; spares left out)."""
    stages, sums = summary["pipeline"]["stages"], summary["param_checksums"]
    whole = summary["pipeline"]["replicas"] * stages
    return [{sums[r] for r in range(whole) if r % stages == s} for s in range(stages)]


# How long the survivors wait for the killed rank.  Horovod 0.28.1's Gloo controller gathers every
# rank's requests on rank 0 with one receive from several ranks, which a dead peer's closed socket
# does not fail (2 ranks: one peer, which does): in a world of 4, ranks 0 and 1 learn of the loss
# only when --gloo-timeout-seconds runs out (measured: 180 s of a 203 s test at the default the
# other elastic tests use).  No worker joins this job, so nothing needs longer.
KILL_WAIT = 30


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_elastic_pipeline_survives_a_killed_rank_of_the_second_replica(fw, tmp_path):
    """-np 4 on two hosts of two slots: replica 0 (ranks 0, 1) on one, replica 1 (ranks 2, 3) on
    the other.  Rank 3 (replica 1's last stage) is SIGKILLed while rank 0 is held at
    the first commit; the survivors roll back to it, the world re-forms without that host at
    R = 1, and the job finishes its epochs with each stage's ranks identical."""
    job = PipelineJob(tmp_path, ["localhost:2", "127.0.0.1:2"], np=4,
                      flags=[*JOB, "--epochs", "2"], gate_until="release", gloo_timeout=KILL_WAIT,
                      module=FRAMEWORKS[fw])
    try:
        job.wait_until_held(timeout=200)
        workers = job.workers("localhost") + job.workers("127.0.0.1")
        victims = [p for p in workers if p.environ().get("HOROVOD_RANK") == "3"]
        assert len(workers) == 4 and len(victims) == 1, [p.environ().get("HOROVOD_RANK")
                                                         for p in workers]
        # Horovod numbers a host's slots consecutively: replica 1 (ranks 2, 3) is one host's
        host = {p.environ().get("HOROVOD_RANK"): p.environ().get("HOROVOD_HOSTNAME") for p in workers}
        assert host["2"] == host["3"] != host["0"] == host["1"], host
        victims[0].send_signal(signal.SIGKILL)
        psutil.wait_procs(victims, timeout=30)
        job.release()
        job.wait_for(r"elastic pipeline: \d worker\(s\) = 2 stages x 1 replica", timeout=200)
        summary = job.finish(timeout=240)
    finally:
        job.kill()
    sizes = [(r["world_size"], r["replicas"]) for r in summary["elastic_resizes"]]
    assert sizes[0] == (4, 2) and sizes[-1][1] == 1, sizes
    first, resized = summary["elastic_resizes"][:2]
    assert (resized["epoch"], resized["consumed"]) == (1, 4 * 32 * 2), "rolled back to the commit"
    assert resized["target_lr"] == pytest.approx(first["target_lr"] / 2)  # the LR follows R
    assert [r["epoch"] for r in summary["epochs"]] == [1, 2]
    assert summary["final_test_accuracy"] > 0.7
    assert all(len(s) == 1 for s in stage_checksums(summary)), summary["param_checksums"]
    assert not job.workers("127.0.0.1") and not job.workers("localhost")


def test_elastic_pipeline_grows_a_second_replica_when_a_host_is_added(tmp_path):
    """-np 2 (one replica), then a second host of two slots appears: at the commit where the
    notification lands the world re-forms at 4 ranks = 2 replicas, the newcomers get their
    stages' committed weights from the ranks that held them, the LR doubles with R, and each
    stage's two ranks end identical."""
    job = PipelineJob(tmp_path, ["localhost:2"], np=2, max_np=4, flags=[*JOB, "--epochs", "2"],
                      gate_until="host-update")
    try:
        job.wait_until_held(timeout=200)
        job.set_hosts(["localhost:2", "127.0.0.1:2"])
        summary = job.finish(timeout=240)
    finally:
        job.kill()
    sizes = [(r["world_size"], r["replicas"]) for r in summary["elastic_resizes"]]
    assert sizes == [(2, 1), (4, 2)], sizes
    first, grown = summary["elastic_resizes"]
    assert (grown["epoch"], grown["consumed"]) == (1, 4 * 32), "joined at the held commit"
    assert grown["target_lr"] == pytest.approx(2 * first["target_lr"])
    assert summary["final_test_accuracy"] > 0.7
    assert all(len(s) == 1 for s in stage_checksums(summary)), summary["param_checksums"]


# --- no fault: the same maths as one process ---------------------------------------------------

def elastic_pipeline(tmp_path: Path, np_: int, hosts: list[str], flags: list[str],
                     module: str) -> dict:
    job = PipelineJob(tmp_path, hosts, np=np_, flags=flags, module=module)
    try:
        return job.finish(timeout=400)
    finally:
        job.kill()


@pytest.mark.parametrize("np_,hosts,micro,reference_batch", [
    (2, ["localhost:2"], 4, B), (4, ["localhost:2", "127.0.0.1:2"], 2, 2 * B)],
    ids=["R1", "R2"])
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_elastic_pipeline_equals_one_process(fw, np_, hosts, micro, reference_batch, tmp_path):
    """float64 CNN, SGD with momentum, file order, fixed LR: the elastic pipeline's weights after
    an epoch equal one process's with batch R x B (tests/test_pipeline.py's tolerance)."""
    ckpt = tmp_path / "pipe"
    flags = [*model(fw), *PLAIN, "--batch-size", str(B), *STAGES, "--microbatches",
             str(micro), "--epochs", "1", "--checkpoint-dir", str(ckpt)]
    summary = elastic_pipeline(tmp_path, np_, hosts, flags, FRAMEWORKS[fw])
    ref = tmp_path / "ref"
    train(FRAMEWORKS[fw], [*model(fw), *PLAIN, "--batch-size", str(reference_batch), "--epochs", "1",
                   "--checkpoint-dir", str(ref), "--metrics-out", str(ref / "m.json")],
          np=1, how="single", env=ENV, timeout=300)
    assert summary["pipeline"]["replicas"] == np_ // 2
    assert [(r["world_size"], r["replicas"]) for r in summary["elastic_resizes"]] == [(np_, np_ // 2)]
    assert all(len(s) == 1 for s in stage_checksums(summary))
    files = sorted(ckpt.glob("ckpt-epoch0001*"))
    assert len(files) == 2, files  # one per stage, by replica 0
    mine = [a for p in files for a in load_params(p)]
    theirs = load_params(sorted(ref.glob("ckpt-epoch0001*"))[0])
    assert_same(mine, theirs)
    reference = json.loads((ref / "m.json").read_text())
    assert summary["final_test_accuracy"] == pytest.approx(reference["final_test_accuracy"])
    assert summary["epochs"][0]["train_loss"] == pytest.approx(
        reference["epochs"][0]["train_loss"], rel=1e-9)


def test_elastic_pipeline_refuses_what_it_does_not_do():
    from conftest import one_error_line, run

    proc = run([sys.executable, "-m", MODULE, "--elastic", *STAGES, "--schedule", "1f1b"],
               timeout=120)
    one_error_line(proc, "--schedule 1f1b with --elastic --pipeline-stages")
