"""Data-parallel training on PyTorch through ``horovod.torch``: the fixed-size job.

The run object (:class:`torch_models.run.TorchRun`) opens the run, every Horovod line in it
marked ``# Horovod:``; the shared loop (:class:`ringtrain.training.fixed.FixedRun`) trains it:
the shard and the LR of every step, the metrics, the output, the checkpoints, the end.
"""

from __future__ import annotations

import argparse

from ringtrain.output.summary import Summary
from ringtrain.training.fixed import FixedRun
from torch_models.run import TorchRun


def train(args: argparse.Namespace) -> Summary:
    run = TorchRun(args)
    return FixedRun(args, run, start_epoch=run.start_epoch).train()
