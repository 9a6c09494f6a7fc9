"""``--partition time``: the split balanced by each layer's timed compute, the same on every rank.

What is timed: each layer of the chain alone, on a probe batch of a micro-batch's rows (B / M),
its forward pass and its backward pass (PyTorch with ``--checkpoint-activations`` and Keras,
whose stages always recompute, count the forward twice: that is what a stage runs), after one
warm-up, the median of :data:`REPEATS` repetitions.  The framework's stage builder
(:mod:`torch_models.stages`, :mod:`tf_models.stages`) does the timing: one layer at a time,
materialised alone (PyTorch: a copy of the meta layer given storage and small values from a
private generator; Keras: a throwaway copy of the layer from its config) and dropped, so no rank
holds the whole model; the random state the weights are built from is left exactly as it was.

The same on every rank: timings differ from rank to rank and run to run, and a split that
differed between two ranks would pair their stages wrongly.  So rank 0 alone times, and its
per-layer seconds are broadcast (:meth:`ringtrain.training.world.World.rank0_verdict`: one
broadcast issued by every rank at the same point of the build, whatever happened on rank 0); every
rank splits on those numbers.  A failure while timing ends every rank with rank 0's one line.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from ringtrain.errors import UserError, printable
from ringtrain.training.world import World

REPEATS = 5  # after one warm-up; the median
# The split's tolerance on the slowest stage: splits within 5% of the fastest possible count as
# ties, and the cut carrying the fewest values decides among them (as under params).  Six
# timings of the built-in CNN's layers (16 rows, one thread, the shared 2-core machine) put a
# stage's total between -7% and +10% of their median (docs/pipeline.md): a gain under 5% is the
# timer's noise, not worth more values on a cut every micro-batch.
SLACK = 0.05

Measure = Callable[[], list[float]]


@dataclass(frozen=True)
class Timing:
    """How to time: the probe batch's rows, whether a stage's forward runs twice (recomputed in
    the backward), and ``agree``, which takes the local measuring function and returns the
    per-layer seconds every rank splits on (in one process: the measurement itself); PyTorch
    times on ``device`` (the run's: ``cpu`` or ``cuda``; Keras places its operations itself)."""

    rows: int
    recompute: bool
    agree: Callable[[Measure], list[float]]
    repeats: int = REPEATS
    device: str = "cpu"


def median_seconds(run: Callable[[], float], repeats: int = REPEATS) -> float:
    """``run()`` returns the seconds it measured; called once to warm up (a first call allocates,
    a traced function traces), then ``repeats`` times: the median."""
    run()
    return statistics.median(run() for _ in range(repeats))


def clock() -> float:
    return time.perf_counter()


def guarded(measure: Measure) -> Measure:
    """``measure`` with any failure as one line naming the way out (rank 0's failure then ends
    every rank with it: :meth:`World.rank0_verdict` carries a :class:`UserError` only)."""
    def run() -> list[float]:
        try:
            costs = [float(c) for c in measure()]
        except UserError:
            raise
        except Exception as err:  # one line, whatever the framework raised: rank 0's verdict
            first = str(err).splitlines()[0] if str(err) else ""
            raise UserError(f"--partition time: timing the model's layers on rank 0 failed "
                            f"({type(err).__name__}: {printable(first)}); use --partition "
                            f"params") from None
        if any(not c >= 0 for c in costs):  # NaN too
            raise UserError(f"--partition time: a layer timed at {min(costs)} s; use --partition "
                            f"params")
        return costs

    return run


def for_run(world: World, args: argparse.Namespace, micro_rows: int,
            device: str = "cpu") -> Timing | None:
    """The pipeline's timing under ``--partition time`` (None under ``params``): rank 0 times,
    every rank takes its figures."""
    if getattr(args, "partition", "params") != "time":
        return None
    return Timing(micro_rows, bool(args.checkpoint_activations),
                  lambda measure: world.rank0_verdict(guarded(measure), None,
                                                      "pipeline.layer_seconds"),
                  device=device)


def in_process(rows: int, recompute: bool = False, repeats: int = REPEATS) -> Timing:
    """Timing in one process (the tests): the measurement itself, guarded as on rank 0."""
    return Timing(rows, recompute, lambda measure: guarded(measure)(), repeats)
