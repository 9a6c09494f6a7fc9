"""Elastic data-parallel training on TensorFlow/Keras 3: keeps training while workers leave and join.

The epoch loop and each world's bookkeeping are shared with PyTorch
(:func:`ringtrain.training.elastic.train_world`), driving the run object
(:class:`tf_models.run.KerasRun`, opened without collectives, stepping through
:class:`~tf_models.horovod_keras.DistributedModel` so that the loop can stop, commit and roll
back between any two optimizer steps).  :class:`tf_models.horovod_keras.ElasticKerasState` keeps
the commits, rollbacks and the broadcast to newcomers.  The fixed-size trainer runs Horovod's
``DistributedOptimizer`` in ``model.fit`` instead, whose accumulation state (K > 1) lives outside
the optimizer and this state; without membership changes both give the same weights bit for bit.
"""

from __future__ import annotations

import argparse

import horovod.tensorflow as hvd
from horovod.common.elastic import run_fn

from ringtrain.output.summary import Summary
from ringtrain.training import elastic
from ringtrain.training.world import state_broadcast
from tf_models import startup
from tf_models.collectives import COLLECTIVES
from tf_models.horovod_keras import ElasticKerasState, peer_failures_roll_back
from tf_models.run import KerasRun


def train(args: argparse.Namespace) -> Summary:
    run = KerasRun(args, elastic=True)  # Horovod: initialise, pin, wrap (inside)
    # Horovod: the elastic state broadcasts rank 0's weights and optimizer at every (re)start.
    state = ElasticKerasState(run.net, run.optimizer,
                              bcast_object=state_broadcast(COLLECTIVES, hvd.rank),
                              **elastic.initial_state(run.start_epoch))  # plain data, not pickles

    def train_world(state) -> Summary:
        with peer_failures_roll_back():
            run.new_world()  # each world has its own ranks; the shard and LR follow its size
            return elastic.train_world(state, run)

    # Horovod: run the loop elastically: re-run it in every re-formed world, from the last commit.
    # Not ``hvd.elastic.run``: Horovod's TF wrapper swallows op errors it does not recognise (see
    # peer_failures_roll_back); run_fn is the loop it wraps, minus that.
    # Horovod: after a membership change, re-join: shut down and initialise again (the start-up's
    # own hvd.init), the driver handing out the new world's ranks.
    return run_fn(train_world, startup.rejoin)(state)
