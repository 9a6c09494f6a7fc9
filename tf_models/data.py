"""Training data as a ``tf.data`` pipeline over the shards both frameworks use."""

from __future__ import annotations

import argparse

import numpy as np
import tensorflow as tf

from ringtrain.data.sharding import shard_indices


def epoch_batches(n_train: int, rank: int, size: int, args: argparse.Namespace, epoch: int,
                  steps: int) -> list[np.ndarray]:
    """This rank's index batches for ``epoch``: ``steps`` x K micro-batches of batch-size indices
    from the shard the PyTorch trainer uses, so both frameworks see the same images in the same
    order (the last micro-batch of an epoch may be short, never empty: ``steps`` x K is at most
    the shard's batch count)."""
    idx = shard_indices(n_train, rank, size, args.seed, epoch, shuffle=not args.no_shuffle)
    b = args.batch_size
    return [idx[i * b:(i + 1) * b] for i in range(steps * args.backward_passes_per_step)]


def train_dataset(dataset, images_u8: np.ndarray, labels: np.ndarray, batches: list[np.ndarray]):
    """A ``tf.data`` pipeline over the given index batches, in order, each exactly once.

    The images stay uint8 in memory and are gathered and normalised per batch, with the dataset's
    constants in the same float32 operations as :meth:`Dataset.normalize`.  The number of elements
    is the number of batches, the same on every rank, so ``fit`` runs the same number of steps
    (and allreduces) everywhere.
    """
    images = tf.constant(images_u8)
    targets = tf.constant(labels)
    rows = tf.RaggedTensor.from_row_lengths(
        np.concatenate(batches).astype(np.int64), [len(b) for b in batches])
    shape = [-1, *dataset.input_shape]

    def gather(idx):
        x = (tf.cast(tf.gather(images, idx), tf.float32) / 255.0 - dataset.mean) / dataset.std
        return tf.reshape(x, shape), tf.gather(targets, idx)

    # No autotuning: a gather per step has nothing to tune, and with it on, tearing the iterator
    # down at the end of ``fit`` stalled for up to a minute on long runs (tf.data's autotune
    # thread naps for ever longer periods, up to 60 s, and the teardown waited for it).
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices(rows).map(gather).prefetch(2).with_options(options)
