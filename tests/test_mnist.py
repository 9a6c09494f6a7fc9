"""The shared MNIST reader: verified files, exact parsing, clear errors, resolution order."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import MNIST, REPO

from ringtrain.data import mnist
from ringtrain.errors import UserError

# The real files: the caller's MNIST_DIR where it holds them, else the trainers' default folder
# (conftest.MNIST); never a caller's MNIST_DIR without them.
SHARED = MNIST


def idx_bytes(arr: np.ndarray, magic: int) -> bytes:
    header = magic.to_bytes(4, "big")
    return header + b"".join(d.to_bytes(4, "big") for d in arr.shape) + arr.astype(np.uint8).tobytes()


def write_gz(path: Path, data: bytes) -> Path:
    with gzip.open(path, "wb") as fh:
        fh.write(data)
    return path


@pytest.fixture(scope="module")
def real_dir() -> Path:
    if not all((SHARED / name).is_file() for name, _ in mnist.FILES.values()):
        pytest.skip(f"MNIST not present at {SHARED}; set MNIST_DIR")
    return SHARED


def test_loads_canonical_files(real_dir):
    data = mnist.load(real_dir, download=False)
    assert data.train_images.shape == (60000, 28, 28) and data.train_images.dtype == np.uint8
    assert data.test_images.shape == (10000, 28, 28)
    assert data.train_labels.shape == (60000,) and data.train_labels.dtype == np.int64
    assert set(np.unique(data.train_labels)) == set(range(10))
    # The first training digit of MNIST is a 5 and the first test digit a 7 (well-known facts).
    assert data.train_labels[0] == 5 and data.test_labels[0] == 7


def test_md5_matches_published_sums(real_dir):
    published = dict(line.split()[::-1] for line in (real_dir / "MD5SUMS").read_text().splitlines())
    for name, md5 in mnist.FILES.values():
        assert published[name] == md5


def test_read_idx_roundtrip(tmp_path):
    arr = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    path = write_gz(tmp_path / "x.gz", idx_bytes(arr, mnist.IMAGES_MAGIC))
    np.testing.assert_array_equal(mnist.read_idx(path, mnist.IMAGES_MAGIC, 2), arr)


def test_read_idx_truncated_payload(tmp_path):
    arr = np.zeros((3, 28, 28), dtype=np.uint8)
    path = write_gz(tmp_path / "x.gz", idx_bytes(arr, mnist.IMAGES_MAGIC)[:-100])
    with pytest.raises(UserError, match="truncated"):
        mnist.read_idx(path, mnist.IMAGES_MAGIC)


def test_read_idx_truncated_gzip(tmp_path, real_dir):
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes((real_dir / path.name).read_bytes()[:2000])
    with pytest.raises(UserError, match="unreadable"):
        mnist.read_idx(path, mnist.LABELS_MAGIC)


def test_read_idx_not_mnist(tmp_path):
    path = write_gz(tmp_path / "x.gz", b"this is not an idx file at all")
    with pytest.raises(UserError, match="not an MNIST IDX file"):
        mnist.read_idx(path, mnist.IMAGES_MAGIC)


def copy_dataset(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for name, _ in mnist.FILES.values():
        shutil.copyfile(src / name, dst / name)
    return dst


def test_wrong_md5_is_one_clear_error(tmp_path, real_dir):
    d = copy_dataset(real_dir, tmp_path / "m")
    target = d / "train-labels-idx1-ubyte.gz"
    raw = bytearray(target.read_bytes())
    raw[-5] ^= 0xFF
    target.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"train-labels-idx1-ubyte.gz has MD5 [0-9a-f]{32}, expected"):
        mnist.load(d, download=False)


def test_truncated_file_fails_md5(tmp_path, real_dir):
    d = copy_dataset(real_dir, tmp_path / "m")
    target = d / "t10k-images-idx3-ubyte.gz"
    target.write_bytes(target.read_bytes()[:1000])
    with pytest.raises(UserError, match="t10k-images-idx3-ubyte.gz has MD5"):
        mnist.load(d, download=False)


def test_missing_files_without_download(tmp_path):
    with pytest.raises(UserError, match="not found; put the four MNIST .gz files in"):
        mnist.load(tmp_path / "empty", download=False)


def test_missing_files_offline_download_fails_cleanly(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(mnist.urllib.request, "urlopen", offline)
    with pytest.raises(UserError, match="could not be downloaded"):
        mnist.load(tmp_path / "dl", download=True)
    assert not any((tmp_path / "dl").iterdir()), "no partial download may be left behind"


def test_download_falls_back_to_next_mirror(tmp_path, monkeypatch, real_dir):
    tried = []

    class Resp:
        def __init__(self, data: bytes):
            self._data, self._pos = data, 0

        def read(self, n=-1):
            chunk = self._data[self._pos:] if n < 0 else self._data[self._pos:self._pos + n]
            self._pos += len(chunk)
            return chunk

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def fake_urlopen(url, timeout):
        tried.append(url)
        if url.startswith(mnist.MIRRORS[0]):
            raise OSError("mirror down")
        return Resp((real_dir / url.rsplit("/", 1)[1]).read_bytes())

    monkeypatch.setattr(mnist.urllib.request, "urlopen", fake_urlopen)
    data = mnist.load(tmp_path / "dl", download=True)
    assert data.test_labels[0] == 7
    assert sum(u.startswith(mnist.MIRRORS[0]) for u in tried) == 4
    assert sum(u.startswith(mnist.MIRRORS[1]) for u in tried) == 4


def test_resolution_order(tmp_path, monkeypatch):
    monkeypatch.setenv("MNIST_DIR", str(tmp_path / "env"))
    assert mnist.resolve_data_dir(tmp_path / "cli") == tmp_path / "cli"
    assert mnist.resolve_data_dir(None) == tmp_path / "env"
    monkeypatch.delenv("MNIST_DIR")
    assert mnist.resolve_data_dir(None) == mnist.default_data_dir()


def test_default_is_shared_folder_when_present():
    """The documented default, ../shared/data/mnist beside the repository, whatever MNIST_DIR says."""
    shared = REPO.parent / "shared" / "data" / "mnist"
    if not all((shared / name).is_file() for name, _ in mnist.FILES.values()):
        pytest.skip(f"MNIST not present at {shared}")
    assert mnist.default_data_dir() == shared


def test_default_falls_back_to_user_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(mnist, "_REPO_SHARED", tmp_path / "absent")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert mnist.default_data_dir() == tmp_path / ".cache" / "ringtrain" / "mnist"


def test_normalize_matches_torchvision_constants():
    x = mnist.normalize(np.array([[[0, 255]]], dtype=np.uint8))
    np.testing.assert_allclose(x[0, 0], [-0.1307 / 0.3081, (1 - 0.1307) / 0.3081], rtol=1e-6)
