"""One step, and one evaluation, of a stage: its schedule's ops run in order, with the messages
they need.  The framework does the maths (:class:`StageWork`); this moves the arrays.

A forward op of micro-batch ``m`` takes the previous stage's activations (stage 0: its own
input), runs the stage and sends its output on (the last stage keeps it for the loss); a backward
op takes the next stage's gradient of that output (the last stage: its loss), runs the backward
pass and sends the gradient of the input back (stage 0 has none to send).  Messages carry tag
``4 (m mod 8192) + kind`` (within the 32767 every MPI allows): micro-batches are told apart by
their tag, steps by MPI's order of messages between two ranks (a step's messages are all taken
before the next step posts any).  Test batches all carry one tag: they are sent and taken in the
same order, and MPI keeps the order of messages between two ranks with one tag.

What a stage sends must be what the cut says: an output (or the gradient of an input) whose
shape or dtype differs from its boundary's ends the job in one line naming the stage, the
message and the peer it was for, before it is sent (:func:`check_output`); what a stage
receives is checked by the transport against the same boundary (its byte count).

What a stage holds is measured, not derived from the op list: after every op, the micro-batches
whose forward has run and backward has not (the framework's saved tensors, :meth:`StageWork.held`)
and the sends not yet completed (the transport releases each as soon as it completes; it is
tested at every op); :class:`StepTime` carries each step's peaks.  Evaluation streams: a stage
keeps at most :data:`EVAL_WINDOW` test batches' sends outstanding, waiting for the oldest before
it computes another.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import ml_dtypes
import numpy as np

from ringtrain.faults import watchdog
from ringtrain.strategies.pipeline.placement import Placement
from ringtrain.strategies.pipeline.schedule import BACKWARD, FORWARD, Op

ACTIVATION, GRADIENT, EVAL = 0, 1, 2
KINDS = 4


# --precision bf16's activations, as NumPy arrays (NumPy has no bfloat16 of its own): ml_dtypes'
# bfloat16, the one TensorFlow's tensors already turn into; a cut of this dtype is checked as any
# other, and the transport sends its bytes (transport.wire).
BF16 = np.dtype(ml_dtypes.bfloat16)

TAG_SPAN = 8192  # more than the receives ever posted at once (a window of S + 1)
EVAL_WINDOW = 2  # test batches a stage may have sent and not yet seen taken


def tag(kind: int, m: int) -> int:
    return KINDS * (m % TAG_SPAN) + kind


@dataclass(frozen=True)
class Boundary:
    """What crosses a cut between two stages: one example's shape, and the dtype."""

    shape: tuple[int, ...]
    dtype: Any

    def rows(self, n: int) -> tuple[int, ...]:
        return (n, *self.shape)


def check_output(out: Any, boundary: Boundary, rows: int, place: Placement, what: str,
                 dest: int, stage: int) -> None:
    """``out``, this stage's ``what`` for ``stage`` (rank ``dest``), must be an array of the
    boundary's shape for ``rows`` examples and of its dtype; else the job ends in one line,
    nothing sent."""
    want = boundary.rows(rows)
    if isinstance(out, np.ndarray) and out.shape == want and out.dtype == boundary.dtype:
        return
    got = (f"shape {out.shape} of {out.dtype}" if isinstance(out, np.ndarray)
           else f"a {type(out).__name__}")
    watchdog.end_job(f"stage {place.stage} (rank {place.rank}) computed {what} as {got}, expected "
                     f"shape {want} of {np.dtype(boundary.dtype)} (the boundary to stage {stage}, "
                     f"rank {dest}); nothing was sent, so the job ends")


class StageWork(Protocol):
    """A stage's maths for one step, in the framework."""

    def forward(self, m: int, x: np.ndarray | None) -> np.ndarray | None:
        """Micro-batch ``m``'s forward pass from ``x`` (None on the first stage, which reads its
        own input): its output to send on (None on the last stage, which computes the loss)."""

    def backward(self, m: int, grad: np.ndarray | None) -> np.ndarray | None:
        """Micro-batch ``m``'s backward pass from the gradient of its output (None on the last
        stage: from its loss), the gradients accumulated: the gradient of its input to send back
        (None on the first stage)."""

    # Optional: ``held() -> int``, the micro-batches whose tensors the stage keeps now (between
    # their forward and their backward); without it the engine counts forwards minus backwards.


class Link(Protocol):  # ringtrain.strategies.pipeline.transport.Link, or a test's stand-in
    def post(self, shape, dtype, source: int, tag: int, what: str) -> Any: ...
    def wait(self, incoming) -> np.ndarray: ...
    def send(self, array: np.ndarray, dest: int, tag: int) -> int: ...
    def release(self) -> int: ...
    def finish_sends(self, what: str, keep: int = 0) -> None: ...


@dataclass
class StepTime:
    """One step on this stage: its seconds, all of them (``wall``) and computing (``busy``); the
    most micro-batches whose activations it held at once (``held``), and the most sends it had
    outstanding at once (``sends``); the bytes it sent (``sent``: activations and gradients,
    what ``--precision bf16`` halves)."""

    wall: float
    busy: float
    held: int = 0
    sends: int = 0
    sent: int = 0


class Receives:
    """A stage's receives of one kind, posted ``window`` ahead of use in the order the schedule
    takes them (so the one waited for is always posted)."""

    def __init__(self, link: Link, order: Sequence[int], post: Callable[[int], Any],
                 window: int) -> None:
        self.link, self.post, self.window = link, post, window
        self.todo = deque(order)
        self.posted: dict[int, Any] = {}
        self.fill()

    def fill(self) -> None:
        while self.todo and len(self.posted) < self.window:
            m = self.todo.popleft()
            self.posted[m] = self.post(m)

    def take(self, m: int) -> np.ndarray:
        array = self.link.wait(self.posted.pop(m))
        self.fill()
        return array


def run_step(place: Placement, link: Link, work: StageWork, ops: Sequence[Op],
             rows: Sequence[int], inbound: Boundary | None, outbound: Boundary | None) -> StepTime:
    """Run one step's ``ops`` on this stage; ``rows[m]`` is micro-batch m's row count,
    ``inbound``/``outbound`` the cuts before and after the stage (None at the pipeline's ends)."""
    t0 = time.perf_counter()
    busy = 0.0
    window = place.stages + 1  # 1F1B never has more than S micro-batches between two stages
    acts = grads = None
    if inbound is not None:
        acts = Receives(link, [m for k, m in ops if k == FORWARD], lambda m: link.post(
            inbound.rows(rows[m]), inbound.dtype, place.previous, tag(ACTIVATION, m),
            f"stage {place.stage - 1}'s activations of micro-batch {m}"), window)
    if outbound is not None:
        grads = Receives(link, [m for k, m in ops if k != FORWARD], lambda m: link.post(
            outbound.rows(rows[m]), outbound.dtype, place.next, tag(GRADIENT, m),
            f"stage {place.stage + 1}'s gradients of micro-batch {m}"), window)
    # Each kind of op: where its input comes from, the maths, where its output goes, its tag.
    lanes = {FORWARD: (acts, work.forward, place.next if outbound is not None else None, ACTIVATION,
                       outbound, "the activations", place.stage + 1),
             BACKWARD: (grads, work.backward, place.previous if inbound is not None else None,
                        GRADIENT, inbound, "the input's gradients", place.stage - 1)}
    held = getattr(work, "held", None)
    counted = most_held = most_sends = sent = 0
    for kind, m in ops:
        incoming, compute, dest, kind_tag, cut, what, peer = lanes[kind]
        sends = link.release()  # the sends completed since the last op go now
        arg = incoming.take(m) if incoming is not None else None
        start = time.perf_counter()
        out = compute(m, arg)
        busy += time.perf_counter() - start
        counted += 1 if kind == FORWARD else -1
        most_held = max(most_held, held() if held is not None else counted)
        if dest is not None:
            check_output(out, cut, rows[m], place, f"{what} of micro-batch {m}", dest, peer)
            sends = link.send(out, dest, tag(kind_tag, m))
            sent += out.nbytes
        most_sends = max(most_sends, sends)
    link.finish_sends(f"stage {place.stage}'s messages")
    return StepTime(time.perf_counter() - t0, busy, most_held, most_sends, sent)


class EvalRelay:
    """Evaluation through the stages, one test batch at a time, forward only: stage 0 runs its
    layers on the batch and sends the result on, the middle stages receive, run and send, the
    last stage receives and returns the logits (the others return None).  A stage runs ahead of
    the next by at most ``window`` batches: before it computes another, it waits (bounded, as
    every wait) until fewer than ``window`` of its sends are outstanding, so the stages work on
    consecutive batches at once and hold a bounded number of them (``peak``: the most sends
    this relay had outstanding at once)."""

    def __init__(self, place: Placement, link: Link, inbound: Boundary | None,
                 outbound: Boundary | None, window: int = EVAL_WINDOW) -> None:
        self.place, self.link = place, link
        self.inbound, self.outbound = inbound, outbound
        self.window, self.peak = window, 0

    def __call__(self, stage: Callable[[Any], Any], x: Any, rows: int,
                 to_numpy: Callable[[Any], np.ndarray]) -> Any:
        place, link = self.place, self.link
        t = tag(EVAL, 0)
        if self.outbound is not None:
            link.finish_sends(f"stage {place.stage}'s test activations", keep=self.window - 1)
        if self.inbound is not None:
            x = link.wait(link.post(self.inbound.rows(rows), self.inbound.dtype, place.previous,
                                    t, f"stage {place.stage - 1}'s test activations"))
        out = stage(x)
        if self.outbound is None:
            return out
        out = to_numpy(out)
        check_output(out, self.outbound, rows, place, "test activations", place.next,
                     place.stage + 1)
        self.peak = max(self.peak, link.send(out, place.next, t))
        return None

    def finish(self) -> None:
        self.link.finish_sends(f"stage {self.place.stage}'s test activations")
