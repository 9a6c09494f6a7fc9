"""Jobs that die in the middle: fail fast, never hang, keep the newest checkpoint loadable.

These tests really kill, stop and interrupt processes of a running ``horovodrun`` job, then check
that the whole job ends within the bound and leaves no rank behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, launch_cmd, metrics, requires_horovod, run, train

from ringtrain.output.files import atomic_write_bytes

pytestmark = requires_horovod
MODULE = "launch.torch_mnist"
# Long enough to still be training when we strike: many short epochs, a checkpoint after each.
LONG = ["--train-samples", "2048", "--test-samples", "200", "--batch-size", "32", "--epochs", "200",
        "--no-progress"]


def rank_processes(marker: str) -> list[psutil.Process]:
    """This test's rank processes (their command line carries the test's unique folder)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if MODULE in cmd and any(marker in part for part in cmd):
            found.append(proc)
    return found


def rank_of(proc: psutil.Process) -> int | None:
    env = proc.environ()
    for name in ("OMPI_COMM_WORLD_RANK", "HOROVOD_RANK"):
        if name in env:
            return int(env[name])
    return None


def start_job(tmp_path: Path, how: str = "horovodrun", extra: tuple[str, ...] = (),
              pythonpath: str = str(REPO)):
    ckpt = tmp_path / "ckpt"
    cmd = launch_cmd(MODULE, [*LONG, "--checkpoint-dir", str(ckpt), *extra], np=2, how=how)
    env = {**os.environ, "PYTHONPATH": pythonpath}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    deadline = time.monotonic() + 180
    while not list(ckpt.glob("ckpt-epoch*.pt")):
        if job.poll() is not None or time.monotonic() > deadline:
            out = job.communicate(timeout=30)[0] if job.poll() is not None else ""
            kill_tree(job)
            pytest.fail(f"job never reached its first checkpoint:\n{out[-3000:]}")
        time.sleep(0.5)
    return job, ckpt


def kill_tree(job: subprocess.Popen) -> None:
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wait_job(job: subprocess.Popen, limit: float) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        out, _ = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        kill_tree(job)
        out, _ = job.communicate()
        pytest.fail(f"job still running {limit:.0f}s after the fault:\n{out[-3000:]}")
    return job.returncode, out, time.monotonic() - t0


def assert_no_ranks_left(marker: str) -> None:
    deadline = time.monotonic() + 10
    while rank_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = rank_processes(marker)
    assert not left, f"rank processes left running: {[p.pid for p in left]}"


@pytest.mark.parametrize("how", ["horovodrun", "gloo"])
@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "exception"])
def test_dead_rank_fails_the_job_fast(how, fault, tmp_path):
    """Rank 1 dies (SIGKILL, or a KeyboardInterrupt raised in Python): the job exits non-zero
    within 60 s and no rank is left running."""
    job, _ = start_job(tmp_path, how)
    victims = [p for p in rank_processes(str(tmp_path)) if rank_of(p) == 1]
    assert victims, "rank 1 not found"
    victims[0].send_signal(fault)
    rc, out, took = wait_job(job, 60)
    assert rc != 0, out[-2000:]
    assert_no_ranks_left(str(tmp_path))
    if how == "horovodrun" and fault == signal.SIGKILL:
        assert "rank 1" in out, out[-2000:]  # mpirun: "process rank 1 ... exited on signal 9"
    if fault == signal.SIGINT:
        assert "rank 1 interrupted" in out, out[-2000:]


def test_stalled_rank_is_named_and_the_job_ends(tmp_path):
    """Rank 1's Python thread hangs outside any collective while its Horovod thread lives on: the
    job ends after --stall-timeout instead of letting rank 0 wait forever, with one line naming
    rank 1 and where its main thread is stuck (rank 0's watchdog hears its heartbeats, which carry
    that; Horovod's stall check, armed by the same flag, may end it first and is then explained
    the same way).  (The hang is injected through a sitecustomize on the test's PYTHONPATH:
    SIGUSR2 makes the main thread sleep, like a rank stuck in its input pipeline.)"""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGUSR2, lambda *a: time.sleep(3600))\n")
    job, _ = start_job(tmp_path, extra=("--stall-timeout", "10"), pythonpath=f"{hooks}:{REPO}")
    victim = next(p for p in rank_processes(str(tmp_path)) if rank_of(p) == 1)
    victim.send_signal(signal.SIGUSR2)
    rc, out, took = wait_job(job, 90)
    assert rc != 0
    errors = [ln for ln in out.splitlines() if "error: " in ln]
    assert len(errors) == 1, out[-3000:]
    assert "rank 1 (" in errors[0] and "stuck outside Horovod" in errors[0], errors[0]
    assert "sitecustomize.py" in errors[0], errors[0]
    assert_no_ranks_left(str(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupting_the_launcher_keeps_newest_checkpoint_loadable(sig, tmp_path):
    """Ctrl-C or SIGTERM to horovodrun: every rank stops, and the newest checkpoint resumes."""
    job, ckpt = start_job(tmp_path)
    time.sleep(2)
    os.killpg(job.pid, sig)
    rc, out, took = wait_job(job, 60)
    assert rc != 0
    assert_no_ranks_left(str(tmp_path))
    assert not list(ckpt.glob(".*.tmp")), "a half-written checkpoint was left behind"
    newest = max(int(p.stem.split("epoch")[1]) for p in ckpt.glob("ckpt-epoch*.pt"))
    # Resume exactly to the newest epoch: loads it, trains nothing, evaluates.
    proc = run([sys.executable, "-m", MODULE, *LONG[:-3], "--epochs", str(newest), "--no-progress",
                "--checkpoint-dir", str(ckpt), "--resume", "--metrics-out", str(tmp_path / "m.json")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert metrics(tmp_path / "m.json")["resumed_from_epoch"] == newest


# Deterministic enough to compare runs: no dropout, fixed seed, a few seconds per epoch at np 2.
RESUME = ["--train-samples", "4096", "--test-samples", "500", "--batch-size", "32", "--epochs", "3",
          "--dropout", "0", "--seed", "11", "--no-progress"]


@pytest.mark.parametrize("module,ext", [(MODULE, "pt"), ("launch.tf_mnist", "npz")], ids=["torch", "tf"])
def test_resume_after_crash_matches_the_uninterrupted_run(module, ext, tmp_path):
    """A rank is SIGKILLed after the first checkpoint; --resume continues from the newest complete
    epoch, sees the same data order in the remaining epochs (same per-epoch train loss as the
    uninterrupted run) and ends in the same accuracy band."""
    train(module, [*RESUME, "--metrics-out", str(tmp_path / "full.json")])
    full = metrics(tmp_path / "full.json")

    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen(launch_cmd(module, [*RESUME, "--checkpoint-dir", str(ckpt)], np=2),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    deadline = time.monotonic() + 180
    while not list(ckpt.glob(f"ckpt-epoch*.{ext}")):
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint before the crash"
        time.sleep(0.2)
    victim = [p for p in psutil.process_iter(["cmdline"])
              if module in (p.info["cmdline"] or []) and str(ckpt) in p.info["cmdline"]
              and rank_of(p) == 1]
    victim[0].kill()
    rc, out, _ = wait_job(job, 60)
    assert rc != 0
    crashed_at = max(int(p.name[10:14]) for p in ckpt.glob(f"ckpt-epoch*.{ext}"))
    assert crashed_at < 3, "the run finished before the crash: nothing left to resume"

    train(module, [*RESUME, "--checkpoint-dir", str(ckpt), "--resume",
                   "--metrics-out", str(tmp_path / "resumed.json")])
    resumed = metrics(tmp_path / "resumed.json")
    assert resumed["resumed_from_epoch"] == crashed_at
    assert [e["epoch"] for e in resumed["epochs"]] == list(range(crashed_at + 1, 4))
    for got in resumed["epochs"]:
        want = full["epochs"][got["epoch"] - 1]
        assert got["train_loss"] == pytest.approx(want["train_loss"], rel=1e-3), (got, want)
    assert abs(resumed["final_test_accuracy"] - full["final_test_accuracy"]) <= 0.01
    assert len(set(resumed["param_checksums"])) == 1


def test_corrupt_checkpoint_is_one_clear_error(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "ckpt-epoch0003.pt").write_bytes(b"\x00garbage, not a checkpoint")
    proc = run([sys.executable, "-m", MODULE, *LONG, "--checkpoint-dir", str(ckpt), "--resume"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "ckpt-epoch0003.pt is corrupt" in lines[0], proc.stderr


def test_checkpoint_of_another_model_is_refused(tmp_path):
    import torch

    ckpt = tmp_path / "ckpt"
    run([sys.executable, "-m", MODULE, *LONG[:-3], "--epochs", "1", "--no-progress",
         "--checkpoint-dir", str(ckpt)])
    path = ckpt / "ckpt-epoch0001.pt"
    state = torch.load(path, weights_only=True)
    state["meta"]["model"] = "resnet-50"
    torch.save(state, path)
    proc = run([sys.executable, "-m", MODULE, *LONG, "--checkpoint-dir", str(ckpt), "--resume"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "belongs to model 'resnet-50', not 'mnist-cnn-v1'" in proc.stderr


def test_atomic_write_keeps_previous_file_when_interrupted(tmp_path, monkeypatch):
    target = tmp_path / "ckpt-epoch0001.pt"
    atomic_write_bytes(target, b"old and complete")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # the kill arrives between writing and renaming

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(target, b"new" * 1000)
    assert target.read_bytes() == b"old and complete"
    assert [p.name for p in tmp_path.iterdir()] == [target.name], "temp file left behind"
