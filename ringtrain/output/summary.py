"""What a run keeps: one record per epoch and the ``--metrics-out`` summary, the same document for
both frameworks and both loops (fixed and elastic)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


def param_checksum(arrays: Iterable[np.ndarray]) -> str:
    """SHA-256 over the parameters' float32 bytes in model order: equal only if bit-identical."""
    digest = hashlib.sha256()
    for arr in arrays:
        digest.update(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    return digest.hexdigest()[:16]


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    lr: float
    seconds: float
    images_per_second: float

    @classmethod
    def of(cls, epoch: int, *, loss_sum: float, images: float, test: tuple[float, float], lr: float,
           seconds: float) -> EpochRecord:
        """The record of an epoch that trained on ``images`` images (all ranks) with this summed
        loss, and evaluated to ``test`` = (loss, accuracy)."""
        return cls(epoch=epoch, train_loss=loss_sum / max(images, 1), test_loss=test[0],
                   test_accuracy=test[1], lr=lr, seconds=seconds, images_per_second=images / seconds)


@dataclass
class Summary:
    """The ``--metrics-out`` document."""

    framework: str
    versions: dict[str, str]
    controller: str
    world_size: int
    batch_size_per_rank: int
    global_batch_size: int
    base_lr: float
    effective_lr: float
    lr_scaling: str
    epochs: list[EpochRecord] = field(default_factory=list)
    final_test_accuracy: float | None = None
    final_test_loss: float | None = None
    total_seconds: float = 0.0
    images_per_second: float = 0.0
    param_checksums: list[str] = field(default_factory=list)
    param_count: int = 0
    resumed_from_epoch: int | None = None
    elastic_resizes: list[dict[str, Any]] | None = None  # (epoch, sample, world size) changes
    model: str = "cnn"  # --model: a built-in name or the user's package.module:function
    dataset: str = "mnist"
    data: dict[str, Any] | None = None  # --data: spec, input shape, classes, sizes, normalisation
    autotune: dict[str, Any] | None = None  # --autotune: samples, finished, the chosen parameters
    strategy: str = "ring"  # --strategy
    # --strategy ps: servers, workers, staleness; the staleness histogram (server updates each
    # applied gradient was behind), updates/s and bytes per step of each server, each worker's
    # wait, and the exactly-once counters (ringtrain.strategies.ps.run.summary_record)
    ps: dict[str, Any] | None = None
    # --pipeline-stages > 1: the stages (layers, params, bytes), schedule, micro-batches, the
    # replicas, and each stage's measured busy and step time (param_checksums are then per rank
    # of its stage's weights: equal within a stage)
    pipeline: dict[str, Any] | None = None
    host: dict[str, Any] = field(default_factory=lambda: {
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()})
    # A strategy's own fields that the document does not declare above (its run object's
    # summary_fields), written at the document's top level: a new strategy adds its record
    # without a change here.
    extra: dict[str, Any] = field(default_factory=dict)

    def set_fields(self, fields: dict[str, Any]) -> None:
        """A strategy's fields: the declared ones set, any other kept in :attr:`extra`."""
        for name, value in fields.items():
            if name in self.__dataclass_fields__ and name != "extra":
                setattr(self, name, value)
            else:
                self.extra[name] = value

    def to_json(self) -> str:
        document = asdict(self)
        document.update(document.pop("extra"))
        return json.dumps(document, indent=2)
