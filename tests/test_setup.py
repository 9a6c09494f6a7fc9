"""``.ci/setup`` on a machine it cannot finish on: one line naming what is missing, exit status 2,
nothing created; and a failed Horovod build reported by its first real error.

The missing-tools case runs setup as an unprivileged user (``setpriv``) with a PATH that holds
only the shell tools it needs, so it cannot reach apt-get and must stop at its first step.  It
never gets near pip or the build: each test takes well under a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import REPO

BUILD_ERRORS = REPO / ".ci" / "horovod-build.sh"
# What setup calls before it gets to the missing tools (bash builtins aside).
SHELL_TOOLS = ["bash", "sed", "id", "date", "dirname", "cat", "ls", "sort", "tail", "awk"]
NOBODY = 65534


def as_user_with_path(bin_dir: Path, home: Path) -> tuple[list[str], dict[str, str]]:
    env = {"PATH": str(bin_dir), "HOME": str(home), "LANG": "C.UTF-8"}
    if os.geteuid() != 0:
        return [], env
    if shutil.which("setpriv") is None:
        pytest.skip("running setup without root needs setpriv (util-linux) here")
    return [shutil.which("setpriv"), f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"], env


@pytest.fixture
def bare_machine():
    """A PATH with the shell's tools only (no MPI, compiler, cmake, make or patch), a home, and a
    copy of the scripts setup reads, all where the unprivileged user can reach them (pytest's
    tmp_path and a clone under /root are private to root)."""
    top = Path(tempfile.mkdtemp(prefix="rt-setup-test-"))
    try:
        top.chmod(0o755)
        bin_dir, home, repo = top / "bin", top / "home", top / "repo"
        bin_dir.mkdir()
        for tool in SHELL_TOOLS:
            found = shutil.which(tool)
            assert found, tool
            (bin_dir / tool).symlink_to(found)
        home.mkdir(mode=0o777)
        home.chmod(0o777)
        (repo / ".ci").mkdir(parents=True)
        for name in (".ci/setup", ".ci/horovod-build.sh", ".ci/trust.sh", ".ci/horovod-sdist.sha256",
                     "constraints.txt"):
            shutil.copyfile(REPO / name, repo / name)
        shutil.copytree(REPO / ".ci" / "horovod-patches", repo / ".ci" / "horovod-patches")
        yield bin_dir, home, repo
    finally:
        shutil.rmtree(top, ignore_errors=True)


def run_setup(bare_machine, extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    bin_dir, home, repo = bare_machine
    prefix, env = as_user_with_path(bin_dir, home)
    return subprocess.run([*prefix, str(bin_dir / "bash"), str(repo / ".ci" / "setup")], capture_output=True,
                          text=True, timeout=60, env={**env, **extra_env}, stdin=subprocess.DEVNULL)


def test_missing_tools_are_named_in_one_line(bare_machine):
    venv = bare_machine[1] / "venv"
    proc = run_setup(bare_machine, {"RINGTRAIN_VENV": str(venv), "PYTHON": "/usr/bin/python3"})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("[setup] ERROR: missing mpirun, mpicxx, cmake, g++, make, patch"), lines[0]
    assert "apt-get install" in lines[0] and "re-run" in lines[0]
    assert not venv.exists()


def test_unknown_python_is_named_in_one_line(bare_machine):
    # Give setup every tool it asks for (as do-nothing stand-ins), so only the interpreter is wrong.
    bin_dir, home, _ = bare_machine
    for tool in ["mpirun", "mpicxx", "cmake", "g++", "make", "patch"]:
        (bin_dir / tool).symlink_to(shutil.which("true"))
    proc = run_setup(bare_machine, {"RINGTRAIN_VENV": str(home / "venv"), "PYTHON": "python3.99"})
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert lines == [lines[0]] and "PYTHON=python3.99: no such interpreter" in lines[0], proc.stderr


# --- the build-failure report ---------------------------------------------------------------------

NOISE = [
    "I0000 00:00:1795447684.626240    9996 port.cc:153] oneDNN custom operations are on.",
    "    GLOO_ENFORCE_NE(rv, -1, strerror(errno)); // Error handling",
    "[ 12%] Building CXX object CMakeFiles/gloo.dir/common/logging.cc.o",
    "In file included from /tmp/tmp.ab/horovod-0.28.1/horovod/common/group_table.cc:16:",
]
GCC_ERROR = [
    "/tmp/tmp.ab/horovod-0.28.1/horovod/common/group_table.h:35:47: error: 'string' in namespace 'std' "
    "does not name a type",
    "   35 |   int32_t GetGroupIDFromTensorName(const std::string& tensor_name) const;",
    "      |                                               ^~~~~~",
    "/tmp/tmp.ab/horovod-0.28.1/horovod/common/group_table.h:20:1: note: 'std::string' is defined in "
    "header '<string>'",
]


def first_build_error(log: Path) -> subprocess.CompletedProcess:
    script = f'set -euo pipefail; source "{BUILD_ERRORS}"; first_build_error "{log}" | cat'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_build_report_shows_the_first_compiler_error_not_the_noise(tmp_path):
    log = tmp_path / "build.log"
    later = "/tmp/tmp.ab/horovod-0.28.1/horovod/common/common.h:343:18: error: 'logic_error' is not a member"
    # a long log, so that a reader that stops early would have cut off a writer (SIGPIPE)
    log.write_text("\n".join(NOISE * 20000 + GCC_ERROR + [later, "error: subprocess-exited-with-error"]))
    proc = first_build_error(log)
    assert proc.returncode == 0, proc.stderr
    shown = proc.stdout.splitlines()
    assert shown == GCC_ERROR, shown
    assert not any(n in proc.stdout for n in NOISE[:3]) and later not in proc.stdout


def test_build_report_falls_back_to_cmake_errors_then_to_the_logs_end(tmp_path):
    log = tmp_path / "build.log"
    cmake_error = ["CMake Error at third_party/gloo/CMakeLists.txt:1 (cmake_minimum_required):",
                   "  Compatibility with CMake < 3.5 has been removed from CMake."]
    log.write_text("\n".join(NOISE + cmake_error))
    assert first_build_error(log).stdout.splitlines()[0].startswith("CMake Error at third_party/gloo")
    log.write_text("\n".join(f"line {i}" for i in range(100)))
    assert first_build_error(log).stdout.splitlines() == [f"line {i}" for i in range(84, 100)]
