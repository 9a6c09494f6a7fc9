"""Elastic data-parallel MNIST on TensorFlow/Keras 3: keeps training while workers leave and join.

The epoch loop is shared with PyTorch (:func:`launch.elastic.run_epochs`); this module is the
Keras glue: :class:`tf_models.horovod_keras.ElasticKerasState` for commits, rollbacks and the
broadcast to newcomers, and the same :class:`DistributedModel` train step as ``model.fit`` uses,
called directly so that the loop can stop at any step.  The LR is set on the optimizer before
each step: a per-step schedule keyed on the step counter cannot follow a world size that changes.
"""

from __future__ import annotations

import argparse

import horovod
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import run_fn

from launch import checkpoint, elastic, mnist, watchdog
from launch.report import Reporter, Summary
from launch.runtime import before_init, controller
from launch.sharding import eval_indices
from tf_models.horovod_keras import (
    DistributedModel,
    ElasticKerasState,
    allreduce_sums,
    peer_failures_roll_back,
)
from tf_models.model import build_model
from tf_models.train import configure_devices, load_checkpoint, make_evaluator, save_checkpoint


def train_elastic(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    hvd.init()
    watchdog.start(args.stall_timeout, hvd, elastic=True)  # watchdog: a frozen worker is lost
    configure_devices(hvd.local_rank(), hvd.local_size())
    if args.checkpoint_dir and hvd.rank() == 0:
        checkpoint.ensure_writable(args.checkpoint_dir)
    train_images, train_y, test_images, test_y = elastic.local_data(args)
    n_train, n_test = len(train_y), len(test_y)
    train_x = mnist.normalize(train_images)[..., np.newaxis]
    test_x = mnist.normalize(test_images)[..., np.newaxis]

    keras.utils.set_random_seed(args.seed + hvd.rank())  # rank 0's weights win at the first sync
    net = build_model(args.dropout, None)
    param_count = net.count_params()
    optimizer = keras.optimizers.SGD(learning_rate=args.base_lr, momentum=args.momentum)
    optimizer.build(net.trainable_variables)
    start_epoch = 0
    if args.resume and hvd.rank() == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = load_checkpoint(args.checkpoint_dir, net, optimizer, param_count, 0)
    model = DistributedModel(
        net, backward_passes_per_step=args.backward_passes_per_step,
        micro_batch_size=args.batch_size, fp16_allreduce=args.fp16_allreduce,
        gradient_predivide_factor=args.gradient_predivide_factor)
    model.compile(optimizer=optimizer)
    state = ElasticKerasState(net, optimizer, **elastic.initial_state(start_epoch))
    evaluate = make_evaluator(net)

    def run(state) -> Summary:
        with peer_failures_roll_back():
            return one_world(state)

    def one_world(state) -> Summary:
        rank, size = hvd.rank(), hvd.size()
        # Traced anew for every world: the gradient exchange is decided at trace time (a world of
        # one issues no allreduce), so a step traced for one worker must not run with two.
        train_step = tf.function(model.train_step, jit_compile=False)

        def step(idx: np.ndarray, lr: float) -> tuple[float, int]:
            optimizer.learning_rate = lr
            model.loss_tracker.reset_state()
            train_step((tf.constant(train_x[idx]), tf.constant(train_y[idx])))
            return float(model.loss_tracker.total.numpy()), len(idx)

        eval_idx = eval_indices(n_test, rank, size)
        glue = elastic.Glue(
            rank=rank, size=size, step=step,
            sum_across_ranks=lambda values: allreduce_sums(values, name="elastic_sums").tolist(),
            evaluate=lambda: evaluate(test_x[eval_idx], test_y[eval_idx]),
            save_checkpoint=lambda epoch: args.checkpoint_dir and save_checkpoint(
                args.checkpoint_dir, epoch, net, optimizer, param_count, args))
        report = Reporter(rank == 0, progress=not args.no_progress)
        test_loss, test_acc = elastic.run_epochs(state, args, n_train, glue, report)
        summary = Summary(framework="tf", controller=controller(hvd), param_count=param_count,
                          versions={"tensorflow": tf.__version__, "keras": keras.__version__,
                                    "horovod": horovod.__version__},
                          **elastic.summary_fields(state, args, glue))
        return report.finish(summary, test_loss=test_loss, test_acc=test_acc,
                             train_seconds=state.train_seconds, images_seen=state.images_seen,
                             params=[w.numpy() for w in net.weights],
                             allgather_object=hvd.allgather_object, metrics_out=args.metrics_out)

    # Not ``hvd.elastic.run``: Horovod's TF wrapper swallows op errors it does not recognise (see
    # peer_failures_roll_back); run_fn is the loop it wraps, minus that.
    return run_fn(run, reset)(state)


def reset() -> None:
    """Re-join the job after a membership change: the driver hands out new ranks at init."""
    hvd.shutdown()
    hvd.init()
