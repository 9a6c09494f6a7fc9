"""``--strategy ps`` on TensorFlow/Keras 3: the framework's half of a parameter-server run.

The twin of :mod:`torch_models.ps`: :class:`KerasPSRun` opens as every Keras run does
(:func:`tf_models.startup.open_rank`, :meth:`~tf_models.run.KerasModelRun.open_model`), without
the ring's recipe (no ``DistributedOptimizer``, no ``model.fit``); server 0
(rank 0) keeps a plain ``keras.optimizers.SGD`` only to write and read checkpoints in the ring's
format.  A step's gradient is one traced function (:func:`make_gradient`): K micro-batches under
``tf.GradientTape``, each loss weighted 1/K, as the ring's ``fit`` computes it before the
allreduce.  Keras keeps momentum as ``m = mu m - lr g; w += m`` (the ``keras`` rule of
:class:`ringtrain.strategies.ps.engine.SliceSGD`): its momentum slots hold the servers' velocity as is.
"""

from __future__ import annotations

import argparse

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from ringtrain.errors import UserError
from ringtrain.strategies.ps import options as ps_options
from ringtrain.strategies.ps.run import ParameterServerRun
from ringtrain.training import startup
from tf_models.horovod_keras import sparse_logits_loss
from tf_models.run import KerasModelRun


def make_gradient(net: keras.Model, k: int, micro: int):
    """``gradient(x, y) -> (flat gradient, loss sum)`` of one optimizer step of K x B rows,
    traced once per shape."""
    variables = net.trainable_variables

    @tf.function(jit_compile=False, reduce_retracing=True)
    def gradient(x, y):
        accumulated, total = None, tf.constant(0.0, tf.float64)
        for m in range(k):  # unrolled at trace time: K is a constant
            xs, ys = (x, y) if k == 1 else (x[m * micro:(m + 1) * micro], y[m * micro:(m + 1) * micro])
            with tf.GradientTape() as tape:
                per_example = sparse_logits_loss(ys, net(xs, training=True))
                loss = tf.reduce_mean(tf.cast(per_example, tf.float32))
                scaled = loss / k if k > 1 else loss
            grads = tape.gradient(scaled, variables)
            accumulated = grads if accumulated is None else [
                a + g for a, g in zip(accumulated, grads, strict=True)]
            total += tf.reduce_sum(tf.cast(per_example, tf.float64))
        return tf.concat([tf.reshape(g, [-1]) for g in accumulated], 0), total

    return gradient


class KerasPSRun(ParameterServerRun, KerasModelRun):
    """The parameter servers' framework-free half (:class:`ParameterServerRun`) with a Keras rank
    that holds the whole model (:class:`~tf_models.run.KerasModelRun`)."""

    momentum_rule = "keras"

    def __init__(self, args: argparse.Namespace) -> None:
        self.open_run(hvd, lambda: self.open_model(args, check_world=ps_options.check_world),
                      self.open_optimizer)
        self.gradient = make_gradient(self.net, args.backward_passes_per_step, args.batch_size)

    def open_optimizer(self) -> None:
        """Server 0's optimizer, for checkpoints only (the servers update their slices), and the
        resume on rank 0; no wrapping, no broadcast, no compile."""
        self.trained = list(self.net.trainable_variables)
        odd = sorted({str(v.dtype) for v in self.trained} - {"float32"})
        if odd:
            raise UserError(f"--strategy ps keeps the parameters as float32, and this model has "
                            f"{', '.join(odd)} ones; use float32 parameters or the ring")
        self.optimizer = None
        if self.world.rank == 0:
            self.optimizer = keras.optimizers.SGD(learning_rate=self.target_lr,
                                                  momentum=self.args.momentum)
            self.optimizer.build(self.trained)
        self.start_epoch = startup.resume_epoch(self.world, self.args, self.restore)

    # --- the flat vector ----------------------------------------------------------------------

    def get_flat(self) -> np.ndarray:
        return np.concatenate([np.asarray(v.numpy(), np.float32).reshape(-1) for v in self.trained])

    def set_flat(self, flat: np.ndarray) -> None:
        start = 0
        for v in self.trained:
            n = int(np.prod(v.shape))
            v.assign(flat[start:start + n].reshape(v.shape))
            start += n

    def flat_gradient(self, batch) -> tuple[np.ndarray, float, int]:
        x, y = batch
        grad, total = self.gradient(tf.constant(x), tf.constant(y))
        total = float(total.numpy())
        self.loss_sum += total
        return grad.numpy(), total / max(len(y), 1), len(y)

    def get_velocity(self) -> np.ndarray | None:
        if not self.args.momentum:
            return None
        return np.concatenate([np.asarray(m.numpy(), np.float32).reshape(-1)
                               for m in self.optimizer.momentums])

    def set_velocity(self, flat: np.ndarray | None, steps: int, lr: float) -> None:
        self.optimizer.iterations.assign(steps)
        self.optimizer.learning_rate = lr
        if flat is None:
            return
        start = 0
        for m in self.optimizer.momentums:
            n = int(np.prod(m.shape))
            m.assign(flat[start:start + n].reshape(m.shape))
            start += n

    def _statistics(self) -> list:
        return [w for w in self.net.non_trainable_weights
                if w.dtype in ("float16", "float32", "float64")]

    def buffer_values(self) -> np.ndarray:
        stats = self._statistics()
        if not stats:
            return np.zeros(0)
        return np.concatenate([np.asarray(w.numpy(), np.float64).reshape(-1) for w in stats])

    def set_buffers(self, flat: np.ndarray) -> None:
        start = 0
        for w in self._statistics():
            n = int(np.prod(w.shape))
            w.assign(flat[start:start + n].reshape(w.shape).astype(w.dtype))
            start += n

