"""The messages between a replica's stages: activations forward, gradients back, as NumPy
buffers over MPI point to point (mpi4py), on a communicator of the pipeline's own.

Why MPI and not Horovod: Horovod 0.28.1 has collectives only (allreduce, allgather, broadcast,
alltoall), no send/receive between two ranks; an alltoall per micro-batch would make every rank
of the world take part in every hop.  Why not ``torch.distributed.pipelining``: it needs a
``torch.distributed`` process group (its own rendezvous and transport, Gloo or NCCL, beside
Horovod's), exists for PyTorch only, and would run its own schedule and its own gradient
reduction; here one schedule (:mod:`ringtrain.strategies.pipeline.schedule`) serves both frameworks and the
gradients go through Horovod's process sets.  MPI is there already: Horovod's MPI controller runs
on it, and mpi4py initialises it with ``MPI_THREAD_MULTIPLE`` before ``hvd.init()`` (which then
uses it), so Horovod's background thread and these messages share it safely.  Gloo has no
point-to-point API in Horovod, so a pipeline needs the MPI controller (refused under Gloo).

Receives are posted before they are needed (:mod:`ringtrain.strategies.pipeline.engine` posts a window of
them ahead); every wait polls its request with a short, growing pause (10 us up to
:data:`MAX_PAUSE`, so a rank waiting through the pipeline's bubble gives its core to the stage it
waits for) and is bounded: past ``--stall-timeout`` (and the watchdog's grace) it ends the job
with one line naming the peer, though the watchdog, which knows what this rank waits for
(:func:`ringtrain.faults.watchdog.waiting`), normally speaks first.

A sent buffer is kept only until its send completes: every send, every poll of a wait and
:meth:`Link.release` (the engine calls it at each op) test the outstanding sends and drop the
completed ones, so a stage holds the buffers its schedule bounds (docs/pipeline.md), not a step's
worth; :meth:`Link.finish_sends` waits for the rest (all at a step's end, all but a window during
evaluation).  A send completes no later than its receiver takes it (sooner when MPI copies it out
eagerly or the receiver has posted the receive).

A completed receive counts only if it received the bytes of its whole buffer (the completed
request's ``MPI.Status``, ``Get_count(MPI.BYTE)``): a shorter message, or one longer than the
buffer (``MPI_ERR_TRUNCATE``), ends the job in one line naming the peer, the message and the
boundary's shape and dtype, and the buffer (whose tail would be whatever the heap held) is never
used.  One integer comparison per message.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringtrain.faults import watchdog
from ringtrain.faults.guardian import GRACE

MAX_PAUSE = 0.0005  # s between two polls of a long wait


def mpi():
    """mpi4py's MPI module; importing it initialises MPI (``MPI_THREAD_MULTIPLE``) if nobody has
    yet, which is why a pipeline run imports it before ``hvd.init()``."""
    from mpi4py import MPI

    return MPI


def world_size() -> int:
    """The number of ranks MPI started (before Horovod is initialised)."""
    return mpi().COMM_WORLD.Get_size()


def wire(array: np.ndarray) -> np.ndarray:
    """What MPI sends or fills for ``array``: the array itself, or for a dtype MPI cannot name
    (``ml_dtypes``' bfloat16 of ``--precision bf16``, which mpi4py refuses) a view of the same
    bytes as unsigned integers of its width.  The receiver's check is unchanged: the byte count
    of the whole buffer, whose shape and dtype are the boundary's."""
    if array.dtype.kind == "V" or array.dtype.type.__module__.startswith("ml_dtypes"):
        return array.view(f"u{array.dtype.itemsize}")
    return array


@dataclass
class Incoming:
    """A posted receive: its buffer, filled once the request completes."""

    buffer: np.ndarray
    request: Any
    source: int
    what: str


@dataclass
class Link:
    """This rank's point-to-point messages (and the pipeline's one small allreduce per step), on
    ``comm``, a duplicate of ``MPI_COMM_WORLD``: its tags never meet Horovod's traffic."""

    comm: Any
    rank: int
    timeout: float  # --stall-timeout; 0: wait for ever, as the user asked
    sends: list[tuple[Any, np.ndarray, int]] = field(default_factory=list)

    @classmethod
    def open(cls, rank: int, timeout: float) -> Link:
        return cls(mpi().COMM_WORLD.Dup(), rank, timeout)

    def post(self, shape: tuple[int, ...], dtype, source: int, tag: int, what: str) -> Incoming:
        buffer = np.empty(shape, dtype)  # the boundary's dtype: what wait() returns and checks
        return Incoming(buffer, self.comm.Irecv(wire(buffer), source=source, tag=tag), source,
                        what)

    def wait(self, incoming: Incoming) -> np.ndarray:
        """The received array, once its request has completed with all of its buffer's bytes."""
        MPI, buffer = mpi(), incoming.buffer
        status = MPI.Status()
        try:
            self._wait(incoming.request, incoming.what, incoming.source, status=status)
        except MPI.Exception as err:
            if err.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            self._refuse(incoming, "longer than its buffer (MPI_ERR_TRUNCATE)")
        got = status.Get_count(MPI.BYTE)
        if got != buffer.nbytes:
            self._refuse(incoming, f"{got} bytes")
        return buffer

    def _refuse(self, incoming: Incoming, what: str) -> None:
        buffer = incoming.buffer
        watchdog.end_job(
            f"rank {self.rank} refused {incoming.what} from rank {incoming.source}: {what}, expected "
            f"{buffer.nbytes} bytes (shape {buffer.shape} of {buffer.dtype}, the boundary's); nothing "
            f"of it was used, so the job ends")

    def send(self, array: np.ndarray, dest: int, tag: int) -> int:
        """Send without waiting; the buffer is kept until the send completes.  Returns the sends
        outstanding now, this one included (the completed ones released first)."""
        self.release()
        array = np.ascontiguousarray(array)
        self.sends.append((self.comm.Isend(wire(array), dest=dest, tag=tag), array, dest))
        return len(self.sends)

    def release(self) -> int:
        """Drop the sends that have completed (their buffers go); the number still outstanding."""
        if self.sends:
            self.sends = [sent for sent in self.sends if not sent[0].Test()]
        return len(self.sends)

    def finish_sends(self, what: str, keep: int = 0) -> None:
        """Wait, oldest first, until at most ``keep`` sends are outstanding (0: every message sent
        has been taken by its receiver)."""
        self.release()
        while len(self.sends) > keep:
            request, _, dest = self.sends[0]
            self._wait(request, f"{what} to be received", dest, "by", reap=False)
            self.sends.pop(0)
            self.release()

    def allreduce_sum(self, values: np.ndarray, what: str) -> np.ndarray:
        """Element-wise float64 sum over every rank, without Horovod's coordination cycle (a few
        microseconds here, against a millisecond or more)."""
        send = np.ascontiguousarray(values, np.float64)
        out = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, out, op=mpi().SUM), what, None)
        return out

    def _wait(self, request, what: str, peer: int | None, towards: str = "from",
              status: Any = None, reap: bool = True) -> None:
        """Poll ``request`` until it completes (bounded); meanwhile release completed sends,
        unless ``reap`` is False (waiting for one of them)."""
        if reap:
            self.release()
        if request.Test(status):
            return
        deadline = time.monotonic() + self.timeout + GRACE if self.timeout > 0 else None
        source = f" {towards} rank {peer}" if peer is not None else ""
        pause = 1e-5
        with watchdog.waiting(f"{what}{source}"):
            while not request.Test(status):
                if reap:
                    self.release()
                if deadline is not None and time.monotonic() > deadline:
                    watchdog.end_job(
                        f"rank {self.rank} waited {self.timeout + GRACE:.0f} s for {what}{source} "
                        f"(--stall-timeout {self.timeout:g}): "
                        f"{'that rank' if peer is not None else 'a rank'} is frozen, dead or cut "
                        f"off; aborting the job")
                time.sleep(pause)
                pause = min(2 * pause, MAX_PAUSE)
