"""The elastic pipeline's engine, framework-free: a pipeline that runs on Horovod's global
collectives alone, so that it survives Horovod's elastic re-forms (docs/pipeline.md, "Elastic
pipeline").

Why not the fixed pipeline's design under ``--elastic``: an elastic job runs on Gloo, which has no
messages between two ranks (no mpi4py communicator), and in Horovod 0.28.1 process sets in an
elastic job crash when a rank is SIGKILLed (``ProcessSetTable::Finalize_`` raises
``gloo::IoException``; horovod issues #3501, #4021).  So here everything is a collective over the
whole world, which Horovod's elastic machinery re-forms like any other:

* **Layout** (:class:`Layout`): S stages fixed, R = W // S replicas, ``rank = replica x S +
  stage`` (the fixed pipeline's :class:`~ringtrain.strategies.pipeline.placement.Placement`
  rule); the W - R x S ranks beyond are *spares*: they take part in every collective with empty
  or zero contributions and compute nothing, and become stages again when the world re-forms
  with enough ranks.
* **Transport, lockstep** (:func:`train_step`, :func:`exchange`): a GPipe step runs in ticks that
  every rank executes together: forward ticks t = 0 .. Mmax + S - 2 (stage s runs micro-batch
  t - s when there is one), then as many backward ticks (stage s runs micro-batch
  M - 1 - (t - (S - 1 - s))).  After each tick ONE ``alltoall`` of a flat byte buffer, with a
  split per destination rank, carries every activation (forward) or activation gradient
  (backward) to its neighbour in the same replica; a rank with nothing to send sends zero-length
  splits.  The receiver knows what it expects (the cut's shape and dtype, the micro-batch's
  rows) and checks every split's length.  The same on Gloo and MPI, in both frameworks.
* **Gradients** (:func:`average_stage`): one float64 Sum allreduce of a whole-model-sized flat
  buffer per step, each rank filling its own stage's slice (zeros elsewhere; a spare: all zeros),
  then each stage's slice divided by R.
* **Elastic state** (:func:`sources`): after a re-form every rank reports (the stage it held at
  its last commit, its commit count); each stage's weights and optimizer state are then
  broadcast from the lowest rank that held it at the newest commit, the plain state from the
  lowest rank at the newest commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline.engine import Boundary
from ringtrain.strategies.pipeline.placement import Placement
from ringtrain.training import wire


class Comm(Protocol):
    """The collectives the lockstep pipeline issues, over the whole world (the framework's
    Horovod; a test's stand-in).  Every rank calls each one, in the same order, with the same
    name."""

    def alltoall(self, data: np.ndarray, splits: Sequence[int], name: str
                 ) -> tuple[np.ndarray, list[int]]:
        """``data`` (uint8, 1-D) cut by ``splits`` (bytes per destination rank): what every rank
        sent this one, concatenated in rank order, and the bytes from each."""

    def allreduce_sum(self, array: np.ndarray, name: str) -> np.ndarray:
        """Element-wise float64 sum over every rank."""

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        """Rank ``root``'s ``array`` (same shape and dtype on every rank)."""

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        """Every rank's 1-D ``array``, concatenated in rank order."""


class LockstepError(RuntimeError):
    """A message of the wrong length: the ranks disagree about the schedule (a bug, never a
    peer's failure, which Horovod raises as its own error)."""


# --- where each rank sits ------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """This rank's place in a world of ``size`` ranks: the fixed pipeline's :class:`Placement`
    over the first R x S ranks, or a spare (``placement`` None)."""

    stages: int
    size: int
    rank: int

    @property
    def replicas(self) -> int:
        return self.size // self.stages

    @property
    def spare(self) -> bool:
        return self.rank >= self.replicas * self.stages

    @cached_property
    def placement(self) -> Placement | None:
        return None if self.spare else Placement(self.stages, self.replicas * self.stages,
                                                 self.rank)

    @property
    def stage(self) -> int | None:
        return None if self.spare else self.placement.stage

    @property
    def replica(self) -> int | None:
        return None if self.spare else self.placement.replica

    @property
    def first(self) -> bool:
        return not self.spare and self.placement.first

    @property
    def last(self) -> bool:
        return not self.spare and self.placement.last

    @cached_property
    def grid(self) -> Placement:
        """The fixed pipeline's placement of the first R x S ranks, for its rules (any rank's,
        a spare's too: who holds a stage of a replica)."""
        return Placement(self.stages, self.replicas * self.stages, 0)

    def rank_of(self, stage: int, replica: int) -> int:
        return self.grid.rank_of(stage, replica)

    @property
    def previous(self) -> int | None:
        return None if self.spare else self.placement.previous

    @property
    def next(self) -> int | None:
        return None if self.spare else self.placement.next

    def describe(self) -> str:
        return f"rank {self.rank} (spare)" if self.spare else self.placement.describe()


def check_world(stages: int, size: int) -> None:
    """An elastic pipeline needs one whole replica: at least S ranks."""
    if size < stages:
        raise UserError(f"the elastic pipeline's world has {size} rank(s), fewer than its "
                        f"--pipeline-stages {stages}: no replica can hold every stage; give "
                        f"horovodrun --min-np {stages} or more")


# --- the ticks ---------------------------------------------------------------------------------

def ticks(stages: int, micro: int) -> int:
    """Ticks of one direction of a GPipe step of ``micro`` micro-batches: M + S - 1."""
    return micro + stages - 1


def forward_micro(stage: int, tick: int) -> int:
    """The micro-batch stage ``stage`` runs forward at ``tick`` (out of range: none)."""
    return tick - stage


def backward_micro(stages: int, stage: int, tick: int, micro: int) -> int:
    """The micro-batch stage ``stage`` runs backward at ``tick``: the last stage starts at tick 0
    with the last micro-batch (GPipe: last in, first out), each stage one tick after the next."""
    return micro - 1 - (tick - (stages - 1 - stage))


# --- one exchange --------------------------------------------------------------------------------

def as_bytes(array: np.ndarray) -> np.ndarray:
    """``array``'s bytes as a 1-D uint8 array (any dtype, bfloat16 included: the receiver knows
    the dtype from the cut, so the wire carries bytes only)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


Expected = tuple[tuple[int, ...], Any]  # (shape, dtype) of what a source sends this rank


def exchange(comm: Comm, size: int, outgoing: dict[int, np.ndarray],
             expected: dict[int, Expected], name: str) -> dict[int, np.ndarray]:
    """One alltoall: ``outgoing[dest]`` to each destination (zero bytes to the others); returns
    what each source in ``expected`` sent, as its expected shape and dtype.  Any split whose
    length is not what this rank expects (something from a rank it expects nothing from, or a
    wrong byte count) raises :class:`LockstepError` naming both."""
    splits = [0] * size
    parts = []
    for dest in sorted(outgoing):
        data = as_bytes(outgoing[dest])
        splits[dest] = data.size
        parts.append(data)
    buf = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    received, got = comm.alltoall(buf, splits, name)
    got = [int(n) for n in got]
    want = [0] * size
    for src, (shape, dtype) in expected.items():
        want[src] = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if got != want or len(received) != sum(want):
        bad = [r for r in range(size) if r >= len(got) or got[r] != want[r]]
        raise LockstepError(f"{name}: received {got} bytes per rank, expected {want} "
                            f"(ranks {bad} disagree with this one about the schedule)")
    out, offset = {}, 0
    for src in range(size):
        if want[src]:
            shape, dtype = expected[src]
            chunk = np.asarray(received[offset:offset + want[src]], np.uint8)
            out[src] = chunk.copy().view(np.dtype(dtype)).reshape(shape)
        offset += want[src]
    return out


# --- one step --------------------------------------------------------------------------------------

class StageWork(Protocol):
    """A stage's maths (the same contract as the fixed pipeline's
    :class:`~ringtrain.strategies.pipeline.engine.StageWork`): arrays in, arrays out."""

    def forward(self, m: int, x: np.ndarray | None) -> np.ndarray | None: ...

    def backward(self, m: int, grad: np.ndarray | None) -> np.ndarray | None: ...


def _check(out: Any, cut: Boundary, rows: int, layout: Layout, what: str) -> np.ndarray:
    want = cut.rows(rows)
    if not (isinstance(out, np.ndarray) and out.shape == want
            and out.dtype == np.dtype(cut.dtype)):
        got = (f"shape {out.shape} of {out.dtype}" if isinstance(out, np.ndarray)
               else f"a {type(out).__name__}")
        raise LockstepError(f"{layout.describe()} computed {what} as {got}, expected shape "
                            f"{want} of {np.dtype(cut.dtype)}")
    return out


def train_step(layout: Layout, comm: Comm, work: StageWork | None, rows: Sequence[int],
               micro_max: int, inbound: Boundary | None, outbound: Boundary | None) -> int:
    """One GPipe step of this rank in lockstep with every other: ``rows[m]`` is micro-batch m's
    row count in this rank's replica (its M may be below ``micro_max`` at an epoch's end),
    ``micro_max`` the most micro-batches of any replica (the same on every rank: it fixes the
    tick count), ``inbound``/``outbound`` the cuts around the stage.  A spare passes
    ``work=None``.  Returns the bytes this rank sent."""
    s, stages, size = layout.stage, layout.stages, layout.size
    n = ticks(stages, micro_max)
    micro = len(rows)
    sent = 0
    inbox: dict[int, np.ndarray] = {}
    for t in range(n):  # forward: activations go to the next stage
        outgoing, expected, incoming = {}, {}, None
        if s is not None:
            m = forward_micro(s, t)
            if 0 <= m < micro:
                x = None if layout.first else inbox.pop(m)
                y = work.forward(m, x)
                if not layout.last:
                    outgoing[layout.next] = _check(y, outbound, rows[m], layout,
                                                   f"the activations of micro-batch {m}")
            if not layout.first:
                incoming = forward_micro(s - 1, t)
                if 0 <= incoming < micro:
                    expected[layout.previous] = (inbound.rows(rows[incoming]), inbound.dtype)
        got = exchange(comm, size, outgoing, expected, f"pipeline.lockstep.f{t}")
        sent += sum(a.nbytes for a in outgoing.values())
        if layout.previous in got:
            inbox[incoming] = got[layout.previous]
    for t in range(n):  # backward: the gradients of the inputs go to the previous stage
        outgoing, expected, incoming = {}, {}, None
        if s is not None:
            m = backward_micro(stages, s, t, micro)
            if 0 <= m < micro:
                g = None if layout.last else inbox.pop(m)
                dx = work.backward(m, g)
                if not layout.first:
                    outgoing[layout.previous] = _check(dx, inbound, rows[m], layout,
                                                       f"the input gradients of micro-batch {m}")
            if not layout.last:
                incoming = backward_micro(stages, s + 1, t, micro)
                if 0 <= incoming < micro:
                    expected[layout.next] = (outbound.rows(rows[incoming]), outbound.dtype)
        got = exchange(comm, size, outgoing, expected, f"pipeline.lockstep.b{t}")
        sent += sum(a.nbytes for a in outgoing.values())
        if layout.next in got:
            inbox[incoming] = got[layout.next]
    return sent


def forward_only(layout: Layout, comm: Comm, compute, rows: Sequence[int], micro_max: int,
                 inbound: Boundary | None, outbound: Boundary | None, name: str) -> list[Any]:
    """Forward ticks only (evaluation): ``compute(m, x)`` runs batch m (``x`` None on the first
    stage); returns the last stage's outputs in order (empty elsewhere)."""
    s, size = layout.stage, layout.size
    inbox: dict[int, np.ndarray] = {}
    results: list[Any] = []
    for t in range(ticks(layout.stages, micro_max)):
        outgoing, expected, incoming = {}, {}, None
        if s is not None:
            m = forward_micro(s, t)
            if 0 <= m < len(rows):
                y = compute(m, None if layout.first else inbox.pop(m))
                if layout.last:
                    results.append(y)
                else:
                    outgoing[layout.next] = _check(y, outbound, rows[m], layout,
                                                   f"the activations of test batch {m}")
            if not layout.first:
                incoming = forward_micro(s - 1, t)
                if 0 <= incoming < len(rows):
                    expected[layout.previous] = (inbound.rows(rows[incoming]), inbound.dtype)
        got = exchange(comm, size, outgoing, expected, f"{name}.f{t}")
        if layout.previous in got:
            inbox[incoming] = got[layout.previous]
    return results


# --- the stages' gradients and buffers --------------------------------------------------------

def average_stage(comm: Comm, layout: Layout, sizes: Sequence[int], mine: np.ndarray | None,
                  name: str) -> np.ndarray | None:
    """The mean over the R replicas of this rank's stage's flat float64 vector ``mine`` (None on
    a spare, which gets None back).

    The cost, the price of having no process sets under elastic: ONE Sum allreduce of a buffer
    as large as the whole model (``sum(sizes)`` float64s, every stage's slice, zeros outside
    the rank's own), so every rank moves every stage's bytes, S times what a stage's own process
    set would move (and float64, twice float32's bytes).  The fixed pipeline's process sets move
    a stage's bytes among its R ranks only."""
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    buf = np.zeros(int(offsets[-1]), np.float64)
    s = layout.stage
    if s is not None:
        if mine.size != sizes[s]:
            raise LockstepError(f"{layout.describe()}: {mine.size} values for stage {s}, "
                                f"expected {sizes[s]}")
        buf[offsets[s]:offsets[s + 1]] = mine
    total = np.asarray(comm.allreduce_sum(buf, name), np.float64)
    if s is None:
        return None
    return total[offsets[s]:offsets[s + 1]] / layout.replicas


GRADS = "pipeline.elastic.grads"  # the step's one whole-model allreduce (average_stage's name)


def spare_step(layout: Layout, comm: Comm, rows: Sequence[int], sizes: Sequence[int]) -> None:
    """A spare's step: every collective a stage's step issues (the ticks' alltoalls, the
    gradients' allreduce), in the same order, with nothing of its own."""
    train_step(layout, comm, None, rows, len(rows), None, None)
    average_stage(comm, layout, sizes, None, GRADS)


# --- after a re-form: who hands each stage over -----------------------------------------------

Report = tuple[int | None, int]  # (stage held at the last commit, or None; commits made)


def sources(reports: Sequence[Report], stages: int) -> tuple[int, list[int]]:
    """From every rank's report (in rank order), the rank whose plain state every rank takes
    (the lowest at the newest commit) and, per stage, the rank its weights and optimizer state
    come from: the lowest rank that held it at the newest commit.  Before the job's first commit
    (newest = 0) every rank holds the same freshly built model: every stage from that rank.
    A stage that no rank held at the newest commit (all its replicas lost at once) cannot be
    recovered: one line."""
    newest = max(c for _, c in reports)
    root = min(r for r, (_, c) in enumerate(reports) if c == newest)
    if newest == 0:
        return root, [root] * stages
    out = []
    for s in range(stages):
        holders = [r for r, (st, c) in enumerate(reports) if c == newest and st == s]
        if not holders:
            raise UserError(f"the elastic pipeline lost every replica of stage {s} at once (no "
                            f"surviving rank held it at commit {newest}): its weights are gone; "
                            f"restart the job, with more replicas (R = world / S) to survive "
                            f"such a loss")
        out.append(holders[0])
    return root, out


def broadcast_plain(comm: Comm, root: int, rank: int, value: Any, name: str) -> Any:
    """Rank ``root``'s ``value`` (plain data, :mod:`ringtrain.training.wire`'s JSON) on every
    rank: its size, then its bytes."""
    data = np.frombuffer(bytearray(wire.encode(value)), np.uint8) if rank == root else None
    n = int(comm.broadcast(np.array([data.size if data is not None else 0], np.int64), root,
                           f"{name}.size")[0])
    if data is None:
        data = np.zeros(n, np.uint8)
    return wire.decode(np.asarray(comm.broadcast(data, root, f"{name}.data"), np.uint8).tobytes())


def gather_reports(comm: Comm, report: Report) -> list[Report]:
    """Every rank's :data:`Report`, in rank order (two int64s each; -1 for no stage)."""
    stage, commits = report
    flat = np.asarray(comm.allgather(np.array([-1 if stage is None else stage, commits], np.int64),
                                     "pipeline.elastic.reports"), np.int64).reshape(-1, 2)
    return [(None if s < 0 else int(s), int(c)) for s, c in flat]


def handover(comm: Comm, rank: int, stages: int, report: Report, plain: Any
             ) -> tuple[Any, list[int], int]:
    """At the start of a world, on every rank: every rank's report gathered, the plain state of
    the lowest rank at the newest commit, and per stage the rank to broadcast it from
    (:func:`sources`); returns (that plain state, the sources, the newest commit count)."""
    reports = gather_reports(comm, report)
    root, per_stage = sources(reports, stages)
    newest = max(c for _, c in reports)
    return broadcast_plain(comm, root, rank, plain, "pipeline.elastic.state"), per_stage, newest
