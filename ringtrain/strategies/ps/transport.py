"""The parameter servers' transport: MPI through mpi4py, point to point, beside Horovod.

Horovod has no point-to-point API; mpi4py, already a dependency, has it for both frameworks.  A
parameter-server job therefore needs MPI underneath (``horovodrun`` without ``--gloo``, or
``mpirun``): :func:`start` refuses Gloo in one line before anything starts.

Who initialises MPI matters.  mpi4py does, before ``hvd.init()``, asking for
``MPI_THREAD_MULTIPLE`` (Horovod's background thread calls MPI while the main thread does; the
watchdog's thread may call ``MPI_Abort``); Horovod then finds MPI initialised, uses it and leaves
it alone when it shuts down.  The run shuts Horovod down once the run is open (its start-up
collectives done): the parameter servers need no Horovod collective, its background loop would
go on coordinating every rank every 10 ms, and with a dead worker that coordination never
completes, so Horovod's thread would wait forever and the rank's exit with it (measured: with
``mpirun --enable-recovery`` and one rank killed, two survivors that kept Horovod up hung at exit
until killed; with Horovod shut down they trained on, formed a communicator without the dead
rank and exited 0).  The run's own collectives (epoch sums, evaluation, checksums) then go
through :func:`world` over mpi4py: the same plain data in arrays as Horovod's, no pickles.

Each wait polls (``Testany``) and sleeps between polls, from 50 us up to 1 ms: a busy wait would
take a core from a worker on this 2-core machine, and a blocking ``Wait`` could not be bounded.
The completed request's ``MPI.Status`` gives the values it received (``Get_count``), which the
engine compares with what the message's kind holds; a message longer than its receive
(``MPI_ERR_TRUNCATE``) is refused here, naming its sender.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ringtrain.errors import UserError
from ringtrain.runtime import uses_gloo
from ringtrain.strategies.ps.engine import BadMessage
from ringtrain.strategies.ps.options import PS_NEEDS_MPI
from ringtrain.training.world import Collectives, World

RECOVERY_ENV = "OMPI_MCA_orte_enable_recovery"  # what mpirun --enable-recovery sets in each rank
# How long a survivor's MPI_Finalize may wait, once the job has lost a rank, before the survivor
# leaves without it.  A finalize that completes takes well under a second.
FINALIZE_GRACE = 10.0


def start(what: str = "horovodrun --gloo") -> Any:
    """Before ``hvd.init()``: MPI, initialised by mpi4py with ``MPI_THREAD_MULTIPLE`` (unless
    Horovod already runs in this process); the ``MPI`` module.  One line for Gloo, for a missing
    mpi4py and for an MPI without thread support."""
    if uses_gloo(os.environ):
        raise UserError(PS_NEEDS_MPI.format(what=what))
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise UserError(f"--strategy ps needs mpi4py ({err}); run 'make setup'") from None
    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise UserError(f"this MPI runs at thread level {MPI.Query_thread()}, and --strategy ps "
                        f"needs MPI_THREAD_MULTIPLE (Horovod's thread and the training thread "
                        f"both call MPI); use an MPI built with thread support (Open MPI is)")
    return MPI


def recovery_enabled(env: dict[str, str] | None = None) -> bool:
    """Whether the launcher keeps the job alive when a rank dies (Open MPI 4's
    ``mpirun --enable-recovery``, ``horovodrun --mpi-args=--enable-recovery``)."""
    return (env if env is not None else os.environ).get(RECOVERY_ENV) == "1"


class MpiLink:
    """:class:`ringtrain.strategies.ps.engine.Link` over a communicator: ``Isend``/``Irecv`` of float32
    arrays, waits bounded by polling.  ``mpi``: mpi4py's ``MPI`` module (a test's stand-in)."""

    POLL_MIN, POLL_MAX = 50e-6, 1e-3

    def __init__(self, comm, mpi: Any = None) -> None:
        if mpi is None:
            from mpi4py import MPI as mpi

        self.MPI, self.comm = mpi, comm
        self.status = mpi.Status()

    def isend(self, dest: int, tag: int, buf: np.ndarray) -> Any:
        return self.comm.Isend([buf, self.MPI.FLOAT], dest=dest, tag=tag)

    def irecv(self, source: int, tag: int, buf: np.ndarray) -> Any:
        return self.comm.Irecv([buf, self.MPI.FLOAT], source=source, tag=tag)

    def wait_any(self, requests: Sequence[Any], timeout: float) -> tuple[int, int] | None:
        MPI = self.MPI
        reqs = [MPI.REQUEST_NULL if r is None else r for r in requests]
        deadline, pause = time.monotonic() + timeout, self.POLL_MIN
        while True:
            try:
                index, done = MPI.Request.Testany(reqs, self.status)
            except MPI.Exception as err:
                if err.Get_error_class() != MPI.ERR_TRUNCATE:
                    raise
                source = self.status.Get_source()
                raise BadMessage(
                    f"rank {self.comm.Get_rank()} refused a message from "
                    f"{f'rank {source}' if source >= 0 else 'a peer'}: one longer than the receive "
                    f"posted for it (tag {self.status.Get_tag()}, MPI_ERR_TRUNCATE), expected at "
                    f"most that receive's length; nothing of it was used, so the job ends") from None
            if done and index != MPI.UNDEFINED:
                count = self.status.Get_count(MPI.FLOAT)  # MPI.UNDEFINED: not whole float32s
                return index, count if count != MPI.UNDEFINED else -1
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, self.POLL_MAX)

    def wait(self, request: Any, timeout: float) -> int | None:
        got = self.wait_any([request], timeout)
        return None if got is None else got[1]


class _Ranks:
    """What :class:`World` reads of Horovod's module, for a communicator."""

    def __init__(self, comm) -> None:
        self.comm = comm

    def rank(self) -> int:
        return self.comm.Get_rank()

    def size(self) -> int:
        return self.comm.Get_size()

    def mpi_enabled(self) -> bool:
        return True

    def gloo_enabled(self) -> bool:
        return False


def collectives(comm) -> Collectives:
    """The collectives framework-free code issues, over ``comm``: float64 sums, and the broadcast
    and allgather of the 1-D arrays :class:`World` carries its plain data in (no pickles)."""
    from mpi4py import MPI

    def total(values: Sequence[float], name: str) -> list[float]:
        mine = np.asarray(values, dtype=np.float64)
        out = np.empty_like(mine)
        comm.Allreduce(mine, out, op=MPI.SUM)
        return out.tolist()

    def broadcast(array: np.ndarray, name: str) -> np.ndarray:
        out = np.ascontiguousarray(array).copy()  # every rank passes one of the root's size
        comm.Bcast(out, root=0)
        return out

    def gather(array: np.ndarray, name: str) -> np.ndarray:
        mine = np.ascontiguousarray(array)
        counts = np.empty(comm.Get_size(), np.int64)
        comm.Allgather(np.array([mine.size], np.int64), counts)
        out = np.empty(int(counts.sum()), mine.dtype)
        comm.Allgatherv(mine, [out, counts.tolist()])
        return out

    return Collectives(sum=total, broadcast=broadcast, allgather=gather)


def world(comm) -> World:
    """A :class:`World` whose collectives run over ``comm`` (mpi4py), not Horovod."""
    return World(_Ranks(comm), collectives(comm))


def without(comm, ranks: Sequence[int]):
    """A communicator of ``comm``'s ranks but ``ranks`` (dead ones), formed by the survivors alone
    (``MPI_Comm_create_group`` is collective over the new group only); their order is kept."""
    group = comm.Get_group().Excl(sorted(ranks))
    try:
        return comm.Create_group(group)
    finally:
        group.Free()


def bound_finalize_after_losing(grace: float = FINALIZE_GRACE) -> None:
    """Once the job has lost a rank: at this rank's exit, MPI_Finalize gets ``grace`` seconds,
    after which the rank leaves without it, exit status 0 (its work is done and written).

    Open MPI 4.1.4's MPI_Finalize ends in a fence over every rank of the job, the lost ones
    included; it usually completes, but in 1 of 14 runs of a killed worker's job every survivor
    waited in it for ever (``ompi_mpi_finalize``, seen with gdb), and the job with them.
    mpi4py's own finalize holds the GIL, so no timer could end that wait: this one calls
    ``MPI_Finalize`` through ctypes, which releases the GIL, and a timer thread ends the process
    if it has not returned.
    mpi4py's finalize at exit then finds MPI finalized and does nothing.  Under
    ``mpirun --enable-recovery`` (the only way a job outlives a rank) a rank that leaves without
    finalizing does not end the job or change its exit status."""
    atexit.register(_finalize_within, grace)


def _finalize_within(grace: float) -> None:
    from mpi4py import MPI

    if MPI.Is_finalized():
        return
    lib = _libmpi()
    if lib is None:
        return  # not Linux, or no libmpi mapped: mpi4py's own finalize, unbounded

    def leave() -> None:
        if MPI.COMM_WORLD.Get_rank() == 0:
            sys.stderr.write(f"warning: MPI_Finalize still waited for the lost rank(s) after "
                             f"{grace:g} s; rank 0 leaves without it\n")
        _flush()
        os._exit(0)

    timer = threading.Timer(grace, leave)
    timer.daemon = True
    timer.start()
    _flush()
    lib.MPI_Finalize()
    timer.cancel()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded into this process (not another one on the path)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {ln.split()[-1] for ln in maps if "/libmpi.so" in ln}
    except OSError:
        return None
    if len(paths) != 1:
        return None
    try:
        return ctypes.CDLL(paths.pop(), mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def leave(code: int) -> None:
    """This rank leaves the job now, with ``code``, without MPI_Finalize (whose closing fence
    counts every rank of the job, the ones it no longer trains with included) and without
    MPI_Abort: a worker the servers went on without, under ``mpirun --enable-recovery``, where a
    rank that leaves does not end the others."""
    _flush()
    os._exit(code)
