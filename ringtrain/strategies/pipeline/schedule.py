"""The order in which a stage runs the forward (F) and backward (B) passes of a step's M
micro-batches, and what that order costs in idle time.

* **GPipe** (Huang et al. 2019): all M forwards, then all M backwards (last micro-batch first).
  Simple; every stage keeps the activations of all M micro-batches until their backward.
* **1F1B** (PipeDream-flush, Narayanan et al. 2021): stage ``s`` runs ``S - s - 1`` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining backwards.
  Same step time, but a stage holds at most ``S - s`` micro-batches' activations at once.

Both flush at the end of every step (all M backwards done before the optimizer steps), so the
weights a micro-batch sees are the step's weights: the step equals one data-parallel step over
the same examples.  With equal forward times per stage, and equal backward times, each stage is
idle for a fraction ``(S - 1) / (M + S - 1)`` of the step (the "bubble"), in both schedules:
:func:`simulate` replays a schedule on that model, :func:`bubble_formula` is the closed form.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SCHEDULES = ("gpipe", "1f1b")
FORWARD, BACKWARD = "F", "B"
Op = tuple[str, int]  # (FORWARD or BACKWARD, micro-batch index)


def stage_ops(schedule: str, stages: int, stage: int, micro: int) -> list[Op]:
    """Stage ``stage``'s ops for one step of ``micro`` micro-batches, in the order it runs them."""
    if schedule == "gpipe":
        return ([(FORWARD, m) for m in range(micro)]
                + [(BACKWARD, m) for m in reversed(range(micro))])
    if schedule != "1f1b":
        raise ValueError(schedule)
    warm = min(stages - stage - 1, micro)
    ops: list[Op] = [(FORWARD, m) for m in range(warm)]
    for i in range(micro - warm):
        ops += [(FORWARD, warm + i), (BACKWARD, i)]
    ops += [(BACKWARD, m) for m in range(micro - warm, micro)]
    return ops


def in_flight(ops: list[Op]) -> int:
    """The most micro-batches whose forward has run and backward has not, at any point: how many
    micro-batches' activations the stage holds at once."""
    held = most = 0
    for kind, _ in ops:
        held += 1 if kind == FORWARD else -1
        most = max(most, held)
    return most


@dataclass(frozen=True)
class Timeline:
    """A step replayed on unit costs: each stage's ops as (op, start, end), the step's length."""

    ops: list[list[tuple[Op, float, float]]]
    makespan: float

    def bubble(self) -> float:
        """The fraction of stage-time spent idle."""
        busy = sum(end - start for stage in self.ops for _, start, end in stage)
        return 1.0 - busy / (len(self.ops) * self.makespan)


def simulate(schedule: str, stages: int, micro: int, forward: float | Sequence[float] = 1.0,
             backward: float | Sequence[float] = 2.0) -> Timeline:
    """Replay the schedule: every stage runs its ops in order, each op as soon as its input is
    there (a forward needs the previous stage's forward of that micro-batch, a backward the next
    stage's backward, the last stage's backward its own forward); messages take no time.
    ``forward``/``backward``: one op's time, the same for every stage or one per stage."""
    fwd = [forward] * stages if isinstance(forward, (int, float)) else list(forward)
    bwd = [backward] * stages if isinstance(backward, (int, float)) else list(backward)
    orders = [stage_ops(schedule, stages, s, micro) for s in range(stages)]
    done: dict[tuple[int, Op], float] = {}
    timeline: list[list[tuple[Op, float, float]]] = [[] for _ in range(stages)]
    clock = [0.0] * stages
    position = [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            if position[s] == len(orders[s]):
                continue
            op = kind, m = orders[s][position[s]]
            if kind == FORWARD:
                needs = (s - 1, (FORWARD, m)) if s > 0 else None
            else:
                needs = (s + 1, (BACKWARD, m)) if s < stages - 1 else (s, (FORWARD, m))
            if needs is not None and needs not in done:
                continue
            start = max(clock[s], done[needs] if needs else 0.0)
            end = start + (fwd[s] if kind == FORWARD else bwd[s])
            done[(s, op)] = clock[s] = end
            timeline[s].append((op, start, end))
            position[s] += 1
            moved = True
        if not moved:
            raise RuntimeError(f"{schedule} deadlocks at S={stages}, M={micro}")
    return Timeline(timeline, max(clock))


def bubble_formula(stages: int, micro: int) -> float:
    """The idle fraction of a flushed pipeline with equal stages: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (micro + stages - 1)
