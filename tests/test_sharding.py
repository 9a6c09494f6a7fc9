"""Rank-strided sharding: disjoint, complete up to the trimmed remainder, equal steps."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.data.sharding import batches_per_epoch, epoch_permutation, eval_indices, shard_indices


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("n", [60000, 1000, 997])
def test_shards_disjoint_complete_equal(world, n):
    shards = [shard_indices(n, r, world, seed=7, epoch=3) for r in range(world)]
    sizes = {len(s) for s in shards}
    assert sizes == {n // world}, "every rank must get the same number of samples"
    joined = np.concatenate(shards)
    assert len(np.unique(joined)) == len(joined), "shards overlap"
    missing = np.setdiff1d(np.arange(n), joined)
    assert len(missing) == n % world, "only the trimmed remainder may be left out"
    # The left-out samples are the tail of this epoch's permutation, not a fixed set.
    np.testing.assert_array_equal(np.sort(missing), np.sort(epoch_permutation(n, 7, 3)[n - n % world:]))
    steps = {batches_per_epoch(n, world, 32) for _ in range(world)}
    assert steps == {-(-(n // world) // 32)}


@pytest.mark.parametrize("world", [2, 3, 7])
def test_strided_from_one_permutation(world):
    perm = epoch_permutation(100, seed=1, epoch=0)
    for r in range(world):
        np.testing.assert_array_equal(shard_indices(100, r, world, 1, 0), perm[r::world][: 100 // world])


def test_reshuffles_per_epoch_identically_everywhere():
    a = shard_indices(60000, 1, 4, seed=5, epoch=1)
    assert not np.array_equal(a, shard_indices(60000, 1, 4, seed=5, epoch=2))
    np.testing.assert_array_equal(a, shard_indices(60000, 1, 4, seed=5, epoch=1))


def test_no_shuffle_is_file_order():
    np.testing.assert_array_equal(shard_indices(10, 1, 3, 0, 0, shuffle=False), [1, 4, 7])


def test_eval_shards_cover_everything_once():
    for world in range(1, 9):
        joined = np.concatenate([eval_indices(10001, r, world) for r in range(world)])
        np.testing.assert_array_equal(np.sort(joined), np.arange(10001))


@pytest.mark.parametrize("rank,world,n", [(2, 2, 10), (-1, 2, 10), (0, 0, 10), (0, 4, 3)])
def test_rejects_impossible_worlds(rank, world, n):
    with pytest.raises(ValueError):
        shard_indices(n, rank, world, 0, 0)


def test_optimizer_steps_groups_and_caps():
    from ringtrain.data.sharding import optimizer_steps
    from ringtrain.errors import UserError

    assert optimizer_steps(1000, 2, 32, 1) == 16  # 500 per rank -> 16 batches (last partial)
    assert optimizer_steps(1000, 2, 32, 3) == 5  # 16 batches in groups of 3, remainder dropped
    assert optimizer_steps(1000, 2, 32, 1, max_steps=4) == 4
    with pytest.raises(UserError, match="fewer than --backward-passes-per-step 20"):
        optimizer_steps(1000, 2, 32, 20)


@pytest.mark.parametrize("before,after", [(2, 3), (3, 1), (4, 2), (1, 4)])
def test_resharding_mid_epoch_keeps_the_epoch_order(before, after):
    """Elastic resize: what ranks consumed before plus what the new world gets is one prefix of the
    epoch order, with nothing skipped or seen twice."""
    from ringtrain.data.sharding import remaining_shard

    n, batch, steps_done, seed, epoch = 997, 8, 5, 3, 2
    order = epoch_permutation(n, seed, epoch)
    first = [remaining_shard(n, 0, r, before, seed, epoch)[: steps_done * batch] for r in range(before)]
    consumed = before * steps_done * batch
    seen = np.concatenate(first)
    np.testing.assert_array_equal(np.sort(seen), np.sort(order[:consumed]))
    rest = [remaining_shard(n, consumed, r, after, seed, epoch) for r in range(after)]
    assert len({len(s) for s in rest}) == 1  # equal steps for the new world too
    everything = np.concatenate([seen, *rest])
    assert len(np.unique(everything)) == len(everything)
    np.testing.assert_array_equal(np.sort(everything),
                                  np.sort(order[: consumed + after * ((n - consumed) // after)]))


def test_remaining_shard_from_zero_is_the_plain_shard():
    from ringtrain.data.sharding import remaining_shard

    for r in range(3):
        np.testing.assert_array_equal(remaining_shard(100, 0, r, 3, 1, 4), shard_indices(100, r, 3, 1, 4))
