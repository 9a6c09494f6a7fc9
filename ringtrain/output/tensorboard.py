"""TensorBoard event files, written without TensorFlow or the ``tensorboard`` package.

Both trainers write the same tags through this one writer, so the PyTorch process never imports
TensorFlow and neither needs ``tensorboard`` installed (TF 2.21 no longer brings it; install it
only to *view* the files: ``pip install tensorboard; tensorboard --logdir DIR``).

An event file is a sequence of TFRecords (length, CRC, payload, CRC; CRC-32C, masked), each
payload an ``Event`` protocol buffer: the first carries the file version, the others a wall time,
a step and a ``Summary`` of ``(tag, simple_value)`` scalars.  Those few protobuf fields are
encoded by hand below (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto).
Read back by TensorFlow's reader in the tests; tensorboard 2.21.0's ``EventAccumulator`` (what the
TensorBoard server loads with) lists the same scalars from a torch and a TF run's files.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path

# Same tags in both frameworks.  Per-epoch scalars are written at step = epoch; per-step ones
# (--tensorboard-steps) at step = training samples seen so far by all ranks together, an axis
# that means the same at every world size, elastic resizes included.
EPOCH_TAGS = {"train_loss": "epoch/train_loss", "test_loss": "epoch/test_loss",
              "test_accuracy": "epoch/test_accuracy", "lr": "epoch/lr",
              "images_per_second": "epoch/images_per_second"}
STEP_LOSS, STEP_LR = "step/train_loss", "step/lr"


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()
_FILES = itertools.count()  # an elastic job's rank 0 opens one file per world, maybe within a second


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(crc: int) -> int:
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(payload: bytes) -> bytes:
    """One TFRecord: the framing TensorBoard's reader checks."""
    length = struct.pack("<Q", len(payload))
    return (length + struct.pack("<I", _masked(crc32c(length))) + payload
            + struct.pack("<I", _masked(crc32c(payload))))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:  # length-delimited (wire type 2)
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int = 0, file_version: str | None = None,
          scalars: dict[str, float] | None = None) -> bytes:
    """An ``Event``: wall_time (1, double), step (2, int64), file_version (3) or summary (5)."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:  # Summary.value (1): Value.tag (1), Value.simple_value (2, float)
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
                          for tag, value in scalars.items())
        out += _field(5, values)
    return out


def _doubles(number: int, values: list[float]) -> bytes:  # packed repeated double
    return _field(number, struct.pack(f"<{len(values)}d", *values))


def histogram_event(wall_time: float, step: int, tag: str, counts: dict[int, int]) -> bytes:
    """An ``Event`` whose summary value (``Value.histo``, 5) is a ``HistogramProto`` of integer
    values: min (1), max (2), num (3), sum (4), sum_squares (5), bucket_limit (6), bucket (7);
    bucket i counts the values in (limit[i-1], limit[i]], so each integer is its own bucket."""
    keys = sorted(counts)
    n = float(sum(counts.values()))
    total = float(sum(k * c for k, c in counts.items()))
    squares = float(sum(k * k * c for k, c in counts.items()))
    histo = b"".join(b"%c" % (i << 3 | 1) + struct.pack("<d", v) for i, v in
                     ((1, float(keys[0]) if keys else 0.0), (2, float(keys[-1]) if keys else 0.0),
                      (3, n), (4, total), (5, squares)))
    histo += _doubles(6, [float(k) for k in keys]) + _doubles(7, [float(counts[k]) for k in keys])
    value = _field(1, tag.encode()) + _field(5, histo)
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + _field(5, _field(1, value))


class EventWriter:
    """Appends scalars to one new event file in ``logdir`` (created on the first write, so a run
    that fails before training leaves no file behind)."""

    def __init__(self, logdir: str | os.PathLike) -> None:
        self.logdir = Path(logdir)
        self._file = None

    def _open(self):
        if self._file is None:
            self.logdir.mkdir(parents=True, exist_ok=True)
            self._file = self._create()
            self._file.write(record(event(time.time(), file_version="brain.Event:2")))
        return self._file

    def _create(self):
        """A new event file, never an existing one: its name is predictable (time, host, pid),
        so whoever else can write to the folder could have put a symlink to one of the user's
        files there, which ``open(name, "ab")`` would have followed and appended to."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW
        for _ in range(100):
            name = (f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}."
                    f"{os.getpid()}.{next(_FILES)}.ringtrain")
            try:
                return os.fdopen(os.open(self.logdir / name, flags, 0o644), "ab")
            except FileExistsError:  # taken (by a planted file, say): the next number
                continue
        raise FileExistsError(f"no free event file name in {self.logdir}")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._open().write(record(event(time.time(), step, scalars=values)))

    def histogram(self, step: int, tag: str, counts: dict[int, int]) -> None:
        """``counts`` ({integer value: how many}) as one histogram (TensorBoard's Histograms and
        Distributions tabs)."""
        self._open().write(record(histogram_event(time.time(), step, tag, counts)))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
