"""Elastic data-parallel training on TensorFlow/Keras 3: keeps training while workers leave and join.

The epoch loop is shared with PyTorch (:func:`ringtrain.training.elastic.run_epochs`), and each world's
bookkeeping with the fixed-size trainer (:class:`ringtrain.training.job.Job`); this module is the Keras glue:
:class:`tf_models.horovod_keras.ElasticKerasState` for commits, rollbacks and the broadcast to
newcomers, and :class:`~tf_models.horovod_keras.DistributedModel`'s train step (K micro-batches,
one allreduce, one update), called directly so that the loop can stop, commit and roll back
between any two optimizer steps.  The fixed-size trainer runs Horovod's ``DistributedOptimizer``
in ``model.fit`` instead, whose accumulation state (K > 1) lives outside the optimizer and this
state; without membership changes both give the same weights bit for bit.  The LR is set on the
optimizer before each step, as in the fixed-size trainer, from the world size of the moment.
"""

from __future__ import annotations

import argparse

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import run_fn

from ringtrain.data.dataset import model_inputs
from ringtrain.data.sharding import eval_indices
from ringtrain.faults import watchdog
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init
from ringtrain.training import elastic
from ringtrain.training.job import Job
from tf_models import common
from tf_models.horovod_keras import DistributedModel, ElasticKerasState, peer_failures_roll_back
from tf_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise (again after every membership change, in reset()).
    hvd.init()
    # Horovod: pin this rank to its share of the cores and its GPU, once for the process's life.
    use_gpu = common.configure_devices(hvd.local_rank(), hvd.local_size())
    first = Job(args, framework="tf", versions=common.VERSIONS, hvd=hvd,
                collectives=common.COLLECTIVES, use_gpu=use_gpu, elastic=True)
    watchdog.start(args.stall_timeout, hvd, elastic=True)  # watchdog: a frozen worker is lost
    keras.utils.set_random_seed(args.seed + first.rank)  # rank 0's weights win at the first sync
    net = build(args.model, first.dataset, args.dropout, None)  # checked on every rank
    param_count = net.count_params()
    first.check_folders(param_count)
    train_images, train_y, test_images, test_y = elastic.local_data(args)
    n_train, n_test = len(train_y), len(test_y)
    train_x = model_inputs(first.dataset, train_images)
    test_x = model_inputs(first.dataset, test_images)

    optimizer = keras.optimizers.SGD(learning_rate=args.base_lr, momentum=args.momentum)
    optimizer.build(net.trainable_variables)
    start_epoch = 0
    if args.resume and first.rank == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = common.load_checkpoint(args.checkpoint_dir, net, optimizer, first.model_name,
                                             param_count)
    # Horovod: wrap the model: its train step averages the gradients over all ranks (allreduce).
    model = DistributedModel(
        net, backward_passes_per_step=args.backward_passes_per_step,
        micro_batch_size=args.batch_size, fp16_allreduce=args.fp16_allreduce,
        gradient_predivide_factor=args.gradient_predivide_factor)
    model.compile(optimizer=optimizer)
    # Horovod: the elastic state broadcasts rank 0's weights and optimizer at every (re)start.
    state = ElasticKerasState(net, optimizer, **elastic.initial_state(start_epoch))
    eval_sums = common.make_eval_sums(net, first.dataset.input_shape)
    weights_finite = common.make_weights_finite(net)

    def run(state) -> Summary:
        with peer_failures_roll_back():
            return one_world(state)

    def one_world(state) -> Summary:
        # Each world has its own ranks, so its own Job; the shard and the LR scale are derived
        # from the world size inside run_epochs.
        job = Job(args, framework="tf", versions=common.VERSIONS, hvd=hvd,
                  collectives=common.COLLECTIVES, use_gpu=use_gpu, elastic=True)
        # Traced anew for every world: the gradient exchange is decided at trace time (a world of
        # one issues no allreduce), so a step traced for one worker must not run with two.
        train_step = tf.function(model.train_step, jit_compile=False)

        def step(idx: np.ndarray, lr: float) -> tuple[float, int]:
            optimizer.learning_rate = lr
            model.loss_tracker.reset_state()
            train_step((tf.constant(train_x[idx]), tf.constant(train_y[idx])))
            return float(model.loss_tracker.total.numpy()), len(idx)

        eval_idx = eval_indices(n_test, job.rank, job.size)
        return job.elastic_world(
            state, n_train=n_train, step=step, param_count=param_count,
            eval_sums=lambda: eval_sums(test_x[eval_idx], test_y[eval_idx]),
            save=lambda epoch: common.save_checkpoint(args.checkpoint_dir, epoch, net, optimizer,
                                                      job.model_name, param_count, args),
            params=lambda: common.parameters(net), weights_finite=weights_finite)

    # Not ``hvd.elastic.run``: Horovod's TF wrapper swallows op errors it does not recognise (see
    # peer_failures_roll_back); run_fn is the loop it wraps, minus that.
    return run_fn(run, reset)(state)


def reset() -> None:
    """Re-join the job after a membership change: the driver hands out new ranks at init."""
    hvd.shutdown()
    hvd.init()
