"""Hold back a native library's start-up log lines below the level the user asked for.

TensorFlow 2.21 logs from C++ while it loads, straight to file descriptor 2, through two copies
of absl logging that ignore ``TF_CPP_MIN_LOG_LEVEL``: measured here with the variable at 2 and at
3, every ``import tensorflow`` still printed ``WARNING: All log messages before
absl::InitializeLog() is called are written to STDERR`` and ``I0000 ... port.cc:153] oneDNN
custom operations are on ...``, twice each.  Whether the oneDNN line appears depends on the CPU
(TF turns oneDNN on by default only on CPUs with AVX512-VNNI/BF16 or AMX), so a user saw it on
one machine and not the next, before the job's first line.  absl offers no run-time switch for
messages logged before ``absl::InitializeLog()`` (abseil-cpp PR #1957 proposes one), and
``TF_ENABLE_ONEDNN_OPTS=0`` would change the numerics, not just the log.

So :func:`quiet_native_logs` reads what native code writes to fd 2 while the framework loads and
passes on every line except log records below ``TF_CPP_MIN_LOG_LEVEL``'s level (0 INFO, 1
WARNING, 2 ERROR, 3 FATAL), which it applies to absl's records too.  Errors, fatal records and
every line that is not itself a log record pass through; Python's own stderr (warnings,
tracebacks) never enters the filter.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}
# absl:  I0000 00:00:1795447680.872803    9914 port.cc:153] message
# tsl:   2026-01-30 22:44:42.456316: I tensorflow/core/util/port.cc:153] message
RECORD = re.compile(rb"^(?:([IWEF])\d{4} [\d:.]+\s+\d+ [^\s\]]+:\d+\]"
                    rb"|\d{4}-\d\d-\d\d [\d:.]+: ([IWEF]) [^\s\]]+:\d+\])")
ABSL_PREINIT = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


def min_level(value: str | None) -> int:
    """``TF_CPP_MIN_LOG_LEVEL`` as TensorFlow reads it: a number, anything else counts as 0."""
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0


def severity(line: bytes) -> int | None:
    """A log record's level (0 INFO ... 3 FATAL), or None for a line that starts no record."""
    if line.rstrip(b"\r") == ABSL_PREINIT:
        return SEVERITY[b"W"]
    match = RECORD.match(line)
    return SEVERITY[match.group(1) or match.group(2)] if match else None


def filter_lines(chunk: bytes, level: int) -> bytes:
    """The lines of ``chunk`` to show: all but the log records below ``level``.

    A record's continuation lines (cpu_feature_guard's message spans two) are shown: reads from
    the pipe can join two writes, so a continuation cannot be told from the next writer's plain
    line, and hiding a real message is worse than showing half of a noisy one.  (The multi-line
    records TF 2.21 prints at start-up are the ones it filters itself.)
    """
    kept = []
    for line in chunk.splitlines(keepends=True):
        level_of_line = severity(line.rstrip(b"\n"))
        if level_of_line is None or level_of_line >= level:
            kept.append(line)
    return b"".join(kept)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _pump(read_fd: int, out_fd: int, level: int) -> None:
    """Copy whole lines from the pipe to the real stderr, filtered, until every writer is gone."""
    tail = b""
    try:
        while chunk := os.read(read_fd, 1 << 16):
            data, cut = tail + chunk, (tail + chunk).rfind(b"\n") + 1
            tail = data[cut:]
            _write_all(out_fd, filter_lines(data[:cut], level))
        _write_all(out_fd, filter_lines(tail, level))
    except OSError:
        pass  # stderr itself is gone: nothing left to show anything on
    finally:
        os.close(read_fd)


@contextlib.contextmanager
def quiet_native_logs(level: int) -> Iterator[None]:
    """Inside this block, native writes to fd 2 reach the real stderr through the filter above.

    Python code keeps a stream on the real stderr (a duplicate, never closed, because a logging
    handler created during the import may hold on to it).  Leaving the block puts fd 2 back; if
    native code kept a copy of the pipe, the filter keeps forwarding what arrives through it.
    """
    if level <= 0:
        yield
        return
    try:
        sys.stderr.flush()
        real = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no usable stderr: nothing to protect
        yield
        return
    python_stream = open(os.dup(real), "w", buffering=1, closefd=True,  # noqa: SIM115
                         encoding=getattr(sys.stderr, "encoding", None) or "utf-8",
                         errors="backslashreplace")
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, real, level), daemon=True,
                            name="native-log-filter")
    pump.start()
    saved_stderr, sys.stderr = sys.stderr, python_stream
    try:
        yield
    finally:
        sys.stderr = saved_stderr
        os.dup2(real, 2)  # closes the pipe's write end: the pump drains it and stops
        pump.join(timeout=10)
        if not pump.is_alive():
            os.close(real)
