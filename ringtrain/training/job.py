"""The trainer skeleton both frameworks share: everything around the Horovod lines.

A trainer (``torch_models/train.py``, ``tf_models/train.py`` and their elastic twins) does the
framework's part: ``hvd.init()``, pinning, building the model, wrapping the optimizer, the
broadcast and the train step.  A :class:`Job` does the rest, the same way for both: start-up checks,
loading the data, the resume broadcast, the banner and the :class:`~ringtrain.output.summary.Summary`, exact
epoch metrics, the epoch line, TensorBoard, checkpoints on rank 0, and the end of the run.

Two places mark progress, for anything that needs to know the job is moving:

* :meth:`Job.step_done`: every optimizer step of every loop (fixed and elastic, both frameworks)
  ends there, on every rank, after its gradient allreduce has completed;
* :meth:`Job._collective`: every collective the skeleton issues (the data verdict, the resume
  broadcast, loss and metric sums, the final checksum gather) passes through it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringtrain import flags, model_spec
from ringtrain.data import dataset
from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at
from ringtrain.output import checkpoint
from ringtrain.output.summary import EpochRecord, Reporter, Summary, param_checksum
from ringtrain.output.tensorboard import EPOCH_TAGS, STEP_LOSS, STEP_LR, EventWriter
from ringtrain.runtime import controller
from ringtrain.training import elastic

EVAL_BATCH = 1000  # test images per forward pass when evaluating, in both frameworks

Loss = float | Callable[[], float]  # a number, or a callable read only when the value is shown


@dataclass(frozen=True)
class Collectives:
    """The three collectives the skeleton issues, from the framework's Horovod module."""

    sum: Callable[[Sequence[float], str], Sequence[float]]  # float64 Sum allreduce (values, name)
    broadcast_object: Callable[..., Any]  # hvd.broadcast_object(obj, root_rank=0, name=...)
    allgather_object: Callable[..., Any]  # hvd.allgather_object(obj, name=...)


class Job:
    """One run (or, in an elastic job, one world) of a trainer, as seen from rank ``hvd.rank()``.

    Create it right after ``hvd.init()`` (and the framework's device set-up): it checks what needs
    the world size (:func:`ringtrain.flags.validate_world`, unless ``elastic``) on every rank before
    any collective, so an impossible setting ends every rank with the same line.
    """

    def __init__(self, args: argparse.Namespace, *, framework: str, versions: dict[str, str],
                 hvd, collectives: Collectives, use_gpu: bool, elastic: bool = False) -> None:
        self.args, self.framework, self.versions = args, framework, versions
        self.rank, self.size = hvd.rank(), hvd.size()
        self.controller = controller(hvd)
        self.comm = collectives
        self.dataset = dataset.get()
        self.model_name = model_spec.model_name(args.model, self.dataset.name)
        if not elastic:
            flags.validate_world(args, self.size)
        if args.amp and not use_gpu:
            raise UserError("--amp needs a CUDA GPU; drop the flag on CPU machines")
        self.report = Reporter(self.rank == 0, progress=not args.no_progress)
        self.board = EventWriter(args.tensorboard) if args.tensorboard and self.rank == 0 else None
        self.n_train = 0  # training samples per epoch, known once the data is loaded
        self.summary: Summary | None = None
        self.train_seconds = self.images_seen = 0.0

    # --- collectives -------------------------------------------------------------------------

    def _collective(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Issue one of the skeleton's collectives; it has completed on this rank on return."""
        result = fn(*args, **kwargs)
        watchdog.progress()  # watchdog: a collective completed
        return result

    def sum(self, values: Sequence[float], name: str) -> list[float]:
        """Element-wise float64 sum over all ranks."""
        return [float(v) for v in self._collective(self.comm.sum, values, name)]

    def broadcast(self, obj: Any, name: str) -> Any:
        return self._collective(self.comm.broadcast_object, obj, root_rank=0, name=name)

    def gather(self, obj: Any, name: str) -> list[Any]:
        return self._collective(self.comm.allgather_object, obj, name=name)

    # --- start-up ----------------------------------------------------------------------------

    def check_folders(self, param_count: int) -> None:
        """Rank 0 proves it can write where it will write (creates the folders), with room for one
        checkpoint of a model of ``param_count`` parameters; ``--resume`` needs its folder."""
        args = self.args
        if self.rank == 0:
            if args.checkpoint_dir:
                if args.resume:
                    checkpoint.check_resume_folder(args.checkpoint_dir)
                checkpoint.ensure_writable(args.checkpoint_dir, need_bytes=checkpoint.estimated_bytes(
                    param_count, args.momentum))
            if args.tensorboard:
                checkpoint.ensure_writable(args.tensorboard, "--tensorboard")

    def load_data(self, param_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """This rank's (train images, train labels, test images, test labels), uint8 images.

        Rank 0 alone checks its output folders and may download; every rank learns its verdict
        (a broadcast with a fixed name), so a problem ends all ranks with rank 0's line instead of
        leaving the others waiting in the next collective.
        """
        data, problem = None, None
        if self.rank == 0:
            try:
                self.check_folders(param_count)
                data = self.dataset.load(self.args.data_dir, download=True)
            except UserError as err:
                problem = str(err)
        problem = self.broadcast(problem, "data_problem")
        if problem is not None:
            raise UserError(problem)
        if data is None:
            data = self.dataset.load(self.args.data_dir, download=False)
        view = dataset.rank_view(data, self.args.train_samples, self.args.test_samples,
                                 self.rank, self.size)
        self.n_train = len(view[1])
        return view

    def resume(self, load: Callable[[], int]) -> int:
        """The epoch to continue after: rank 0 runs ``load`` (restore the newest checkpoint into
        the model and optimizer, return its epoch, 0 if none) under ``--resume``; every rank learns
        the epoch, or the one line that says why rank 0 could not resume.  The trainer then
        broadcasts rank 0's weights and optimizer state, resumed or fresh."""
        epoch, problem = 0, None
        if self.args.resume and self.rank == 0:
            try:
                epoch = load()
            except UserError as err:
                problem = str(err)
        epoch, problem = self.broadcast((epoch, problem), "resume")
        if problem is not None:
            raise UserError(problem)
        if self.args.resume and epoch == 0:
            self.info(f"resume: no checkpoint in {self.args.checkpoint_dir} yet; starting from epoch 1")
        return epoch

    def new_summary(self, param_count: int, **fields: Any) -> Summary:
        return Summary(framework=self.framework, versions=self.versions,
                       controller=self.controller, param_count=param_count,
                       model=self.args.model, dataset=self.dataset.name, **fields)

    def begin(self, *, param_count: int, target_lr: float, steps: int, start_epoch: int) -> None:
        """The fixed-size run's summary, and its banner line."""
        args, k = self.args, self.args.backward_passes_per_step
        global_batch = args.batch_size * self.size * k
        self.summary = self.new_summary(
            param_count, world_size=self.size, batch_size_per_rank=args.batch_size,
            global_batch_size=global_batch, base_lr=args.base_lr, effective_lr=target_lr,
            lr_scaling="none (adasum)" if args.adasum else args.lr_scaling,
            resumed_from_epoch=start_epoch or None)
        self.info(f"{' + '.join(f'{k} {v}' for k, v in self.versions.items())} ({self.controller}):"
                  f" {self.size} rank(s), {self.model_name} {param_count:,} params, lr "
                  f"{args.base_lr:g} -> {target_lr:g}, {steps} steps/epoch of {global_batch} images")

    def info(self, message: str) -> None:
        self.report.info(message)

    # --- training ----------------------------------------------------------------------------

    def lr(self, epoch: int, step: int, steps: int, target_lr: float) -> float:
        """The LR rule (:func:`ringtrain.lr.lr_at`) for step ``step`` (from 0) of ``steps`` in
        ``epoch`` (from 1): the one implementation both fixed trainers apply per step."""
        a = self.args
        return lr_at(epoch - 1 + step / steps, a.base_lr, target_lr, a.warmup_epochs, a.epochs,
                     a.lr_decay)

    def step_done(self, epoch: int, step: int, steps: int, *, loss: Loss, lr: float,
                  consumed: int) -> None:
        """Optimizer step ``step`` (from 1) of ``steps`` in ``epoch`` has completed on this rank,
        gradient allreduce included.  ``loss`` is this rank's mean loss over the step's batch,
        ``consumed`` the samples of this epoch that all ranks together have trained on so far."""
        watchdog.progress(step=True)  # watchdog: a step completed, its allreduce included
        self.report.step(epoch, self.args.epochs, step, steps, loss)
        if self.board is not None and self.args.tensorboard_steps:
            value = loss() if callable(loss) else loss
            self.board.scalars((epoch - 1) * self.n_train + consumed,
                               {STEP_LOSS: value, STEP_LR: lr})

    def evaluate(self, local_sums: Callable[[], Sequence[float]]) -> tuple[float, float]:
        """Exact global (test loss, accuracy) from each rank's (loss sum, correct, count)."""
        loss, correct, count = self.sum(local_sums(), "eval_totals")
        return loss / count, correct / count

    def end_epoch(self, epoch: int, *, train_sums: Sequence[float], seconds: float, lr: float,
                  evaluate: Callable[[], Sequence[float]], save: Callable[[int], None]) -> EpochRecord:
        """A fixed-size run's epoch end, on every rank: exact train loss (this rank's (loss sum,
        images) summed over ranks), evaluation, the record, and rank 0's checkpoint ``save``."""
        loss_total, images = self.sum(train_sums, "train_loss")
        test_loss, test_acc = self.evaluate(evaluate)
        rec = EpochRecord(epoch=epoch, train_loss=loss_total / images, test_loss=test_loss,
                          test_accuracy=test_acc, lr=lr, seconds=seconds,
                          images_per_second=images / seconds)
        self.train_seconds += seconds
        self.images_seen += images
        self.summary.epochs.append(rec)
        self.epoch_done(rec)
        if self.args.checkpoint_dir and self.rank == 0:
            save(epoch)
        return rec

    def epoch_done(self, rec: EpochRecord) -> None:
        """The epoch line and the epoch's TensorBoard scalars (rank 0)."""
        self.report.epoch(rec, self.args.epochs)
        if self.board is not None:
            self.board.scalars(rec.epoch, {tag: getattr(rec, key) for key, tag in EPOCH_TAGS.items()})
            self.board.flush()

    # --- the end -----------------------------------------------------------------------------

    def elastic_world(self, state, *, n_train: int, step, eval_sums: Callable[[], Sequence[float]],
                      save: Callable[[int], None], param_count: int,
                      params: Callable[[], Iterable[np.ndarray]],
                      weights_finite: Callable[[], bool]) -> Summary:
        """One world of an elastic job, from ``state``'s committed position to the end: the shared
        loop (:func:`ringtrain.training.elastic.run_epochs`) with the framework's ``step`` (this rank's
        indices, LR -> its loss sum and count), ``eval_sums`` and rank 0's checkpoint ``save``."""
        glue = elastic.Glue(rank=self.rank, size=self.size, step=step, eval_sums=eval_sums,
                            save_checkpoint=lambda epoch: self.args.checkpoint_dir and save(epoch),
                            weights_finite=weights_finite)
        test_loss, test_acc = elastic.run_epochs(state, self.args, n_train, glue, self)
        summary = self.new_summary(param_count, **elastic.summary_fields(state, self.args, glue))
        return self.finish(summary, test_loss=test_loss, test_acc=test_acc,
                           train_seconds=state.train_seconds, images_seen=state.images_seen,
                           params=params())

    def final_metrics(self, evaluate: Callable[[], Sequence[float]]) -> tuple[float, float]:
        """The last epoch's test metrics; evaluated now if this run trained no epoch (resumed at
        or past the last one)."""
        if self.summary.epochs:
            return self.summary.epochs[-1].test_loss, self.summary.epochs[-1].test_accuracy
        return self.evaluate(evaluate)

    def finish(self, summary: Summary, *, test_loss: float, test_acc: float, train_seconds: float,
               images_seen: float, params: Iterable[np.ndarray]) -> Summary:
        """Close the run on every rank: gather each rank's parameter checksum (a collective, so
        all ranks call this), then rank 0 writes the summary and prints the final line."""
        summary.final_test_loss, summary.final_test_accuracy = test_loss, test_acc
        summary.total_seconds = train_seconds
        summary.images_per_second = images_seen / train_seconds if train_seconds else 0.0
        summary.param_checksums = self.gather(param_checksum(params), "checksums")
        self.report.write_summary(self.args.metrics_out, summary)
        if self.board is not None:
            self.board.close()
        self.info(f"final test accuracy {100 * test_acc:.2f}% ({summary.images_per_second:.0f} "
                  f"img/s over {train_seconds:.1f}s of training)")
        return summary

    def finish_fixed(self, evaluate: Callable[[], Sequence[float]],
                     params: Iterable[np.ndarray]) -> Summary:
        test_loss, test_acc = self.final_metrics(evaluate)
        return self.finish(self.summary, test_loss=test_loss, test_acc=test_acc,
                           train_seconds=self.train_seconds, images_seen=self.images_seen,
                           params=params)

