"""What the user sees and keeps: progress, epoch lines, the JSON summary.  Rank 0 only.

One display for both frameworks and both loops (fixed and elastic): :class:`Reporter`, driven by
:class:`ringtrain.training.job.Job`.

Other ranks construct a silent :class:`Reporter` so trainer code never branches on rank for
output; N ranks printing the same progress bar into one terminal is noise, not information.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


def param_checksum(arrays: Iterable[np.ndarray]) -> str:
    """SHA-256 over the parameters' float32 bytes in model order: equal only if bit-identical."""
    digest = hashlib.sha256()
    for arr in arrays:
        digest.update(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    return digest.hexdigest()[:16]


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write-then-rename in the target folder: readers see the old file or the new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@dataclass
class EpochRecord:
    epoch: int
    train_loss: float
    test_loss: float
    test_accuracy: float
    lr: float
    seconds: float
    images_per_second: float


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
    host: dict[str, Any] = field(default_factory=lambda: {
        "machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version()})

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class Reporter:
    """Progress bar (terminal) or quiet, plus one line per epoch; silent when not rank 0."""

    def __init__(self, enabled: bool, progress: bool = True, stream=None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.progress = progress and enabled and self.stream.isatty()
        self._last_draw = 0.0

    def info(self, message: str) -> None:
        if self.enabled:  # one write per line: MPI's output tagging splits separate writes
            self.stream.write(message + "\n")
            self.stream.flush()

    def step(self, epoch: int, epochs: int, step: int, steps: int,
             loss: float | Callable[[], float] | None) -> None:
        """Redraw the bar at most ~10 times a second.  A callable ``loss`` is called only when the
        bar is drawn (reading a GPU tensor's value waits for the GPU)."""
        if not self.progress:
            return
        now = time.monotonic()
        if step < steps and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 30
        filled = int(width * step / max(steps, 1))
        bar = "#" * filled + "." * (width - filled)
        if callable(loss):
            loss = loss()
        tail = f" loss {loss:.4f}" if loss is not None else ""
        self.stream.write(f"\repoch {epoch}/{epochs} [{bar}] {step}/{steps}{tail}")
        if step >= steps:
            self.stream.write("\r" + " " * (width + 60) + "\r")
        self.stream.flush()

    def epoch(self, rec: EpochRecord, epochs: int) -> None:
        self.info(
            f"epoch {rec.epoch}/{epochs}: train loss {rec.train_loss:.4f}  "
            f"test loss {rec.test_loss:.4f}  test acc {100 * rec.test_accuracy:.2f}%  "
            f"lr {rec.lr:.4g}  {rec.seconds:.1f}s  {rec.images_per_second:.0f} img/s"
        )

    def write_summary(self, path: str | None, summary: Summary) -> None:
        if self.enabled and path:
            atomic_write_bytes(path, summary.to_json().encode())
