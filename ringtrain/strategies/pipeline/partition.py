"""How a chain of layers splits into S contiguous stages.

By default (``--partition params``) balanced by parameter count, not FLOPs: what a split is for
is that each rank holds only its stage's weights, their gradients and optimizer state (about 1/S
of the whole), so the largest stage is what must fit.  Among the splits whose largest stage is
as small as it can be, the one whose cuts carry the fewest activation values per example (what
crosses between ranks every micro-batch) wins, then the earliest cuts.  Every stage holds at
least one layer with weights: a stage without any would have nothing to train (and its optimizer
nothing to step).

``--partition time`` runs the same search on each layer's timed forward and backward pass
(:mod:`ringtrain.strategies.pipeline.timing`) instead of its parameter count: the slowest stage
is what a pipeline's step waits for.  Timings are not exact, so "as small as it can be" there
means within a slack of the smallest (:data:`ringtrain.strategies.pipeline.timing.SLACK`), and
among those the cut tie-break decides as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ringtrain.errors import UserError


@dataclass(frozen=True)
class Stage:
    """One stage of a split model: its layers' names, parameter count and bytes (the weights'
    own dtype), the shape of one example entering and leaving it; under ``--partition time``
    also its layers' timed seconds (forward and backward of one micro-batch) and their share of
    the whole model's."""

    index: int
    layers: tuple[str, ...]
    params: int
    bytes: int
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    seconds: float | None = None
    time_share: float | None = None

    def record(self) -> dict:
        timed = {} if self.seconds is None else {"seconds": self.seconds,
                                                 "time_share": self.time_share}
        return {"stage": self.index, "layers": list(self.layers), "params": self.params,
                "bytes": self.bytes, "input_shape": list(self.input_shape),
                "output_shape": list(self.output_shape), **timed}

    def line(self) -> str:
        timed = "" if self.time_share is None else f", {self.time_share:.0%} of the timed compute"
        return (f"stage {self.index}: {', '.join(self.layers)} ({self.params:,} params, "
                f"{self.bytes:,} bytes{timed}; in {tuple(self.input_shape)} -> out "
                f"{tuple(self.output_shape)})")


def timed_stages(stages: Sequence[Stage], costs: Sequence[float] | None) -> list[Stage]:
    """``stages`` with each one's timed seconds and share of the whole model's (``costs``: one
    per layer, in order; None leaves them as they are: split by parameters)."""
    if costs is None:
        return list(stages)
    total, out, first = sum(costs), [], 0
    for s in stages:
        seconds = sum(costs[first:first + len(s.layers)])
        first += len(s.layers)
        out.append(replace(s, seconds=seconds, time_share=seconds / total if total else 0.0))
    return out


def balanced_split(params: Sequence[int], cut_sizes: Sequence[int], stages: int,
                   what: str, costs: Sequence[float] | None = None,
                   slack: float = 0.0) -> list[range]:
    """Contiguous ranges of layer indices, one per stage.  ``params[i]`` is layer i's parameter
    count, ``cut_sizes[i]`` the values per example leaving it (a cut after layer i sends that
    many); ``what`` names the model in the error when it has fewer layers with weights than
    stages.  The largest stage is minimised by ``costs`` (one per layer; default: ``params``),
    and the cut tie-break chooses among the splits whose largest stage is at most ``1 + slack``
    times the smallest possible (0: exactly it)."""
    n = len(params)
    cost = list(params if costs is None else costs)
    if len(cost) != n:
        raise ValueError(f"{len(cost)} costs for {n} layers")
    weighted = sum(1 for p in params if p > 0)
    if stages > weighted:
        raise UserError(f"--pipeline-stages {stages} is more than the {weighted} layers with "
                        f"weights of {what}: every stage needs one; use at most {weighted} stages")
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    has_weights = [0]
    for p in params:
        has_weights.append(has_weights[-1] + (p > 0))

    def ok(start: int, end: int) -> bool:  # layers start..end-1 may form a stage
        return has_weights[end] > has_weights[start]

    # 1: the smallest possible largest stage (layers 0..n-1 in k stages).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for end in range(1, n + 1):
            for start in range(k - 1, end):
                if best[k - 1][start] < inf and ok(start, end):
                    best[k][end] = min(best[k][end], max(best[k - 1][start], prefix[end] - prefix[start]))
    cap = best[stages][n] if not slack else best[stages][n] * (1 + slack)
    # 2: among splits with no stage above the cap, the fewest values crossing the cuts, then the
    # earliest cuts: (cost, cuts) compared as tuples.
    plan: list[list[tuple[float, tuple[int, ...]] | None]] = [[None] * (n + 1) for _ in range(stages + 1)]
    plan[0][0] = (0, ())
    for k in range(1, stages + 1):
        for end in range(1, n + 1):
            options = []
            for start in range(k - 1, end):
                before = plan[k - 1][start]
                if before is None or not ok(start, end) or prefix[end] - prefix[start] > cap:
                    continue
                cut = cut_sizes[start - 1] if start > 0 else 0
                options.append((before[0] + cut, (*before[1], start)))
            plan[k][end] = min(options) if options else None
    starts = [*plan[stages][n][1], n]
    return [range(starts[i], starts[i + 1]) for i in range(stages)]


def stage_ranges(params: Sequence[int], cut_sizes: Sequence[int], stages: int, given: bool,
                 spec: str, costs: Sequence[float] | None = None,
                 slack: float = 0.0) -> list[range]:
    """The layers of each stage: a builder's own list of stages (``given``: one "layer" each,
    which must be S of them and each hold weights; ``costs`` change nothing there), or
    :func:`balanced_split` (by ``costs`` where given, else by parameter count)."""
    if not given:
        return balanced_split(params, cut_sizes, stages, f"--model {spec}", costs, slack)
    if len(params) != stages:
        raise UserError(f"--model {spec} returned {len(params)} stages but --pipeline-stages is "
                        f"{stages}; return one per stage")
    empty = [i for i, n in enumerate(params) if n == 0]
    if empty:
        raise UserError(f"--model {spec}: stage {empty[0]} of the {stages} it returned holds no "
                        f"weights; every stage needs some to train")
    return [range(i, i + 1) for i in range(stages)]
