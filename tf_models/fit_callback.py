"""The bridge from Keras' ``model.fit`` to the run's shared bookkeeping (fixed-size TF job)."""

from __future__ import annotations

import time

import keras

from ringtrain.training.fixed_loop import FixedLoop


class FixedLoopCallback(keras.callbacks.Callback):
    """``model.fit``'s hooks, on every rank, handed to the :class:`~ringtrain.training.fixed_loop.FixedLoop`
    once per optimizer step, i.e. every K-th of fit's micro-batch steps.

    Before each optimizer step the optimizer gets the step's LR from :meth:`FixedLoop.before_step`,
    the LR rule the PyTorch trainer and both elastic loops use (a float32 variable, assigned
    ``float32(lr_at(...))``; only the K-th micro-batch step applies it).  After it, the step's
    mean loss on this rank (from the run's float64 :func:`~tf_models.horovod_keras.loss_sums`
    metric) goes to :meth:`FixedLoop.after_step`, which checks the weights and reports the step;
    at the epoch's end, this rank's (loss sum, images) go to :meth:`FixedLoop.end_epoch`.  The
    callback reads fit's state and hands it on; it changes nothing of the run's but the LR.
    """

    def __init__(self, fixed: FixedLoop, sums: keras.metrics.Metric) -> None:
        super().__init__()
        self.fixed, self.sums, self.k = fixed, sums, fixed.args.backward_passes_per_step
        self.shards = fixed.run.shard_size
        self.epoch, self.lr, self.t0, self.seen = 0, 0.0, 0.0, (0.0, 0.0)

    def totals(self) -> tuple[float, float]:
        return float(self.sums.total.numpy()), float(self.sums.count.numpy())

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.epoch = epoch + 1  # Keras counts epochs from 0, the reports from 1
        self.t0, self.seen = time.perf_counter(), (0.0, 0.0)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if batch % self.k == 0:  # the first micro-batch of an optimizer step
            self.lr = self.fixed.before_step(self.epoch, batch // self.k)
            self.model.optimizer.learning_rate = self.lr

    def on_train_batch_end(self, batch, logs=None) -> None:
        if (batch + 1) % self.k:  # gradients accumulated, nothing applied yet
            return
        total, count = self.totals()
        step_loss = (total - self.seen[0]) / (count - self.seen[1])
        self.seen = (total, count)
        self.fixed.after_step(self.epoch, (batch + 1) // self.k, loss=step_loss, lr=self.lr,
                              consumed=int(count) * self.shards)

    def on_epoch_end(self, epoch, logs=None) -> None:
        seconds = time.perf_counter() - self.t0
        self.fixed.end_epoch(self.epoch, train_sums=list(self.totals()), seconds=seconds, lr=self.lr)
