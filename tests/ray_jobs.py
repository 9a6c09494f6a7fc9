"""Running ``python -m launch.ray`` in tests: a job in its own session with its own Ray folder,
its output collected as it arrives, and every process it started killed at the end."""

from __future__ import annotations

import contextlib
import importlib.util
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
from conftest import REPO


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
                guardian = "launch.guardian" in cmd and cmd[cmd.index("launch.guardian") + 1:][:1] in (
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
    import json

    return json.loads(Path(path).read_text())
