"""The start-up log filter's rules, line by line (tests/test_launchers.py runs it end to end)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

from ringtrain.native_logs import filter_lines, min_level, severity

ABSL_INFO = b"I0000 00:00:1795447680.872803    9914 port.cc:153] oneDNN custom operations are on.\n"
ABSL_ERROR = b"E0000 00:00:1758131045.203198 3722035 cuda_dnn.cc:8579] Unable to register cuDNN factory\n"
TSL_INFO = b"2026-01-30 22:44:42.456316: I tensorflow/core/util/port.cc:153] oneDNN custom operations\n"
TSL_WARNING = b"2026-01-30 22:44:42.456316: W tensorflow/core/x.cc:1] something odd\n"
PREINIT = b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
GUARD = (b"I0000 00:00:1795447681.240148    9914 cpu_feature_guard.cc:227] This TensorFlow binary is "
         b"optimized.\nTo enable the following instructions: AVX2 FMA, rebuild TensorFlow.\n")


def test_severity_of_absl_tsl_and_other_lines():
    assert severity(ABSL_INFO.rstrip()) == 0 and severity(ABSL_ERROR.rstrip()) == 2
    assert severity(TSL_INFO.rstrip()) == 0 and severity(TSL_WARNING.rstrip()) == 1
    assert severity(PREINIT.rstrip()) == 1
    for other in (b"To enable the following instructions", b"Traceback (most recent call last):",
                  b"I am a plain line", b"[vm:15721] OPAL ERROR: Unreachable in file ext3x_client.c"):
        assert severity(other) is None


def test_levels_hide_only_records_below_them():
    chunk = PREINIT + ABSL_INFO + TSL_WARNING + ABSL_ERROR
    assert filter_lines(chunk, 1) == PREINIT + TSL_WARNING + ABSL_ERROR
    assert filter_lines(chunk, 2) == ABSL_ERROR
    assert filter_lines(chunk, 3) == b""


def test_lines_that_are_no_record_always_pass():
    """Even right after a hidden record in the same read: the pipe may have joined two writers'
    output, and a real message must never be lost to a guess."""
    assert filter_lines(GUARD, 2) == b"To enable the following instructions: AVX2 FMA, rebuild TensorFlow.\n"
    assert filter_lines(ABSL_INFO + b"a plain line\n", 2) == b"a plain line\n"
    assert filter_lines(ABSL_INFO + ABSL_ERROR + b"  detail of the error\n", 2) == (
        ABSL_ERROR + b"  detail of the error\n")


def test_min_level_reads_like_tensorflow():
    assert [min_level(v) for v in (None, "", "0", "2", "3", "x", "-1")] == [0, 0, 0, 2, 3, 0, 0]


DRIVER = r"""
import os, sys
from ringtrain.native_logs import quiet_native_logs
with quiet_native_logs(2):
    for i in range(2000):  # more than one pipe buffer, records split across reads
        os.write(2, b"I0000 00:00:1.1    1 port.cc:153] noise %d\n" % i)
        os.write(2, b"kept %d\n" % i)
    print("python line", file=sys.stderr)
os.write(2, b"after the block\n")
"""


def test_every_kept_line_arrives_in_order_and_python_stderr_bypasses_the_filter():
    proc = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert [ln for ln in lines if ln.startswith("kept")] == [f"kept {i}" for i in range(2000)]
    assert "noise" not in proc.stderr
    assert "python line" in lines and lines[-1] == "after the block"
