"""What a run reads from a Keras model besides training it: one batch's test sums, whether its
weights are still numbers, and its weights for the checksums."""

from __future__ import annotations

import math
from collections.abc import Iterator

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


def _floating(weights) -> list:
    return [w for w in weights if tf.as_dtype(w.dtype).is_floating]


def weights_total(weights) -> tf.Tensor:
    """A float64 scalar, finite whenever every weight of ``weights`` is a finite number: each
    tensor's sum in its own dtype (a NaN or inf makes its tensor's sum NaN or inf), the sums then
    added as float64 scalars.  No copy of any weight: a float64 cast of each tensor, as this once
    took, doubled a float32 kernel's memory inside the train step, and TensorFlow's kernels out
    of memory fail as segfaults or NaNs, read as divergence.  Not finite does not mean diverged:
    finite weights whose sum overflows their dtype (float32 beyond 3.4e38, float16 beyond 65504)
    give inf too; :func:`weights_all_finite` tells the two apart, as float64 sums do on the
    PyTorch side (:func:`torch_models.evaluation.weights_finite`)."""
    sums = [tf.cast(tf.reduce_sum(w), tf.float64) for w in _floating(weights)]
    return tf.add_n(sums) if sums else tf.constant(0.0, tf.float64)


def weights_all_finite(weights) -> tf.Tensor:
    """Whether every weight of ``weights`` is a finite number, exactly: each tensor's
    ``is_finite``, one boolean tensor at a time (a quarter of a float32 weight).  Only taken
    where :func:`weights_total` is not finite."""
    result = tf.constant(True)
    for w in _floating(weights):
        result = tf.logical_and(result, tf.reduce_all(tf.math.is_finite(w)))
    return result


def make_weights_finite(net: keras.Model):
    """``weights_finite()``: whether every trainable weight is a finite number (the sums of
    :func:`weights_total`, then where they are not finite the exact check, each traced)."""
    weights = net.trainable_weights
    total = tf.function(lambda: weights_total(weights))
    exact = tf.function(lambda: weights_all_finite(weights))
    return lambda: math.isfinite(float(total())) or bool(exact())


class WeightsTotal(keras.metrics.Metric):
    """A ``compile`` metric of the fixed job: :func:`weights_total` of the trainable weights
    (each tensor's sum in its own dtype), taken inside fit's train step, which updates its
    metrics after the optimizer's update, so that each step's finiteness check (:meth:`finite`)
    reads one variable; only where it is not finite does :meth:`finite` run the exact check
    (:func:`weights_all_finite`), on the same weights, outside the step.  Calling the traced
    :func:`make_weights_finite` after each step cost 1.6 ms of a CNN step on 2 cores, most of it
    the call (BENCHMARKS.md section 8.6)."""

    def __init__(self, net: keras.Model) -> None:
        super().__init__(name="weights_total", dtype="float64")
        weights = net.trainable_weights
        # A closure, not an attribute: a metric counts the variables it holds as its own (its
        # ``variables``, which Keras' default reset_state zeroes), and these are the model's.
        self._sum = lambda: weights_total(weights)
        self._exact = tf.function(lambda: weights_all_finite(weights))
        self.total = self.add_variable(shape=(), initializer="zeros", dtype="float64", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign(self._sum())

    def result(self):
        return self.total

    def reset_state(self):
        self.total.assign(0.0)

    def finite(self) -> bool:
        return math.isfinite(float(self.total.numpy())) or bool(self._exact())


def parameters(net: keras.Model) -> Iterator[np.ndarray]:
    """Every weight, trainable or not (BatchNorm's moving statistics too), in model order, one
    at a time: ``.numpy()`` copies, and a list of them would hold a copy of the whole model."""
    return (w.numpy() for w in net.weights)
