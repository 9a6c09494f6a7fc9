"""The ring's flags: none of its own beyond the shared ones (``ringtrain.flags``); what needs the
world size."""

from __future__ import annotations

import argparse

from ringtrain.errors import UserError

NAME = "ring"
HELP = "ring (default): Horovod's allreduce, synchronous SGD"
NEEDS_MPI = None  # runs under every launcher, Ray's Gloo included


def add_args(parser: argparse.ArgumentParser) -> None:
    """The ring has no flags of its own."""


def implied(args: argparse.Namespace) -> bool:
    return False  # the default: chosen when no other strategy is asked for


def check_unused(args: argparse.Namespace) -> None:
    """Nothing to leave out: the ring has no flags of its own."""


def validate(args: argparse.Namespace) -> None:
    """Nothing beyond the shared checks."""


def check_world(args: argparse.Namespace, world_size: int) -> None:
    """Right after ``hvd.init()``, on every rank."""
    if args.adasum and world_size & (world_size - 1):
        raise UserError(f"--adasum needs a power-of-two number of processes, not {world_size}; run "
                        f"2, 4, 8... processes or drop --adasum")
