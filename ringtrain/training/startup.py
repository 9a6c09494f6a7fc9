"""A run's start, the same for both frameworks and both loops: what the trainers call between
``hvd.init()`` and the first step.

Each check runs on every rank, or on rank 0 with its verdict broadcast (:meth:`World.rank0_verdict`),
so a problem ends every rank with the same one line instead of leaving some waiting for the others.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TypeVar

from ringtrain import horovod_tools, optimizer_spec
from ringtrain.data import dataset as datasets
from ringtrain.data import decoded_cache
from ringtrain.data.dataset import ArrayData, FolderData
from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.output import checkpoint, files
from ringtrain.runtime import first_on_this_host
from ringtrain.training.world import Collectives, World

T = TypeVar("T")


def begin(args: argparse.Namespace, hvd, collectives: Collectives, *, use_gpu: bool,
          check_world: Callable[[argparse.Namespace, int], None], elastic: bool = False) -> World:
    """This rank's :class:`World`, after the strategy's checks that need the world size
    (``check_world``; not for an elastic job, whose size changes), and the watchdog started."""
    world = World(hvd, collectives)
    if not elastic:
        check_world(args, world.size)
    if args.amp and not use_gpu:
        raise UserError("--amp needs a CUDA GPU; drop the flag on CPU machines")
    watchdog.start(args.stall_timeout, hvd, world.gather,  # watchdog: a stuck rank ends the job
                   elastic=elastic)
    return world


def check_output_folders(world: World | None, args: argparse.Namespace, param_count: int) -> None:
    """Rank 0's folders exist and take writes, the checkpoint folder with room for one checkpoint
    of a model of ``param_count`` parameters; ``--resume`` needs its folder.  Every rank learns
    rank 0's verdict (elastic workers pass ``world=None`` and call this on rank 0 alone: no
    collective outside the elastic loop)."""
    def check() -> None:
        if args.checkpoint_dir:
            if args.resume:
                checkpoint.check_resume_folder(args.checkpoint_dir)
            files.ensure_writable(args.checkpoint_dir, need_bytes=checkpoint.estimated_bytes(
                param_count, optimizer_spec.state_slots(args)))
        if args.tensorboard:
            files.ensure_writable(args.tensorboard, "--tensorboard")
        for flag, path in horovod_tools.output_files(args):  # --timeline-out, --autotune's log
            files.ensure_writable(os.path.dirname(os.path.abspath(path)), flag)

    if world is None:
        check()
    else:
        world.rank0_verdict(check, None, "output_folders")


def open_data(world: World | None, args: argparse.Namespace) -> ArrayData | FolderData | None:
    """The run's data for ``--data mnist`` or ``folder:DIR`` (None for the user's own, which the
    framework's glue opens).

    In a fixed job rank 0 opens it first (it may download MNIST; it scans a folder and computes
    its pixel statistics) and every rank learns its verdict; a folder's index is then broadcast,
    so every rank shards the same list, and MNIST read by every rank from the verified files.  An
    elastic worker (``world=None``) opens it alone: a collective outside the elastic loop would
    never be matched by a worker that joins later.
    """
    if world is None:
        return with_decode_cache(args, datasets.open_builtin(args))
    opened: dict[str, ArrayData | FolderData | None] = {}

    def rank0() -> dict | None:
        opened["data"] = datasets.open_builtin(args, download=True)
        return opened["data"].to_plain() if isinstance(opened["data"], FolderData) else None

    shared = world.rank0_verdict(rank0, None, "data")
    if world.rank == 0:
        return with_decode_cache(args, opened["data"])
    return with_decode_cache(args, FolderData.from_plain(shared)) if shared is not None \
        else datasets.open_builtin(args, download=False)


def with_decode_cache(args: argparse.Namespace, data: ArrayData | FolderData | None):
    """A folder's data with this host's decoded cache opened (``--decode-cache``); where there
    can be none, the host's first rank says why in one warning line and the run decodes."""
    if not isinstance(data, FolderData) or args.no_decode_cache:
        return data

    def warn(message: str) -> None:
        if first_on_this_host():
            print(f"warning: {message}", file=sys.stderr, flush=True)

    return data.with_caches(decoded_cache.cache_dir(args.decode_cache), warn)


def every_rank(world: World | None, work: Callable[[], T]) -> T:
    """``work()`` on every rank; a :class:`UserError` on any of them ends all of them with that
    line (an allgather with a fixed name, whatever happened), rather than leaving the others in
    their next collective.  Without a world (an elastic worker) it is just ``work()``."""
    if world is None:
        return work()
    result, problem = None, None
    try:
        result = work()
    except UserError as err:
        problem = str(err)
    problems = world.gather(problem, "every_rank")
    for rank, found in enumerate(problems):
        if found is not None:
            raise UserError(found if rank == 0 else f"{found} (rank {rank})")
    return result


def resume_epoch(world: World, args: argparse.Namespace, restore: Callable[[], int]) -> int:
    """The epoch to continue after: under ``--resume`` rank 0 runs ``restore`` (the newest
    checkpoint into its model and optimizer; its epoch, 0 if none) and every rank learns the
    epoch.  The trainer then broadcasts rank 0's weights and optimizer state, resumed or fresh."""
    epoch = world.rank0_verdict(restore if args.resume else (lambda: 0), 0, "resume")
    if args.resume and epoch == 0 and world.rank == 0:
        print(f"resume: no checkpoint in {args.checkpoint_dir} yet; starting from epoch 1", flush=True)
    return epoch
