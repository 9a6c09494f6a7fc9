"""The start of every TensorFlow/Keras run, whatever its strategy: the twin of
:mod:`torch_models.startup`, every Horovod line marked ``# Horovod:``.  The ring
(:mod:`tf_models.run`, and its elastic job's re-joins: :func:`rejoin`), the pipeline
(:mod:`tf_models.pipeline`) and the parameter servers (:mod:`tf_models.ps`) start here; it is the
one place ``hvd.init()`` is called for TensorFlow.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.tensorflow as hvd

from ringtrain.data import dataset as datasets
from ringtrain.horovod_tools import HorovodTools
from ringtrain.runtime import before_init
from ringtrain.training import startup
from ringtrain.training.world import World
from tf_models import devices
from tf_models.collectives import COLLECTIVES
from tf_models.data import TfData, open_data


@dataclass
class Rank:
    """What the start-up hands the strategy: this rank's world, whether it has a GPU, its data,
    Horovod's tools."""

    world: World
    use_gpu: bool
    data: TfData
    tools: HorovodTools


def open_rank(args: argparse.Namespace, *, check_world: Callable[[argparse.Namespace, int], None],
              process_sets: Sequence[Any] | None = None, elastic: bool = False,
              data_width: Callable[[World], int] | None = None) -> Rank:
    """As :func:`torch_models.startup.open_rank`: initialise, pin, the watchdog, the data."""
    before_init(args.stall_timeout)
    tools = HorovodTools.before_init(args)  # --timeline-out, --autotune: the environment
    _init(process_sets)  # Horovod: initialise
    # Horovod: pin this rank to its share of the host's cores and to GPU local_rank (if any).
    use_gpu = devices.configure(hvd.local_rank(), hvd.local_size())
    world = startup.begin(args, hvd, COLLECTIVES, use_gpu=use_gpu, elastic=elastic,
                          check_world=check_world)
    together = None if elastic else world  # who opens together, with collectives
    # Horovod: this host's rank count sizes the data's decoding threads (--data).
    data = open_data(args, together, hvd.local_size())
    if not elastic:
        datasets.check_world(args, data.info, data_width(world) if data_width else world.size)
    return Rank(world, use_gpu, data, tools)


def _init(process_sets: Sequence[Any] | None = None) -> None:
    # Horovod: initialise (with the strategy's process sets); every rank knows its rank and size.
    hvd.init(process_sets=list(process_sets) if process_sets else None)


def rejoin() -> None:
    """An elastic job's re-join after a membership change: the driver hands out new ranks at init."""
    # Horovod: shut down and initialise again: the driver hands out the new world's ranks.
    hvd.shutdown()
    _init()
