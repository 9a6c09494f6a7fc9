"""One job (or one world of an elastic job) as a rank sees it: its rank, the world size, the
controller, and the collectives the framework-free code issues.

The framework hands in Horovod's own functions (:class:`Collectives`); every collective issued
through a :class:`World` marks progress for the watchdog once it has completed.  Each is issued in
the same order on every rank, with a name that does not depend on the rank: that is what Horovod
matches ranks on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.runtime import controller
from ringtrain.training import wire

T = TypeVar("T")


@dataclass(frozen=True)
class Collectives:
    """The three collectives framework-free code needs, from the framework's Horovod module: a
    sum, and a broadcast and an allgather of NumPy arrays (int64 or uint8, one dimension).
    Objects travel as :mod:`ringtrain.training.wire`'s JSON in those arrays, never pickled."""

    sum: Callable[[Sequence[float], str], Sequence[float]]  # float64 Sum allreduce (values, name)
    broadcast: Callable[[np.ndarray, str], np.ndarray]  # rank 0's array (array, name)
    allgather: Callable[[np.ndarray, str], np.ndarray]  # every rank's, concatenated (array, name)


def broadcast_plain(comm: Collectives, is_root: bool, value: Any, name: str) -> Any:
    """Rank 0's ``value`` on every rank, as :mod:`ringtrain.training.wire` encodes it (its size
    first, then its bytes)."""
    data = np.frombuffer(bytearray(wire.encode(value)), np.uint8) if is_root else None
    size = int(comm.broadcast(np.array([len(data) if is_root else 0], np.int64), f"{name}.size")[0])
    if not is_root:
        data = np.zeros(size, np.uint8)
    return wire.decode(np.asarray(comm.broadcast(data, f"{name}.data"), np.uint8).tobytes())


def allgather_plain(comm: Collectives, value: Any, name: str) -> list[Any]:
    """Every rank's ``value``, in rank order (the sizes first, then the bytes)."""
    data = np.frombuffer(bytearray(wire.encode(value)), np.uint8)
    sizes = np.asarray(comm.allgather(np.array([len(data)], np.int64), f"{name}.sizes"), np.int64)
    joined = np.asarray(comm.allgather(data, f"{name}.data"), np.uint8).tobytes()
    if int(sizes.sum()) != len(joined) or (sizes < 0).any():
        raise wire.WireError(f"allgather {name}: {len(joined)} bytes for sizes {sizes.tolist()}")
    ends = np.cumsum(sizes).tolist()
    return [wire.decode(joined[end - int(n):end]) for n, end in zip(sizes, ends, strict=True)]


def state_broadcast(comm: Collectives, get_rank: Callable[[], int]) -> Callable[[Any], Any]:
    """A ``bcast_object`` for Horovod's elastic ``State``: what it syncs at every (re)start and
    checks at every commit (the committed plain attributes, the host-update tuple) as plain data
    rather than cloudpickle's."""
    return lambda value: broadcast_plain(comm, get_rank() == 0, value,
                                         f"elastic.{type(value).__name__}")


class World:
    """Create right after ``hvd.init()`` (again after every elastic re-form: ranks change)."""

    def __init__(self, hvd, collectives: Collectives) -> None:
        self.rank, self.size = hvd.rank(), hvd.size()
        self.controller = controller(hvd)
        self._comm = collectives

    def _collective(self, fn: Callable[..., T], *args, **kwargs) -> T:
        result = fn(*args, **kwargs)
        watchdog.progress()  # watchdog: a collective completed
        return result

    def sum(self, values: Sequence[float], name: str) -> list[float]:
        """Element-wise float64 sum over all ranks."""
        return [float(v) for v in self._collective(self._comm.sum, values, name)]

    def broadcast(self, obj: Any, name: str) -> Any:
        """Rank 0's ``obj`` (plain data: :mod:`ringtrain.training.wire`) on every rank."""
        return self._collective(broadcast_plain, self._comm, self.rank == 0, obj, name)

    def gather(self, obj: Any, name: str) -> list[Any]:
        """Every rank's ``obj`` (plain data), in rank order."""
        return self._collective(allgather_plain, self._comm, obj, name)

    def rank0_verdict(self, work: Callable[[], T], default: T, name: str) -> T:
        """Rank 0 runs ``work``; every rank returns its result (``default`` elsewhere) or raises
        the :class:`UserError` it met.  One broadcast with a fixed name whatever happened, so a
        problem on rank 0 ends every rank with its line instead of leaving the others waiting in
        their next collective.  The result travels as plain data (:mod:`ringtrain.training.wire`):
        a tuple arrives as a list."""
        result, problem = default, None
        if self.rank == 0:
            try:
                result = work()
            except UserError as err:
                problem = str(err)
        result, problem = self.broadcast((result, problem), name)
        if problem is not None:
            raise UserError(problem)
        return result
