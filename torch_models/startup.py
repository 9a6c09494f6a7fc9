"""The start of every PyTorch run, whatever its strategy: the steps between a checked command line
and the strategy's own model and optimizer, in the order they happen, every Horovod line marked
``# Horovod:``.  The ring (:mod:`torch_models.run`), the pipeline (:mod:`torch_models.pipeline`,
which passes its stage process sets) and the parameter servers (:mod:`torch_models.ps`) each call
:func:`open_rank` once; it is the one place ``hvd.init()`` is called for PyTorch.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch

from ringtrain.data import dataset as datasets
from ringtrain.horovod_tools import HorovodTools
from ringtrain.runtime import before_init
from ringtrain.training import startup
from ringtrain.training.world import World
from torch_models import devices
from torch_models.collectives import COLLECTIVES
from torch_models.data import TorchData, open_data


@dataclass
class Rank:
    """What the start-up hands the strategy: this rank's world, its device, its data (None until
    opened: an elastic worker opens it alone), Horovod's tools."""

    world: World
    device: torch.device
    data: TorchData
    tools: HorovodTools


def open_rank(args: argparse.Namespace, *, check_world: Callable[[argparse.Namespace, int], None],
              process_sets: Sequence[Any] | None = None, elastic: bool = False,
              data_width: Callable[[World], int] | None = None) -> Rank:
    """Initialise Horovod (with the strategy's ``process_sets``), pin, start the watchdog after
    the strategy's ``check_world``, and open the data, checked against ``data_width`` (the ranks
    that read disjoint shards; default every rank).  ``elastic``: a worker of an elastic job, which
    issues no collective while it opens (a worker joining later would never be matched)."""
    before_init(args.stall_timeout)
    tools = HorovodTools.before_init(args)  # --timeline-out, --autotune: the environment
    # Horovod: initialise (with the strategy's process sets); every rank knows its rank and size.
    hvd.init(process_sets=list(process_sets) if process_sets else None)
    # Horovod: pin this rank to its share of the host's cores and to GPU local_rank (if any).
    device = devices.pin(hvd.local_rank(), hvd.local_size())
    world = startup.begin(args, hvd, COLLECTIVES, use_gpu=device.type == "cuda", elastic=elastic,
                          check_world=check_world)
    together = None if elastic else world  # who opens together, with collectives
    # Horovod: this host's rank count sizes the data's decoding workers (--data).
    data = open_data(args, together, device, hvd.local_size())
    if not elastic:
        datasets.check_world(args, data.info, data_width(world) if data_width else world.size)
    return Rank(world, device, data, tools)
