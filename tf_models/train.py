"""Data-parallel training on TensorFlow/Keras 3 through Horovod's Keras API: the fixed-size job.

The twin of :mod:`torch_models.train`: same flags, same shards, same LR rule, same output.  The
run object (:class:`tf_models.run.KerasRun`) opens the run, every Horovod line in it marked
``# Horovod:``, and runs ``model.fit``; the shared :class:`~ringtrain.training.fixed.FixedRun`
keeps the books of every step and epoch.
"""

from __future__ import annotations

import argparse

from ringtrain.output.summary import Summary
from ringtrain.training.fixed import FixedRun
from tf_models.run import KerasRun


def train(args: argparse.Namespace) -> Summary:
    run = KerasRun(args)
    return FixedRun(args, run, start_epoch=run.start_epoch).train()
