"""Rank-strided sharding shared by both frameworks.

Every rank derives the same permutation from (seed, epoch), so no indices are ever communicated,
and takes every N-th element starting at its rank.  Shards are trimmed to ``n // world_size`` so
all ranks run the same number of steps: a rank with one extra batch would issue one extra
allreduce that nobody answers, and the job would hang at the end of the epoch.
"""

from __future__ import annotations

import math

import numpy as np

from ringtrain.errors import UserError


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's global sample order, identical on every rank and in every framework."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def shard_indices(
    num_samples: int, rank: int, world_size: int, seed: int, epoch: int, shuffle: bool = True
) -> np.ndarray:
    """Indices of this rank's training shard for ``epoch``: ``perm[rank::world_size]``, trimmed."""
    if num_samples < world_size:
        raise ValueError(f"{num_samples} samples cannot feed {world_size} ranks")
    return remaining_shard(num_samples, 0, rank, world_size, seed, epoch, shuffle)


def remaining_shard(num_samples: int, consumed: int, rank: int, world_size: int, seed: int,
                    epoch: int, shuffle: bool = True) -> np.ndarray:
    """This rank's share of the epoch's samples after the first ``consumed`` of its order.

    Elastic jobs change world size mid-epoch.  Because a strided shard consumed in prefix order
    covers exactly a prefix of the epoch order (after s samples per rank, ``order[:N*s]``), the
    job's position in an epoch is one integer, and re-sharding the rest for a new world size
    keeps the epoch's data order, skipping and repeating nothing.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if not 0 <= consumed <= num_samples:
        raise ValueError(f"consumed {consumed} is outside an epoch of {num_samples} samples")
    order = epoch_permutation(num_samples, seed, epoch) if shuffle else np.arange(num_samples)
    rest = order[consumed:]
    return rest[rank::world_size][: len(rest) // world_size]


def eval_indices(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """Untrimmed, unshuffled strided shard for evaluation: every sample is counted exactly once.

    Shards may differ in size by one; exact metrics come from summing (loss, correct, count)
    across ranks, which is why evaluation needs no equal step counts beyond one final allreduce.
    """
    return np.arange(rank, num_samples, world_size)


def batches_per_epoch(num_samples: int, world_size: int, batch_size: int) -> int:
    """Batches every rank runs per epoch (the last one may be partial, equal everywhere)."""
    return math.ceil((num_samples // world_size) / batch_size)


def optimizer_steps(num_samples: int, world_size: int, batch_size: int, backward_passes: int,
                    max_steps: int | None = None, strict: bool = True) -> int:
    """Optimizer steps per epoch, equal on every rank: batches grouped by ``backward_passes``
    (trailing batches that do not fill a group are dropped), capped by ``max_steps``.  ``strict``
    refuses an epoch too short for one step; an elastic job in mid-epoch only has none left."""
    batches = batches_per_epoch(num_samples, world_size, batch_size)
    if strict and batches < backward_passes:
        raise UserError(f"each rank gets {batches} batches per epoch, fewer than "
                        f"--backward-passes-per-step {backward_passes}; use more data or a smaller batch")
    steps = batches // backward_passes
    return min(steps, max_steps) if max_steps else steps


def fixed_sample(total: int, n: int) -> np.ndarray:
    """``n`` of ``range(total)`` drawn once with a fixed seed, in ascending order: the same on
    every rank and every run (``--train-samples`` of a folder or the user's data, the images the
    normalisation is computed from)."""
    return np.sort(np.random.default_rng(0).permutation(total)[:n])
