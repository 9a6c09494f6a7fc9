"""Elastic data-parallel training on TensorFlow/Keras 3: keeps training while workers leave and join.

The epoch loop and each world's bookkeeping are shared with PyTorch
(:func:`ringtrain.training.elastic.train_world`); this module is the Keras glue:
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
import tensorflow as tf
from horovod.common.elastic import run_fn

from ringtrain import model_spec
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init
from ringtrain.training import elastic, startup
from ringtrain.training.world import World, state_broadcast
from tf_models import checkpoints, devices
from tf_models.collectives import COLLECTIVES, VERSIONS, average_statistics
from tf_models.data import open_data
from tf_models.evaluation import make_batch_sums, make_weights_finite, parameters
from tf_models.horovod_keras import DistributedModel, ElasticKerasState, peer_failures_roll_back
from tf_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise (again after every membership change, in reset()).
    hvd.init()
    # Horovod: pin this rank to its share of the cores and its GPU, once for the process's life.
    use_gpu = devices.configure(hvd.local_rank(), hvd.local_size())
    first = startup.begin(args, hvd, COLLECTIVES, use_gpu=use_gpu, elastic=True)
    # Opened by this worker alone: a collective here would be outside the elastic loop, which a
    # worker joining mid-run would never be matched with.  Sharded per world below.
    data = open_data(args, None, hvd.local_size())
    keras.utils.set_random_seed(args.seed + first.rank)  # rank 0's weights win at the first sync
    net = build(args.model, data.info, args.dropout, None)  # checked on every rank
    param_count = net.count_params()
    model_name = model_spec.model_name(args.model, data.info.name)
    if first.rank == 0:
        startup.check_output_folders(None, args, param_count)

    optimizer = keras.optimizers.SGD(learning_rate=args.base_lr, momentum=args.momentum)
    optimizer.build(net.trainable_variables)
    start_epoch = 0
    if args.resume and first.rank == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = checkpoints.restore(args.checkpoint_dir, net, optimizer, model_name, param_count,
                                          data.info)
    # Horovod: wrap the model: its train step averages the gradients over all ranks (allreduce).
    model = DistributedModel(
        net, backward_passes_per_step=args.backward_passes_per_step,
        micro_batch_size=args.batch_size, fp16_allreduce=args.fp16_allreduce,
        gradient_predivide_factor=args.gradient_predivide_factor)
    model.compile(optimizer=optimizer)
    # Horovod: the elastic state broadcasts rank 0's weights and optimizer at every (re)start.
    state = ElasticKerasState(net, optimizer, bcast_object=state_broadcast(COLLECTIVES, hvd.rank),
                              **elastic.initial_state(start_epoch))  # plain data, not pickles
    batch_sums = make_batch_sums(net, data.info.input_shape)
    weights_finite = make_weights_finite(net)

    def run(state) -> Summary:
        with peer_failures_roll_back():
            return one_world(state)

    def one_world(state) -> Summary:
        # Each world has its own ranks, so its own World; the shard and the LR scale are derived
        # from the world size inside train_world.
        world = World(hvd, COLLECTIVES)
        # Traced anew for every world: the gradient exchange is decided at trace time (a world of
        # one issues no allreduce), so a step traced for one worker must not run with two.
        train_step = tf.function(model.train_step, jit_compile=False)

        def step(batch, lr: float) -> tuple[float, int]:
            x, y = batch
            optimizer.learning_rate = lr
            model.loss_tracker.reset_state()
            train_step((tf.constant(x), tf.constant(y)))
            return float(model.loss_tracker.total.numpy()), len(y)

        ops = elastic.FrameworkOps(
            batches=data.batches, step=step,
            eval_sums=lambda: data.eval_sums(batch_sums, world.rank, world.size),
            problem=lambda: data.problem, sync_buffers=lambda: average_statistics(net),
            save_checkpoint=lambda epoch: checkpoints.save(args.checkpoint_dir, epoch, net, optimizer,
                                                           model_name, param_count, args, data.info),
            weights_finite=weights_finite, parameters=lambda: parameters(net))
        return elastic.train_world(state, args, world, ops, data=data.info, framework="tf",
                                   versions=VERSIONS, param_count=param_count)

    # Not ``hvd.elastic.run``: Horovod's TF wrapper swallows op errors it does not recognise (see
    # peer_failures_roll_back); run_fn is the loop it wraps, minus that.
    return run_fn(run, reset)(state)


def reset() -> None:
    """Re-join the job after a membership change: the driver hands out new ranks at init."""
    hvd.shutdown()
    hvd.init()
