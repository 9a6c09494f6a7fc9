"""What the framework-free code (:class:`ringtrain.training.world.World`) needs from
``horovod.torch``: its collectives, and the versions a run's summary records."""

from __future__ import annotations

import horovod
import horovod.torch as hvd
import numpy as np
import torch

from ringtrain.training.world import Collectives

VERSIONS = {"torch": torch.__version__, "horovod": horovod.__version__}


def _sum(values, name: str) -> list[float]:
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum, name=name).tolist()


def _broadcast(array: np.ndarray, name: str) -> np.ndarray:
    return hvd.broadcast(torch.from_numpy(array), root_rank=0, name=name).numpy()


def _allgather(array: np.ndarray, name: str) -> np.ndarray:
    return hvd.allgather(torch.from_numpy(array), name=name).numpy()


# Plain arrays only: World sends JSON in them (ringtrain.training.wire), never a pickle.
COLLECTIVES = Collectives(sum=_sum, broadcast=_broadcast, allgather=_allgather)


def average_buffers(model, process_set=hvd.global_process_set) -> None:
    """Average the model's floating-point buffers (BatchNorm's running mean and variance) over the
    ranks, in place.  Horovod, unlike DDP, never syncs buffers: each rank's running statistics
    follow its own shard, so evaluation and checkpoints would differ by rank.  Called at every
    epoch's end, on every rank (the model, so the decision, is the same everywhere); a model
    without such buffers issues nothing.  A pipeline stage averages its own over its replicas
    (``process_set``: the stage's)."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if buffers:
        averaged = hvd.grouped_allreduce(buffers, op=hvd.Average, name="buffers",
                                         process_set=process_set)
        with torch.no_grad():
            for b, avg in zip(buffers, averaged, strict=True):
                b.copy_(avg)
