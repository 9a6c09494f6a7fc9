"""The run's ``--metrics-out`` summary, begun and finished the same way by both loops (fixed and
elastic) in both frameworks."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

import numpy as np

from ringtrain.output.progress import Progress
from ringtrain.output.summary import Summary, param_checksum
from ringtrain.training.run import RunIdentity
from ringtrain.training.world import World


def new_summary(args: argparse.Namespace, world: World, identity: RunIdentity,
                **fields: Any) -> Summary:
    return Summary(framework=identity.framework, versions=dict(identity.versions),
                   controller=world.controller, param_count=identity.param_count,
                   model=identity.model, dataset=identity.data.name, data=identity.data.record(),
                   strategy=identity.strategy, **fields)


def finish(world: World, progress: Progress, args: argparse.Namespace, summary: Summary, *,
           test: tuple[float, float], train_seconds: float, images_seen: float,
           params: Iterable[np.ndarray]) -> Summary:
    """Close the run on every rank: gather each rank's parameter checksum (a collective, so all
    ranks call this), then rank 0 writes the summary and prints the final line."""
    summary.final_test_loss, summary.final_test_accuracy = test
    summary.total_seconds = train_seconds
    summary.images_per_second = images_seen / train_seconds if train_seconds else 0.0
    summary.param_checksums = world.gather(param_checksum(params), "checksums")
    progress.finish(args.metrics_out, summary)
    return summary
