"""The arguments of Horovod's ``DistributedOptimizer``, from the flags: the same for both frameworks
(``horovod.torch`` and ``horovod.tensorflow.keras`` take the same names) and both loops."""

from __future__ import annotations

import argparse
from typing import Any


def distributed_optimizer_options(args: argparse.Namespace, hvd) -> dict[str, Any]:
    """``--fp16-allreduce``, ``--backward-passes-per-step``, ``--adasum`` and
    ``--gradient-predivide-factor`` as ``hvd.DistributedOptimizer`` keyword arguments."""
    return {"compression": hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
            "backward_passes_per_step": args.backward_passes_per_step,
            "op": hvd.Adasum if args.adasum else hvd.Average,
            "gradient_predivide_factor": args.gradient_predivide_factor}
