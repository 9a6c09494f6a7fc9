"""Launching processes the way users do, and the small facts every benchmark part shares."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringtrain.output.files import atomic_write_bytes

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
PY = sys.executable
# Which variable carries the rank depends on the launcher; bench's own launches set BENCH_RANK.
RANK_ENV_VARS = ("BENCH_RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "RANK", "PMI_RANK")


def launcher_rank() -> int | None:
    for name in RANK_ENV_VARS:
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return None


def base_env(**extra: str) -> dict[str, str]:
    """The environment every launched job gets: repo importable, TF's C++ banner off."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONUNBUFFERED": "1"}
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_exec(module: str, args: Sequence[str]) -> list[str]:
    """``python -m bench.workers.rankexec module args``: the per-rank wrapper that records peak RSS (and
    runs py-spy on rank 0 when asked), so every side of a comparison is measured the same way."""
    return [PY, "-m", "bench.workers.rankexec", module, *args]


def horovodrun(np: int, cmd: Sequence[str], gloo: bool = False,
               timeline: str | None = None) -> list[str]:
    out = [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}"]
    if gloo:
        out.append("--gloo")
    if timeline:
        out += ["--timeline-filename", timeline]
    return out + list(cmd)


def mpirun(np: int, cmd: Sequence[str]) -> list[str]:
    return [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe",
            "--bind-to", "none", "-np", str(np), "-x", "PATH", "-x", "PYTHONPATH",
            "-x", "TF_CPP_MIN_LOG_LEVEL", *cmd]


def torchrun(np: int, cmd: Sequence[str]) -> list[str]:
    """``torchrun --nproc_per_node N`` on a free port (cmd is ``python -m module args``)."""
    assert cmd[0] == PY and cmd[1] == "-m", cmd
    return [str(BIN / "torchrun"), "--nproc_per_node", str(np), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), "-m", *cmd[2:]]


@dataclass
class Result:
    returncode: int
    seconds: float
    output: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def run(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 900,
        log: Path | None = None) -> Result:
    """Run to completion; output goes to ``log`` (kept for post-mortems) and is returned.

    The job gets its own process group so that a timeout ends the launcher *and* the ranks it
    started (killing only ``horovodrun`` would leave them running and skew the next run); so does
    the driver's own end (Ctrl-C, or SIGTERM under :func:`terminate_as_exit`): the job is in
    another session, which no signal to the driver reaches.
    """
    t0 = time.perf_counter()
    proc = subprocess.Popen(list(cmd), env=env or base_env(), cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        code, out = 124, (out or "") + f"\n[bench] timed out after {timeout}s"
    except BaseException:
        kill_group(proc)
        raise
    seconds = time.perf_counter() - t0
    if log is not None:
        write_text(log, " ".join(cmd) + "\n\n" + out)
    return Result(code, seconds, out)


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def terminate_as_exit() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit here, so that cleanups run as on Ctrl-C: the running job's
    process group is killed (:func:`run`), the cluster's hosts are torn down."""
    def stop(signum, _frame):
        raise SystemExit(128 + signum)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def run_parallel(cmds: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
                 timeout: float = 900, log: Path | None = None) -> Result:
    """Start several processes at once (a job without a launcher, e.g. MultiWorkerMirrored);
    the job fails if any process does."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(list(c), env=e, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for c, e in zip(cmds, envs, strict=True)]
    outs, code = [], 0
    deadline = t0 + timeout
    for i, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            for q in procs:
                kill_group(q)
            out, _ = p.communicate()
            out += f"\n[bench] timed out after {timeout}s"
            code = 124
        except BaseException:  # the driver ends (see run)
            for q in procs:
                kill_group(q)
            raise
        outs.append(f"--- process {i} ---\n{out}")
        code = code or p.returncode
    out = "\n".join(outs)
    if log is not None:
        write_text(log, out)
    return Result(code, time.perf_counter() - t0, out)


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())


def write_bytes(path: str | os.PathLike, data: bytes, mode: int = 0o644) -> None:
    """Every file bench writes, through here: the library's atomic write (a fresh ``mkstemp`` file
    renamed onto the path, so a symlink planted there is replaced, not followed; a plain
    ``write_text`` wrote through it, as root into any file of the system), keeping a results
    file's usual mode and without a checkpoint's fsync."""
    atomic_write_bytes(path, data, mode=mode, durable=False)


def write_text(path: str | os.PathLike, text: str, mode: int = 0o644) -> None:
    write_bytes(path, text.encode(), mode)


def write_json(path: str | os.PathLike, data: Any, indent: int | None = 2) -> None:
    write_text(path, json.dumps(data, indent=indent, sort_keys=False) + "\n")


def private_dir(path: str | os.PathLike) -> str | None:
    """Make ``path`` where it is missing (mode 0700, as every folder above it that is missing) and
    return None where it is a folder, not a symlink, owned by the caller and writable by no one
    else (neither group nor others); otherwise why not, as words that start with the path.  A
    folder that exists is never changed.  The results folder's rule (``.ci/trust.sh``'s
    ``private_dir``): the cluster parts run as root, and a folder another user made first, or can
    write to, would let them plant a symlink where root writes, or the pictures the trainers read
    (``<out>/tmp/data``)."""
    path = Path(os.path.abspath(path))
    if not os.path.lexists(path):
        old = os.umask(0o077)
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as err:
            return f"{path} cannot be created ({err.strerror})"
        finally:
            os.umask(old)
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a folder"
    if st.st_uid != os.geteuid():
        return f"{path} belongs to {user_name(st.st_uid)}, not to you ({user_name(os.geteuid())})"
    if st.st_mode & 0o022:
        return f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def user_name(uid: int) -> str:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)
