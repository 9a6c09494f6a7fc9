"""MNIST from the four canonical IDX ``.gz`` files, shared by both frameworks.

:func:`ringtrain.data.dataset.open_builtin` opens it for ``--data mnist`` (the default).

Both trainers read the same bytes through this module so that, for the same seed and epoch, they
see the same images in the same order.  Files are verified by MD5 before parsing: a half-downloaded
or substituted file fails here with one clear line instead of deep inside a training step.

Where the files are looked for: ``--data-dir``, then ``$MNIST_DIR``, then a default folder
(``../shared/data/mnist`` next to this repository when it exists, else ``~/.cache/ringtrain/mnist``).
Missing files are downloaded into that folder from the usual mirrors, with fallback.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringtrain.errors import UserError

FILES = {
    "train_images": ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
    "train_labels": ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
    "test_images": ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
    "test_labels": ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
}
MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://storage.googleapis.com/cvdf-datasets/mnist/",
    "http://yann.lecun.com/exdb/mnist/",
)
IMAGES_MAGIC, LABELS_MAGIC = 2051, 2049
TRAIN_SIZE, TEST_SIZE = 60_000, 10_000
# Normalisation constants everyone uses for MNIST (pytorch/examples); both frameworks apply them.
PIXEL_MEAN, PIXEL_STD = 0.1307, 0.3081

_REPO_SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist"


@dataclass(frozen=True)
class Mnist:
    """The four arrays: images ``uint8 [N, 28, 28]`` and labels ``int64 [N]``."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def default_data_dir() -> Path:
    if _REPO_SHARED.is_dir():
        return _REPO_SHARED
    return Path.home() / ".cache" / "ringtrain" / "mnist"


def resolve_data_dir(cli_dir: str | os.PathLike | None = None) -> Path:
    """``--data-dir``, then ``$MNIST_DIR``, then :func:`default_data_dir`."""
    if cli_dir:
        return Path(cli_dir).expanduser()
    if os.environ.get("MNIST_DIR"):
        return Path(os.environ["MNIST_DIR"]).expanduser()
    return default_data_dir()


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download(name: str, dest: Path, md5: str) -> None:
    """Fetch ``name`` into ``dest`` from the first mirror that serves the right bytes."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    for mirror in MIRRORS:
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{name}.")
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(mirror + name, timeout=30) as r:
                shutil.copyfileobj(r, out)
            if md5sum(Path(tmp)) == md5:
                os.replace(tmp, dest)
                return
        except OSError:
            pass
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise UserError(
        f"MNIST file {name} is missing from {dest.parent} and could not be downloaded "
        f"(offline?); copy the four MNIST .gz files there, or pass --data-dir / set MNIST_DIR "
        f"to a folder that has them"
    )


def ensure_files(data_dir: Path, download: bool = True) -> dict[str, Path]:
    """Paths of the four verified files, downloading missing ones when ``download`` is set."""
    paths = {}
    for key, (name, md5) in FILES.items():
        path = data_dir / name
        if not path.is_file():
            if not download:
                raise UserError(
                    f"MNIST file {path} not found; put the four MNIST .gz files in {data_dir} "
                    f"or point --data-dir / MNIST_DIR at a folder that has them"
                )
            _download(name, path, md5)
        actual = md5sum(path)
        if actual != md5:
            raise UserError(
                f"MNIST file {path} has MD5 {actual}, expected {md5} (corrupt or not MNIST); "
                f"delete it to re-download, or replace it with the canonical file"
            )
        paths[key] = path
    return paths


def read_idx(path: Path, magic: int, expected_count: int | None = None) -> np.ndarray:
    """Parse one gzip'd IDX file, checking its header against its payload."""
    try:
        with gzip.open(path, "rb") as fh:
            raw = fh.read()
    except (OSError, EOFError) as err:
        raise UserError(f"MNIST file {path} is unreadable ({err}); delete it and re-download") from None
    if len(raw) < 8 or int.from_bytes(raw[:4], "big") != magic:
        raise UserError(f"{path} is not an MNIST IDX file (bad magic number); replace it")
    ndim = raw[3]
    header = 4 + 4 * ndim
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    if len(raw) != header + int(np.prod(dims)):
        raise UserError(
            f"MNIST file {path} is truncated ({len(raw) - header} bytes of data for shape {dims}); "
            f"delete it and re-download"
        )
    if expected_count is not None and dims[0] != expected_count:
        raise UserError(f"{path} holds {dims[0]} items, expected {expected_count}; replace it")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def load(data_dir: str | os.PathLike | None = None, download: bool = True) -> Mnist:
    """Resolve, verify and parse MNIST."""
    paths = ensure_files(resolve_data_dir(data_dir), download=download)
    return Mnist(
        train_images=read_idx(paths["train_images"], IMAGES_MAGIC, TRAIN_SIZE),
        train_labels=read_idx(paths["train_labels"], LABELS_MAGIC, TRAIN_SIZE).astype(np.int64),
        test_images=read_idx(paths["test_images"], IMAGES_MAGIC, TEST_SIZE),
        test_labels=read_idx(paths["test_labels"], LABELS_MAGIC, TEST_SIZE).astype(np.int64),
    )


def normalize(images: np.ndarray) -> np.ndarray:
    """uint8 [N, 28, 28] -> float32 [N, 28, 28] scaled like torchvision's ToTensor + Normalize:
    ``(pixel / 255 - PIXEL_MEAN) / PIXEL_STD``."""
    # In place, same operations in the same order: one float32 copy instead of four (the whole
    # training set is ~190 MB as float32, and every rank on the host holds its own).
    out = images.astype(np.float32)
    out /= 255.0
    out -= PIXEL_MEAN
    out /= PIXEL_STD
    return out
