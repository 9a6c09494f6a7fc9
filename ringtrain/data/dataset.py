"""The dataset seam: what a trainer needs to know about its data, and nothing MNIST-specific.

A dataset is an object with the attributes and method of :class:`Dataset`; :mod:`ringtrain.data.mnist`
provides the one ringtrain ships.  Trainers, the CLI checks and the model builders read the input
shape, the class count and the training-set size from here, never from a dataset's own module,
so a second dataset is one new module plus one line in :data:`DATASETS`.

Each rank takes its view of the arrays with :func:`rank_view`; loading them in a job (rank 0 alone
may download, every rank learns its verdict) is :func:`ringtrain.training.startup.load_data`.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple, Protocol

import numpy as np

from ringtrain.data.sharding import eval_indices
from ringtrain.errors import UserError

# name -> module whose ``DATASET`` attribute implements the interface (imported on first use).
DATASETS = {"mnist": "ringtrain.data.mnist"}
DEFAULT = "mnist"


class Arrays(Protocol):
    """Images ``uint8 [N, ...]`` (any layout that reshapes to ``[N, *input_shape]``), labels
    ``int64 [N]`` in ``range(num_classes)``."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


class Dataset(Protocol):
    name: str  # recorded in summaries and in the built-in models' names ("mnist-cnn-v1")
    input_shape: tuple[int, int, int]  # one example, channels last: (height, width, channels)
    num_classes: int  # models map an input to this many logits
    train_size: int  # the full training set (bounds --train-samples before anything starts)
    # Normalisation: x = (pixel / 255 - mean) / std, in float32.  ``normalize`` applies it in
    # numpy; the TensorFlow input pipeline applies the same constants in graph ops.
    mean: float
    std: float

    def load(self, data_dir: str | None = None, download: bool = True) -> Arrays:
        """The four arrays, verified; a problem is one :class:`UserError` line."""

    def normalize(self, images: np.ndarray) -> np.ndarray:
        """uint8 images -> float32 of the same shape."""


def get(name: str = DEFAULT) -> Dataset:
    if name not in DATASETS:
        raise UserError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return importlib.import_module(DATASETS[name]).DATASET


def model_inputs(dataset: Dataset, images: np.ndarray) -> np.ndarray:
    """Normalised float32 ``[N, *input_shape]`` (channels last) from uint8 images."""
    return dataset.normalize(images).reshape(len(images), *dataset.input_shape)


class RankData(NamedTuple):
    """The arrays one rank trains and evaluates on (uint8 images)."""

    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray


def subset(data: Arrays, args) -> RankData:
    """The first ``--train-samples`` training and ``--test-samples`` test images, unsharded (an
    elastic job shards them per world; training data is sharded per epoch)."""
    n_train = args.train_samples or len(data.train_labels)
    n_test = min(args.test_samples or len(data.test_labels), len(data.test_labels))
    return RankData(data.train_images[:n_train], data.train_labels[:n_train],
                    data.test_images[:n_test], data.test_labels[:n_test])


def rank_view(data: Arrays, args, rank: int, world_size: int) -> RankData:
    """:func:`subset`, with this rank's strided share of the test images."""
    view = subset(data, args)
    test_idx = eval_indices(len(view.test_labels), rank, world_size)
    return view._replace(test_images=view.test_images[test_idx], test_labels=view.test_labels[test_idx])
