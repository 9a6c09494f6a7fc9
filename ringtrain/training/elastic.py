"""What an elastic job needs beyond a fixed-size one, independent of the framework.

Horovod's elastic mode (``horovodrun --min-np/--max-np --host-discovery-script``) restarts the
training function whenever workers leave or join.  The trainer must then know three things that a
fixed job gets for free: that it really runs under an elastic launcher, where in the epoch the job
is (one integer, see :func:`ringtrain.data.sharding.remaining_shard`), and the LR for the new world
size.  The loop itself (:func:`train_world`) is shared by both frameworks; each hands in its run
object (:class:`ringtrain.training.run.FrameworkRun`).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

from ringtrain.data.sharding import optimizer_steps, remaining_shard
from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at, scaled_lr
from ringtrain.output import checkpoint
from ringtrain.output.progress import Progress
from ringtrain.output.summary import EpochRecord, Summary
from ringtrain.training import divergence, summaries
from ringtrain.training.evaluation import exact_test_metrics
from ringtrain.training.run import FrameworkRun

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


def epoch_progress(epoch: int, consumed: int, num_samples: int, world_size: int, batch_size: int,
                   backward_passes: int, max_steps: int | None = None) -> float:
    """Fractional epochs done: the LR schedule's clock.

    The fixed trainers run ``epoch - 1 + step / steps``; after s steps in a world of N ranks the
    elastic job has consumed ``s * batch * K * N`` samples, so ``consumed / (batch * K * N *
    steps)`` is the same clock, to the bit (both are correctly rounded quotients of the same
    rational), also when a partial last batch makes ``steps`` batches hold fewer samples than
    that.  After a resize the clock runs on for the new world from the same ``consumed``.
    """
    steps = optimizer_steps(num_samples, world_size, batch_size, backward_passes, max_steps,
                            strict=False)
    per_step = batch_size * backward_passes * world_size
    return epoch - 1 + min(consumed / (per_step * max(steps, 1)), 1.0)


# --- the loop both frameworks run in every world of the job ---------------------------------------

def initial_state(start_epoch: int = 0) -> dict[str, Any]:
    """The plain-Python part of an elastic job's committed state (the framework's State object
    adds model and optimizer).  ``consumed`` is the job's position in the epoch order."""
    return {"epoch": start_epoch + 1, "consumed": 0, "epoch_steps": 0, "loss_sum": [0.0, 0.0],
            "epoch_started": time.time(), "train_seconds": 0.0, "images_seen": 0.0,
            "records": [], "resizes": []}


def train_world(state, run: FrameworkRun) -> Summary:
    """One world of an elastic job, from ``state``'s committed position to the end of the run.

    Called again after every membership change, with ``state`` restored to its last commit and
    synced from rank 0, and ``run.world`` the new world: everything that depends on the world
    size is derived here, from it, never carried over.
    """
    args, world, data = run.args, run.world, run.identity.data
    progress = Progress(args, world.rank, data.train_size)
    test = run_epochs(state, run, progress)
    summary = summaries.new_summary(args, world, run.identity,
                                    **summary_fields(state, args, world.size))
    return summaries.finish(world, progress, args, summary, test=test,
                            train_seconds=state.train_seconds, images_seen=state.images_seen,
                            params=run.parameters())


def run_epochs(state, run: FrameworkRun, progress: Progress) -> tuple[float, float]:
    """Train from ``state``'s position to the last epoch; return the final (test loss, accuracy)."""
    args, world, n_train = run.args, run.world, run.identity.data.train_size
    k, batch = args.backward_passes_per_step, args.batch_size
    watchdog.new_world(world.rank, world.size)  # the job re-formed: progress, with a new rank
    target_lr = scaled_lr(args.base_lr, world.size, args.lr_scaling)
    if not state.resizes:  # the job's first world: what the fixed job's banner adds (the update)
        for line in run.describe():
            progress.info(line)
    if not state.resizes or state.resizes[-1]["world_size"] != world.size:
        state.resizes.append({"epoch": state.epoch, "consumed": state.consumed,
                              "world_size": world.size, "target_lr": target_lr})
        progress.info(f"elastic: {world.size} worker(s) from epoch {state.epoch}, sample "
                      f"{state.consumed}/{n_train}: lr {args.base_lr:g} -> {target_lr:g}, "
                      f"global batch {batch * world.size * k}")
    run.take_loss_sum()  # what steps rolled back by a re-form added is not the committed state's
    result = None
    while state.epoch <= args.epochs:
        epoch = state.epoch
        # Horovod: shard: the rest of the epoch's order, strided over the ranks of this world.
        shard = remaining_shard(n_train, state.consumed, world.rank, world.size, args.seed, epoch,
                                shuffle=not args.no_shuffle)
        steps = optimizer_steps(len(shard), 1, batch, k, strict=False)  # the fixed count, for the rest
        if args.max_steps:
            steps = max(0, min(steps, args.max_steps - state.epoch_steps))
        done_before, pending, lr = state.epoch_steps, 0, target_lr
        batches = run.batches([shard[s * batch * k:][:batch * k] for s in range(steps)])
        for step in range(steps):
            lr = lr_at(epoch_progress(epoch, state.consumed, n_train, world.size, batch, k,
                                      args.max_steps),
                       args.base_lr, target_lr, args.warmup_epochs, args.epochs, args.lr_decay)
            loss, used = run.step(next(batches), lr)
            divergence.stop_if(run.diverged((epoch, state.epoch_steps + 1, loss)), world.gather,
                              run.problem)
            pending += used
            state.consumed += used * world.size  # a strided prefix per rank is a prefix of the order
            state.epoch_steps += 1
            watchdog.progress(step=True)  # watchdog: a step completed, its allreduce included
            progress.step(epoch, state.epoch_steps, done_before + steps, loss=loss, lr=lr,
                          consumed=state.consumed)
            if (step + 1) % args.commit_every == 0 and step + 1 < steps:
                pending = _fold(state, run, pending)
                state.commit()
        divergence.stop_if(run.flush_diverged(), world.gather, run.problem)
        _fold(state, run, pending)
        run.sync_buffers()
        test = exact_test_metrics(world, run.eval_sums(), run.problem, epoch)
        close_epoch(state, run, progress, epoch, lr, test, saves=world.rank == 0)
        result = test
    if result is None:
        last = state.records[-1] if state.records else None
        result = ((last["test_loss"], last["test_accuracy"]) if last
                  else exact_test_metrics(world, run.eval_sums()))
    return result


def close_epoch(state, run, progress: Progress, epoch: int, lr: float, test: tuple[float, float],
                *, saves: bool) -> None:
    """The end of an epoch of an elastic job (the ring's and the elastic pipeline's): its record
    printed and kept, the checkpoint written where due (by the rank that ``saves``), the state
    moved to the next epoch and committed."""
    rec = EpochRecord.of(epoch, loss_sum=state.loss_sum[0], images=state.loss_sum[1], test=test,
                         lr=lr, seconds=time.time() - state.epoch_started)
    progress.epoch(rec)
    checkpoint.save_if_due(run.args, saves, epoch, run.save)
    state.records.append(asdict(rec))
    state.train_seconds += rec.seconds
    state.images_seen += state.loss_sum[1]
    state.epoch, state.consumed, state.epoch_steps = epoch + 1, 0, 0
    state.loss_sum, state.epoch_started = [0.0, 0.0], time.time()
    state.commit()


def summary_fields(state, args, world_size: int) -> dict[str, Any]:
    """The elastic parts of the run's :class:`ringtrain.output.summary.Summary`."""
    k = args.backward_passes_per_step
    return {"world_size": world_size, "batch_size_per_rank": args.batch_size,
            "global_batch_size": args.batch_size * world_size * k, "base_lr": args.base_lr,
            "effective_lr": scaled_lr(args.base_lr, world_size, args.lr_scaling),
            "lr_scaling": args.lr_scaling, "epochs": [EpochRecord(**r) for r in state.records],
            "elastic_resizes": list(state.resizes)}


def _fold(state, run: FrameworkRun, pending_images: int) -> int:
    """Add every rank's loss since the last commit to the committed epoch total (a collective, so
    the epoch's train loss survives ranks that leave); return the emptied pending count."""
    total = run.world.sum([run.take_loss_sum(), pending_images], "elastic_sums")
    state.loss_sum = [state.loss_sum[0] + total[0], state.loss_sum[1] + total[1]]
    return 0
