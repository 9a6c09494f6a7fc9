"""A run whose weights stop being numbers ends at that step, with one line naming the step and the
ranks whose loss went first (or the bad file one of them read), before any checkpoint of those
weights is written.

Each rank sees only its own loss, but a NaN or inf in one rank's loss reaches every rank's weights
in the same step: the gradient average carries it.  So the decision is taken on the weights, which
are identical on every rank (the run object's ``diverged`` check reads them: a NaN or inf anywhere
makes it non-finite), and every rank stops at the same step; only then do they learn, in one
allgather, which ranks' losses were not finite, and why.  A file of the training data that does
not decode is read as a NaN image for exactly this reason: the rank that met it alone knows, and
this way every rank stops with it.  A step that mixed precision skips (its scaled gradients
overflowed) leaves the weights finite, and training goes on, as it should; a data problem is then
caught at the epoch's end (:func:`ringtrain.training.evaluation.exact_test_metrics`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ringtrain.errors import UserError

Gather = Callable[[object, str], list]


def stop(gather: Gather, epoch: int, step: int, local_loss: Callable[[], float],
         local_problem: str | None = None) -> UserError:
    """The error every rank raises once the weights are no longer finite after optimizer step
    ``step`` of ``epoch``; ``gather`` is the world's allgather (all ranks call this together)."""
    reports = gather((float(local_loss()), local_problem), "divergence")
    when = f"at epoch {epoch}, step {step}"
    problems = [(rank, problem) for rank, (_, problem) in enumerate(reports) if problem]
    if problems:
        return data_error(problems, when)
    bad = [(rank, loss) for rank, (loss, _) in enumerate(reports) if not math.isfinite(loss)]
    if bad:
        values = sorted({repr(loss) for _, loss in bad})
        where = (f"the loss was {' / '.join(values)} on rank{'s' if len(bad) > 1 else ''} "
                 f"{', '.join(str(rank) for rank, _ in bad)}")
    else:
        where = "the loss was finite on every rank, but the update overflowed"
    return UserError(f"training diverged {when}: {where}, and the weights are no longer finite "
                     f"numbers; no checkpoint holds them. Lower --base-lr (or use --lr-scaling "
                     f"sqrt), or look for NaN/inf values in the data")


def stop_if(diverged: tuple[int, int, object] | None, gather: Gather,
            local_problem: str | None) -> None:
    """Raise :func:`stop`'s error for ``diverged``, a run object's (epoch, step, this rank's loss
    of the step: a number or a callable that reads it) tag of the step after which the weights
    stopped being finite, on every rank alike; nothing when it is None."""
    if diverged:
        epoch, step, loss = diverged
        raise stop(gather, epoch, step, loss if callable(loss) else (lambda: loss), local_problem)


def data_problem(gather: Gather, local_problem: str | None, when: str) -> UserError:
    """The error every rank raises when the world's sum says some rank met a data problem."""
    problems = [(rank, p) for rank, p in enumerate(gather(local_problem, "data_problems")) if p]
    return data_error(problems, when)


def data_error(problems: list[tuple[int, str]], when: str) -> UserError:
    rank, problem = problems[0]
    more = f"; {len(problems) - 1} more rank(s) met one too" if len(problems) > 1 else ""
    return UserError(f"{problem}: met by rank {rank} {when}{more}. Fix or remove it (items are "
                     f"read as they are trained on, so a bad one stops the run when it is reached)")
