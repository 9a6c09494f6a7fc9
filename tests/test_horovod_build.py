"""A Horovod built from another patch never runs silently: the trainers and setup refuse it.

``make setup`` records the patch's SHA-256 inside the Horovod wheel it builds
(``horovod/_ringtrain_patch.py``).  A stale wheel (an older checkout's patch) or a foreign one
(PyPI's, a container's) lacks fixes the trainers rely on; upstream 0.28.1 on Keras 3 trained ranks
apart without an error.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, one_error_line, requires_horovod, run

from launch.dispatch import ANY_HOROVOD, horovod_build_problem

PATCH = REPO / ".ci" / "horovod-0.28.1.patch"


def record(folder: Path, patch_bytes: bytes | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if patch_bytes is not None:
        sha = hashlib.sha256(patch_bytes).hexdigest()
        (folder / "_ringtrain_patch.py").write_text(f'PATCH_SHA256 = "{sha}"\n')
    return folder


def test_the_build_check_accepts_only_the_checkouts_patch(tmp_path, monkeypatch):
    monkeypatch.delenv(ANY_HOROVOD, raising=False)
    patch = tmp_path / "p.patch"
    patch.write_bytes(b"the patch\n")
    assert horovod_build_problem(patch, record(tmp_path / "same", b"the patch\n")) is None
    stale = horovod_build_problem(patch, record(tmp_path / "stale", b"an older patch\n"))
    assert "was built from another version of the patch" in stale and "make setup" in stale, stale
    foreign = horovod_build_problem(patch, record(tmp_path / "foreign", None))
    assert "was not built by ringtrain's setup" in foreign and ANY_HOROVOD in foreign, foreign
    monkeypatch.setenv(ANY_HOROVOD, "1")
    assert horovod_build_problem(patch, record(tmp_path / "foreign2", None)) is None
    assert horovod_build_problem(tmp_path / "no-patch-here", record(tmp_path / "f3", None)) is None


def test_without_a_checkout_a_horovod_that_records_no_patch_is_still_refused(tmp_path, monkeypatch):
    """ringtrain installed without its checkout (``pip install .``: no patch beside the package)
    cannot tell which patch a build records, but PyPI's Horovod, which records none, is still one
    line (the check used to switch itself off there)."""
    monkeypatch.delenv(ANY_HOROVOD, raising=False)
    nowhere = tmp_path / "no-patch-here"
    foreign = horovod_build_problem(nowhere, record(tmp_path / "foreign", None))
    assert foreign and "was not built by ringtrain's setup" in foreign, foreign
    assert horovod_build_problem(nowhere, record(tmp_path / "ours", b"some patch\n")) is None


@requires_horovod
def test_the_installed_build_is_this_checkouts():
    assert horovod_build_problem() is None


@requires_horovod
def test_a_checkout_with_another_patch_refuses_the_installed_horovod(tmp_path):
    """The same code beside a changed patch (a pull without 'make setup'): one line, exit 2,
    before any framework loads."""
    copy = tmp_path / "checkout"
    for package in ("launch", "torch_models", "tf_models"):
        shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / ".ci").mkdir()
    (copy / ".ci" / PATCH.name).write_bytes(PATCH.read_bytes() + b"# one more fix\n")
    proc = run([sys.executable, "-m", "launch.torch_mnist", "--epochs", "1"],
               env={"PYTHONPATH": str(copy)}, cwd=copy)
    one_error_line(proc, "was built from another version of the patch", "run 'make setup'")


def wheel_patch(wheel: Path) -> str:
    """The shell helper .ci/setup uses on a cached wheel."""
    script = f'source {REPO / ".ci" / "horovod-build.sh"}; wheel_patch "$1" {sys.executable}'
    proc = subprocess.run(["bash", "-c", script, "x", str(wheel)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def fake_wheel(path: Path, record_text: str | None) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("horovod/__init__.py", "__version__ = '0.28.1'\n")
        if record_text is not None:
            wheel.writestr("horovod/_ringtrain_patch.py", record_text)
    return path


def test_setup_reads_the_patch_a_wheel_records(tmp_path):
    assert wheel_patch(fake_wheel(tmp_path / "a.whl", None)) == ""
    assert wheel_patch(fake_wheel(tmp_path / "b.whl", 'PATCH_SHA256 = "abc123"\n')) == "abc123"
    assert wheel_patch(tmp_path / "missing.whl") == ""


@requires_horovod
def test_setup_refuses_a_foreign_wheel_in_its_cache(tmp_path):
    """A wheel under this checkout's cache key that was not built from its patch: setup stops with
    one line instead of installing it.  The throwaway venv borrows the installed stack (a .pth
    file), so setup gets to its cache within seconds and installs nothing."""
    key_file = Path(sys.prefix) / ".horovod-key"
    if not key_file.is_file():
        pytest.skip(f"{key_file} is missing: this venv was not made by .ci/setup")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    borrowed = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    (site / "borrowed.pth").write_text(f"{borrowed}\n")
    shutil.copytree(borrowed / "pip", site / "pip")  # pip itself, to run "already satisfied"
    wheel_dir = tmp_path / "cache" / "wheels" / key_file.read_text().strip()
    wheel_dir.mkdir(parents=True)
    fake_wheel(wheel_dir / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl", None)
    proc = subprocess.run(["bash", str(REPO / ".ci" / "setup")], capture_output=True, text=True,
                          timeout=600, env={"PATH": f"{venv / 'bin'}:/usr/bin:/bin:/usr/sbin:/sbin",
                                            "HOME": str(Path.home()), "RINGTRAIN_VENV": str(venv),
                                            "RINGTRAIN_CACHE": str(tmp_path / "cache")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "ERROR:" in ln]
    assert len(errors) == 1, proc.stderr[-2000:]
    for needle in (f"the cached Horovod wheel in {wheel_dir} was not built from this checkout's "
                   f".ci/horovod-0.28.1.patch", "it records patch 'none'", "delete that folder"):
        assert needle in errors[0], errors[0]
    assert not (venv / ".horovod-key").exists()
