"""What a run reads from a Keras model besides training it: one batch's test sums, whether its
weights are still numbers, and its weights for the checksums."""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf

from ringtrain.data.dataset import DataInfo
from tf_models.horovod_keras import sparse_logits_loss


def make_batch_sums(net: keras.Model, data: DataInfo):
    """``batch_sums(x, y)``: one batch's (test loss sum, correct), traced once for the data's
    input shape and dtype; the data (:meth:`tf_models.data.TfData.eval_sums`) runs it over this
    rank's test share."""

    @tf.function(input_signature=[tf.TensorSpec([None, *data.input_shape], data.input_dtype),
                                  tf.TensorSpec([None], tf.int64)])
    def batch_sums(x, y):
        logits = net(x, training=False)
        loss = tf.reduce_sum(tf.cast(sparse_logits_loss(y, logits), tf.float64))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float64))
        return loss, correct

    return batch_sums


def weights_total(weights) -> tf.Tensor:
    """The float64 sum of ``weights``: not finite exactly when some weight is not a number."""
    return tf.add_n([tf.reduce_sum(tf.cast(w, tf.float64)) for w in weights])


def make_weights_finite(net: keras.Model):
    """``weights_finite()``: whether every trainable weight is a finite number (one float64 sum
    per tensor, in one traced function)."""
    weights = net.trainable_weights
    total = tf.function(lambda: weights_total(weights))
    return lambda: math.isfinite(float(total()))


class WeightsTotal(keras.metrics.Metric):
    """A ``compile`` metric of the fixed job: the float64 sum of every trainable weight, taken
    inside fit's train step, which updates its metrics after the optimizer's update, so that each
    step's finiteness check (:meth:`finite`) reads one variable.  Calling the traced
    :func:`make_weights_finite` after each step cost 1.6 ms of a CNN step on 2 cores, most of it
    the call (BENCHMARKS.md section 8.6)."""

    def __init__(self, net: keras.Model) -> None:
        super().__init__(name="weights_total", dtype="float64")
        weights = net.trainable_weights
        # A closure, not an attribute: a metric counts the variables it holds as its own (its
        # ``variables``, which Keras' default reset_state zeroes), and these are the model's.
        self._sum = lambda: weights_total(weights)
        self.total = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign(self._sum())

    def result(self):
        return self.total

    def reset_state(self):
        self.total.assign(0.0)

    def finite(self) -> bool:
        return math.isfinite(float(self.total.numpy()))


def parameters(net: keras.Model) -> list[np.ndarray]:
    """Every weight, trainable or not (BatchNorm's moving statistics too), in model order."""
    return [w.numpy() for w in net.weights]
