"""A run's data for Keras: ``tf.data`` pipelines over the shards both frameworks use.

* MNIST (:class:`InMemory`): uint8 arrays in memory, gathered and normalised per batch in graph
  ops, with MNIST's constants in the same float32 operations as PyTorch's path.
* An image folder or the user's own dataset (:class:`Streamed`): this rank's index batches,
  decoded and resized in parallel (``map`` with ``num_parallel_calls=AUTOTUNE``, on a private
  pool of ``--workers`` threads; the decoding is :mod:`ringtrain.data.images`, PIL, which
  releases the GIL while it decodes, so both frameworks see the same pixels), then prefetched
  (``AUTOTUNE``).  A file that does not decode becomes a NaN image, as in PyTorch.

Every rank's pipeline holds the same number of batches, so ``fit`` runs the same number of steps
(and allreduces) everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from ringtrain.data import user_data
from ringtrain.data.dataset import ArrayData, DataInfo, FolderData
from ringtrain.data.sharding import eval_indices, fixed_sample
from ringtrain.errors import UserError
from ringtrain.runtime import threads_per_rank
from ringtrain.training import startup
from ringtrain.training.evaluation import EVAL_BATCH
from ringtrain.training.world import World

BatchSums = Callable[[Any, Any], tuple[Any, Any]]  # (x, y) -> (loss sum, correct), traced


def _rows(batches: Sequence[np.ndarray]) -> tf.RaggedTensor:
    return tf.RaggedTensor.from_row_lengths(np.concatenate(batches).astype(np.int64),
                                            [len(b) for b in batches])


class TfData:
    """What the trainers read: ``info``; ``fit_dataset(index_batches)`` for ``model.fit``;
    ``batches(index_batches)``, numpy ``(x, y)`` for the elastic loop; ``eval_sums``; and
    ``problem``, the first data problem this rank met."""

    info: DataInfo
    problem: str | None = None

    def load(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def fit_dataset(self, index_batches: Sequence[np.ndarray]) -> tf.data.Dataset:
        raise NotImplementedError

    def batches(self, index_batches: Sequence[np.ndarray]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in index_batches:
            yield self.load("train", b)

    def eval_sums(self, batch_sums: BatchSums, rank: int, size: int) -> list[float]:
        """This rank's (test loss sum, correct, count, problems) over its strided test share."""
        idx = eval_indices(self.info.test_size, rank, size)
        loss = correct = 0.0
        for start in range(0, len(idx), self.eval_batch):
            x, y = self.load("test", idx[start:start + self.eval_batch])
            batch_loss, batch_correct = batch_sums(x, y)
            loss += float(batch_loss)
            correct += float(batch_correct)
        return [loss, correct, len(idx), 1.0 if self.problem else 0.0]


class InMemory(TfData):
    eval_batch = EVAL_BATCH

    def __init__(self, data: ArrayData) -> None:
        self.data, self.info = data, data.info
        self.train_x = data.inputs(data.train_images)  # for the elastic loop's numpy batches
        self.test_x = data.inputs(data.test_images)

    def load(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if split == "train":
            return self.train_x[indices], self.data.train_labels[indices]
        return self.test_x[indices], self.data.test_labels[indices]

    def fit_dataset(self, index_batches):
        """Gathered and normalised per batch from uint8 in memory, with the dataset's constants in
        the same float32 operations as :func:`ringtrain.data.mnist.normalize`."""
        images = tf.constant(self.data.train_images)
        targets = tf.constant(self.data.train_labels)
        shape = [-1, *self.info.input_shape]
        mean, std = self.info.normalization.mean[0], self.info.normalization.std[0]

        def gather(idx):
            x = (tf.cast(tf.gather(images, idx), tf.float32) / 255.0 - mean) / std
            return tf.reshape(x, shape), tf.gather(targets, idx)

        # No autotuning: a gather per step has nothing to tune, and with it on, tearing the
        # iterator down at the end of ``fit`` stalled for up to a minute on long runs (tf.data's
        # autotune thread naps for ever longer periods, up to 60 s, and the teardown waited).
        options = tf.data.Options()
        options.autotune.enabled = False
        return (tf.data.Dataset.from_tensor_slices(_rows(index_batches)).map(gather).prefetch(2)
                .with_options(options))


class Streamed(TfData):
    def __init__(self, info: DataInfo, load_items: Callable[[str, np.ndarray], tuple],
                 args: argparse.Namespace, local_size: int) -> None:
        self.info, self.load_items = info, load_items
        self.workers = max(1, args.workers if args.workers is not None else threads_per_rank(local_size))
        self.eval_batch = args.batch_size

    def load(self, split: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, y, problem = self.load_items(split, indices)
        if problem and self.problem is None:
            self.problem = problem
        return x, y

    def fit_dataset(self, index_batches):
        shape = self.info.input_shape

        def load(idx):
            x, y = tf.numpy_function(lambda i: self.load("train", i), [idx],
                                     [tf.as_dtype(self.info.input_dtype), tf.int64], stateful=True)
            return tf.ensure_shape(x, [None, *shape]), tf.ensure_shape(y, [None])

        options = tf.data.Options()
        options.threading.private_threadpool_size = self.workers
        return (tf.data.Dataset.from_tensor_slices(_rows(index_batches))
                .map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
                .prefetch(tf.data.AUTOTUNE).with_options(options))


def open_data(args: argparse.Namespace, world: World | None, local_size: int) -> TfData:
    """The run's data (``--data``), checked; ``world`` None in an elastic worker (no collective)."""
    builtin = startup.open_data(world, args)
    if isinstance(builtin, ArrayData):
        return InMemory(builtin)
    if isinstance(builtin, FolderData):
        return Streamed(builtin.info, builtin.batch, args, local_size)
    info, splits = startup.every_rank(world, lambda: open_user_data(args))
    dtype = np.dtype(info.input_dtype)

    def load_items(split: str, indices: np.ndarray):
        """The items' inputs and labels; one that raises or does not match item 0 (shape, kind,
        label in range) gets a stand-in input (NaN features, zero token ids) and label -1, whose
        loss is NaN (:func:`tf_models.horovod_keras.sparse_logits_loss`): the step that reads it
        makes every rank's weights non-finite, and every rank stops there naming it."""
        ds, xs, ys, problem = splits[split], [], [], None
        for i in indices:
            try:
                x, label = ds[int(i)]
                x = np.asarray(x)
                why = user_data.item_problem(args.data, split, int(i), x.shape,
                                             user_data.input_dtype(x.dtype.kind, x.dtype.itemsize),
                                             label, info.input_shape, info.input_dtype,
                                             info.num_classes)
                if why:
                    raise ValueError(why)
                xs.append(x.astype(dtype))
                ys.append(int(label))
            except Exception as err:
                problem = problem or (str(err) if isinstance(err, ValueError) and str(err).startswith("item ")
                                      else f"item {int(i)} of --data {args.data}'s {split} split raised "
                                           f"{type(err).__name__}: {err}")
                xs.append(np.full(info.input_shape, np.nan, dtype) if dtype.kind == "f"
                          else np.zeros(info.input_shape, dtype))
                ys.append(-1)
        return np.stack(xs), np.array(ys, np.int64), problem

    return Streamed(info, load_items, args, local_size)


def first_input(spec: str, split: str, ds) -> tuple[tuple[int, ...], str, bool]:
    """Item 0's input of ``split``: its shape, what it trains as, whether it is an image."""
    x, _ = user_data.first_item(spec, split, ds)
    try:  # an array or a tensor; not a PIL image, which would pass as numbers of another layout
        array = np.asarray(x) if isinstance(x, np.ndarray) or hasattr(x, "numpy") else None
    except Exception:
        array = None
    if array is None or array.dtype == object:
        raise UserError(user_data.input_problem(spec, split, "tf", None,
                                                f"a {type(x).__module__}.{type(x).__qualname__}", None))
    kind = user_data.input_dtype(array.dtype.kind, array.dtype.itemsize)
    problem = user_data.input_problem(spec, split, "tf", array.shape, array.dtype, kind)
    if problem:
        raise UserError(problem)
    return tuple(array.shape), kind, kind == user_data.FLOAT and array.ndim == 3


def open_user_data(args: argparse.Namespace) -> tuple[DataInfo, dict[str, Any]]:
    """``--data package.module:function`` for Keras: both splits, their first items checked."""
    spec = args.data
    splits = {split: user_data.call(spec, split, "tf") for split in user_data.SPLITS}
    firsts = {split: first_input(spec, split, ds) for split, ds in splits.items()}
    user_data.same_inputs(spec, firsts["train"][:2], firsts["test"][:2])
    shape, dtype, image = firsts["train"]
    num_classes, classes = user_data.classes(spec, splits["train"])
    n_train, n_test = user_data.sizes(args, spec, splits["train"], splits["test"])
    splits = {"train": _subset(splits["train"], n_train), "test": _subset(splits["test"], n_test)}
    info = DataInfo(spec, spec, shape, num_classes, classes, n_train, n_test, None,
                    input_dtype=dtype, image=image)
    return info, splits


class _Subset:
    """Items ``keep`` of a map-style dataset."""

    def __init__(self, ds, keep: list[int]) -> None:
        self.ds, self.keep = ds, keep

    def __len__(self) -> int:
        return len(self.keep)

    def __getitem__(self, i: int):
        return self.ds[self.keep[i]]


def _subset(ds, n: int):
    """``n`` items drawn once with a fixed seed (``--train-samples``), or the whole dataset."""
    if n >= len(ds):
        return ds
    return _Subset(ds, fixed_sample(len(ds), n).tolist())
