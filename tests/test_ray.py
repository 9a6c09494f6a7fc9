"""``python -m launch.ray`` on a local Ray: the same job as under horovodrun (identical ranks, the
same weights bit for bit, rank 0's output once, checkpoints and TensorBoard files), elastic mode,
and bad input as one line before Ray or any framework is imported.

The job starts its own Ray (``ray.init``) sized for its workers and stops it at the end; each test
gives it a Ray folder of its own (``RAY_TMPDIR``) and checks that nothing of it is left.
tests/test_ray_cluster.py runs the same launcher on a two-node Ray cluster of network namespaces.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import BIN, REPO, SMALL, requires_horovod, run

# --- running python -m launch.ray in a test (also used by tests/test_ray_cluster.py) -------------

def ray_missing() -> str | None:
    """Why the Ray tests cannot run here, or None."""
    if importlib.util.find_spec("ray") is None:
        return ("Ray is not installed in this environment (make test installs it: RINGTRAIN_RAY=1 "
                "bash .ci/setup; or pip install -c constraints.txt -e '.[ray]')")
    if importlib.util.find_spec("horovod") is None:
        return "horovod is not installed; run make setup"
    return None


requires_ray = pytest.mark.skipif(ray_missing() is not None, reason=ray_missing() or "")


def job_env(extra: dict | None = None) -> dict[str, str]:
    """The environment a job gets: the suite's (TF quiet, this checkout importable), deprecation
    warnings shown (each one would be a line of the job's output), no inherited Ray address."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONWARNINGS": "default::DeprecationWarning", **(extra or {})}
    env.pop("RAY_ADDRESS", None)
    return env


WARNING_AT = re.compile(r"(\S+\.py):\d+: \w*Warning: ")


def warning_lines(out: str) -> list[str]:
    """Lines that say ``...Warning``, but for warnings raised in another library's own code (on
    Python 3.13 TensorFlow's gast prints dozens of DeprecationWarnings from its site-packages
    files in every worker once they are shown): Horovod's and this checkout's count."""
    def elsewhere(line: str) -> bool:
        m = WARNING_AT.search(line)
        return bool(m) and "/site-packages/" in m[1] and "/site-packages/horovod/" not in m[1]
    return [ln for ln in out.splitlines() if "Warning" in ln and not elsewhere(ln)]


def error_lines(out: str) -> list[str]:
    return [ln for ln in out.splitlines() if "error: " in ln]


class RayJob:
    """``python -m launch.ray ARGS``, running; ``cmd_prefix`` runs it elsewhere (a namespace).

    A local Ray started by the job lives under ``RAY_TMPDIR`` (a short folder of its own, as
    Ray's socket paths must stay under 108 bytes): every process whose command line names that
    folder, and every process of the job's session, is killed by :meth:`kill`.
    """

    def __init__(self, args: list[str], cmd_prefix: list[str] | None = None, env: dict | None = None):
        self.tmpdir = tempfile.mkdtemp(prefix="rtray-")
        os.chmod(self.tmpdir, 0o755)
        cmd = [*(cmd_prefix or []), sys.executable, "-m", "launch.ray", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=job_env({"RAY_TMPDIR": self.tmpdir, **(env or {})}),
                                     cwd=REPO, start_new_session=True, stdin=subprocess.DEVNULL)
        self.lines: list[str] = []
        self.times: list[float] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.rank_pids: set[int] = set()  # the job's Ray workers on this host, as seen while it ran
        threading.Thread(target=self._watch_ranks, daemon=True).start()

    def _watch_ranks(self) -> None:
        while self.proc.poll() is None:
            for proc in psutil.process_iter(["name"]):
                with contextlib.suppress(psutil.Error, OSError):
                    if "BaseHorovod" in (proc.info["name"] or "") and os.getsid(proc.pid) == self.proc.pid:
                        self.rank_pids.add(proc.pid)
            time.sleep(0.5)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.times.append(time.monotonic())
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> float:
        """Seconds until a line matches ``pattern``; fails (and kills the job) past ``timeout`` or
        if the job ends first."""
        t0 = time.monotonic()
        while not any(re.search(pattern, ln) for ln in list(self.lines)):
            if self.proc.poll() is not None or time.monotonic() - t0 > timeout:
                self.kill()
                pytest.fail(f"never saw {pattern!r}:\n{self.output()[-4000:]}")
            time.sleep(0.2)
        return time.monotonic() - t0

    def wait(self, timeout: float) -> tuple[int, float]:
        """(exit status, seconds waited); fails (and kills the job) past ``timeout``."""
        t0 = time.monotonic()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"job still running after {timeout:.0f} s:\n{self.output()[-4000:]}")
        self.reader.join(timeout=10)
        print(self.output())  # shown with a failure
        return self.proc.returncode, time.monotonic() - t0

    def leftovers(self) -> list[psutil.Process]:
        """Processes of this job still running: its session (the local Ray it started, its
        workers), what names its Ray folder, and its ranks' guardians (their own sessions)."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, OSError):
                if proc.pid == os.getpid():
                    continue
                cmd = proc.info["cmdline"] or []
                module = "ringtrain.faults.guardian"  # python -m MODULE RANK_PID
                guardian = module in cmd and cmd[cmd.index(module) + 1:][:1] in (
                    [str(pid)] for pid in self.rank_pids)
                if os.getsid(proc.pid) == self.proc.pid or guardian or any(
                        self.tmpdir in part for part in cmd):
                    found.append(proc)
        return found

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for proc in self.leftovers():
            with contextlib.suppress(psutil.Error):
                proc.kill()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def run_job(args: list[str], timeout: float = 300, **kwargs) -> tuple[int, str, RayJob]:
    job = RayJob(args, **kwargs)
    try:
        rc, _ = job.wait(timeout)
        return rc, job.output(), job
    finally:
        deadline = time.monotonic() + 15
        while job.leftovers() and time.monotonic() < deadline:
            time.sleep(0.5)
        job.left = [(p.pid, " ".join(p.cmdline()[:3])) for p in job.leftovers() if p.is_running()]
        job.close()


def assert_clean(job: RayJob) -> None:
    """The job stopped the local Ray it started: nothing of it was left 15 s after it ended."""
    assert not job.left, f"processes left running: {job.left}"


def metrics(path: Path) -> dict:
    return json.loads(Path(path).read_text())


QUICK = [*SMALL, "--epochs", "1"]
TIMEOUT = 300


# --- bad input: one line, exit status 2, nothing imported first --------------------------------

def launch_without_ray(argv: list[str]) -> subprocess.CompletedProcess:
    """``python -m launch.ray ARGV`` in a process where ``import ray`` fails, as where Ray is not
    installed: a flag error that is reported as such was found before Ray was imported."""
    code = ("import sys, runpy; sys.modules['ray'] = None; sys.argv = ['launch.ray'] + sys.argv[1:]; "
            "runpy.run_module('launch.ray', run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=60, env=job_env(), cwd=REPO)


BAD_FLAGS = [
    ([], "say how many workers: --num-workers N"),
    (["--num-workers", "0"], "--num-workers must be at least 1"),
    (["--num-workers", "2", "--min-workers", "1"], "add --elastic"),
    (["--elastic", "--num-workers", "2"], "an --elastic job sizes itself"),
    (["--elastic", "--min-workers", "3", "--max-workers", "2"], "--max-workers 2 is smaller than"),
    (["--num-work", "2"], "unrecognized arguments: --num-work 2"),  # no abbreviations
    (["--num-workers", "2", "--epochs", "0"], "--epochs must be a positive integer"),
    (["--num-workers", "2", "--cpus-per-worker", "0"], "--cpus-per-worker must be at least 1"),
    (["--num-workers", "2", "--address", "ray://head:10001"], "Ray Client addresses are not supported"),
    (["--num-workers", "2", "--address", "head"], "expected HOST:PORT"),
    (["--num-workers", "2", "--address", "127.0.0.1:6379", "--object-store-memory", "100"],
     "sizes the local Ray"),
    (["--num-workers", "2", "--object-store-memory", "10"], "at least 80 MB"),
    (["--num-workers", "2", "--model", "no-such-model"], "--model must be cnn, mlp or"),
]


@pytest.mark.parametrize("argv,needle", BAD_FLAGS, ids=[" ".join(a) or "none" for a, _ in BAD_FLAGS])
def test_bad_flags_are_one_line_before_ray_is_imported(argv, needle):
    proc = launch_without_ray(["--framework", "torch", *argv])
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout


def test_ray_not_installed_is_one_line():
    proc = launch_without_ray(["--framework", "torch", "--num-workers", "2", *QUICK])
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.strip().splitlines() == [
        "error: Ray is not installed in this environment; install it with: pip install -c "
        "constraints.txt -e '.[ray]' (or RINGTRAIN_RAY=1 make setup)"], proc.stderr


def test_help_lists_ray_and_trainer_flags():
    proc = run([sys.executable, "-m", "launch.ray", "--help"])
    assert proc.returncode == 0, proc.stderr
    for needle in ("--framework {torch,tf}", "--address", "--num-workers", "--min-workers",
                   "--cpus-per-worker", "--gpus-per-worker", "--batch-size", "--metrics-out"):
        assert needle in proc.stdout


@requires_ray
def test_address_that_refuses_is_one_line_at_once():
    """A head that is not there (nothing listens on the port): one line in seconds, not Ray's
    minutes of retrying."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        rc, out, job = run_job(["--framework", "torch", "--num-workers", "2", "--address",
                                f"127.0.0.1:{port}", *QUICK], timeout=60)
    assert rc == 2, out
    assert error_lines(out) == [f"error: --address 127.0.0.1:{port}: nothing answers there (Connection "
                                f"refused); start the cluster first (ray start --head on the head "
                                f"node) or correct the address"], out
    assert len(out.splitlines()) == 1 and "Traceback" not in out, out


@requires_ray
def test_the_ray_layer_imports_no_framework():
    """A Ray worker process holds horovod.ray and this launcher before the trainer runs; neither
    may load a framework, so that the trainer's import is the process's only Horovod framework
    module."""
    code = ("import sys, horovod.ray, launch.ray; print(sorted(m for m in ('torch', 'tensorflow', "
            "'keras', 'horovod.torch', 'horovod.tensorflow', 'horovod.keras') if m in sys.modules))")
    proc = run([sys.executable, "-c", code])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr


@requires_horovod
@requires_ray
def test_every_ray_executor_has_a_job_key_of_its_own():
    """The key that signs an executor's rendezvous requests is its own: executors made in one
    process, from one settings object or from two, hold different keys, each executor's
    rendezvous server and its workers' environment carry that key, and a request signed with
    another executor's key is refused there.  (0.28.1 made MiniSettings.key once, at import:
    every executor of the process shared it.)  No Ray cluster is started."""
    from horovod.ray.runner import Coordinator, MiniSettings, RayExecutor
    from test_rendezvous_auth import KEY_VAR, request, sign

    shared = RayExecutor.create_settings(timeout_s=30)
    executors = [RayExecutor(shared, num_workers=1), RayExecutor(shared, num_workers=1),
                 RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=1),
                 RayExecutor(MiniSettings(), min_workers=1, max_workers=2)]
    keys = [e.settings.key for e in executors]
    assert len(set(keys)) == len(keys) and all(len(k) == 32 for k in keys)
    coordinators = []
    try:
        for executor in executors[:2]:
            coordinator = Coordinator(executor.settings)
            coordinator.register("localhost", "node-1", 0)
            env = coordinator.establish_rendezvous()
            coordinators.append(coordinator)
            assert env[KEY_VAR] == executor.settings.key.hex()
        port = coordinators[0].global_rendezv_port
        assert request(port, "GET", "/global/0", headers=sign(keys[1], "GET", "/global/0"))[0] == 403
        assert request(port, "GET", "/global/0", headers=sign(keys[0], "GET", "/global/0"))[0] == 404
    finally:
        for coordinator in coordinators:
            coordinator.rendezvous.stop()


# --- training on a local Ray ---------------------------------------------------------------------

@requires_horovod
@requires_ray
@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_local_ray_trains_with_identical_ranks(fw, tmp_path):
    """Two workers on a local Ray: identical ranks, rank 0's lines once, rank 0's files; and (torch)
    the weights of the same flags under horovodrun --gloo -np 2, bit for bit."""
    out = tmp_path / "m.json"
    extra = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--tensorboard", str(tmp_path / "tb")]
    rc, text, job = run_job(["--framework", fw, "--num-workers", "2", *QUICK, "--metrics-out", str(out),
                             *extra], timeout=TIMEOUT)
    assert rc == 0, text[-4000:]
    m = metrics(out)
    assert m["framework"] == fw and m["world_size"] == 2 and m["controller"] == "gloo"
    assert len(m["param_checksums"]) == 2 and len(set(m["param_checksums"])) == 1, m["param_checksums"]
    assert m["final_test_accuracy"] > 0.3
    # rank 0's lines, once each; no worker's warnings (Horovod's Ray layer used deprecated Ray APIs)
    assert text.count("final test accuracy") == 1 and text.count("epoch 1/1:") == 1, text
    assert "2 worker(s) on 1 node(s)" in text
    assert not warning_lines(text) and not error_lines(text), text
    # rank 0 alone wrote the checkpoint and the TensorBoard events, as under horovodrun
    assert len(list((tmp_path / "ckpt").glob("ckpt-epoch0001.*"))) == 1
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert_clean(job)
    if fw == "torch":  # the same flags under horovodrun --gloo -np 2: the same job, bit for bit
        hvd_out = tmp_path / "hvd.json"
        proc = run([str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable,
                    "-m", "launch", "--framework", fw, *QUICK, "--metrics-out", str(hvd_out)],
                   timeout=TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        under_horovodrun = metrics(hvd_out)
        assert m["param_checksums"] == under_horovodrun["param_checksums"]
        assert [e["train_loss"] for e in m["epochs"]] == [e["train_loss"] for e in under_horovodrun["epochs"]]
        assert m["final_test_accuracy"] == under_horovodrun["final_test_accuracy"]


@requires_horovod
@requires_ray
def test_local_ray_elastic_job(tmp_path):
    """--elastic under Ray: Horovod's elastic driver marks its workers HOROVOD_ELASTIC=1 (the
    trainer refuses --elastic otherwise) and the job trains on both workers."""
    out = tmp_path / "m.json"
    rc, text, job = run_job(["--framework", "torch", "--elastic", "--min-workers", "1", "--max-workers",
                             "2", *SMALL, "--epochs", "2", "--metrics-out", str(out)], timeout=TIMEOUT)
    assert rc == 0, text[-4000:]
    m = metrics(out)
    assert [r["world_size"] for r in m["elastic_resizes"]] == [2]
    assert len(set(m["param_checksums"])) == 1 and len(m["param_checksums"]) == 2
    losses = [e["train_loss"] for e in m["epochs"]]
    assert len(losses) == 2 and losses[1] < losses[0]
    assert text.count("final test accuracy") == 1 and not error_lines(text), text
    assert_clean(job)


@requires_horovod
@requires_ray
def test_user_error_in_the_workers_is_one_line(tmp_path):
    """A problem the workers find (here: no MNIST where --data-dir points, and no way to download
    it) ends the job with the trainers' own line, once, exit status 2, as under horovodrun."""
    nowhere = tmp_path / "nowhere"
    rc, text, job = run_job(["--framework", "torch", "--num-workers", "2", *QUICK, "--data-dir",
                             str(nowhere)], timeout=TIMEOUT,
                            env={"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"})
    assert rc == 2, text[-4000:]
    lines = error_lines(text)
    assert len(lines) == 1 and str(nowhere) in lines[0], text
    assert "Traceback" not in text, text
    assert_clean(job)


# --- the KubeRay example -------------------------------------------------------------------------

def test_kuberay_manifest_is_valid_yaml_with_a_valid_command():
    """docs/kuberay-ringtrain.yaml (not run on Kubernetes here): valid YAML, a RayJob whose Ray
    version is the one constraints.txt pins, with Ray's token authentication, and an entrypoint
    this launcher accepts."""
    import shlex

    import yaml

    from launch import ray as launcher

    doc = yaml.safe_load((REPO / "docs" / "kuberay-ringtrain.yaml").read_text())
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayJob"
    pinned = next(line.split("==")[1] for line in (REPO / "constraints.txt").read_text().splitlines()
                  if line.startswith("ray=="))
    cluster = doc["spec"]["rayClusterSpec"]
    assert cluster["rayVersion"] == pinned
    assert cluster["authOptions"] == {"mode": "token"}, "Ray's ports without its token authentication"
    pods = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert all(c["image"] for p in pods for c in p["template"]["spec"]["containers"])
    words = shlex.split(doc["spec"]["entrypoint"])
    assert words[:3] == ["python", "-m", "launch.ray"], words
    args = launcher.build_parser().parse_args(words[3:])
    assert args.__dict__.pop("framework") == "torch"
    launcher.validate(args)
    workers = cluster["workerGroupSpecs"][0]
    assert args.num_workers * args.cpus_per_worker <= workers["replicas"] * int(
        workers["rayStartParams"]["num-cpus"])
