"""How a run ends when it cannot go on: a loss that stops being a number, a scheduler's SIGTERM,
Ctrl-C on rank 0 in the middle of a save.  Each ends every rank, in one line, with nothing
half-written and every checkpoint on disk loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from conftest import REPO, launch_cmd, one_error_line, requires_horovod, run, train

pytestmark = requires_horovod
MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
EXT = {"torch": "pt", "tf": "npz"}
# 256 images / 2 ranks / 32 per step: 4 optimizer steps per epoch.
SMALL = ["--train-samples", "256", "--test-samples", "100", "--batch-size", "32", "--no-progress"]

# Models that turn their output into NaN on one rank at one training step (counted in training
# mode: the start-up check and evaluation do not count), the way bad data or an overflow does.
POISON = textwrap.dedent('''
    import math, os

    RANK = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    AT = int(os.environ.get("POISON_AT", "0"))  # the training step (from 1) whose loss is NaN
    POISONED = RANK == int(os.environ.get("POISON_RANK", "1"))  # on which rank


    def build(input_shape, num_classes):
        import torch
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(math.prod(input_shape), num_classes)
                self.calls = 0

            def forward(self, x):
                out = self.fc(x.flatten(1))
                if self.training:
                    self.calls += 1
                    if POISONED and self.calls == AT:
                        out = out * float("nan")
                return out

        return Net()


    def build_keras(input_shape, num_classes):
        import keras
        import tensorflow as tf

        class Poison(keras.layers.Layer):
            def build(self, shape):
                self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False,
                                             name="calls")

            def call(self, x, training=False):
                if not training:
                    return x
                self.calls.assign_add(1.0)
                bad = tf.logical_and(tf.equal(self.calls, float(AT)), POISONED)
                return x * tf.where(bad, float("nan"), 1.0)

        inputs = keras.Input(input_shape)
        logits = keras.layers.Dense(num_classes)(keras.layers.Flatten()(inputs))
        return keras.Model(inputs, Poison()(logits))
''')
SPECS = {"torch": "poison:build", "tf": "poison:build_keras"}


@pytest.fixture(scope="module")
def user_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("poison")
    (root / "poison.py").write_text(POISON)
    return root


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_a_nan_loss_on_one_rank_ends_every_rank_at_that_step(framework, user_path, tmp_path):
    """Rank 1's loss is NaN at step 7 = epoch 2, step 3: both ranks stop there with one line
    naming the step and the rank, and epoch 1's checkpoint is the last one written."""
    ckpt = tmp_path / "ckpt"
    proc = train("launch", ["--framework", framework, "--model", SPECS[framework], *SMALL,
                            "--epochs", "3", "--checkpoint-dir", str(ckpt), "--stall-timeout", "60"],
                 np=2, expect_ok=False, timeout=240,
                 env={"PYTHONPATH": f"{user_path}:{REPO}", "POISON_AT": "7"})
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert "training diverged at epoch 2, step 3: the loss was nan on rank 1," in errors[0], errors[0]
    assert "no checkpoint holds them" in errors[0], errors[0]
    assert sorted(p.name for p in ckpt.iterdir()) == [f"ckpt-epoch0001.{EXT[framework]}"]


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_a_nan_loss_in_one_process_is_one_line(framework, user_path):
    proc = run([sys.executable, "-m", "launch", "--framework", framework, "--model", SPECS[framework],
                *SMALL, "--epochs", "1"],
               env={"PYTHONPATH": f"{user_path}:{REPO}", "POISON_AT": "2", "POISON_RANK": "0"})
    one_error_line(proc, "training diverged at epoch 1, step 2: the loss was nan on rank 0,")


def test_a_nan_loss_in_an_elastic_job_ends_it(user_path, tmp_path):
    """The shared elastic loop checks the weights after every step, as the fixed loops do."""
    from test_elastic import ElasticJob

    job = ElasticJob(tmp_path, "launch", ["localhost:2"], np=2, max_np=2, epochs=3,
                     extra=["--framework", "torch", "--model", SPECS["torch"], *SMALL],
                     env={"PYTHONPATH": f"{user_path}:{REPO}", "POISON_AT": "7"})
    try:
        job.proc.wait(timeout=240)
    finally:
        job.kill()
    assert job.proc.returncode != 0
    errors = [ln for ln in job.lines if "error:" in ln]
    assert errors and all("training diverged at epoch 2, step 3: the loss was nan on rank 1" in ln
                          for ln in errors), job.output()[-3000:]


# --- SIGTERM: finish a save under way, exit 143 -------------------------------------------------

LONG = ["--train-samples", "1024", "--test-samples", "100", "--batch-size", "32", "--epochs", "200",
        "--no-progress"]


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"never saw {what}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


def ended_saying(job: subprocess.Popen, line: str) -> None:
    """The job ends (within 90 s), not cleanly, without a traceback, saying ``line`` once."""
    out, err = job.communicate(timeout=90)
    assert job.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    assert (out + err).count(line) == 1, (out + err)[-3000:]


def assert_checkpoints_load(ckpt: Path, framework: str) -> list[int]:
    """No temporary file is left, and every checkpoint in the folder passes the trainer's own
    reader (archive checks included); returns their epochs."""
    from ringtrain.output import checkpoint

    assert not list(ckpt.glob(".*")), f"half-written files left: {list(ckpt.glob('.*'))}"
    epochs = []
    if framework == "torch":
        from torch_models import checkpoints
    else:
        from tf_models import checkpoints
    for path in checkpoint.newest_first(ckpt, EXT[framework]):
        meta, _ = checkpoint.load(path, checkpoints.read, 1 << 40,  # any size: ours
                                  checkpoints.expected_member)
        epochs.append(meta["epoch"])
    return epochs


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_sigterm_ends_a_run_with_143_and_one_line(framework, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", MODULES[framework], *LONG, "--checkpoint-dir",
                             str(ckpt)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    wait_for(lambda: len(list(ckpt.glob("ckpt-*"))) >= 2, "two checkpoints", proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, (proc.returncode, err[-2000:])
    assert "Traceback" not in err, err[-2000:]
    assert err.count("stopped by SIGTERM") == 1, err[-2000:]
    epochs = assert_checkpoints_load(ckpt, framework)
    resumed = run([sys.executable, "-m", MODULES[framework], *LONG[:-3], "--epochs", str(max(epochs)),
                   "--no-progress", "--checkpoint-dir", str(ckpt), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]


def test_sigterm_to_every_rank_ends_the_job(tmp_path):
    """What Slurm does on preemption: SIGTERM to every task at once."""
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen(launch_cmd("launch.torch_mnist", [*LONG, "--checkpoint-dir", str(ckpt)], np=2),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    try:
        wait_for(lambda: list(ckpt.glob("ckpt-*")), "a checkpoint", job)
        ranks = [p for p in psutil.Process(job.pid).children(recursive=True)
                 if p.cmdline()[:1] == [sys.executable] and "launch.torch_mnist" in p.cmdline()]
        assert len(ranks) == 2, ranks
        for p in ranks:
            p.send_signal(signal.SIGTERM)
        ended_saying(job, "stopped by SIGTERM")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert_checkpoints_load(ckpt, "torch")


def test_sigterm_during_a_save_lets_it_finish(tmp_path):
    """The deterministic core of "save a checkpoint if one is due": the signal arrives while the
    save runs; the file is written whole, then the process exits 143 and runs nothing after."""
    target = tmp_path / "ckpt-epoch0001.pt"
    code = textwrap.dedent(f"""
        import argparse, os, signal, time
        from ringtrain.faults import termination
        from ringtrain.output import checkpoint, files
        termination.install()

        def save(epoch):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1.0)  # the signal is pending, its thread waits for the save
            files.atomic_write_bytes({str(target)!r}, b"x" * 5_000_000)

        checkpoint.save_if_due(argparse.Namespace(checkpoint_dir={str(tmp_path)!r}), True, 1, save)
        time.sleep(10)
        print("still running")
    """)
    proc = run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 143, (proc.returncode, proc.stderr)
    assert "still running" not in proc.stdout
    assert target.stat().st_size == 5_000_000
    assert [p.name for p in tmp_path.iterdir()] == [target.name], "temp file left behind"


# --- Ctrl-C on rank 0 during a save --------------------------------------------------------------

BIG = textwrap.dedent('''
    def build(input_shape, num_classes):
        from torch import nn
        # ~16M parameters: a checkpoint (weights and momentum) of 128 MB takes a while to write.
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 20_000), nn.ReLU(),
                             nn.Linear(20_000, num_classes))
''')


def test_ctrl_c_on_rank_0_during_a_save_leaves_nothing_half_written(tmp_path):
    """SIGINT to rank 0 as soon as its save's temporary file appears: the save is abandoned,
    its temporary file removed, the job ends, and what is on disk loads.  (Whether the signal
    lands before the rename is up to the machine; the assertions hold either way.)"""
    (tmp_path / "big.py").write_text(BIG)
    ckpt = tmp_path / "ckpt"
    args = ["--framework", "torch", "--model", "big:build", "--train-samples", "128",
            "--test-samples", "32", "--batch-size", "16", "--epochs", "50", "--no-progress",
            "--checkpoint-dir", str(ckpt)]
    job = subprocess.Popen(launch_cmd("launch", args, np=2), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
                           env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"})
    try:
        wait_for(lambda: list(ckpt.glob("ckpt-*")), "a first checkpoint", job, timeout=240)
        rank0 = [p for p in psutil.Process(job.pid).children(recursive=True)
                 if p.cmdline()[:1] == [sys.executable] and "launch" in p.cmdline()
                 and p.environ().get("OMPI_COMM_WORLD_RANK") == "0"]
        assert len(rank0) == 1, rank0
        wait_for(lambda: list(ckpt.glob(".ckpt-*.tmp")), "a save in progress", job, timeout=240)
        rank0[0].send_signal(signal.SIGINT)
        ended_saying(job, "rank 0 interrupted")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert assert_checkpoints_load(ckpt, "torch"), "no checkpoint survived"
