"""The elastic pipeline's loop (``--elastic --pipeline-stages S``), framework-free: one world of
an elastic job, from the committed position to the end of the run, on a run object of the
framework's (:class:`ElasticStages`; PyTorch's is
:class:`torch_models.pipeline_elastic.TorchElasticPipeline`).

The ring's elastic loop (:func:`ringtrain.training.elastic.run_epochs`) counts every rank as a
data-parallel worker; here the data-parallel width is R = W // S, the replicas: the shard of each
step, the LR (``scaled_lr`` by R), the global batch and the sample clock follow R, every stage of
a replica computes its replica's shard (the first stage reads the inputs, the last the labels),
and the epoch's train loss counts the last stages' losses only.  The steps are lockstep GPipe
(:mod:`ringtrain.strategies.pipeline.lockstep`), every rank in every collective, spares too.
After a re-form, :meth:`ElasticStages.reform` hands each stage from a rank that held it at the
last commit (the plain state from the lowest rank at that commit) before this loop runs again.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import numpy as np
from horovod.common.elastic import State

from ringtrain.data.sharding import optimizer_steps, remaining_shard
from ringtrain.errors import UserError
from ringtrain.faults import watchdog
from ringtrain.lr import lr_at, scaled_lr
from ringtrain.output.progress import Progress
from ringtrain.output.summary import Summary
from ringtrain.strategies.pipeline.lockstep import Layout
from ringtrain.training import summaries
from ringtrain.training.elastic import close_epoch, epoch_progress, initial_state, summary_fields
from ringtrain.training.evaluation import exact_test_metrics


class ElasticStages(Protocol):
    """What the loop asks of the framework's elastic pipeline run."""

    args: Any
    world: Any  # ringtrain.training.world.World of this world
    layout: Layout
    identity: Any
    n_train: int

    def batches(self, steps: list[np.ndarray]) -> Any:
        """An iterator of the framework's step data (first and last stages), else Nones."""

    def step(self, data: Any, rows: list[int], lr: float) -> tuple[float, bool]:
        """One lockstep step; (the step's summed loss on the replica's last stage, else 0;
        whether this stage's weights are finite)."""

    def eval_sums(self) -> list[float]: ...

    @property
    def problem(self) -> str | None:
        """The first data problem this rank met, or None (the one line every rank ends with)."""

    def sync_buffers(self) -> None: ...

    def save(self, epoch: int) -> None: ...

    def parameters(self) -> list[np.ndarray]: ...

    def describe(self) -> list[str]: ...

    def facts(self) -> dict[str, Any]: ...


PLAIN = tuple(initial_state())  # the plain attributes a commit keeps


class PipelineState(State):
    """Horovod's elastic state for the elastic pipeline: ``commits`` (made so far), the stage the
    rank held at its last commit and a copy of it, and the ring's plain attributes (epoch, sample
    position, records...).  ``sync`` does nothing: what a new world needs depends on its layout,
    and a world re-formed after a host was removed is not synced by Horovod at all (its
    ``HostsUpdatedInterrupt`` skips the sync); the run's ``reform`` runs at the
    start of every world instead."""

    def __init__(self, run, *, bcast_object, get_rank, start_epoch: int = 0) -> None:
        self.run = run
        self.commits = 0
        for key, value in initial_state(start_epoch).items():
            setattr(self, key, value)
        self._plain = self.plain()
        # Before the first commit every rank holds every stage as built (the same everywhere).
        self.held_stage: int | None = None
        self._copies = {s: run.snapshot(s) for s in range(run.stage_count)}
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def plain(self) -> dict[str, Any]:
        return copy.deepcopy({key: getattr(self, key) for key in PLAIN})

    def set_plain(self, values: dict[str, Any]) -> None:
        for key in PLAIN:
            setattr(self, key, copy.deepcopy(values[key]))

    def keep(self) -> None:
        """The rank's stage as it is now, as its committed copy."""
        s = self.run.layout.stage
        self.held_stage = s
        self._copies = {} if s is None else {s: self.run.snapshot(s)}

    def save(self) -> None:
        self._plain = self.plain()
        self.keep()
        self.commits += 1

    def restore(self) -> None:
        self.set_plain(self._plain)
        for s, copy_ in self._copies.items():
            self.run.load_snapshot(s, copy_)

    def sync(self) -> None:
        pass


def micro_rows(rows: int, size: int) -> list[int]:
    """A step's ``rows`` cut into micro-batches of ``size`` (the last one shorter)."""
    return [size] * (rows // size) + ([rows % size] if rows % size else [])


def train_world(state, run: ElasticStages) -> Summary:
    """One world of the job; returns the run's summary once the last epoch is done."""
    args, world = run.args, run.world
    progress = Progress(args, world.rank, run.n_train)
    test = run_epochs(state, run, progress)
    replicas = run.layout.replicas
    fields = summary_fields(state, args, replicas)  # the data-parallel width is R
    fields.update(world_size=world.size)
    summary = summaries.new_summary(args, world, run.identity, **fields,
                                    pipeline={**run.facts(), "replicas": replicas})
    return summaries.finish(world, progress, args, summary, test=test,
                            train_seconds=state.train_seconds, images_seen=state.images_seen,
                            params=run.parameters())


def run_epochs(state, run: ElasticStages, progress: Progress) -> tuple[float, float]:
    args, world, layout, n_train = run.args, run.world, run.layout, run.n_train
    k, batch = args.backward_passes_per_step, args.batch_size
    replicas = layout.replicas
    watchdog.new_world(world.rank, world.size)
    target_lr = scaled_lr(args.base_lr, replicas, args.lr_scaling)
    if not state.resizes:
        for line in run.describe():
            progress.info(line)
    if not state.resizes or state.resizes[-1]["world_size"] != world.size:
        state.resizes.append({"epoch": state.epoch, "consumed": state.consumed,
                              "world_size": world.size, "replicas": replicas,
                              "target_lr": target_lr})
        spares = world.size - replicas * layout.stages
        progress.info(f"elastic pipeline: {world.size} worker(s) = {layout.stages} stages x "
                      f"{replicas} replica(s)" + (f" + {spares} spare(s)" if spares else "")
                      + f" from epoch {state.epoch}, sample {state.consumed}/{n_train}: lr "
                      f"{args.base_lr:g} -> {target_lr:g}, global batch {batch * replicas * k}")
    result = None
    while state.epoch <= args.epochs:
        epoch = state.epoch
        # Horovod: shard by replica: every stage of replica r computes the same rows' indices (the
        # first stage reads their inputs, the last their labels); spares read nothing.
        shard = remaining_shard(n_train, state.consumed, layout.replica or 0, replicas, args.seed,
                                epoch, shuffle=not args.no_shuffle)
        steps = optimizer_steps(len(shard), 1, batch, k, strict=False)  # equal on every replica
        if args.max_steps:
            steps = max(0, min(steps, args.max_steps - state.epoch_steps))
        done_before, lr = state.epoch_steps, target_lr
        pending = [0.0, 0.0]  # this rank's (loss sum, images) since the last commit, last stage
        data = run.batches([shard[s * batch * k:][:batch * k] for s in range(steps)])
        for step in range(steps):
            lr = lr_at(epoch_progress(epoch, state.consumed, n_train, replicas, batch, k,
                                      args.max_steps),
                       args.base_lr, target_lr, args.warmup_epochs, args.epochs, args.lr_decay)
            used = len(shard[step * batch * k:][:batch * k])
            loss, finite = run.step(next(data), micro_rows(used, run.micro), lr)
            # every rank learns its replica's loss and whether any stage's weights stopped being
            # finite (slot 0), in one allreduce over every rank
            mine = np.zeros(1 + replicas)
            mine[0] = 0.0 if finite else 1.0
            if layout.last:
                mine[1 + layout.replica] = loss
                pending[0] += loss
                pending[1] += used
            total = world.sum(mine.tolist(), "pipeline.elastic.step")
            if total[0]:
                raise UserError(f"the elastic pipeline's weights stopped being finite numbers at "
                                f"epoch {epoch}, step {state.epoch_steps + 1}: lower --base-lr")
            state.consumed += used * replicas
            state.epoch_steps += 1
            watchdog.progress(step=True)
            progress.step(epoch, state.epoch_steps, done_before + steps,
                          loss=total[1 + (layout.replica or 0)] / max(used, 1), lr=lr,
                          consumed=state.consumed)
            if (step + 1) % args.commit_every == 0 and step + 1 < steps:
                pending = _fold(state, world, pending)
                state.commit()
        _fold(state, world, pending)
        run.sync_buffers()
        test = exact_test_metrics(world, run.eval_sums(), run.problem, epoch)
        close_epoch(state, run, progress, epoch, lr, test, saves=layout.replica == 0)
        result = test
    if result is None:
        last = state.records[-1]
        result = (last["test_loss"], last["test_accuracy"])
    return result


def _fold(state, world, pending: list[float]) -> list[float]:
    """Every last stage's loss and images since the last commit added to the committed epoch
    total (a collective, so the epoch's train loss survives ranks that leave)."""
    total = world.sum(pending, "pipeline.elastic.sums")
    state.loss_sum = [state.loss_sum[0] + total[0], state.loss_sum[1] + total[1]]
    return [0.0, 0.0]
