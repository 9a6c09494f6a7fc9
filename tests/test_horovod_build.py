"""A Horovod built from another patch series never runs silently: the trainers and setup refuse it.

``make setup`` records the series' hash (.ci/horovod-build.sh: series_sha256) inside the Horovod
wheel it builds (``horovod/_ringtrain_patch.py``).  A stale wheel (an older checkout's series) or a
foreign one (PyPI's, a container's) lacks fixes the trainers rely on; upstream 0.28.1 on Keras 3
trained ranks apart without an error.
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

from ringtrain.horovod_build import ANY_HOROVOD, horovod_build_problem, series_sha256

SERIES = REPO / ".ci" / "horovod-patches"


def record(folder: Path, sha: str | None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if sha is not None:
        (folder / "_ringtrain_patch.py").write_text(f'PATCH_SHA256 = "{sha}"\n')
    return folder


def shell_series_sha256(series: Path) -> str:
    """The series' hash as setup computes it (.ci/horovod-build.sh)."""
    script = f'source {REPO / ".ci" / "horovod-build.sh"}; series_sha256 "$1"'
    proc = subprocess.run(["bash", "-c", script, "x", str(series)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_series_hash_covers_order_names_and_content(tmp_path):
    """Setup (bash) and the trainers' check (Python) hash a series alike, and the hash moves with
    each patch's content, name and place in the series, not with the series file's comments."""
    series = tmp_path / "s"
    series.mkdir()
    (series / "a.patch").write_bytes(b"one\n")
    (series / "b.patch").write_bytes(b"two\n")
    (series / "series").write_text("# comment\na.patch\n\nb.patch  # trailing comment\n")
    first = series_sha256(series)
    assert first == shell_series_sha256(series)
    lines = "".join(f"{hashlib.sha256(c).hexdigest()}  {n}\n" for n, c in [("a.patch", b"one\n"),
                                                                          ("b.patch", b"two\n")])
    assert first == hashlib.sha256(lines.encode()).hexdigest()
    (series / "series").write_text("a.patch\nb.patch\n")
    assert series_sha256(series) == first
    (series / "series").write_text("b.patch\na.patch\n")
    assert series_sha256(series) != first
    (series / "series").write_text("a.patch\nb.patch\n")
    (series / "b.patch").write_bytes(b"two!\n")
    assert series_sha256(series) != first and series_sha256(series) == shell_series_sha256(series)


def test_the_build_check_accepts_only_the_checkouts_series(tmp_path, monkeypatch):
    monkeypatch.delenv(ANY_HOROVOD, raising=False)
    series = tmp_path / "series-dir"
    series.mkdir()
    (series / "fix.patch").write_bytes(b"the patch\n")
    (series / "series").write_text("fix.patch\n")
    want = series_sha256(series)
    assert horovod_build_problem(series, record(tmp_path / "same", want)) is None
    stale = horovod_build_problem(series, record(tmp_path / "stale", "0" * 64))
    assert "was built from another version of the patch series" in stale and "make setup" in stale, stale
    foreign = horovod_build_problem(series, record(tmp_path / "foreign", None))
    assert "was not built by ringtrain's setup" in foreign and ANY_HOROVOD in foreign, foreign
    (series / "series").write_text("fix.patch\nlost.patch\n")
    incomplete = horovod_build_problem(series, record(tmp_path / "incomplete", want))
    assert "incomplete" in incomplete and "lost.patch" in incomplete, incomplete
    monkeypatch.setenv(ANY_HOROVOD, "1")
    assert horovod_build_problem(series, record(tmp_path / "foreign2", None)) is None
    assert horovod_build_problem(tmp_path / "no-series-here", record(tmp_path / "f3", None)) is None


def test_without_a_checkout_a_horovod_that_records_no_patch_is_still_refused(tmp_path, monkeypatch):
    """ringtrain installed without its checkout (``pip install .``: no patch beside the package)
    cannot tell which patch a build records, but PyPI's Horovod, which records none, is still one
    line (the check used to switch itself off there)."""
    monkeypatch.delenv(ANY_HOROVOD, raising=False)
    nowhere = tmp_path / "no-patch-here"
    foreign = horovod_build_problem(nowhere, record(tmp_path / "foreign", None))
    assert foreign and "was not built by ringtrain's setup" in foreign, foreign
    assert horovod_build_problem(nowhere, record(tmp_path / "ours", "0f" * 32)) is None


@requires_horovod
def test_the_installed_build_is_this_checkouts():
    assert horovod_build_problem() is None


@requires_horovod
def test_a_checkout_with_another_series_refuses_the_installed_horovod(tmp_path):
    """The same code beside a changed patch series (a pull without 'make setup'): one line, exit 2,
    before any framework loads."""
    copy = tmp_path / "checkout"
    for package in ("launch", "ringtrain", "torch_models", "tf_models"):
        shutil.copytree(REPO / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(SERIES, copy / ".ci" / SERIES.name)
    last = (copy / ".ci" / SERIES.name / "series").read_text().split()[-1]
    with open(copy / ".ci" / SERIES.name / last, "ab") as patch:
        patch.write(b"# one more fix\n")
    proc = run([sys.executable, "-m", "launch.torch_mnist", "--epochs", "1"],
               env={"PYTHONPATH": str(copy)}, cwd=copy)
    one_error_line(proc, "was built from another version of the patch series", "run 'make setup'")


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
    """A wheel under this checkout's cache key that was not built from its series: setup stops with
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
                   f".ci/horovod-patches", "it records patch series 'none'", "delete that folder"):
        assert needle in errors[0], errors[0]
    assert not (venv / ".horovod-key").exists()
