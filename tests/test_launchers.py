"""One job, any launcher: plain python, horovodrun (MPI), horovodrun --gloo, raw mpirun; and the
``python -m launch --framework`` front door with its one-line errors."""

from __future__ import annotations

import sys

import pytest
from conftest import SMALL, metrics, requires_horovod, run, train

MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
QUICK = [*SMALL, "--epochs", "1"]


@requires_horovod
@pytest.mark.parametrize("fw", ["torch", "tf"])
@pytest.mark.parametrize("how,np_,controller", [
    ("single", 1, "mpi"), ("horovodrun", 2, "mpi"), ("gloo", 2, "gloo"), ("mpirun", 2, "mpi")])
def test_same_job_under_every_launcher(fw, how, np_, controller, tmp_path):
    out = tmp_path / "m.json"
    # The framework flag and the direct module are the same job: use both across the matrix.
    module, flags = ("launch", ["--framework", fw]) if how in ("gloo", "single") else (MODULES[fw], [])
    train(module, [*flags, *QUICK, "--metrics-out", str(out)], np=np_, how=how)
    m = metrics(out)
    assert m["framework"] == fw and m["world_size"] == np_ and m["controller"] == controller
    assert len(m["param_checksums"]) == np_ and len(set(m["param_checksums"])) == 1


@requires_horovod
def test_oversubscribed_without_extra_flags(tmp_path):
    """-np 3 on a 2-core machine: horovodrun's default host list, no -H, no --oversubscribe."""
    out = tmp_path / "m.json"
    from conftest import BIN

    proc = run([str(BIN / "horovodrun"), "-np", "3", sys.executable, "-m", "launch.torch_mnist",
                *QUICK, "--metrics-out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(out)["world_size"] == 3


def test_help_lists_frameworks_and_trainer_flags():
    proc = run([sys.executable, "-m", "launch", "--help"])
    assert proc.returncode == 0
    for needle in ("--framework {torch,tf}", "--batch-size", "--fp16-allreduce", "--metrics-out"):
        assert needle in proc.stdout


def fake_package(root, name: str, body: str) -> None:
    pkg = root.joinpath(*name.split("."))
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)


@pytest.mark.parametrize("fw,shadow,needle", [
    ("tf", "tensorflow", "tensorflow is not installed"),
    ("torch", "torch", "torch is not installed"),
    ("tf", "horovod", "Horovod was not built with tensorflow support"),
])
def test_missing_framework_is_one_line(fw, shadow, needle, tmp_path):
    """A missing framework, or a Horovod without it, is named in one line with the fix."""
    if shadow == "horovod":
        fake_package(tmp_path, "horovod", "")  # a Horovod with no tensorflow extension
    else:
        fake_package(tmp_path, shadow, f'raise ImportError("No module named {shadow}")')
    from conftest import REPO

    proc = run([sys.executable, "-m", "launch", "--framework", fw, *QUICK],
               env={"PYTHONPATH": f"{tmp_path}:{REPO}"})
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "make setup" in lines[0], proc.stderr
