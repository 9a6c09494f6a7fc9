"""The guardian: a tiny process per rank that ends the rank when the rank's whole process is frozen.

Started by :mod:`ringtrain.faults.watchdog` as ``python -m ringtrain.faults.guardian PID
LIMIT_SECONDS HOST`` in its own session. The rank's watchdog thread writes a line to its stdin
every second; a feed quiet for ``LIMIT_SECONDS`` means no thread of the rank runs (SIGSTOP, a swap
storm, a hung node), and the guardian SIGKILLs it with one line. After its rank called
``MPI_Abort`` (an ``abort`` line), it also sees that the MPI launcher ends (see
:func:`_end_stuck_launcher`). Standard library only: it must start in milliseconds and cost a few
MB.
"""

from __future__ import annotations

import os
import signal
import sys
import time

GRACE = 10.0  # s a rank other than 0 waits beyond the timeout, for rank 0 to speak first


def now() -> float:
    return time.monotonic()


def say(line: str) -> None:
    """One line on stderr, written at once (MPI's output tagging splits separate writes)."""
    try:
        os.write(2, f"error: {line}\n".encode())
    except OSError:
        pass


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("State:"):
                    return line.split(None, 1)[1].strip()
    except OSError:
        pass
    return "?"


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return int(fh.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return ""


MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "orted", "prterun", "prted")


def _end_stuck_launcher(launcher: int | None) -> None:
    """After its rank called MPI_Abort: if the MPI launcher (mpirun, or the host's orted) is still
    there :data:`GRACE` seconds later, it is waiting for a host it cannot reach (measured: mpirun
    waited for ever for the orted of a cut-off host), so interrupt it twice, as a user would
    (Open MPI's second Ctrl-C forces it out), then kill it."""
    if launcher is None or not _comm(launcher).startswith(MPI_LAUNCHERS):
        return
    # Let go of the rank's output pipes first: a launcher that waits for them to close must not
    # wait for us.  (The rank's own line has said why the job ends.)
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    deadline = now() + GRACE
    while now() < deadline:
        if not os.path.exists(f"/proc/{launcher}"):
            return
        time.sleep(0.5)
    for sig, wait in ((signal.SIGINT, 1.0), (signal.SIGINT, 5.0), (signal.SIGKILL, 0.0)):
        try:
            os.kill(launcher, sig)
        except ProcessLookupError:
            return
        end = now() + wait
        while now() < end and os.path.exists(f"/proc/{launcher}"):
            time.sleep(0.2)


def guard(pid: int, limit: float, host: str) -> int:
    """Watch rank process ``pid`` through its feed on stdin: SIGKILL it when the feed has been
    quiet for ``limit`` seconds (the whole process is frozen); when the feed ends (the rank is
    gone) after an ``abort`` line, see that the MPI launcher ends too; else exit."""
    import selectors

    launcher = _parent_of(pid)
    rank, last, aborting = "?", now(), False
    sel = selectors.DefaultSelector()
    sel.register(sys.stdin.buffer, selectors.EVENT_READ)
    buf = b""
    while True:
        if sel.select(timeout=1.0):
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:  # the rank ended
                if aborting:
                    _end_stuck_launcher(launcher)
                return 0
            buf = (buf + chunk)[-64:]
            lines = [ln.decode(errors="replace").strip() for ln in buf.split(b"\n")[:-1]]
            if "bye" in lines:
                return 0  # the rank is exiting normally
            aborting = aborting or "abort" in lines
            if lines and lines[-1].isdigit():
                rank = lines[-1]
            last = now()
        if not os.path.exists(f"/proc/{pid}"):
            if aborting:
                _end_stuck_launcher(launcher)
            return 0
        quiet = now() - last
        if quiet > limit and not aborting:
            state = _proc_state(pid)
            why = {"T": "stopped (SIGSTOP?)", "t": "stopped by a debugger",
                   "D": "stuck in the kernel (disk, NFS?)"}.get(
                state[:1], f"process state {state}, but its Python threads do not run")
            say(f"rank {rank} ({host}, pid {pid}) is frozen: {why}, its watchdog has not run for "
                 f"{quiet:.0f} s; killed it so that the job can end or carry on without it")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return 0


if __name__ == "__main__":
    if len(sys.argv) == 4:
        sys.exit(guard(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]))
    sys.exit("usage: python -m ringtrain.faults.guardian PID LIMIT_SECONDS HOST (started by the trainers)")
