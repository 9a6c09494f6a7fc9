"""The Horovod patch series (.ci/horovod-patches/): well-formed, applies exactly patch by patch, and
reproduces the single patch it replaced.

Applying needs Horovod 0.28.1's sdist: ``$HOROVOD_SDIST`` when set, else ``pip download`` (PyPI,
or pip's cache); without either the tests that apply skip, saying why.  Either is copied and
must have the sha256 pinned in .ci/horovod-sdist.sha256 (a test error otherwise, as the scripts
that build refuse it).  Applying the whole series takes a few seconds.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import REPO

from ringtrain.horovod_build import series_sha256

SERIES = REPO / ".ci" / "horovod-patches"
VERSION = "0.28.1"
# The commit whose .ci/horovod-0.28.1.patch the series replaced, and the patches that made up the
# series then (name: the first 16 hex digits of its SHA-256).  Patches added later come after
# them in the series and are not part of the comparison.
SINGLE_PATCH_COMMIT = "064397f"
CONVERTED = {
    "build-cxx17.patch": "d6961ff12d5c492d",
    "torch-cxx20-headers.patch": "655fd5cb267c464e",
    "gcc-missing-includes.patch": "12e906078eb2b80f",
    "flatbuffers-span-assignable.patch": "2cc8878330b61adb",
    "python312-without-distutils.patch": "5607a877144b84a3",
    "gloo-cmake4.patch": "7bf785889a7b00d9",
    "tf-without-xla-ops.patch": "73687ce0fe297276",
    "torch-cuda-only-when-asked.patch": "b4d9280470f98d7d",
    "gloo-process-set-interface.patch": "72ab062ae4862ba1",
    "gloo-unresolvable-host.patch": "fd95e97ef10474e7",
    "quiet-extension-check.patch": "c3e3e29ec35b873a",
    "keras3-variables.patch": "12b658f73136cf46",
    "keras3-distributed-optimizer.patch": "e4910ccfd19c3f0b",
    "keras3-callbacks.patch": "33bc2180fb83939c",
    "keras3-sync-batch-norm.patch": "ece682f0e830839a",
    "keras3-elastic-state.patch": "300aeae3e92f164e",
    "tf-elastic-reraise.patch": "0e6d958526b60b7c",
    "keras-adasum-and-op-checks.patch": "51a169e4b25fb193",
    "torch-zero-grad-args.patch": "2d9478453f4bf343",
    "rendezvous-forget-finished-scope-only.patch": "21eff705d6c47f40",
    "ssh-keepalive.patch": "1c69c1463fb62934",
    "rendezvous-signed-requests.patch": "65c38425c9d181a0",
    "ray-2.60.patch": "b840d6ac7665bd87",
    "mpi-keep-configured-btl-exclusions.patch": "edad410e8e01521c",
    "logging-skip-below-level.patch": "396a98eb90c2dd6b",
    "torch-function-name-cache.patch": "f55247d5c4c3129d",
    "loop-wake-on-enqueue.patch": "6f9bd1a19f026065",
    "loop-caller-runs-rounds.patch": "3477e07e0f035cf2",
    "loop-batch-wait.patch": "a8cdf9b177604e10",
    "torch-name-taken-until-synchronized.patch": "bcd3bae93a444ecc",
    "mpi-coordination-doorbell.patch": "860ad86c2854004f",
}
# tree_sha256 of the sdist with the single patch applied (frozen when the series replaced it).
SINGLE_PATCH_TREE = "aa620bc6fc4a283b07e39ee63848ff444d20122d132fa57c4402fe51edec104d"


def series_names(series: Path = SERIES) -> list[str]:
    names = [line.split("#", 1)[0].strip() for line in (series / "series").read_text().splitlines()]
    return [n for n in names if n]


def header(patch: Path) -> str:
    """The patch's text before its first diff."""
    text = patch.read_text()
    return text[:text.index("\ndiff -ruN ") + 1] if "\ndiff -ruN " in text else text


def tree_sha256(root: Path) -> str:
    """The SHA-256 of one line ``<sha256 of the file>  <path>`` per file under root, in path order."""
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(root)}\n"
             for p in sorted(root.rglob("*")) if p.is_file()]
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def pinned_sdist_sha256(version: str = VERSION) -> str:
    """The sha256 .ci/horovod-sdist.sha256 pins for horovod-VERSION.tar.gz (sha256sum's format)."""
    pins = (REPO / ".ci" / "horovod-sdist.sha256").read_text()
    found = re.findall(rf"^([0-9a-f]{{64}})  horovod-{re.escape(version)}\.tar\.gz$", pins, flags=re.M)
    assert len(found) == 1, f"no single sha256 pinned for horovod-{version}.tar.gz: {found}"
    return found[0]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory) -> Path:
    """Horovod's sdist, copied into a folder of this test's (the file then checked and unpacked)."""
    folder = tmp_path_factory.mktemp("sdist")
    found = folder / f"horovod-{VERSION}.tar.gz"
    if os.environ.get("HOROVOD_SDIST"):
        shutil.copyfile(os.environ["HOROVOD_SDIST"], found)
        return verified(found, "HOROVOD_SDIST")
    try:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
                               "--no-deps", "--no-binary", ":all:", f"horovod=={VERSION}", "-d", str(folder)],
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("pip download of Horovod's sdist took over 180 s (no network?); set HOROVOD_SDIST")
    if proc.returncode != 0 or not found.is_file():
        pytest.skip(f"cannot get Horovod {VERSION}'s sdist (set HOROVOD_SDIST): {proc.stderr.strip()[-300:]}")
    return verified(found, "pip download")


def verified(sdist: Path, source: str) -> Path:
    got = hashlib.sha256(sdist.read_bytes()).hexdigest()
    want = pinned_sdist_sha256()
    assert got == want, f"{source}: {sdist.name} has sha256 {got}, not {want} (.ci/horovod-sdist.sha256)"
    return sdist


def unpack(sdist: Path, where: Path) -> Path:
    with tarfile.open(sdist) as tar:
        # (the "data" filter where this Python has it: 3.11.4 and later)
        tar.extractall(where, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    return where / f"horovod-{VERSION}"


def apply(patch: bytes, src: Path) -> str:
    """Apply a patch as the build does (no fuzz); its output, which must not mention an offset."""
    proc = subprocess.run(["patch", "-p1", "--fuzz=0", "--no-backup-if-mismatch", "-d", str(src)],
                          input=patch, capture_output=True, timeout=60)
    out = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, out
    return out


def test_every_patch_is_listed_once_and_opens_with_its_header():
    names = series_names()
    assert names and len(names) == len(set(names)), names
    assert sorted(names) == sorted(p.name for p in SERIES.glob("*.patch")), "series and files differ"
    for name in names:
        head = header(SERIES / name)
        assert head.startswith("Description: "), name
        fields = re.findall(r"^([A-Z][A-Za-z-]+):", head, flags=re.M)
        assert {"Description", "Author", "Forwarded", "Last-Update"} <= set(fields), (name, fields)
        # nothing in a header that patch(1) could read as part of a diff
        assert not re.search(r"^(---|\+\+\+|@@|\*\*\*|Index:|diff )", head, flags=re.M), name
        assert "\ndiff -ruN a/" in (SERIES / name).read_text(), name


def test_each_patch_applies_exactly_after_the_ones_before_it(sdist, tmp_path):
    """Patch k onto the sdist with patches 1..k-1 applied: no fuzz (the build refuses it) and no
    offset, so every prefix of the series is a tree that a patch of it was made from."""
    src = unpack(sdist, tmp_path)
    for name in series_names():
        out = apply((SERIES / name).read_bytes(), src)
        assert not re.search(r"offset|fuzz", out, flags=re.I), (name, out)


def test_the_series_reproduces_the_single_patch_it_replaced(sdist, tmp_path):
    """The converted patches, applied in series order, give byte for byte the tree that
    .ci/horovod-0.28.1.patch gave (frozen as SINGLE_PATCH_TREE; with git history, the old patch
    itself is applied too and the two trees compared file by file)."""
    def now(name: str) -> str:
        patch = SERIES / name
        return hashlib.sha256(patch.read_bytes()).hexdigest()[:16] if patch.is_file() else ""
    changed = [n for n, sha in CONVERTED.items() if now(n) != sha]
    if changed:
        pytest.skip(f"{', '.join(changed)} changed since the series replaced the single patch "
                    f"(equality was checked then); this test pins the conversion only")
    names = [n for n in series_names() if n in CONVERTED]
    assert names == list(CONVERTED), "the converted patches are no longer in their order"
    series_tree = unpack(sdist, tmp_path / "series")
    for name in names:
        apply((SERIES / name).read_bytes(), series_tree)
    old = subprocess.run(["git", "-C", str(REPO), "show",
                          f"{SINGLE_PATCH_COMMIT}:.ci/horovod-0.28.1.patch"], capture_output=True)
    if old.returncode == 0:
        single_tree = unpack(sdist, tmp_path / "single")
        apply(old.stdout, single_tree)
        diff = subprocess.run(["diff", "-r", str(single_tree), str(series_tree)], capture_output=True,
                              text=True)
        assert diff.returncode == 0, diff.stdout[-3000:]
        assert tree_sha256(single_tree) == SINGLE_PATCH_TREE
    assert tree_sha256(series_tree) == SINGLE_PATCH_TREE


def test_the_tree_tool_round_trips_the_series(sdist, tmp_path):
    """`.ci/horovod-patch tree` then `diff` writes the series back byte for byte; a new commit
    becomes a new patch at the series' end.  Run from a copy of the scripts, so that `diff`
    rewrites the copy's series, not this checkout's."""
    copy = tmp_path / "repo"
    (copy / ".ci").mkdir(parents=True)
    for name in ("horovod-patch", "horovod-build.sh", "trust.sh", "horovod-sdist.sha256"):
        shutil.copy(REPO / ".ci" / name, copy / ".ci" / name)
    shutil.copytree(SERIES, copy / ".ci" / SERIES.name)
    tool = ["bash", str(copy / ".ci" / "horovod-patch")]
    env = {**os.environ, "HOROVOD_SDIST": str(sdist)}
    tree = tmp_path / "tree"
    for cmd in (["tree", str(tree)], ["diff", str(tree)]):
        proc = subprocess.run([*tool, *cmd], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
    for patch in [*SERIES.glob("*.patch"), SERIES / "series"]:
        assert (copy / ".ci" / SERIES.name / patch.name).read_bytes() == patch.read_bytes(), patch.name
    assert series_sha256(copy / ".ci" / SERIES.name) == series_sha256(SERIES)

    (tree / "horovod" / "__init__.py").write_text((tree / "horovod" / "__init__.py").read_text() + "# more\n")
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "commit", "-qam", "extra.patch\n\nDescription: one more line\nAuthor: t"],
                   check=True)
    proc = subprocess.run([*tool, "diff", str(tree)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert series_names(copy / ".ci" / SERIES.name) == [*series_names(), "extra.patch"]
    extra = (copy / ".ci" / SERIES.name / "extra.patch").read_text()
    assert extra.startswith("Description: one more line\nAuthor: t\n\ndiff -ruN a/horovod/__init__.py"), extra
    assert "+# more" in extra
