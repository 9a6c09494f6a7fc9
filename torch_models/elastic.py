"""Elastic data-parallel training on PyTorch: keeps training while workers leave and join.

Horovod elastic re-runs the wrapped function after every membership change, with the committed
state (model, optimizer, position in the epoch) restored on the survivors and broadcast to
newcomers by ``hvd.elastic.TorchState``.  The epoch loop itself is shared with TensorFlow
(:func:`ringtrain.training.elastic.train_world`), driving the same run object as the fixed job
(:class:`torch_models.run.TorchRun`, opened without collectives).  Nothing here may issue a
collective outside the wrapped function: a worker that joins later would wait in it while the
others sync.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch

from ringtrain.output.summary import Summary
from ringtrain.runtime import threads_per_rank
from ringtrain.training import elastic
from ringtrain.training.world import state_broadcast
from torch_models.collectives import COLLECTIVES
from torch_models.run import TorchRun


def train(args: argparse.Namespace) -> Summary:
    run = TorchRun(args, elastic=True)  # Horovod: initialise, pin, wrap (inside)
    # Horovod: the elastic state broadcasts rank 0's weights and optimizer at every (re)start.
    state = hvd.elastic.TorchState(run.model, run.optimizer, **elastic.initial_state(run.start_epoch))
    # Its plain attributes as JSON, not cloudpickle (TorchState takes no bcast_object; 0.28.1's
    # State and ObjectState both call this attribute).  The optimizer's own sync still pickles
    # its scalar options: docs/security.md.
    state._bcast_object = state_broadcast(COLLECTIVES, hvd.rank)
    # Horovod: after a re-form, this host's cores split among its ranks of the new world.
    set_threads = lambda: torch.set_num_threads(threads_per_rank(hvd.local_size()))  # noqa: E731
    state.register_reset_callbacks([set_threads])

    # Horovod: run the loop elastically: re-run it in every re-formed world, from the last commit.
    @hvd.elastic.run
    def train_world(state) -> Summary:
        run.new_world()  # each world has its own ranks; the shard and LR follow its size
        return elastic.train_world(state, run)

    return train_world(state)
