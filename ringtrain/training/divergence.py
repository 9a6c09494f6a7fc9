"""A run whose weights stop being numbers ends at that step, with one line naming it and the ranks
whose loss went first, before any checkpoint of those weights is written.

Each rank sees only its own loss, but a NaN or inf in one rank's loss reaches every rank's weights
in the same step: the gradient average carries it.  So the decision is taken on the weights, which
are identical on every rank (the trainers' :func:`weights_finite` sums them, a NaN or inf anywhere
makes the sum one), and every rank stops at the same step; only then do they learn, in one
allgather, which ranks' losses were not finite.  A step that mixed precision skips (its scaled
gradients overflowed) leaves the weights finite, and training goes on, as it should.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ringtrain.errors import UserError


def stop(gather: Callable[[object, str], list], epoch: int, step: int,
         local_loss: Callable[[], float]) -> UserError:
    """The error every rank raises once the weights are no longer finite after optimizer step
    ``step`` of ``epoch``; ``gather`` is the job's allgather (all ranks call this together)."""
    losses = gather(float(local_loss()), "divergence")
    bad = [(rank, loss) for rank, loss in enumerate(losses) if not math.isfinite(loss)]
    if bad:
        values = sorted({repr(loss) for _, loss in bad})
        where = (f"the loss was {' / '.join(values)} on rank{'s' if len(bad) > 1 else ''} "
                 f"{', '.join(str(rank) for rank, _ in bad)}")
    else:
        where = "the loss was finite on every rank, but the update overflowed"
    return UserError(f"training diverged at epoch {epoch}, step {step}: {where}, and the weights are "
                     f"no longer finite numbers; no checkpoint holds them. Lower --base-lr (or use "
                     f"--lr-scaling sqrt), or look for NaN/inf values in the data")
