"""Data-parallel training on TensorFlow/Keras 3 through Horovod's Keras API: the fixed-size trainer.

The twin of :mod:`torch_models.train`: same flags, same shards, same LR rule, same output, the
same Horovod lines, each marked ``# Horovod:`` below.  It is Horovod's own Keras recipe (its
``tensorflow2_keras_mnist.py`` example), on the Horovod that ``make setup`` patches for Keras 3:
``hvd.DistributedOptimizer`` averages the gradients, ``BroadcastGlobalVariablesCallback`` hands
rank 0's weights and optimizer state to every rank when training begins, and ``model.fit`` runs
the steps.  With ``--backward-passes-per-step K`` fit runs K micro-batch steps of B rows per
optimizer step (each loss weighted 1/K; the wrapper sums their gradients locally and allreduces
on the K-th).
:class:`FitToJob` hands fit's hooks to the shared :class:`ringtrain.training.job.Job` once per optimizer step
(the LR before it, progress after it) and once per epoch (metrics, output, checkpoint), on every
rank in the same order, so every rank issues the same collectives.  Train loss comes from
:func:`~tf_models.horovod_keras.loss_sums` (float64 sums the Job allreduces, exact over ranks),
not from Horovod's ``MetricAverageCallback``, which averages the ranks' averages.
"""

from __future__ import annotations

import argparse
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

from ringtrain.data.dataset import model_inputs
from ringtrain.data.sharding import optimizer_steps, shard_indices
from ringtrain.faults import watchdog
from ringtrain.lr import scaled_lr
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init
from ringtrain.training import divergence
from ringtrain.training.job import Job
from tf_models import common
from tf_models.horovod_keras import loss_sums
from tf_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise; from here on every rank knows its rank and the world size.
    hvd.init()
    # Horovod: pin this rank to its share of the host's cores and to GPU local_rank (if any).
    use_gpu = common.configure_devices(hvd.local_rank(), hvd.local_size())
    job = Job(args, framework="tf", versions=common.VERSIONS, hvd=hvd,
              collectives=common.COLLECTIVES, use_gpu=use_gpu)
    watchdog.start(args.stall_timeout, hvd)  # watchdog: a frozen or cut-off rank ends the job
    rank, size, k = job.rank, job.size, args.backward_passes_per_step

    # Different seeds per rank on purpose: the broadcast below, not luck, makes ranks agree.
    keras.utils.set_random_seed(args.seed + rank)
    net = build(args.model, job.dataset, args.dropout, "mixed_float16" if args.amp else None)
    param_count = net.count_params()  # the model is checked on every rank before any collective

    train_images, train_labels, test_images, test_y = job.load_data(param_count)
    test_x = model_inputs(job.dataset, test_images)
    steps = optimizer_steps(job.n_train, size, args.batch_size, k, args.max_steps)

    # Horovod: scale the learning rate with the number of workers (warm-up and decay per step).
    target_lr = scaled_lr(args.base_lr, size, args.lr_scaling, args.adasum)
    optimizer = keras.optimizers.SGD(learning_rate=target_lr, momentum=args.momentum)
    if args.amp:  # wrapped inside: the loss-scale skip decision is taken on allreduced gradients
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    # Horovod: wrap the optimizer: gradients are averaged over all ranks (allreduce) every K-th
    # micro-batch step, after summing the K locally.
    optimizer = hvd_keras.DistributedOptimizer(
        optimizer, backward_passes_per_step=k, op=hvd.Adasum if args.adasum else hvd.Average,
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        gradient_predivide_factor=args.gradient_predivide_factor)
    optimizer.build(net.trainable_variables)  # slots exist now: checkpoints and broadcast see them
    start_epoch = job.resume(lambda: common.load_checkpoint(
        args.checkpoint_dir, net, optimizer, job.model_name, param_count))
    sums = loss_sums()
    # Each micro-batch's loss weighs 1/K, so the K summed gradients are their mean, as in the
    # PyTorch trainer (loss / K) and for every op: Horovod's own average_aggregated_gradients
    # refuses Adasum.  XLA off: this Horovod build has no XLA kernels (Keras turns it on on GPUs).
    net.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                loss_weights=1.0 / k, metrics=[sums], jit_compile=False)

    job.begin(param_count=param_count, target_lr=target_lr, steps=steps, start_epoch=start_epoch)
    eval_sums = common.make_eval_sums(net, job.dataset.input_shape)
    if start_epoch < args.epochs:
        # Horovod: shard: rank r takes every N-th sample of each epoch's order, the same on all ranks.
        batches = [b for epoch in range(start_epoch + 1, args.epochs + 1)
                   for b in epoch_batches(job.n_train, rank, size, args, epoch, steps)]
        to_job = FitToJob(job, sums, steps=steps, k=k, target_lr=target_lr,
                          weights_finite=common.make_weights_finite(net),
                          evaluate=lambda: eval_sums(test_x, test_y),
                          save=lambda e: common.save_checkpoint(args.checkpoint_dir, e, net, optimizer,
                                                                job.model_name, param_count, args))
        # Horovod: broadcast rank 0's weights and optimizer state (fresh or resumed) as fit begins.
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), to_job]
        net.fit(train_dataset(job.dataset, train_images, train_labels, batches), epochs=args.epochs,
                initial_epoch=start_epoch, steps_per_epoch=steps * k, shuffle=False, verbose=0,
                callbacks=callbacks)
    else:  # resumed at the end: nothing to train, but every rank evaluates rank 0's weights
        hvd.broadcast_variables([*net.weights, *optimizer.variables], root_rank=0)
    return job.finish_fixed(lambda: eval_sums(test_x, test_y), common.parameters(net))


class FitToJob(keras.callbacks.Callback):
    """``model.fit``'s hooks, on every rank, handed to the :class:`~ringtrain.training.job.Job` once per
    optimizer step, i.e. every K-th of fit's micro-batch steps.

    Before each optimizer step the optimizer gets the step's LR from :meth:`Job.lr`, the LR rule the
    PyTorch trainer and both elastic loops use (a float32 variable, assigned ``float32(lr_at(...))``;
    only the K-th micro-batch step applies it).  After it, the step's mean loss on this rank (from
    ``sums``, the float64 :func:`~tf_models.horovod_keras.loss_sums` metric) goes to
    :meth:`Job.step_done`; at the epoch's end, this rank's (loss sum, images) and test sums go to
    :meth:`Job.end_epoch`.
    """

    def __init__(self, job: Job, sums: keras.metrics.Metric, *, steps: int, k: int,
                 target_lr: float, weights_finite, evaluate, save) -> None:
        super().__init__()
        self.job, self.sums, self.steps, self.k, self.target_lr = job, sums, steps, k, target_lr
        self.weights_finite = weights_finite
        self.evaluate, self.save = evaluate, save
        self.epoch, self.lr, self.t0, self.seen = 0, 0.0, 0.0, (0.0, 0.0)

    def totals(self) -> tuple[float, float]:
        return float(self.sums.total.numpy()), float(self.sums.count.numpy())

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.epoch = epoch + 1  # Keras counts epochs from 0, the reports from 1
        self.t0, self.seen = time.perf_counter(), (0.0, 0.0)

    def on_train_batch_begin(self, batch, logs=None) -> None:
        if batch % self.k == 0:  # the first micro-batch of an optimizer step
            self.lr = self.job.lr(self.epoch, batch // self.k, self.steps, self.target_lr)
            self.model.optimizer.learning_rate = self.lr

    def on_train_batch_end(self, batch, logs=None) -> None:
        if (batch + 1) % self.k:  # gradients accumulated, nothing applied yet
            return
        total, count = self.totals()
        step_loss = (total - self.seen[0]) / (count - self.seen[1])
        self.seen = (total, count)
        if not self.weights_finite():  # identical on every rank: all stop here
            raise divergence.stop(self.job.gather, self.epoch, (batch + 1) // self.k,
                                  lambda: step_loss)
        self.job.step_done(self.epoch, (batch + 1) // self.k, self.steps, loss=step_loss, lr=self.lr,
                           consumed=int(count) * self.job.size)

    def on_epoch_end(self, epoch, logs=None) -> None:
        seconds = time.perf_counter() - self.t0
        self.job.end_epoch(self.epoch, train_sums=list(self.totals()), seconds=seconds, lr=self.lr,
                           evaluate=self.evaluate, save=self.save)


# --- data --------------------------------------------------------------------------------------

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
