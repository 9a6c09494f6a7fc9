"""SIGTERM (a scheduler's preemption, ``scancel``, ``kill``): finish a checkpoint save that is under
way, then end with one line and exit status 143 (128 + SIGTERM, what a shell reports).

Python runs signal handlers only between bytecodes of the main thread, and a rank spends most of
its time inside Horovod's C++ waits, where a handler could wait for ever for a peer that was
terminated first.  So the handler does nothing itself: ``signal.set_wakeup_fd`` wakes a thread,
which ends the process at once, or as soon as the save in progress (:func:`saving`) is complete,
with ``os._exit``: nothing is half-written (saves are atomic, and none is cut), and the launcher
sees the rank end and ends the job.  Ctrl-C (SIGINT) stays a ``KeyboardInterrupt``, which abandons
a save in progress and removes its temporary file (:func:`ringtrain.output.summary.atomic_write_bytes`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from ringtrain.errors import launcher_rank

EXIT_CODE = 128 + signal.SIGTERM
_save_lock = threading.Lock()  # held by the main thread while it saves, taken for good on SIGTERM
_installed = False


def install() -> None:
    """Make SIGTERM end this process as described above; a no-op outside the main thread (where
    Python cannot set signal handlers) and when already installed."""
    global _installed
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # the wakeup fd carries it
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_wait_for_sigterm, args=(read_fd,), name="ringtrain-sigterm",
                     daemon=True).start()
    _installed = True


def _wait_for_sigterm(read_fd: int) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):
        pass
    _save_lock.acquire()  # waits for a save in progress; no new one starts after this
    if launcher_rank() == 0:
        sys.stdout.flush()
        sys.stderr.write("rank 0 stopped by SIGTERM; the checkpoints already written are "
                         "complete, continue with --resume\n")
        sys.stderr.flush()
    os._exit(EXIT_CODE)


@contextlib.contextmanager
def saving() -> Iterator[None]:
    """A checkpoint save that a SIGTERM arriving meanwhile lets finish."""
    with _save_lock:
        yield
