"""Helpers to run the trainers the way users do: real processes under real launchers."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common import netns_hosts

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SMALL = ["--train-samples", "1024", "--test-samples", "500", "--batch-size", "32", "--no-progress"]
# What every --metrics-out summary holds, in both frameworks (fields may be added, never renamed).
SUMMARY_KEYS = {"framework", "versions", "controller", "world_size", "batch_size_per_rank",
                "global_batch_size", "base_lr", "effective_lr", "lr_scaling", "epochs",
                "final_test_accuracy", "final_test_loss", "total_seconds", "images_per_second",
                "param_checksums", "param_count", "resumed_from_epoch", "host", "model", "dataset"}


def launch_cmd(module: str, args: list[str], np: int = 2, how: str = "horovodrun") -> list[str]:
    """The command line for ``python -m module args`` (or ``python script.py args``) under ``how``
    with ``np`` processes."""
    py = [sys.executable, *([module] if module.endswith(".py") else ["-m", module]), *args]
    if how == "single":
        return py
    if how == "horovodrun":
        return [str(BIN / "horovodrun"), "-np", str(np), "-H", f"localhost:{np}", *py]
    if how == "gloo":
        return [str(BIN / "horovodrun"), "--gloo", "-np", str(np), "-H", f"localhost:{np}", *py]
    if how == "mpirun":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np),
                "-x", "PATH", "-x", "PYTHONPATH", *py]
    raise ValueError(how)


# The trainers' decoded-image cache (--data folder:DIR) of this test session, not the user's
# ~/.cache/ringtrain/decoded: the folders the tests write are gone after them.
DECODE_CACHE = tempfile.mkdtemp(prefix="ringtrain-tests-decoded-")
atexit.register(shutil.rmtree, DECODE_CACHE, True)

# The suite does not depend on its caller's environment.  The variables that change what the code
# under test does (MNIST_DIR; RINGTRAIN_*: the decode cache, the Horovod the dispatcher accepts,
# the elastic hosts file; HOROVOD_*: fusion, cycle time, controller, interface, timeouts, an
# elastic or a launched rank's identity, ...) are taken out of os.environ when the suite starts,
# before any test module is collected, so neither the tests run in this process nor the processes
# they start see them; a test that means one sets it itself (monkeypatch.setenv, or run's env).
# They stay out: the autouse fixture below takes out again, around every test, what library code
# or a test set in this process and left behind.  Kept: the suite's own opt-in switches
# (docs/testing.md, "Opt-in variables"), which choose what runs, not how the code behaves, and
# how `make setup` built this environment (.ci/setup's cache and GPU build), which the tests of
# the installed build must match.
KEPT_ENV = frozenset({"RINGTRAIN_FULL", "RINGTRAIN_FAULTS", "RINGTRAIN_FAULT_LOG", "HOROVOD_SDIST",
                      "RINGTRAIN_CACHE", "HOROVOD_GPU_OPERATIONS"})


def changes_behaviour(name: str) -> bool:
    """A caller's variable the suite does not inherit (see KEPT_ENV for those it does)."""
    return (name == "MNIST_DIR" or name.startswith(("RINGTRAIN_", "HOROVOD_"))) and name not in KEPT_ENV


CALLERS_ENV = {name: os.environ[name] for name in sorted(os.environ) if changes_behaviour(name)}


def callers_mnist() -> Path | None:
    """The caller's MNIST_DIR where it holds the four MNIST files (the skip messages' advice, for
    a machine without ../shared/data/mnist), else None."""
    from ringtrain.data import mnist

    given = CALLERS_ENV.get("MNIST_DIR")
    folder = Path(given).expanduser() if given else None
    return folder if folder and all((folder / name).is_file() for name, _ in mnist.FILES.values()) else None


def default_mnist() -> Path:
    from ringtrain.data import mnist

    return mnist.default_data_dir()


# The MNIST files the tests read: the caller's folder (above), else where the trainers look by
# default (../shared/data/mnist, else ~/.cache/ringtrain/mnist).  The same bytes either way: the
# trainers check every file's MD5.
MNIST = callers_mnist() or default_mnist()
# What the suite sets in os.environ itself, for this process and every process it starts: the
# session's decode cache (as run() gives it), and MNIST_DIR only where the caller's folder holds
# the files (an MNIST_DIR without them, or none, leaves the trainers' default).
SUITE_ENV = {"RINGTRAIN_DECODE_CACHE": DECODE_CACHE,
             **({"MNIST_DIR": str(MNIST)} if callers_mnist() else {})}


def suite_environment() -> None:
    """os.environ as the suite runs: no variable that changes behaviour but SUITE_ENV's."""
    for name in [name for name in os.environ if changes_behaviour(name)]:
        del os.environ[name]
    os.environ.update(SUITE_ENV)


suite_environment()


@pytest.fixture(autouse=True)
def _suite_environment():
    """Every test starts, and leaves, with the suite's environment (in-process library code sets
    HOROVOD_* itself: the stall check, the timeline, the autotuner)."""
    suite_environment()
    yield
    suite_environment()


def run(cmd: list[str], timeout: float = 300, env: dict | None = None,
        cwd: Path | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2",
                "RINGTRAIN_DECODE_CACHE": DECODE_CACHE, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=stdin,
                          env=full_env, cwd=cwd or REPO)


def train(module: str, args: list[str], np: int = 2, how: str = "horovodrun",
          timeout: float = 300, expect_ok: bool = True, env: dict | None = None):
    proc = run(launch_cmd(module, args, np, how), timeout=timeout, env=env)
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"{module} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-3000:]}")
    return proc


def metrics(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def one_error_line(proc, *needles: str) -> str:
    """The run ended as bad input must: exit status 2, no traceback, exactly one ``error:`` line,
    which names every needle."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` (e.g. ``2m``) mounted on ``folder`` (created), unmounted afterwards;
    skips the test where it cannot be mounted (not root)."""
    folder.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "ringtrain-test-tmpfs", str(folder)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {proc.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def horovod_ready() -> bool:
    return (BIN / "horovodrun").exists()


requires_horovod = pytest.mark.skipif(not horovod_ready(), reason="horovod is not installed; run make setup")


@pytest.fixture(scope="module")
def hosts():
    """Two network-namespace "hosts" with their own addresses and sshd (bench/common/netns_hosts.py),
    shared by a test module; the module skips with the reason where they cannot be made."""
    try:
        with netns_hosts.two_hosts() as made:
            yield made
    except netns_hosts.Unavailable as err:
        pytest.skip(f"cannot make two hosts with their own addresses and sshd here: {err}")


def pytest_collection_modifyitems(config, items):
    """CI's share (tests/ci_share.py): the launches that repeat a proof run with RINGTRAIN_FULL=1."""
    import ci_share

    for item in items:
        why = ci_share.reason(item.nodeid)
        if why:
            item.add_marker(pytest.mark.skip(reason=why))


_SUITE_START = [0.0]


def pytest_sessionstart(session):
    import time

    _SUITE_START[0] = time.monotonic()


def pytest_terminal_summary(terminalreporter):
    """The suite's own time (CI's target: 20 min on an idle 2-core machine), and which share ran."""
    import time

    import ci_share

    minutes = (time.monotonic() - _SUITE_START[0]) / 60
    share = "the full suite" if ci_share.FULL else "CI's share (RINGTRAIN_FULL=1 runs the rest)"
    terminalreporter.write_line(f"ringtrain: {share} took {minutes:.1f} min")
