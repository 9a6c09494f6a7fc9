"""What an elastic job needs beyond a fixed-size one, independent of the framework.

Horovod's elastic mode (``horovodrun --min-np/--max-np --host-discovery-script``) restarts the
training function whenever workers leave or join.  The trainer must then know three things that a
fixed job gets for free: that it really runs under an elastic launcher, where in the epoch the job
is (one integer, see :func:`ringtrain.data.sharding.remaining_shard`), and the LR for the new world size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ringtrain.data import dataset
from ringtrain.data.sharding import remaining_shard, steps_per_epoch
from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at, scaled_lr
from ringtrain.output.summary import EpochRecord
from ringtrain.training import divergence

LAUNCH_HINT = ("horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script "
               "launch/discover_hosts.sh python -m launch.torch_mnist --elastic")


def launched_elastic() -> bool:
    """horovodrun's elastic driver marks every worker it starts (``HOROVOD_ELASTIC=1``)."""
    return os.environ.get("HOROVOD_ELASTIC") == "1"


def check_launcher(elastic_flag: bool) -> None:
    """Refuse a mismatch between the trainer's mode and the launcher's, before ``hvd.init()``.

    Without ``--elastic`` under an elastic launcher, a lost worker would kill the job instead of
    shrinking it; with ``--elastic`` under a fixed launcher there is no driver to rejoin.
    """
    if elastic_flag and not launched_elastic():
        raise UserError(f"--elastic needs horovodrun's elastic mode, e.g. {LAUNCH_HINT}")
    if launched_elastic() and not elastic_flag:
        raise UserError("horovodrun started this job in elastic mode (--min-np/--max-np/"
                        "--host-discovery-script); add --elastic to the trainer's flags")


def local_data(args) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, test images, test labels), uint8 images, read by this worker
    alone: a broadcast here would be a collective outside the elastic loop, which a worker
    joining mid-run would never be matched with.  Sharding happens later, per world."""
    data = dataset.get().load(args.data_dir)
    n_train = args.train_samples or len(data.train_labels)
    n_test = min(args.test_samples or len(data.test_labels), len(data.test_labels))
    return (data.train_images[:n_train], data.train_labels[:n_train],
            data.test_images[:n_test], data.test_labels[:n_test])


def epoch_steps(num_samples: int, world_size: int, batch_size: int, backward_passes: int,
                max_steps: int | None = None) -> int:
    """Optimizer steps per rank over ``num_samples`` samples: the fixed trainers' rule
    (:func:`ringtrain.data.sharding.optimizer_steps`: batches, the last one possibly partial, grouped by
    ``backward_passes``, trailing batches that fill no group dropped), without its refusal of too
    little data, which mid-epoch only means that no step is left."""
    steps = steps_per_epoch(num_samples, world_size, batch_size) // backward_passes
    return min(steps, max_steps) if max_steps else steps


def epoch_progress(epoch: int, consumed: int, num_samples: int, world_size: int, batch_size: int,
                   backward_passes: int, max_steps: int | None = None) -> float:
    """Fractional epochs done: the LR schedule's clock.

    The fixed trainers run ``epoch - 1 + step / steps``; after s steps in a world of N ranks the
    elastic job has consumed ``s * batch * K * N`` samples, so ``consumed / (batch * K * N *
    steps)`` is the same clock, to the bit (both are correctly rounded quotients of the same
    rational), also when a partial last batch makes ``steps`` batches hold fewer samples than
    that.  After a resize the clock runs on for the new world from the same ``consumed``.
    """
    steps = epoch_steps(num_samples, world_size, batch_size, backward_passes, max_steps)
    per_step = batch_size * backward_passes * world_size
    return epoch - 1 + min(consumed / (per_step * max(steps, 1)), 1.0)


# --- the loop both frameworks run inside hvd.elastic.run ---------------------------------------

def initial_state(start_epoch: int = 0) -> dict[str, Any]:
    """The plain-Python part of an elastic job's committed state (the framework's State object
    adds model and optimizer).  ``consumed`` is the job's position in the epoch order."""
    return {"epoch": start_epoch + 1, "consumed": 0, "epoch_steps": 0, "loss_sum": [0.0, 0.0],
            "epoch_started": time.time(), "train_seconds": 0.0, "images_seen": 0.0,
            "records": [], "resizes": []}


@dataclass
class Glue:
    """What the shared loop needs from a framework, for the current world."""

    rank: int
    size: int
    step: Callable[[np.ndarray, float], tuple[float, int]]  # (this rank's indices, lr) -> (loss sum, n)
    eval_sums: Callable[[], list[float]]  # this rank's test (loss sum, correct, count)
    save_checkpoint: Callable[[int], None]  # rank 0, after each epoch (a no-op without a folder)
    weights_finite: Callable[[], bool]  # every parameter a finite number (identical on all ranks)


def run_epochs(state, args, n_train: int, glue: Glue, job) -> tuple[float, float]:
    """Train from ``state``'s position to the last epoch; return the final (test loss, accuracy).

    Called again after every membership change, with ``state`` restored to its last commit and
    synced from rank 0: everything that depends on the world size is derived here, from
    ``glue.size``, never carried over.  ``job`` is this world's :class:`ringtrain.training.job.Job`: steps,
    sums, evaluation and the epoch's report go through it, as in a fixed-size run.
    """
    k, batch = args.backward_passes_per_step, args.batch_size
    job.n_train = n_train
    watchdog.new_world(glue.rank, glue.size)  # the job re-formed: progress, with a new rank
    target_lr = scaled_lr(args.base_lr, glue.size, args.lr_scaling)
    if not state.resizes or state.resizes[-1]["world_size"] != glue.size:
        state.resizes.append({"epoch": state.epoch, "consumed": state.consumed,
                              "world_size": glue.size, "target_lr": target_lr})
        job.info(f"elastic: {glue.size} worker(s) from epoch {state.epoch}, sample "
                 f"{state.consumed}/{n_train}: lr {args.base_lr:g} -> {target_lr:g}, "
                 f"global batch {batch * glue.size * k}")
    result = None
    while state.epoch <= args.epochs:
        epoch = state.epoch
        shard = remaining_shard(n_train, state.consumed, glue.rank, glue.size, args.seed, epoch,
                                shuffle=not args.no_shuffle)
        steps = epoch_steps(len(shard), 1, batch, k)  # the fixed trainers' count, for the rest
        if args.max_steps:
            steps = max(0, min(steps, args.max_steps - state.epoch_steps))
        done_before, pending, lr = state.epoch_steps, [0.0, 0.0], target_lr
        for step in range(steps):
            lr = lr_at(epoch_progress(epoch, state.consumed, n_train, glue.size, batch, k,
                                      args.max_steps),
                       args.base_lr, target_lr, args.warmup_epochs, args.epochs, args.lr_decay)
            loss_sum, used = glue.step(shard[step * batch * k:][:batch * k], lr)
            if not glue.weights_finite():  # identical on every rank: all stop here
                raise divergence.stop(job.gather, epoch, state.epoch_steps + 1,
                                      lambda s=loss_sum, n=used: s / max(n, 1))
            pending = [pending[0] + loss_sum, pending[1] + used]
            state.consumed += used * glue.size  # a strided prefix per rank is a prefix of the order
            state.epoch_steps += 1
            job.step_done(epoch, state.epoch_steps, done_before + steps,
                          loss=loss_sum / max(used, 1), lr=lr, consumed=state.consumed)
            if (step + 1) % args.commit_every == 0 and step + 1 < steps:
                pending = _fold(state, pending, job)
                state.commit()
        _fold(state, pending, job)
        test_loss, test_acc = job.evaluate(glue.eval_sums)
        seconds = time.time() - state.epoch_started
        rec = EpochRecord(epoch=epoch, train_loss=state.loss_sum[0] / max(state.loss_sum[1], 1),
                          test_loss=test_loss, test_accuracy=test_acc, lr=lr, seconds=seconds,
                          images_per_second=state.loss_sum[1] / seconds)
        job.epoch_done(rec)
        if glue.rank == 0:
            glue.save_checkpoint(epoch)
        state.records.append(asdict(rec))
        state.train_seconds += seconds
        state.images_seen += state.loss_sum[1]
        state.epoch, state.consumed, state.epoch_steps = epoch + 1, 0, 0
        state.loss_sum, state.epoch_started = [0.0, 0.0], time.time()
        state.commit()
        result = (test_loss, test_acc)
    if result is None:
        last = state.records[-1] if state.records else None
        result = (last["test_loss"], last["test_accuracy"]) if last else job.evaluate(glue.eval_sums)
    return result


def summary_fields(state, args, glue: Glue) -> dict[str, Any]:
    """The elastic parts of the run's :class:`ringtrain.output.summary.Summary`."""
    k = args.backward_passes_per_step
    return {"world_size": glue.size, "batch_size_per_rank": args.batch_size,
            "global_batch_size": args.batch_size * glue.size * k, "base_lr": args.base_lr,
            "effective_lr": scaled_lr(args.base_lr, glue.size, args.lr_scaling),
            "lr_scaling": args.lr_scaling, "epochs": [EpochRecord(**r) for r in state.records],
            "elastic_resizes": list(state.resizes)}


def _fold(state, pending: list[float], job) -> list[float]:
    """Add every rank's loss since the last commit to the committed epoch total (a collective, so
    the epoch's train loss survives ranks that leave); return the emptied pending sums."""
    total = job.sum(pending, "elastic_sums")
    state.loss_sum = [state.loss_sum[0] + total[0], state.loss_sum[1] + total[1]]
    return [0.0, 0.0]
