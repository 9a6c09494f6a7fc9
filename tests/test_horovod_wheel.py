"""`make wheel`'s Horovod in a user's own venv: installed with docs/healed-horovod.md's command, it
runs Horovod's own examples unchanged at -np 2 with identical weights on both ranks, and next to
another torch it is refused at import in one line.

The wheel is the one setup built and cached (.ci/wheel copies it; nothing is built here): without
it the tests skip.  The fresh venvs get the pinned stack the cheap way: a folder of symlinks to
this venv's site-packages, less Horovod (and, for the mismatch, less torch), named by a .pth file.
A venv with its own copy of torch and TensorFlow would hold about 7 GB (this venv's size) and take
minutes to install; the view holds the very files a venv with the pinned versions has, so what the
test installs and runs is the wheel alone, as a user's `pip install` would: pip sees the pinned
stack installed, resolves the wheel's requirements against it and puts Horovod, its
`horovodrun` included, into the fresh venv, whose own site-packages come first on sys.path.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from ringtrain.horovod_build import CHECKOUT_SERIES, series_sha256

EXAMPLES = REPO.parent / "shared" / "horovod-0.28.1" / "examples"
RUN = ("pytorch/pytorch_mnist.py", "tensorflow2/tensorflow2_keras_mnist.py")
SITE = next(Path(sys.prefix).glob("lib/python*/site-packages"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """make wheel's output (.ci/wheel into a temp folder, for this venv): the wheel, what it printed."""
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run(["bash", str(REPO / ".ci" / "wheel"), str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RINGTRAIN_VENV": sys.prefix})
    if proc.returncode == 2 and "run 'make setup'" in proc.stderr:
        pytest.skip(f"no wheel to test: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    wheels = list(out.glob("horovod-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0], proc.stdout


def torch_version(python: str) -> str:
    """torch.__version__ as that interpreter imports it (the distribution's metadata lacks the
    local part: 2.14.1 for 2.14.1+cu130)."""
    return subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                          text=True, timeout=120, check=True).stdout.strip()


def fresh_venv(where: Path, leave_out: tuple[str, ...]) -> Path:
    """A new venv that sees this venv's packages but those whose name starts with one of
    leave_out (and its own, installed later, first)."""
    view = where / "stack"
    view.mkdir(parents=True)
    for entry in SITE.iterdir():
        if not entry.name.lower().startswith(leave_out):
            (view / entry.name).symlink_to(entry)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "pinned-stack.pth").write_text(f"{view}\n")
    return venv


def pip_install(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install",
                           "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=600)


def test_make_wheel_names_its_series_and_what_it_is_bound_to(wheel):
    path, printed = wheel
    version = f"0.28.1+ringtrain.{series_sha256(CHECKOUT_SERIES)[:10]}"
    assert path.name.startswith(f"horovod-{version}-cp{sys.version_info[0]}{sys.version_info[1]}-"), path.name
    bound = next(line for line in printed.splitlines() if "bound to:" in line)
    tf = "tensorflow-cpu" if _has("tensorflow-cpu") else "tensorflow"
    for needle in (f"Python {sys.version_info[0]}.{sys.version_info[1]}",
                   f"torch {torch_version(sys.executable)},",
                   f"TensorFlow {importlib.metadata.version(tf)}", "Open MPI", "GCC "):
        assert needle in bound, (needle, bound)


def _has(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not EXAMPLES.is_dir(), reason=f"no Horovod examples at {EXAMPLES}")
def test_the_wheel_runs_horovods_own_examples_in_a_users_venv(wheel, tmp_path):
    path, _ = wheel
    venv = fresh_venv(tmp_path, ("horovod",))
    proc = pip_install(venv, str(path))  # docs/healed-horovod.md's command
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import horovod, importlib.metadata as m; "
                           "print(horovod.__version__, m.version('horovod'), horovod.__file__)"],
                          capture_output=True, text=True, timeout=120, check=True).stdout.split()
    version = path.name.split("-")[1]
    assert said[:2] == [version, version] and said[2].startswith(str(venv)), said
    run = subprocess.run([str(venv / "bin" / "horovodrun"), "--version"], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.strip() == version, run.stdout + run.stderr

    proc = subprocess.run(["bash", str(REPO / ".ci" / "horovod-examples"), str(EXAMPLES)],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "RINGTRAIN_VENV": str(venv), "HVD_EXAMPLES": " ".join(RUN),
                               "HVD_EXAMPLES_OUT": str(tmp_path / "out")})
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.startswith(RUN)}
    assert proc.returncode == 0 and sorted(rows) == sorted(RUN), proc.stdout[-3000:] + proc.stderr[-2000:]
    for example, (code, models, identical, _seconds) in rows.items():
        # exit status 0, at least one model's final weights, the same on both ranks
        assert code == "0" and int(models) >= 1 and identical == "yes", (example, rows[example])


def test_next_to_another_torch_the_wheel_is_refused_at_import_in_one_line(wheel, tmp_path):
    """torch 2.13.0 (the wheel this machine's pip finds without an index; skipped where there is
    none) in a venv that otherwise has the pinned stack: pip installs the wheel, and importing
    horovod.torch fails with one line that names the torch the build needs."""
    path, _ = wheel
    venv = fresh_venv(tmp_path, ("horovod", "torch"))
    other = pip_install(venv, "--no-index", "--no-deps", "torch==2.13.0")
    if other.returncode != 0:
        pytest.skip(f"no torch 2.13.0 wheel reachable without an index: {other.stderr.strip()[-300:]}")
    proc = pip_install(venv, str(path))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    py = str(venv / "bin" / "python")
    found, built = torch_version(py), torch_version(sys.executable)
    proc = subprocess.run([py, "-c", "import horovod.torch"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        rf"horovod\.common\.exceptions\.HorovodVersionMismatchError: Horovod was built for pytorch "
        rf"{re.escape(built)}, but this process imports pytorch {re.escape(found)}: install "
        rf"torch=={re.escape(built)}, or rebuild Horovod for pytorch {re.escape(found)} \(.*\)", last), last
    # the same venv's TensorFlow is the build's: horovod.tensorflow imports
    tf = subprocess.run([py, "-c", "import horovod.tensorflow"], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert tf.returncode == 0, tf.stderr[-2000:]
