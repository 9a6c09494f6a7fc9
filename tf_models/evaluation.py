"""What a run reads from a Keras model besides training it: test sums, whether its weights are
still numbers, and its weights for the checksums."""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from ringtrain.training.evaluation import EVAL_BATCH
from tf_models.horovod_keras import sparse_logits_loss


def make_eval_sums(net: keras.Model, input_shape: tuple[int, ...]):
    """``eval_sums(x, y)``: this rank's (test loss sum, correct, count), batch by batch."""

    @tf.function(input_signature=[tf.TensorSpec([None, *input_shape], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def batch_sums(x, y):
        logits = net(x, training=False)
        loss = tf.reduce_sum(tf.cast(sparse_logits_loss(y, logits), tf.float64))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float64))
        return loss, correct

    def eval_sums(x: np.ndarray, y: np.ndarray) -> list[float]:
        loss = correct = 0.0
        for start in range(0, len(x), EVAL_BATCH):
            batch_loss, batch_correct = batch_sums(x[start:start + EVAL_BATCH],
                                                   y[start:start + EVAL_BATCH])
            loss += float(batch_loss)
            correct += float(batch_correct)
        return [loss, correct, len(x)]

    return eval_sums


def make_weights_finite(net: keras.Model):
    """``weights_finite()``: whether every trainable weight is a finite number (one float64 sum
    per tensor, in one traced function)."""
    weights = net.trainable_weights

    @tf.function
    def total():
        return tf.add_n([tf.reduce_sum(tf.cast(w, tf.float64)) for w in weights])

    return lambda: math.isfinite(float(total()))


def parameters(net: keras.Model) -> list[np.ndarray]:
    return [w.numpy() for w in net.weights]


# --- checkpoints -------------------------------------------------------------------------------
