"""``--strategy ps`` on TensorFlow/Keras 3: the framework's half of a parameter-server run.

The twin of :mod:`torch_models.ps`: :class:`KerasPSRun` opens as every Keras run does
(:func:`tf_models.startup.open_rank`, :meth:`~tf_models.run.KerasModelRun.open_model`), without
the ring's recipe (no ``DistributedOptimizer``, no ``model.fit``); server 0
(rank 0) keeps the ring's optimizer (:func:`tf_models.optimizers.build`) only to write and read
checkpoints in the ring's format.  ``--precision bf16``: the model was built under
``mixed_bfloat16`` (:meth:`~tf_models.run.KerasModelRun.open_model`, as the ring's), so it
computes in bfloat16 and keeps float32 variables, whose gradients the servers get.  A step's
gradient is one traced function (:func:`make_gradient`): K micro-batches under
``tf.GradientTape``, each loss weighted 1/K, as the ring's ``fit`` computes it before the
allreduce.  Keras keeps momentum as ``m = mu m - lr g; w += m`` (the ``keras`` rule of
:class:`ringtrain.strategies.ps.engine.SliceSGD`): its momentum slots hold the servers' velocity as
is, and so do Adam's and RMSprop's slots the servers' moments (:func:`slots`).
"""

from __future__ import annotations

import argparse

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from ringtrain import optimizer_spec
from ringtrain.errors import UserError
from ringtrain.strategies.ps import options as ps_options
from ringtrain.strategies.ps.run import ParameterServerRun
from ringtrain.training import startup
from tf_models import optimizers
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


def slots(optimizer: keras.optimizers.Optimizer, name: str) -> list:
    """The Keras optimizer's variables holding the servers' state array ``name``
    (:func:`ringtrain.strategies.ps.engine.state_names`)."""
    if name == "velocity":  # SGD's momentum, RMSprop's momentum buffer
        return list(getattr(optimizer, "momentums", None) or optimizer._momentums)
    if name == "exp_avg":
        return list(optimizer._momentums)
    return list(optimizer._velocities)  # exp_avg_sq (Adam), square_avg (RMSprop)


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
            if optimizer_spec.plain_sgd(self.args) and self.args.clip_grad_norm is None:
                self.optimizer = keras.optimizers.SGD(learning_rate=self.target_lr,
                                                      momentum=self.args.momentum)
            else:  # the ring's (its K micro-batch steps counted as Horovod's wrapper counts them)
                self.optimizer = optimizers.build(self.args, self.target_lr,
                                                  self.args.backward_passes_per_step)
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

    def get_state(self) -> tuple[dict[str, np.ndarray], int]:
        arrays = {name: np.concatenate([np.asarray(m.numpy(), np.float32).reshape(-1)
                                        for m in slots(self.optimizer, name)])
                  for name in self.state_names()}
        micro = getattr(self.optimizer, "micro_steps", 1)
        return arrays, int(self.optimizer._iterations.numpy()) // micro

    def set_state(self, arrays: dict[str, np.ndarray], count: int, steps: int, lr: float) -> None:
        # Adam's bias correction reads the iterations: the servers' count (K micro-batch steps
        # each, as Horovod's wrapper counts them); SGD's: the schedule's position, as always.
        micro = getattr(self.optimizer, "micro_steps", 1)
        self.optimizer._iterations.assign(steps if self.args.optimizer == "sgd" else count * micro)
        self.optimizer.learning_rate = lr
        for name, flat in arrays.items():
            start = 0
            for m in slots(self.optimizer, name):
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

