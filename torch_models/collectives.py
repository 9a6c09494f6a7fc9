"""What the framework-free code (:class:`ringtrain.training.world.World`) needs from
``horovod.torch``: its collectives, and the versions a run's summary records."""

from __future__ import annotations

import horovod
import horovod.torch as hvd
import torch

from ringtrain.training.world import Collectives

VERSIONS = {"torch": torch.__version__, "horovod": horovod.__version__}


def _sum(values, name: str) -> list[float]:
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum, name=name).tolist()


COLLECTIVES = Collectives(sum=_sum, broadcast_object=hvd.broadcast_object,
                          allgather_object=hvd.allgather_object)
