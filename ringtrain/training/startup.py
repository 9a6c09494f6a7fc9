"""A run's start, the same for both frameworks and both loops: what the trainers call between
``hvd.init()`` and the first step.

Each check runs on every rank, or on rank 0 with its verdict broadcast (:meth:`World.rank0_verdict`),
so a problem ends every rank with the same one line instead of leaving some waiting for the others.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from ringtrain import flags
from ringtrain.data import dataset as datasets
from ringtrain.data.dataset import Dataset, RankData
from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.output import checkpoint, files
from ringtrain.training.world import Collectives, World


def begin(args: argparse.Namespace, hvd, collectives: Collectives, *, use_gpu: bool,
          elastic: bool = False) -> World:
    """This rank's :class:`World`, after the checks that need the world size (not for an elastic
    job, whose size changes), and the watchdog started."""
    world = World(hvd, collectives)
    if not elastic:
        flags.validate_world(args, world.size)
    if args.amp and not use_gpu:
        raise UserError("--amp needs a CUDA GPU; drop the flag on CPU machines")
    watchdog.start(args.stall_timeout, hvd, elastic=elastic)  # watchdog: a stuck rank ends the job
    return world


def check_output_folders(args: argparse.Namespace, param_count: int) -> None:
    """Rank 0's folders exist and take writes, the checkpoint folder with room for one checkpoint
    of a model of ``param_count`` parameters; ``--resume`` needs its folder.  Call on rank 0."""
    if args.checkpoint_dir:
        if args.resume:
            checkpoint.check_resume_folder(args.checkpoint_dir)
        files.ensure_writable(args.checkpoint_dir, need_bytes=checkpoint.estimated_bytes(
            param_count, args.momentum))
    if args.tensorboard:
        files.ensure_writable(args.tensorboard, "--tensorboard")


def load_data(world: World, args: argparse.Namespace, dataset: Dataset, param_count: int) -> RankData:
    """This rank's data.  Rank 0 alone checks its output folders and may download; every rank
    learns its verdict, then reads the verified files."""
    loaded = {}

    def rank0() -> None:
        check_output_folders(args, param_count)
        loaded["data"] = dataset.load(args.data_dir, download=True)

    world.rank0_verdict(rank0, None, "data_problem")
    data = loaded.get("data") or dataset.load(args.data_dir, download=False)
    return datasets.rank_view(data, args, world.rank, world.size)


def resume_epoch(world: World, args: argparse.Namespace, restore: Callable[[], int]) -> int:
    """The epoch to continue after: under ``--resume`` rank 0 runs ``restore`` (the newest
    checkpoint into its model and optimizer; its epoch, 0 if none) and every rank learns the
    epoch.  The trainer then broadcasts rank 0's weights and optimizer state, resumed or fresh."""
    epoch = world.rank0_verdict(restore if args.resume else (lambda: 0), 0, "resume")
    if args.resume and epoch == 0 and world.rank == 0:
        print(f"resume: no checkpoint in {args.checkpoint_dir} yet; starting from epoch 1", flush=True)
    return epoch
