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

from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.runtime import controller

T = TypeVar("T")


@dataclass(frozen=True)
class Collectives:
    """The three collectives framework-free code needs, from the framework's Horovod module."""

    sum: Callable[[Sequence[float], str], Sequence[float]]  # float64 Sum allreduce (values, name)
    broadcast_object: Callable[..., Any]  # hvd.broadcast_object(obj, root_rank=0, name=...)
    allgather_object: Callable[..., Any]  # hvd.allgather_object(obj, name=...)


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
        return self._collective(self._comm.broadcast_object, obj, root_rank=0, name=name)

    def gather(self, obj: Any, name: str) -> list[Any]:
        return self._collective(self._comm.allgather_object, obj, name=name)

    def rank0_verdict(self, work: Callable[[], T], default: T, name: str) -> T:
        """Rank 0 runs ``work``; every rank returns its result (``default`` elsewhere) or raises
        the :class:`UserError` it met.  One broadcast with a fixed name whatever happened, so a
        problem on rank 0 ends every rank with its line instead of leaving the others waiting in
        their next collective."""
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
