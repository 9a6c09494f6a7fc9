"""A fixed-size run's bookkeeping around the trainer's own loop, the same for both frameworks: the
banner, the LR of every step, each epoch's exact metrics, record and checkpoint, and the end.

The trainer calls :meth:`FixedRun.step_done` after every optimizer step (its gradient allreduce
has completed on this rank) and :meth:`FixedRun.end_epoch` after every epoch, on every rank, in
the same order: that is what keeps the collectives here matched across ranks.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ringtrain.data.dataset import DataInfo
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at
from ringtrain.output import checkpoint
from ringtrain.output.progress import Loss, Progress
from ringtrain.output.summary import EpochRecord, Summary
from ringtrain.training import summaries
from ringtrain.training.evaluation import exact_test_metrics
from ringtrain.training.world import World


class FixedRun:
    def __init__(self, args: argparse.Namespace, world: World, progress: Progress, *, framework: str,
                 versions: dict[str, str], model_name: str, data: DataInfo, param_count: int,
                 target_lr: float, steps: int, start_epoch: int) -> None:
        self.args, self.world, self.progress = args, world, progress
        self.steps, self.target_lr = steps, target_lr
        k = args.backward_passes_per_step
        global_batch = args.batch_size * world.size * k
        self.summary = summaries.new_summary(
            args, world, framework=framework, versions=versions, param_count=param_count,
            data=data, world_size=world.size, batch_size_per_rank=args.batch_size,
            global_batch_size=global_batch, base_lr=args.base_lr, effective_lr=target_lr,
            lr_scaling="none (adasum)" if args.adasum else args.lr_scaling,
            resumed_from_epoch=start_epoch or None)
        self.train_seconds = self.images_seen = 0.0
        progress.info(f"{' + '.join(f'{k} {v}' for k, v in versions.items())} ({world.controller}):"
                      f" {world.size} rank(s), {model_name} {param_count:,} params, lr "
                      f"{args.base_lr:g} -> {target_lr:g}, {steps} steps/epoch of {global_batch} images")

    def lr(self, epoch: int, step: int) -> float:
        """The LR rule (:func:`ringtrain.lr.lr_at`) for step ``step`` (from 0) of ``epoch`` (from
        1): what both fixed trainers set before every optimizer step."""
        a = self.args
        return lr_at(epoch - 1 + step / self.steps, a.base_lr, self.target_lr, a.warmup_epochs,
                     a.epochs, a.lr_decay)

    def step_done(self, epoch: int, step: int, *, loss: Loss, lr: float, consumed: int) -> None:
        """Optimizer step ``step`` (from 1) of ``epoch`` has completed on this rank."""
        watchdog.progress(step=True)  # watchdog: a step completed, its allreduce included
        self.progress.step(epoch, step, self.steps, loss=loss, lr=lr, consumed=consumed)

    def end_epoch(self, epoch: int, *, train_sums: Sequence[float], seconds: float, lr: float,
                  evaluate: Callable[[], Sequence[float]], problem: Callable[[], str | None],
                  save: Callable[[int], None]) -> EpochRecord:
        """On every rank: the exact train loss (this rank's (loss sum, images) summed over ranks),
        the evaluation (which ends every rank if any met a data ``problem``), the record, and
        rank 0's checkpoint ``save``."""
        loss_sum, images = self.world.sum(train_sums, "train_loss")
        test = exact_test_metrics(self.world, evaluate(), problem(), epoch)
        rec = EpochRecord.of(epoch, loss_sum=loss_sum, images=images, test=test, lr=lr,
                             seconds=seconds)
        self.train_seconds += seconds
        self.images_seen += images
        self.summary.epochs.append(rec)
        self.progress.epoch(rec)
        checkpoint.save_if_due(self.args, self.world.rank, epoch, save)
        return rec

    def finish(self, evaluate: Callable[[], Sequence[float]], params: Iterable[np.ndarray]) -> Summary:
        """The last epoch's test metrics (evaluated now if this run trained no epoch: resumed at or
        past the last one), the checksums, the summary."""
        last = self.summary.epochs[-1] if self.summary.epochs else None
        test = (last.test_loss, last.test_accuracy) if last else exact_test_metrics(self.world,
                                                                                      evaluate())
        return summaries.finish(self.world, self.progress, self.args, self.summary, test=test,
                                train_seconds=self.train_seconds, images_seen=self.images_seen,
                                params=params)
