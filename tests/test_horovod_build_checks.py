"""horovodrun's build checks (patch runner-build-checks-cached): what the extension was built with
is asked of it once (a forked process importing it, and TensorFlow with it: seconds of CPU), then
answered from the user's cache, whose file is trusted only where nobody else could have made it.

Each case runs Python in a process of its own with ``XDG_CACHE_HOME`` in the test's folder.  "Not
asked" is proven by making any forked process fail: the checks' only way to ask the extension.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_horovod

pytestmark = requires_horovod

NO_FORK = ("import multiprocessing\n"
           "def refuse(*a, **k):\n"
           "    raise SystemExit('the extension was asked')\n"
           "multiprocessing.get_context = refuse\n")
CHECKS = "from horovod.common import util\nprint(util.mpi_built(), util.gloo_built())\n"


def checks(cache: Path, *, asking: bool, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """mpi_built() and gloo_built() in a fresh process; with ``asking=False`` any fork ends it."""
    code = ("" if asking else NO_FORK) + CHECKS
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache), **(env or {})})


def entries(cache: Path) -> dict:
    return json.loads((cache / "horovod" / "build-checks.json").read_text())


@pytest.fixture(scope="module")
def asked(tmp_path_factory) -> dict:
    """The file one asking process leaves (the slow part, done once for the module)."""
    cache = tmp_path_factory.mktemp("asked")
    first = checks(cache, asking=True)
    assert first.stdout.split() == ["True", "True"], first.stderr[-2000:]
    folder = cache / "horovod"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / "build-checks.json").stat().st_mode) == 0o600
    return entries(cache)


def holding(cache: Path, content: dict | str) -> Path:
    """``cache``'s horovod folder as the checks make it, its file holding ``content``."""
    folder = cache / "horovod"
    folder.mkdir(mode=0o700)
    path = folder / "build-checks.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    path.chmod(0o600)
    return path


def test_a_build_answer_is_asked_once_then_read(tmp_path, asked):
    assert sorted(k.split(" ", 1)[1] for k in asked) == ["tensorflow: built with Gloo",
                                                        "tensorflow: built with MPI"]
    assert all(e["result"] is True and len(e["stamp"]) == 64 for e in asked.values())
    holding(tmp_path, asked)
    again = checks(tmp_path, asking=False)  # answered from the file: nothing forked
    assert again.returncode == 0 and again.stdout.split() == ["True", "True"], again.stderr[-2000:]
    off = checks(tmp_path, asking=False, env={"HOROVOD_BUILD_CHECK_CACHE": "0"})
    assert "the extension was asked" in off.stderr


def test_an_answer_whose_stamp_differs_is_asked_again(tmp_path, asked):
    """A rebuilt extension or another framework install changes the stamp: the kept answer (here
    planted, and wrong) is not used, and the asked one replaces it."""
    holding(tmp_path, {k: {"stamp": "0" * 64, "result": False} for k in asked})
    assert "the extension was asked" in checks(tmp_path, asking=False).stderr
    assert checks(tmp_path, asking=True).stdout.split() == ["True", "True"]
    assert entries(tmp_path) == asked


@pytest.mark.parametrize("damage", ["not json", "a list", "a string result", "too large"])
def test_a_damaged_file_is_asked_past(tmp_path, asked, damage):
    holding(tmp_path, {"not json": "{nope",
                       "a list": json.dumps(list(asked)),
                       "a string result": json.dumps({k: {**e, "result": "yes"} for k, e in asked.items()}),
                       "too large": json.dumps({**asked, "pad": {"x": "y" * 70000}})}[damage])
    assert "the extension was asked" in checks(tmp_path, asking=False).stderr


def test_a_fifo_in_the_files_place_does_not_hang_horovodrun(tmp_path, asked):
    path = holding(tmp_path, asked)
    path.unlink()
    os.mkfifo(path)  # open() for reading would wait for a writer for ever
    assert "the extension was asked" in checks(tmp_path, asking=False).stderr


def test_a_planted_link_is_neither_read_nor_followed(tmp_path, asked):
    path = holding(tmp_path, asked)
    target = tmp_path / "elsewhere.json"
    path.rename(target)  # a file with the right stamps, read through a link someone planted
    path.symlink_to(target)
    before = target.read_bytes()
    assert "the extension was asked" in checks(tmp_path, asking=False).stderr
    assert checks(tmp_path, asking=True).returncode == 0
    assert not path.is_symlink() and path.is_file()  # the link replaced, not written through
    assert target.read_bytes() == before


def test_a_file_or_folder_not_ours_alone_is_not_used(tmp_path, asked):
    path = holding(tmp_path, asked)
    path.parent.chmod(0o777)  # anyone could have put that file there
    assert "the extension was asked" in checks(tmp_path, asking=False).stderr
    path.parent.chmod(0o700)
    if os.geteuid() != 0:
        pytest.skip("giving the file to another user needs root")
    os.chown(path, 12345, -1)  # someone else's file
    assert "the extension was asked" in checks(tmp_path, asking=False).stderr


def test_horovodrun_keeps_the_answer_it_asked_for(tmp_path):
    hvdrun = Path(sys.executable).with_name("horovodrun")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    for _ in range(2):
        proc = subprocess.run([str(hvdrun), "-np", "1", "-H", "localhost:1", sys.executable, "-c", "pass"],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    kept = [e["result"] for k, e in entries(tmp_path).items() if k.endswith("tensorflow: built with MPI")]
    assert kept == [True]
