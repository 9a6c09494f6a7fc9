"""Evaluation, the same in both frameworks: each rank sums (loss, correct, count) over its strided
share of the test set (:func:`ringtrain.data.sharding.eval_indices`), in batches, and the sums are
added up over ranks: exact global metrics, whatever the shard sizes (averaging the ranks' averages
would not be, with shards one image apart).  A fourth sum counts the ranks that have met a data
problem, so that one met while evaluating, or in a training step mixed precision skipped, ends
every rank here, before the epoch's checkpoint."""

from __future__ import annotations

from collections.abc import Sequence

from ringtrain.training import divergence
from ringtrain.training.world import World

EVAL_BATCH = 1000  # test images per forward pass when evaluating in-memory data, both frameworks


def exact_test_metrics(world: World, local_sums: Sequence[float], local_problem: str | None = None,
                       epoch: int | None = None) -> tuple[float, float]:
    """Exact global (test loss, accuracy) from each rank's (loss sum, correct, count, problems)."""
    loss, correct, count, problems = world.sum(local_sums, "eval_totals")
    if problems:
        raise divergence.data_problem(world.gather, local_problem,
                                      f"by the end of epoch {epoch}" if epoch else "while evaluating")
    return loss / count, correct / count
