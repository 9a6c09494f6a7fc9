"""The data seam: what a trainer needs to know about its data, whatever it is (``--data``).

``--data`` names one of three kinds, each read its own way by the framework's glue
(:mod:`torch_models.data`, :mod:`tf_models.data`):

* ``mnist`` (the default): :mod:`ringtrain.data.mnist`, four verified arrays held in memory on
  every rank (47 MB), as ringtrain always has: an :class:`ArrayData`.
* ``folder:DIR``: an image folder (:mod:`ringtrain.data.folder`), indexed once and decoded per
  batch while training: a :class:`FolderData`.
* ``package.module:function``: the user's own dataset (:mod:`ringtrain.data.user_data`), built by
  the framework's glue, which alone can check what the function returns.

Whatever the kind, a run knows it by its :class:`DataInfo`: the input shape and the class count
the model is built for, the split sizes, the normalisation; summaries and checkpoints record it,
and ``--resume`` refuses a checkpoint trained on other classes or shapes.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ringtrain import user_code
from ringtrain.data import decoded_cache, folder, images, mnist
from ringtrain.errors import UserError

IMAGE_SIZE = re.compile(r"^(\d+)(?:x(\d+))?$")


def parse_spec(spec: str) -> tuple[str, str]:
    """``(kind, what)``: ``("mnist", "")``, ``("folder", DIR)`` or ``("user", "pkg.mod:fn")``.
    Checked with the other flags, before any framework is imported."""
    if spec == "mnist":
        return "mnist", ""
    if spec.startswith("folder:") and len(spec) > len("folder:"):
        return "folder", spec[len("folder:"):]
    if user_code.SPEC.match(spec):
        return "user", spec
    raise UserError(f"--data must be mnist, folder:DIR (an image folder with train/ and test/) or "
                    f"package.module:function (your own dataset), got {spec!r}")


def parse_image_size(text: str | None) -> tuple[int, int] | None:
    """``--image-size``: ``N`` (square) or ``HxW``."""
    if text is None:
        return None
    m = IMAGE_SIZE.match(text)
    if not m or int(m.group(1)) < 1 or int(m.group(2) or 1) < 1:
        raise UserError(f"--image-size must be N or HxW in pixels (e.g. 64 or 96x128), got {text!r}")
    return int(m.group(1)), int(m.group(2) or m.group(1))


@dataclass(frozen=True)
class Normalization:
    """``x = (pixel / 255 - mean[c]) / std[c]`` per channel, in float32; ``source`` says where
    the constants come from."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str

    def apply(self, pixels: np.ndarray) -> np.ndarray:
        """uint8 ``[..., C]`` -> float32, in place in one copy, the operations in the same order
        as MNIST's (so that a one-channel folder of MNIST's pixels gives MNIST's inputs)."""
        out = pixels.astype(np.float32)
        # The constants tiled along whole rows of pixels: the same operation on every element,
        # but numpy's loop runs over W x C numbers at a time instead of C (broadcasting 3
        # channel constants took 0.62 of the 1.2 ms that normalising 64 32x32 RGB images took;
        # tiled, all of it took 0.26 ms).
        width = pixels.shape[-2] if pixels.ndim >= 2 else 1
        rows = out.reshape(-1, width * out.shape[-1])
        rows /= 255.0
        rows -= np.tile(np.asarray(self.mean, np.float32), width)
        rows /= np.tile(np.asarray(self.std, np.float32), width)
        return out


@dataclass(frozen=True)
class DataInfo:
    spec: str  # --data as given
    name: str  # in summaries and the built-in models' names ("mnist-cnn-v1")
    # One example's shape: an image's channels last, (height, width, channels); any other input
    # (the user's own data: signals, rows, token ids) as its items arrive.
    input_shape: tuple[int, ...]
    num_classes: int
    classes: tuple[str, ...] | None  # the class names, where the data has them
    train_size: int  # examples this run trains on (after --train-samples)
    test_size: int
    normalization: Normalization | None  # None: the user's data arrives normalised
    input_dtype: str = "float32"  # "int64" for token ids
    image: bool = True  # an image (height, width, channels): what the built-in CNN reads

    def record(self) -> dict[str, Any]:
        """What summaries and checkpoints keep (plain types only)."""
        norm = self.normalization
        return {"spec": self.spec, "input_shape": list(self.input_shape),
                "input_dtype": self.input_dtype, "image": self.image,
                "num_classes": self.num_classes,
                "classes": list(self.classes) if self.classes is not None else None,
                "train_size": self.train_size, "test_size": self.test_size,
                "normalization": None if norm is None else {"mean": list(norm.mean),
                                                            "std": list(norm.std),
                                                            "source": norm.source}}


MNIST_NORMALIZATION = Normalization((mnist.PIXEL_MEAN,), (mnist.PIXEL_STD,),
                                    "MNIST's usual constants (pytorch/examples)")


def mnist_info(train_size: int = mnist.TRAIN_SIZE, test_size: int = mnist.TEST_SIZE) -> DataInfo:
    return DataInfo("mnist", "mnist", (28, 28, 1), 10, tuple(str(i) for i in range(10)),
                    train_size, test_size, MNIST_NORMALIZATION)


@dataclass(frozen=True)
class ArrayData:
    """A dataset held in memory (MNIST): uint8 images ``[N, H, W]`` or ``[N, H, W, C]``."""

    info: DataInfo
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray

    def inputs(self, images_u8: np.ndarray) -> np.ndarray:
        """Normalised float32 ``[N, *input_shape]`` (channels last), MNIST's way."""
        return mnist.normalize(images_u8).reshape(len(images_u8), *self.info.input_shape)


SPLITS = ("train", "test")


@dataclass(frozen=True)
class FolderData:
    """An image folder: its index, decoded per batch by :meth:`batch`, or read from its decoded
    cache (:mod:`ringtrain.data.decoded_cache`) where an image is there already."""

    info: DataInfo
    index: folder.FolderIndex
    # Per split, what a decoded cache must have been made for (None: no cache for this run).
    cache_keys: Mapping[str, str] | None = None
    caches: Mapping[str, decoded_cache.DecodedCache] = field(default_factory=dict)

    def split(self, name: str) -> folder.Split:
        return self.index.train if name == "train" else self.index.test

    def with_keys(self) -> FolderData:
        """The same, with the folder's part of every split's cache key (its file list; sent to
        every rank with the index)."""
        keys = {name: decoded_cache.split_key(self.split(name).root, self.split(name).paths,
                                              self.index.shape, self.index.max_pixels)
                for name in SPLITS}
        return replace(self, cache_keys=keys)

    def with_caches(self, directory: str, say: Callable[[str], None]) -> FolderData:
        """The same, each split's cache file opened (made where there is none) in ``directory``;
        a split without one (said through ``say``, once) decodes as before.  The file's key is
        the folder's part with this host's own stat of every file (:func:`decoded_cache.host_key`):
        this host's copy is what its rows were decoded from."""
        if self.cache_keys is None:
            return self
        caches = {}
        for name in SPLITS:
            part = self.split(name)
            key = decoded_cache.host_key(self.cache_keys[name], part.root, part.paths)
            cache = decoded_cache.open_split(directory, self.index.root, name, key,
                                             len(part.labels), self.index.shape, say)
            if cache is None:
                break  # the same reason would stop the other split: said once
            caches[name] = cache
        return replace(self, caches=caches)

    def cached_share(self, split: str, indices: np.ndarray) -> float:
        """The share of ``indices`` whose pixels are in the split's cache (0 without one)."""
        cache = self.caches.get(split)
        if cache is None or not len(indices):
            return 0.0
        return float(cache.filled(np.asarray(indices, np.int64)).mean())

    def to_plain(self) -> dict[str, Any]:
        """Plain data (the paths and labels as arrays) that rank 0 sends the other ranks
        (:mod:`ringtrain.training.wire`), so that every rank shards the same list."""
        index = self.index
        return {"info": {**self.info.record(), "name": self.info.name},
                "cache_keys": None if self.cache_keys is None else dict(self.cache_keys),
                "index": {"root": index.root, "classes": list(index.classes),
                          "shape": list(index.shape), "max_pixels": index.max_pixels,
                          **{name: {"root": part.root, "paths": part.paths, "labels": part.labels}
                             for name, part in (("train", index.train), ("test", index.test))}}}

    @classmethod
    def from_plain(cls, plain: Any) -> FolderData:
        """The :class:`FolderData` that :meth:`to_plain` made ``plain`` from; a ``ValueError`` for
        anything else (it came from another rank)."""
        try:
            info, index = plain["info"], plain["index"]
            norm = info["normalization"]
            keys = plain.get("cache_keys")
            if keys is not None:
                keys = {name: str(keys[name]) for name in SPLITS}
            splits = {}
            for name in ("train", "test"):
                part = index[name]
                paths, labels = part["paths"], part["labels"]
                if not (isinstance(paths, np.ndarray) and paths.dtype.kind == "S"
                        and isinstance(labels, np.ndarray) and labels.dtype == np.int64
                        and paths.shape == labels.shape and paths.ndim == 1):
                    raise ValueError(f"{name} split")
                splits[name] = folder.Split(str(part["root"]), paths, labels)
            data = cls(DataInfo(str(info["spec"]), str(info["name"]),
                                tuple(int(n) for n in info["input_shape"]), int(info["num_classes"]),
                                tuple(str(c) for c in info["classes"]), int(info["train_size"]),
                                int(info["test_size"]),
                                Normalization(tuple(float(m) for m in norm["mean"]),
                                              tuple(float(s) for s in norm["std"]),
                                              str(norm["source"]))),
                       folder.FolderIndex(str(index["root"]), tuple(str(c) for c in index["classes"]),
                                          splits["train"], splits["test"],
                                          tuple(int(n) for n in index["shape"]),
                                          int(index["max_pixels"])),
                       keys)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a folder's index ({type(err).__name__}: {err})") from None
        if len(data.info.input_shape) != 3 or len(data.index.shape) != 3:
            raise ValueError("not a folder's index (a shape of other than 3 numbers)")
        return data

    def batch(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, str | None]:
        """Normalised float32 ``[B, H, W, C]``, int64 labels, and the first problem met (a file
        that does not decode): its image is NaN, which ends the run at this step on every rank
        (:mod:`ringtrain.training.divergence`), naming the file."""
        part = self.split(split)
        shape = self.info.input_shape
        cache = self.caches.get(split)
        if cache is not None:  # the rows in the cache at once; only the others are decoded
            pixels, done = cache.gather(indices)
        else:
            pixels, done = np.empty((len(indices), *shape), np.uint8), np.zeros(len(indices), bool)
        problem, bad = None, []
        for row in np.flatnonzero(~done):
            i = int(indices[row])
            try:
                pixels[row] = images.load(part.path(i), shape, self.index.max_pixels)
            except images.ImageError as err:
                problem = problem or f"{err.path} is not a readable image ({err.reason})"
                bad.append(row)
                continue
            if cache is not None:
                cache.put(i, pixels[row])
        x = self.info.normalization.apply(pixels)
        x[bad] = np.nan
        return x, part.labels[indices], problem


def open_builtin(args: argparse.Namespace, download: bool = True) -> ArrayData | FolderData | None:
    """The data of ``--data mnist`` or ``folder:DIR`` (None for a user's function, which the
    framework's glue opens).  MNIST may be downloaded; a folder is scanned and its pixel
    statistics computed.  Every problem is one :class:`UserError` line."""
    kind, what = parse_spec(args.data)
    if kind == "mnist":
        arrays = mnist.load(args.data_dir, download=download)
        n_train = args.train_samples or len(arrays.train_labels)
        n_test = min(args.test_samples or len(arrays.test_labels), len(arrays.test_labels))
        info = mnist_info(n_train, n_test)
        return ArrayData(info, arrays.train_images[:n_train], arrays.train_labels[:n_train],
                         arrays.test_images[:n_test], arrays.test_labels[:n_test])
    if kind == "user":
        return None
    max_pixels = args.max_image_pixels
    index = folder.scan(what, parse_image_size(args.image_size), max_pixels)
    if args.train_samples is not None and args.train_samples > len(index.train.labels):
        raise UserError(f"--train-samples {args.train_samples} is more than the "
                        f"{len(index.train.labels)} training images of --data {args.data}; lower "
                        f"it or drop it")
    index = folder.FolderIndex(index.root, index.classes, index.train.subset(args.train_samples),
                               index.test.subset(args.test_samples), index.shape, max_pixels)
    if args.normalize == "imagenet":
        mean, std = folder.IMAGENET
        if index.shape[2] == 1:  # one channel: the luminance-weighted ImageNet constants
            mean, std = (round(sum(mean) / 3, 6),), (round(sum(std) / 3, 6),)
        norm = Normalization(mean, std, "ImageNet's (--normalize imagenet)")
    else:
        mean, std = folder.pixel_stats(index.train, index.shape, max_pixels=max_pixels)
        sample = min(folder.STATS_SAMPLE, len(index.train.labels))
        norm = Normalization(mean, std, f"computed from {sample} training images")
    info = DataInfo(args.data, "folder", index.shape, len(index.classes), index.classes,
                    len(index.train.labels), len(index.test.labels), norm)
    data = FolderData(info, index)
    return data if args.no_decode_cache else data.with_keys()


def check_world(args: argparse.Namespace, info: DataInfo, world_size: int) -> None:
    """Every rank needs at least one training image (the shards are equal, trimmed)."""
    if info.train_size >= world_size:
        return
    if args.train_samples is not None:
        raise UserError(f"--train-samples {info.train_size} is smaller than the world size "
                        f"{world_size}: every rank needs at least one image; raise it or run fewer "
                        f"processes")
    raise UserError(f"--data {info.spec} has {info.train_size} training image(s), fewer than the "
                    f"world size {world_size}: every rank needs at least one; add images or run "
                    f"fewer processes")
