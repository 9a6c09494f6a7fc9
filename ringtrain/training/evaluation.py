"""Evaluation, the same in both frameworks: each rank sums (loss, correct, count) over its strided
share of the test set (:func:`ringtrain.data.sharding.eval_indices`), in batches of
:data:`EVAL_BATCH`, and the sums are added up over ranks: exact global metrics, whatever the shard
sizes (averaging the ranks' averages would not be, with shards one image apart)."""

from __future__ import annotations

from collections.abc import Sequence

from ringtrain.training.world import World

EVAL_BATCH = 1000  # test images per forward pass when evaluating, in both frameworks


def exact_test_metrics(world: World, local_sums: Sequence[float]) -> tuple[float, float]:
    """Exact global (test loss, accuracy) from each rank's (loss sum, correct, count)."""
    loss, correct, count = world.sum(local_sums, "eval_totals")
    return loss / count, correct / count
