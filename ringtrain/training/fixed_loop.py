"""A fixed-size job's loop and bookkeeping, the same for both frameworks: the banner, the shard
and the LR of every step, the divergence stop, each epoch's exact metrics, record and
checkpoint, and the end.

:meth:`FixedLoop.train` runs the epochs through the run object's :meth:`~FrameworkRun.fit`: the
library's own loop (:meth:`FixedLoop.step_epochs`, which calls the run's ``step``), or the
framework's (Keras' ``model.fit``), which reports each optimizer step to :meth:`FixedLoop.before_step`
and :meth:`FixedLoop.after_step` and each epoch to :meth:`FixedLoop.end_epoch`.  Either way every
rank makes the same calls in the same order: that is what keeps the collectives here matched.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import numpy as np

from ringtrain.data.sharding import optimizer_steps, shard_indices
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at
from ringtrain.output import checkpoint
from ringtrain.output.progress import Loss, Progress
from ringtrain.output.summary import EpochRecord, Summary
from ringtrain.training import divergence, summaries
from ringtrain.training.evaluation import exact_test_metrics
from ringtrain.training.run import FrameworkRun, StepTag


class FixedLoop:
    def __init__(self, args: argparse.Namespace, run: FrameworkRun, *, start_epoch: int,
                 progress: Progress | None = None) -> None:
        self.args, self.run, self.world = args, run, run.world
        self.start_epoch = start_epoch
        ident = run.identity
        self.n_train = ident.data.train_size
        k = args.backward_passes_per_step
        self.steps = optimizer_steps(self.n_train, run.shard_size, args.batch_size, k, args.max_steps)
        self.target_lr = run.target_lr
        self.progress = progress or Progress(args, self.world.rank, self.n_train)
        global_batch = args.batch_size * run.shard_size * k
        self.summary = summaries.new_summary(
            args, self.world, ident, world_size=self.world.size, batch_size_per_rank=args.batch_size,
            global_batch_size=global_batch, base_lr=args.base_lr, effective_lr=self.target_lr,
            lr_scaling="none (adasum)" if args.adasum else args.lr_scaling,
            resumed_from_epoch=start_epoch or None)
        self.train_seconds = self.images_seen = 0.0
        note = run.strategy_note()
        self.progress.info(f"{ident.versions_line()} ({self.world.controller}): {self.world.size} "
                           f"rank(s), {ident.model_name} {ident.param_count:,} params, lr "
                           f"{args.base_lr:g} -> {self.target_lr:g}, {self.steps} steps/epoch of "
                           f"{global_batch} images" + (f"; {note}" if note else ""))
        for line in run.describe():
            self.progress.info(line)

    # --- the run ----------------------------------------------------------------------------------

    def train(self) -> Summary:
        """Every epoch after ``start_epoch``, then the end (also when there is none left to train:
        resumed at or past the last epoch)."""
        if self.start_epoch < self.args.epochs:
            self.run.fit(self)
        return self.finish()

    def epochs(self) -> range:
        return range(self.start_epoch + 1, self.args.epochs + 1)

    def index_batches(self, epoch: int, shard: int | None = None) -> list[np.ndarray]:
        """This rank's index arrays of ``epoch`` (shard ``shard``'s, when given), one per
        optimizer step: K x batch-size indices each, the last possibly short but every
        micro-batch non-empty (``steps`` x K is at most the shard's batch count)."""
        a, run = self.args, self.run
        shard = run.shard_rank if shard is None else shard
        # Horovod: shard: rank r takes every N-th sample of the epoch's order, the same on all ranks.
        idx = shard_indices(self.n_train, shard, run.shard_size, a.seed, epoch,
                            shuffle=not a.no_shuffle)
        rows = a.batch_size * a.backward_passes_per_step
        return [idx[s * rows:(s + 1) * rows] for s in range(self.steps)]

    def step_epochs(self) -> None:
        """The library's loop: every epoch's steps through the run's :meth:`~FrameworkRun.step`."""
        run = self.run
        for epoch in self.epochs():
            t0 = time.perf_counter()
            batches = run.batches(self.index_batches(epoch))
            images, lr = 0, self.lr(epoch, 0)
            for step in range(self.steps):
                lr = self.before_step(epoch, step)
                loss, used = run.step(next(batches), lr)
                images += used
                self.after_step(epoch, step + 1, loss=loss, lr=lr, consumed=images * run.shard_size)
            self.stop_if(run.flush_diverged())  # the epoch's last step, before a checkpoint holds it
            self.end_epoch(epoch, train_sums=run.train_sums(images),
                           seconds=time.perf_counter() - t0, lr=lr)

    # --- per step ---------------------------------------------------------------------------------

    def lr(self, epoch: int, step: int) -> float:
        """The LR rule (:func:`ringtrain.lr.lr_at`) for step ``step`` (from 0) of ``epoch`` (from
        1)."""
        a = self.args
        return lr_at(epoch - 1 + step / self.steps, a.base_lr, self.target_lr, a.warmup_epochs,
                     a.epochs, a.lr_decay)

    def before_step(self, epoch: int, step: int) -> float:
        """The LR to set before optimizer step ``step`` (from 0) of ``epoch``."""
        return self.lr(epoch, step)

    def after_step(self, epoch: int, step: int, *, loss: Loss, lr: float, consumed: int) -> None:
        """Optimizer step ``step`` (from 1) of ``epoch`` has completed on this rank: stop every
        rank if the weights are no longer finite, then the watchdog's clock and rank 0's bar."""
        self.stop_if(self.run.diverged((epoch, step, loss)))
        watchdog.progress(step=True)  # watchdog: a step completed, its allreduce included
        self.progress.step(epoch, step, self.steps, loss=loss, lr=lr, consumed=consumed)

    def stop_if(self, diverged: StepTag | None) -> None:
        """Identical on every rank: all stop at the same step (on a GPU, one step later)."""
        divergence.stop_if(diverged, self.world.gather, self.run.problem)

    # --- per epoch, and the end --------------------------------------------------------------------

    def end_epoch(self, epoch: int, *, train_sums: Sequence[float], seconds: float,
                  lr: float) -> EpochRecord:
        """On every rank: BatchNorm's statistics averaged, the exact train loss (this rank's
        (loss sum, images) summed over ranks), the evaluation (which ends every rank if any met a
        data problem), the record, and rank 0's checkpoint."""
        self.run.sync_buffers()  # the same on every rank from here, as evaluation and save need
        loss_sum, images = self.world.sum(train_sums, "train_loss")
        test = exact_test_metrics(self.world, self.run.eval_sums(), self.run.problem, epoch)
        rec = EpochRecord.of(epoch, loss_sum=loss_sum, images=images, test=test, lr=lr,
                             seconds=seconds)
        self.train_seconds += seconds
        self.images_seen += images
        self.summary.epochs.append(rec)
        self.progress.epoch(rec)
        checkpoint.save_if_due(self.args, self.run.writes_checkpoints, epoch, self.run.save)
        if self.run.tools is not None:
            self.run.tools.keep_log(self.world.rank)  # --autotune: rank 0's log, so far
        return rec

    def finish(self) -> Summary:
        """The last epoch's test metrics (evaluated now if this run trained no epoch), the
        checksums, the summary."""
        last = self.summary.epochs[-1] if self.summary.epochs else None
        test = ((last.test_loss, last.test_accuracy) if last
                else exact_test_metrics(self.world, self.run.eval_sums()))
        if self.run.tools is not None:  # --autotune: what Horovod chose, said and kept by rank 0
            self.summary.autotune = self.run.tools.finish(self.world.rank, self.progress.info)
        self.summary.set_fields(self.run.summary_fields())
        return summaries.finish(self.world, self.progress, self.args, self.summary, test=test,
                                train_seconds=self.train_seconds, images_seen=self.images_seen,
                                params=self.run.parameters())
