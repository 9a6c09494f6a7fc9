"""``--data folder:DIR``: an image folder, ``DIR/train/<class>/*`` and ``DIR/test/<class>/*`` (or
``val/``), JPEG and PNG, grayscale or colour.

Scanning builds an index and reads no pixel but the first image's header and a sample for the
normalisation: the classes are the sorted folder names (as ``torchvision.datasets.ImageFolder``
numbers them), each split's files are a sorted list of relative paths held as one NumPy bytes
array, and the pixels are decoded per batch while training (:mod:`ringtrain.data.images`), so a
rank's memory does not grow with the data beyond that list.

(One array, not a Python list of strings: DataLoader workers are forked copies of the rank, and
reading a list's strings touches their reference counts, which copies every page they live on
into every worker; an array's bytes stay shared.)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ringtrain.data import images
from ringtrain.data.sharding import fixed_sample
from ringtrain.errors import UserError

STATS_SAMPLE = 1000  # training images whose pixels give the per-channel mean and std
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # torchvision's ImageNet mean, std


@dataclass(frozen=True)
class Split:
    root: str  # the split's folder
    paths: np.ndarray  # bytes [N]: "<class>/<file>", relative to root
    labels: np.ndarray  # int64 [N], in range(num_classes)

    def path(self, i: int) -> str:
        return os.path.join(self.root, os.fsdecode(self.paths[i]))

    def subset(self, n: int | None) -> Split:
        """``n`` images drawn once (a fixed seed, so every rank and run draws the same), in
        folder order: every class stays in, which the folder's first ``n`` would not do."""
        if n is None or n >= len(self.labels):
            return self
        keep = fixed_sample(len(self.labels), n)
        return Split(self.root, self.paths[keep], self.labels[keep])


@dataclass(frozen=True)
class FolderIndex:
    root: str
    classes: tuple[str, ...]
    train: Split
    test: Split
    shape: tuple[int, int, int]  # (height, width, channels) every image is decoded to
    max_pixels: int = images.MAX_PIXELS  # larger images are refused (--max-image-pixels)


def scan(root: str, image_size: tuple[int, int] | None = None,
         max_pixels: int = images.MAX_PIXELS) -> FolderIndex:
    """Index ``root``; every problem a user can fix is one :class:`UserError` line."""
    top = Path(root)
    if not top.is_dir():
        raise UserError(f"--data folder:{root}: no such folder; give the folder that holds train/ "
                        f"and test/ (or val/)")
    train_dir = top / "train"
    test_dir = next((top / name for name in ("test", "val") if (top / name).is_dir()), None)
    if not train_dir.is_dir():
        raise UserError(f"--data folder:{root} has no train/ folder; put one folder per class "
                        f"in {train_dir}")
    if test_dir is None:
        raise UserError(f"--data folder:{root} has no test/ (or val/) folder; put one folder per "
                        f"class of held-out images in {top / 'test'}")
    classes = _classes(train_dir)
    test_classes = _classes(test_dir)
    if test_classes != classes:
        only_train = sorted(set(classes) - set(test_classes))
        only_test = sorted(set(test_classes) - set(classes))
        raise UserError(f"--data folder:{root}: train/ and {test_dir.name}/ have different classes "
                        f"(only in train/: {', '.join(only_train) or '-'}; only in "
                        f"{test_dir.name}/: {', '.join(only_test) or '-'}); give both the same "
                        f"class folders")
    if len(classes) < 2:
        raise UserError(f"--data folder:{root}: {train_dir} has one class folder ({classes[0]}); "
                        f"classification needs at least two")
    train = _split(train_dir, classes)
    test = _split(test_dir, classes)
    try:
        height, width, channels = images.probe(train.path(0), max_pixels)
    except images.ImageError as err:
        raise UserError(f"--data folder:{root}: {err.path} is not a readable image ({err.reason}); "
                        f"replace or remove it") from None
    if image_size is not None:
        height, width = image_size
    return FolderIndex(str(top), tuple(classes), train, test, (height, width, channels), max_pixels)


def _classes(split_dir: Path) -> list[str]:
    classes = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise UserError(f"{split_dir} has no class folders; put the images of each class in a "
                        f"folder named after it, e.g. {split_dir / 'cat'}")
    return classes


def _split(split_dir: Path, classes: list[str]) -> Split:
    paths, labels = [], []
    for label, name in enumerate(classes):
        files = sorted(e.name for e in os.scandir(split_dir / name)
                       if e.is_file() and not e.name.startswith("."))  # .DS_Store and friends
        for file in files:
            if not images.is_image_name(file):
                raise UserError(f"{split_dir / name / file} is not a JPEG or PNG image; remove it "
                                f"from the image folder (or convert it)")
        if not files:
            raise UserError(f"class folder {split_dir / name} has no images; add some or remove "
                            f"the folder")
        # One array per class, the names as the file system's bytes (os.fsencode): any name,
        # UTF-8 or not (numpy's own str -> bytes conversion takes ASCII only, and a file named
        # café.jpg ended the run in a traceback).  Per class, so that the Python strings of one
        # class at a time are alive, not the whole folder's: scanning 200,000 files in 3 classes
        # peaks 16.3 MiB above the start, against 28.6 MiB with all their strings at once, for
        # a 5.1 MiB list (ru_maxrss; the folders of bench/owndata.py).
        paths.append(np.array([os.fsencode(f"{name}/{file}") for file in files], dtype=np.bytes_))
        labels.append(np.full(len(files), label, dtype=np.int64))
    return Split(str(split_dir), np.concatenate(paths), np.concatenate(labels))


def pixel_stats(split: Split, shape: tuple[int, int, int], sample: int = STATS_SAMPLE,
                max_pixels: int = images.MAX_PIXELS) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of ``pixel / 255`` over ``sample`` training images drawn with a
    fixed seed: the same numbers on every rank and every run (integer sums in float64)."""
    picks = fixed_sample(len(split.labels), sample)
    total = np.zeros(shape[2], np.float64)
    squares = np.zeros(shape[2], np.float64)
    for i in picks:
        try:
            pixels = images.load(split.path(i), shape, max_pixels).reshape(-1, shape[2]).astype(np.float64)
        except images.ImageError as err:
            raise UserError(f"{err.path} is not a readable image ({err.reason}); replace or remove "
                            f"it") from None
        total += pixels.sum(0)
        squares += (pixels * pixels).sum(0)
    count = len(picks) * shape[0] * shape[1] * 255.0 * 255.0
    mean = total / (count / 255.0)
    var = squares / count - mean * mean
    std = np.sqrt(np.maximum(var, 1e-12))
    return tuple(round(float(m), 6) for m in mean), tuple(round(float(s), 6) for s in std)
