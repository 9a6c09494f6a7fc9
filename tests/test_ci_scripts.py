"""The .ci scripts use no folder or file that someone else could have put in place.

What a script's work, cache or output folder holds is run, installed or written through as whoever
runs it (root, for ``.ci/distro-check`` and ``.ci/slurm``).  So each refuses, in one line and
before it does anything else, a folder that is not the caller's, is a symlink or that others can
write, and a symlink where it would write its log or results; and Horovod's sdist, downloaded or
given as ``HOROVOD_SDIST``, is refused unless it has the sha256 pinned in
``.ci/horovod-sdist.sha256``.  "Someone else" is ``nobody``: the planted folders are chowned to it.

Nothing real is built or run: every tool a script would reach after its check is a stand-in that
records its call (the calls log must stay empty, or hold only what runs before the check), and
the interpreter ``.ci/setup`` and ``.ci/wheel`` see is a stand-in too.  Each test takes about a
second and needs no network.  Planting files of another user needs root: the tests skip without it.
"""

from __future__ import annotations

import hashlib
import io
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import REPO

from ringtrain.horovod_build import series_sha256

CI = REPO / ".ci"
SERIES = CI / "horovod-patches"
try:
    NOBODY = pwd.getpwnam("nobody").pw_uid
except KeyError:
    NOBODY = 65534
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
requires_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's files needs root")


# --- helpers ----------------------------------------------------------------------------------------

def snapshot(folder: Path) -> dict[str, tuple]:
    """Every entry under folder, links not followed: type and mode, owner, size, mtime, link target."""
    def entry(p: Path) -> tuple:
        st = p.lstat()
        return st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, os.readlink(p) if p.is_symlink() else None
    found = {".": entry(folder)}
    if folder.is_dir() and not folder.is_symlink():
        for root, dirs, files in os.walk(folder):
            for name in dirs + files:
                p = Path(root) / name
                found[str(p.relative_to(folder))] = entry(p)
    return found


def chown_tree(folder: Path, uid: int) -> None:
    """folder and everything under it (links themselves, not their targets) to uid."""
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            os.lchown(Path(root) / name, uid, uid)
    os.lchown(folder, uid, uid)


def stand_ins(bin_dir: Path, calls: Path, names: list[str], rc: int = 0) -> None:
    """Scripts named ``names`` in bin_dir that append their command line to calls and exit rc."""
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\necho "{name} $*" >> "{calls}"\nexit {rc}\n')
        tool.chmod(0o755)


def called(calls: Path) -> list[str]:
    return calls.read_text().splitlines() if calls.exists() else []


def one_error(proc: subprocess.CompletedProcess, rc: int, *needles: str) -> str:
    """The script stopped with status rc and one line on stderr (its ERROR), naming every needle."""
    assert proc.returncode == rc, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def fake_sdist(path: Path) -> Path:
    """A tarball shaped like Horovod's sdist (enough for the build steps to go on with it)."""
    files = {"horovod-0.28.1/setup.py": b"raise SystemExit('planted')\n",
             "horovod-0.28.1/horovod/__init__.py": b"__version__ = '0.28.1'\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def pinned_sha256() -> str:
    pins = (CI / "horovod-sdist.sha256").read_text()
    found = re.findall(r"^([0-9a-f]{64})  horovod-0\.28\.1\.tar\.gz$", pins, flags=re.M)
    assert len(found) == 1, pins
    return found[0]


# --- .ci/distro-check: its work folder, as root ------------------------------------------------------

def planted_root_fs(path: Path, marker: Path) -> None:
    """A base tarball whose /usr/bin/env, run as root in the chroot, would leave marker behind."""
    with tarfile.open(path, "w") as tar:
        for folder in ("etc", "usr", "usr/bin", "usr/local", "usr/local/share", "root", "work"):
            info = tarfile.TarInfo(folder)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(info)
        script = f"#!/bin/sh\ntouch {marker}\n".encode()
        info = tarfile.TarInfo("usr/bin/env")
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))


@pytest.fixture
def distro_machine(tmp_path):
    """Stand-ins for what distro-check would run after its checks (debootstrap, unshare, chroot,
    mount, apt-get; git answers rev-parse and status, and "clones" into an empty folder), a
    shared/ folder, and the files a planted work folder points at."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    stand_ins(bin_dir, calls, ["debootstrap", "unshare", "chroot", "mount", "apt-get"])
    (bin_dir / "git").write_text(
        f'#!/bin/sh\necho "git $*" >> "{calls}"\n'
        'case "$*" in *rev-parse*) echo 0123456789abcdef0123456789abcdef01234567 ;; *status*) ;;\n'
        '  *clone*) for a; do last=$a; done; mkdir -p "$last" ;; esac\nexit 0\n')
    (bin_dir / "git").chmod(0o755)
    (tmp_path / "shared" / "data" / "mnist").mkdir(parents=True)
    victim, victim_dir = tmp_path / "victim.txt", tmp_path / "victim-dir"
    victim.write_text("a file of root's\n")
    victim_dir.mkdir()
    env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}", "HOME": str(tmp_path), "LANG": "C.UTF-8",
           "DISTRO_CHECK_SHARED": str(tmp_path / "shared"), "DISTRO_CHECK_CACHE": "0"}
    return env, calls, victim, victim_dir


def plant(work: Path, victim: Path, victim_dir: Path, marker: Path) -> None:
    """What another user leaves in the work folder: the root file system, results.tsv pointing at
    a file of theirs to choose, logs/ pointing at a folder of theirs to choose."""
    work.mkdir(exist_ok=True)
    planted_root_fs(work / "base-trixie.tar", marker)
    (work / "results.tsv").symlink_to(victim)
    (work / "logs").symlink_to(victim_dir)


def distro_check(env: dict[str, str], work: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CI / "distro-check"), "trixie"], capture_output=True, text=True,
                          timeout=120, env={**env, "DISTRO_CHECK_DIR": str(work)}, stdin=subprocess.DEVNULL)


@requires_root
@pytest.mark.parametrize("how", ["another-users-folder", "writable-by-others", "a-symlink"])
def test_distro_check_refuses_a_planted_work_folder_and_runs_nothing_of_it(distro_machine, tmp_path, how):
    """The default work folder, /var/tmp/ringtrain-distro, is anyone's to make first: a folder
    there of another user's (or that others can write, or a symlink), with a root file system, a
    results.tsv and a logs/ that are symlinks, is refused in one line.  Nothing of it is unpacked
    or run, no stand-in is called, nothing in it or outside it changes.  Before: the tarball
    became the root whose /usr/bin/env ran as root, the log went into the planter's folder and
    the summary was appended to the planter's choice of file."""
    env, calls, victim, victim_dir = distro_machine
    marker = tmp_path / "planted-env-ran"
    work = tmp_path / "planted"
    plant(work, victim, victim_dir, marker)
    chown_tree(work, NOBODY)
    if how == "writable-by-others":
        os.chown(work, 0, 0)
        work.chmod(0o777)
    elif how == "a-symlink":
        work.chmod(0o700)
        os.chown(work, 0, 0)
        link = tmp_path / "link"
        link.symlink_to(work)
        os.lchown(link, NOBODY, NOBODY)
    given = tmp_path / "link" if how == "a-symlink" else work
    before = snapshot(work), victim.read_bytes(), snapshot(victim_dir)
    proc = distro_check(env, given)
    reason = {"another-users-folder": "belongs to nobody", "writable-by-others": "is writable by others",
              "a-symlink": "is a symlink"}[how]
    line = one_error(proc, 2, "[distro-check] ERROR: work folder:", str(given), reason, "DISTRO_CHECK_DIR")
    assert proc.stdout == "", proc.stdout
    assert (snapshot(work), victim.read_bytes(), snapshot(victim_dir)) == before, line
    assert called(calls) == [] and not marker.exists()


@requires_root
@pytest.mark.parametrize("planted", ["results.tsv", "base-trixie.tar", "logs"])
def test_distro_check_follows_no_symlink_in_its_own_folder(distro_machine, tmp_path, planted):
    """A private work folder of root's with a symlink as its results.tsv, base tarball or logs/:
    refused in one line, the link's target untouched, nothing run."""
    env, calls, victim, victim_dir = distro_machine
    work = tmp_path / "work"
    work.mkdir(mode=0o700)
    planted_root_fs(tmp_path / "elsewhere.tar", tmp_path / "planted-env-ran")
    if planted == "results.tsv":
        planted_root_fs(work / "base-trixie.tar", tmp_path / "planted-env-ran")
        (work / "results.tsv").symlink_to(victim)
    elif planted == "base-trixie.tar":
        (work / "base-trixie.tar").symlink_to(tmp_path / "elsewhere.tar")
    else:
        (work / "logs").symlink_to(victim_dir)
    before = victim.read_bytes(), snapshot(victim_dir)
    proc = distro_check(env, work)
    one_error(proc, 2, "[distro-check] ERROR: work folder:", str(work / planted), "is a symlink")
    assert (victim.read_bytes(), snapshot(victim_dir)) == before
    assert called(calls) == [] and not (tmp_path / "planted-env-ran").exists()
    assert not list(work.glob("root-*")), "a root file system was unpacked"


@requires_root
def test_distro_check_makes_its_work_folder_private(distro_machine, tmp_path):
    """A missing work folder is made with umask 077 (and its logs/), then the script goes on: here
    to its next check, a shared/ folder without MNIST."""
    env, calls, _, _ = distro_machine
    work = tmp_path / "new" / "work"
    proc = distro_check({**env, "DISTRO_CHECK_SHARED": str(tmp_path / "nothing")}, work)
    one_error(proc, 2, "data/mnist not found")
    for folder in (work.parent, work, work / "logs"):
        st = folder.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700, folder
    assert called(calls) == []


# --- .ci/setup and .ci/wheel: the wheel cache and the sdist -------------------------------------------

FAKE_PYTHON = r"""#!/bin/bash
# A stand-in interpreter for .ci/setup and .ci/wheel: records its calls, installs nothing, "downloads"
# FAKE_SDIST, says torch and TensorFlow are there and Horovod is not; other stdin scripts (reading
# a wheel's records) run on the real interpreter.
echo "python $*" >> "$FAKE_LOG"
if [ "$1" = -m ] && [ "$2" = pip ]; then
  dest="" prev=""
  for a in "$@"; do [ "$prev" = -d ] && dest=$a; prev=$a; done
  if [[ " $* " == *" download "* ]] && [ -n "$dest" ]; then cp "$FAKE_SDIST" "$dest/"; fi
  exit 0
fi
if [ "$1" = - ]; then
  script=$(cat)
  case $script in
    *"import torch"*) echo "3.11 2.14.1 2.21.0 x86_64"; exit 0 ;;
    *) exec "$FAKE_REAL_PY" -c "$script" "${@:2}" ;;
  esac
fi
case "$*" in
  *version_info*) echo 3.11 ;;
  *"import horovod"*) exit 1 ;;
esac
exit 0
"""


@pytest.fixture
def fake_build_machine(tmp_path):
    """Every tool .ci/setup calls as a stand-in (apt-get fails: it must not be needed), a stand-in
    interpreter and venv, a planted sdist for its pip download; the environment to run it in."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    stand_ins(bin_dir, calls, ["mpirun", "mpicxx", "cmake", "g++", "make", "patch", "ccache", "ip", "ssh",
                               "sshd", "iptables", "horovodrun"])
    stand_ins(bin_dir, calls, ["apt-get"], rc=1)
    python = bin_dir / "python-stand-in"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(python)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "home").mkdir()
    env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8",
           "TMPDIR": str(tmp_path / "tmp"), "PYTHON": str(python), "RINGTRAIN_VENV": str(venv),
           "RINGTRAIN_CACHE": str(tmp_path / "cache"), "FAKE_LOG": str(calls), "FAKE_REAL_PY": sys.executable,
           "FAKE_SDIST": str(fake_sdist(tmp_path / "horovod-0.28.1.tar.gz"))}
    return env, calls, venv


def run_script(name: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CI / name), *args], capture_output=True, text=True, timeout=120,
                          env=env, stdin=subprocess.DEVNULL)


def foreign_cache(cache: Path, how: str, tmp_path: Path) -> Path:
    """cache made another user's, writable by others, or a symlink; the path to give."""
    if how == "another-users-folder":
        chown_tree(cache, NOBODY)
    elif how == "writable-by-others":
        cache.chmod(0o777)
    else:
        link = tmp_path / "cache-link"
        link.symlink_to(cache)
        return link
    return cache


@requires_root
@pytest.mark.parametrize("how", ["another-users-folder", "writable-by-others", "a-symlink"])
def test_setup_refuses_a_wheel_cache_that_is_not_yours(fake_build_machine, tmp_path, how):
    """The cache's wheel is installed into the venv: a cache folder of another user's (or one
    others can write, or a symlink) is refused in one line before setup installs anything, and
    nothing in it changes.  Before: setup built into it and installed what it found there."""
    env, calls, venv = fake_build_machine
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    given = foreign_cache(cache, how, tmp_path)
    before = snapshot(cache)
    proc = run_script("setup", {**env, "RINGTRAIN_CACHE": str(given)})
    one_error(proc, 2, "[setup] ERROR: the Horovod wheel cache:", str(given), "RINGTRAIN_CACHE")
    assert snapshot(cache) == before
    assert not [c for c in called(calls) if " pip " in f" {c} "], called(calls)
    assert not (venv / ".horovod-key").exists()


@requires_root
def test_setup_refuses_an_sdist_without_the_pinned_sha256(fake_build_machine, tmp_path):
    """pip's download is Horovod's sdist only with the sha256 in .ci/horovod-sdist.sha256: another
    tarball is refused in one line, never unpacked, patched or built.  The cache setup made is
    private (umask 077)."""
    env, calls, venv = fake_build_machine
    proc = run_script("setup", env)
    one_error(proc, 1, "[setup] ERROR: Horovod's sdist from pip:", "has sha256", pinned_sha256(),
              ".ci/horovod-sdist.sha256")
    assert any(" download " in c for c in called(calls)), "setup never got to the download"
    assert not [c for c in called(calls) if c.startswith("patch ") or " wheel " in c], called(calls)
    assert not (venv / ".horovod-key").exists()
    cache = tmp_path / "cache"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700 and not (cache / "wheels").exists()


def build_key(env: dict[str, str]) -> str:
    """The cache key .ci/horovod-build.sh computes in env (the stand-in interpreter's answers)."""
    script = f'source "{CI / "horovod-build.sh"}"; horovod_build_key "$PYTHON" "{SERIES}" 0.28.1'
    proc = subprocess.run(["bash", "-c", f'{script}; echo "$BUILD_KEY"'], capture_output=True, text=True,
                          timeout=60, env=env, check=True)
    return proc.stdout.strip()


@requires_root
@pytest.mark.parametrize("how", ["another-users-folder", "writable-by-others"])
def test_wheel_refuses_a_cache_that_is_not_yours(fake_build_machine, tmp_path, how):
    """`make wheel` copies the cached wheel out for your own venvs: a wheel planted under this
    checkout's key, recording its series and version, in a cache that is not yours (or that others
    can write) is refused in one line and not copied.  Before: it was copied."""
    env, _, _ = fake_build_machine
    series = series_sha256(SERIES)
    wheel_dir = tmp_path / "cache" / "wheels" / build_key(env)
    wheel_dir.mkdir(parents=True)
    with zipfile.ZipFile(wheel_dir / f"horovod-0.28.1+ringtrain.{series[:10]}-cp311-cp311-linux_x86_64.whl",
                         "w") as whl:
        whl.writestr("horovod/_ringtrain_patch.py", f'PATCH_SHA256 = "{series}"\n')
        whl.writestr(f"horovod-0.28.1+ringtrain.{series[:10]}.dist-info/METADATA",
                     f"Name: horovod\nVersion: 0.28.1+ringtrain.{series[:10]}\n")
    given = foreign_cache(tmp_path / "cache", how, tmp_path)
    out = tmp_path / "dist"
    proc = run_script("wheel", {**env, "RINGTRAIN_CACHE": str(given)}, str(out))
    one_error(proc, 2, "[wheel] ERROR: the Horovod wheel cache:", str(given))
    assert not out.exists() or not list(out.iterdir())


def test_the_pinned_sdist_hash_is_what_the_scripts_check(tmp_path):
    """verify_sdist (.ci/trust.sh) accepts a file with the sha256 pinned for its version and refuses
    any other, or a version with no pin; the repository pins one hash for horovod-0.28.1.tar.gz."""
    assert re.fullmatch(r"[0-9a-f]{64}", pinned_sha256())
    sdist = fake_sdist(tmp_path / "horovod-0.28.1.tar.gz")
    copy = tmp_path / "ci"
    copy.mkdir()
    shutil.copy(CI / "trust.sh", copy / "trust.sh")
    (copy / "horovod-sdist.sha256").write_text(
        f"# a comment\n{hashlib.sha256(sdist.read_bytes()).hexdigest()}  horovod-0.28.1.tar.gz\n")

    def verify(ci: Path, version: str = "0.28.1") -> subprocess.CompletedProcess:
        script = f'source "{ci}/trust.sh"; verify_sdist "$1" "$2"'
        return subprocess.run(["bash", "-c", script, "-", str(sdist), version], capture_output=True,
                              text=True, timeout=60)
    assert verify(copy).returncode == 0
    assert verify(copy, "0.28.2").returncode == 1 and "no sha256 is pinned" in verify(copy, "0.28.2").stdout
    theirs = verify(CI)
    assert theirs.returncode == 1 and f"not the {pinned_sha256()} pinned" in theirs.stdout, theirs.stdout


# --- the other scripts that take an sdist or write into a folder ---------------------------------------

def test_gpu_check_refuses_an_sdist_without_the_pinned_sha256(tmp_path):
    """HOROVOD_SDIST is copied into the build folder and checked before anything else is done:
    another tarball is refused in one line (before the first step), and the copy removed."""
    build = tmp_path / "build"
    proc = run_script("gpu-check", {**os.environ, "GPU_CHECK_BUILD": str(build), "PYTHON": "false",
                                    "GPU_CHECK_OUT": str(tmp_path / "out"),
                                    "HOROVOD_SDIST": str(fake_sdist(tmp_path / "h.tar.gz"))})
    one_error(proc, 1, "[gpu-check] ERROR: Horovod's sdist:", "has sha256", pinned_sha256())
    assert "===" not in proc.stdout, "it went on"
    assert not list(build.iterdir())


@requires_root
def test_gpu_check_refuses_an_output_folder_that_is_not_yours(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    chown_tree(out, NOBODY)
    before = snapshot(out)
    proc = run_script("gpu-check", {**os.environ, "GPU_CHECK_BUILD": str(tmp_path / "build"),
                                    "GPU_CHECK_OUT": str(out), "PYTHON": "false"})
    one_error(proc, 1, "[gpu-check] ERROR: output folder:", "belongs to nobody", "GPU_CHECK_OUT")
    assert "===" not in proc.stdout and snapshot(out) == before


def test_horovod_patch_refuses_an_sdist_without_the_pinned_sha256(tmp_path):
    tree = tmp_path / "tree"
    sdist = fake_sdist(tmp_path / "h.tar.gz")
    proc = run_script("horovod-patch", {**os.environ, "HOROVOD_SDIST": str(sdist)}, "tree", str(tree))
    one_error(proc, 2, "error: Horovod's sdist:", "has sha256", pinned_sha256())
    assert not tree.exists()


@pytest.fixture
def stand_in_venv(tmp_path, fake_build_machine):
    """The stand-in interpreter as a venv, with horovodrun and mpirun stand-ins on PATH."""
    env, calls, venv = fake_build_machine
    stand_ins(venv / "bin", calls, ["horovodrun"])
    return env, calls, venv


@requires_root
def test_horovod_suite_refuses_an_output_folder_that_is_not_yours(stand_in_venv, tmp_path):
    """Its logs and JUnit files are written into HVD_SUITE_OUT, then read back."""
    env, calls, _ = stand_in_venv
    tests = tmp_path / "parallel"
    tests.mkdir()
    (tests / "test_x.py").write_text("def test_x():\n    pass\n")
    out = tmp_path / "suite-out"
    out.mkdir()
    chown_tree(out, NOBODY)
    before = snapshot(out)
    proc = run_script("horovod-suite", {**env, "HVD_SUITE_OUT": str(out), "HVD_SUITE_CONTROLLERS": "mpi"},
                      str(tests))
    one_error(proc, 2, "[horovod-suite] ERROR: HVD_SUITE_OUT:", "belongs to nobody")
    assert snapshot(out) == before and called(calls) == []


@requires_root
def test_horovod_examples_refuses_an_output_folder_that_is_not_yours(stand_in_venv, tmp_path):
    """The examples are copied into HVD_EXAMPLES_OUT and run from there."""
    env, calls, _ = stand_in_venv
    examples = tmp_path / "examples"
    (examples / "pytorch").mkdir(parents=True)
    (examples / "pytorch" / "pytorch_mnist.py").write_text("print('example')\n")
    out = tmp_path / "examples-out"
    out.mkdir()
    chown_tree(out, NOBODY)
    before = snapshot(out)
    proc = run_script("horovod-examples", {**env, "HVD_EXAMPLES_OUT": str(out),
                                           "HVD_EXAMPLES": "pytorch/pytorch_mnist.py"}, str(examples))
    one_error(proc, 2, "HVD_EXAMPLES_OUT:", "belongs to nobody")
    assert snapshot(out) == before and called(calls) == []


@requires_root
def test_slurm_stop_refuses_a_cluster_folder_that_is_not_roots(tmp_path):
    """`.ci/slurm stop DIR` kills the pids DIR's pid files name, as root: a folder of another
    user's with a planted slurmd.pid is refused in one line and the process named lives on."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls.log"
    stand_ins(bin_dir, calls, ["squeue", "scancel", "sinfo", "slurmctld", "slurmd", "munged", "sbatch"])
    folder = tmp_path / "cluster"
    folder.mkdir()
    (folder / "slurm.conf").write_text("ClusterName=planted\n")
    victim = subprocess.Popen(["sleep", "120"])
    try:
        (folder / "slurmd.pid").write_text(f"{victim.pid}\n")
        chown_tree(folder, NOBODY)
        env = {"PATH": f"{bin_dir}:{SYSTEM_PATH}", "HOME": str(tmp_path)}
        proc = run_script("slurm", env, "stop", str(folder))
        one_error(proc, 1, "[slurm] ERROR: cluster folder:", "belongs to nobody")
        assert victim.poll() is None, "the planted pid was killed"
        assert called(calls) == []
    finally:
        victim.kill()
        victim.wait()
