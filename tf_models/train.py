"""Data-parallel training on TensorFlow/Keras 3 through Horovod's Keras API: the fixed-size trainer.

The twin of :mod:`torch_models.train`: same flags, same shards, same LR rule, same output, the
same Horovod lines, each marked ``# Horovod:`` below.  It is Horovod's own Keras recipe (its
``tensorflow2_keras_mnist.py`` example), on the Horovod that ``make setup`` patches for Keras 3:
``hvd.DistributedOptimizer`` averages the gradients, ``BroadcastGlobalVariablesCallback`` hands
rank 0's weights and optimizer state to every rank when training begins, and ``model.fit`` runs
the steps.  With ``--backward-passes-per-step K`` fit runs K micro-batch steps of B rows per
optimizer step (each loss weighted 1/K; the wrapper sums their gradients locally and allreduces
on the K-th).  :class:`~tf_models.fit_callback.FixedRunCallback` hands fit's hooks to the shared
:class:`~ringtrain.training.fixed.FixedRun` once per optimizer step (the LR before it, progress
after it) and once per epoch (metrics, output, checkpoint), on every rank in the same order, so
every rank issues the same collectives.  Train loss comes from
:func:`~tf_models.horovod_keras.loss_sums` (float64 sums allreduced at the epoch's end, exact over
ranks), not from Horovod's ``MetricAverageCallback``, which averages the ranks' averages.
"""

from __future__ import annotations

import argparse

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import keras

from ringtrain import model_spec
from ringtrain.data import dataset as datasets
from ringtrain.data.sharding import optimizer_steps
from ringtrain.lr import scaled_lr
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.output.progress import Progress
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init
from ringtrain.training import startup
from ringtrain.training.fixed import FixedRun
from tf_models import checkpoints, devices
from tf_models.collectives import COLLECTIVES, VERSIONS, average_statistics
from tf_models.data import epoch_batches, open_data
from tf_models.evaluation import make_batch_sums, make_weights_finite, parameters
from tf_models.fit_callback import FixedRunCallback
from tf_models.horovod_keras import loss_sums
from tf_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise; from here on every rank knows its rank and the world size.
    hvd.init()
    # Horovod: pin this rank to its share of the host's cores and to GPU local_rank (if any).
    use_gpu = devices.configure(hvd.local_rank(), hvd.local_size())
    world = startup.begin(args, hvd, COLLECTIVES, use_gpu=use_gpu)
    rank, size, k = world.rank, world.size, args.backward_passes_per_step

    data = open_data(args, world, hvd.local_size())  # --data: MNIST, a folder, your own
    datasets.check_world(args, data.info, size)
    # Different seeds per rank on purpose: the broadcast below, not luck, makes ranks agree.
    keras.utils.set_random_seed(args.seed + rank)
    net = build(args.model, data.info, args.dropout, "mixed_float16" if args.amp else None)
    param_count = net.count_params()  # the model is checked on every rank before any collective
    model_name = model_spec.model_name(args.model, data.info.name)
    startup.check_output_folders(world, args, param_count)
    n_train = data.info.train_size
    steps = optimizer_steps(n_train, size, args.batch_size, k, args.max_steps)

    # Horovod: scale the learning rate with the number of workers (warm-up and decay per step).
    target_lr = scaled_lr(args.base_lr, size, args.lr_scaling, args.adasum)
    optimizer = keras.optimizers.SGD(learning_rate=target_lr, momentum=args.momentum)
    if args.amp:  # wrapped inside: the loss-scale skip decision is taken on allreduced gradients
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    # Horovod: wrap the optimizer: gradients are averaged over all ranks (allreduce) every K-th
    # micro-batch step, after summing the K locally.
    optimizer = hvd_keras.DistributedOptimizer(optimizer, **distributed_optimizer_options(args, hvd))
    optimizer.build(net.trainable_variables)  # slots exist now: checkpoints and broadcast see them
    start_epoch = startup.resume_epoch(world, args, lambda: checkpoints.restore(
        args.checkpoint_dir, net, optimizer, model_name, param_count, data.info))
    sums = loss_sums()
    # Each micro-batch's loss weighs 1/K, so the K summed gradients are their mean, as in the
    # PyTorch trainer (loss / K) and for every op: Horovod's own average_aggregated_gradients
    # refuses Adasum.  XLA off: this Horovod build has no XLA kernels (Keras turns it on on GPUs).
    net.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                loss_weights=1.0 / k, metrics=[sums], jit_compile=False)

    run = FixedRun(args, world, Progress(args, rank, n_train), framework="tf", versions=VERSIONS,
                   model_name=model_name, data=data.info, param_count=param_count,
                   target_lr=target_lr, steps=steps, start_epoch=start_epoch)
    batch_sums = make_batch_sums(net, data.info.input_shape)
    evaluate = lambda: data.eval_sums(batch_sums, rank, size)  # noqa: E731
    if start_epoch < args.epochs:
        # Horovod: shard: rank r takes every N-th sample of each epoch's order, the same on all ranks.
        batches = [b for epoch in range(start_epoch + 1, args.epochs + 1)
                   for b in epoch_batches(n_train, rank, size, args, epoch, steps)]
        hooks = FixedRunCallback(run, sums, world=world, k=k, weights_finite=make_weights_finite(net),
                                 evaluate=evaluate, problem=lambda: data.problem,
                                 sync_statistics=lambda: average_statistics(net),
                                 save=lambda e: checkpoints.save(args.checkpoint_dir, e, net, optimizer,
                                                                 model_name, param_count, args,
                                                                 data.info))
        # Horovod: broadcast rank 0's weights and optimizer state (fresh or resumed) as fit begins.
        callbacks = [hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0), hooks]
        net.fit(data.fit_dataset(batches), epochs=args.epochs, initial_epoch=start_epoch,
                steps_per_epoch=steps * k, shuffle=False, verbose=0, callbacks=callbacks)
    else:  # resumed at the end: nothing to train, but every rank evaluates rank 0's weights
        hvd.broadcast_variables([*net.weights, *optimizer.variables], root_rank=0)
    return run.finish(evaluate, parameters(net))
