"""The TensorBoard event writer (``ringtrain/output/tensorboard.py``), read back by TensorFlow's own event
reader, which checks the record framing and both CRCs.  The trainers' ``--tensorboard`` output is
read back the same way in ``tests/test_models.py``, from the runs that train a user's model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ringtrain.output import tensorboard


def read_events(path: Path) -> list:
    """Every event in one file, through TensorFlow's reader (no ``tensorboard`` package needed)."""
    import tensorflow as tf

    return list(tf.compat.v1.train.summary_iterator(str(path)))


def scalars(events: list) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] in file order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for ev in events:
        for value in ev.summary.value:
            out.setdefault(value.tag, []).append((ev.step, value.simple_value))
    return out


def test_crc32c_known_values():
    # RFC 3720 (iSCSI), appendix B.4: 32 bytes of zeros, and of 0xff
    assert tensorboard.crc32c(bytes(32)) == 0x8A9136AA
    assert tensorboard.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert tensorboard.crc32c(b"123456789") == 0xE3069283


def test_written_scalars_read_back_with_tensorflows_reader(tmp_path):
    writer = tensorboard.EventWriter(tmp_path / "tb")
    assert not (tmp_path / "tb").exists(), "nothing is created before the first write"
    writer.scalars(1, {"epoch/train_loss": 0.5, "epoch/lr": 0.02})
    writer.scalars(2**40, {"step/train_loss": -3.25})  # a large step: multi-byte varint
    writer.close()
    files = list((tmp_path / "tb").iterdir())
    assert len(files) == 1 and "tfevents" in files[0].name
    events = read_events(files[0])
    assert events[0].file_version == "brain.Event:2"
    assert scalars(events) == {"epoch/train_loss": [(1, 0.5)], "epoch/lr": [(1, np.float32(0.02))],
                               "step/train_loss": [(2**40, -3.25)]}
    assert all(ev.wall_time > 1e9 for ev in events)


def test_a_damaged_record_is_detected(tmp_path):
    """The CRCs are real: flip one payload byte and TensorFlow's reader refuses the file."""
    writer = tensorboard.EventWriter(tmp_path)
    writer.scalars(1, {"epoch/test_accuracy": 0.75})
    writer.close()
    path = next(tmp_path.iterdir())
    raw = bytearray(path.read_bytes())
    raw[-6] ^= 0x01
    path.write_bytes(bytes(raw))
    import tensorflow as tf

    with pytest.raises(tf.errors.DataLossError):
        read_events(path)
