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


def make_weights_finite(net: keras.Model):
    """``weights_finite()``: whether every trainable weight is a finite number (one float64 sum
    per tensor, in one traced function)."""
    weights = net.trainable_weights

    @tf.function
    def total():
        return tf.add_n([tf.reduce_sum(tf.cast(w, tf.float64)) for w in weights])

    return lambda: math.isfinite(float(total()))


def parameters(net: keras.Model) -> list[np.ndarray]:
    """Every weight, trainable or not (BatchNorm's moving statistics too), in model order."""
    return [w.numpy() for w in net.weights]
