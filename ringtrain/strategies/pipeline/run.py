"""The run object of a pipeline, the part both frameworks share: what the shared loop
(:class:`ringtrain.training.fixed_loop.FixedLoop`) asks of a run, answered for a rank that holds one
stage of one replica.

* **Data.** A replica reads one shard (``shard_rank`` = its index, ``shard_size`` = R, so the LR
  scales with R, the data-parallel width); its first stage reads the inputs, its last stage the
  labels, the stages between read nothing.  A step of K x B rows (K =
  ``--backward-passes-per-step``) is cut into micro-batches of B / M rows.
* **A step.** The schedule's forwards and backwards (:func:`ringtrain.strategies.pipeline.engine.run_step`);
  each micro-batch's loss is its examples' summed loss divided by the step's rows, so the
  accumulated gradients are the step's mean gradient; then the optimizer step, whose allreduce
  averages them over the stage's R replicas (Horovod, in the stage's process set); then one
  small allreduce over every rank, outside Horovod, that tells every rank its replica's loss and
  whether any stage's weights stopped being finite (the stages decide together, so they stop
  together).
* **Metrics.** The last stage computes the loss and the test sums; the other stages report
  zeros, so the loop's sums over every rank count each example once: exact, as in a
  data-parallel run.
* **Checkpoints.** One file per stage, written by the stage's first replica; a resume needs the
  same S (any R) and restores every stage from the same epoch.
* **Checksums.** ``parameters()`` is the stage's own state (gathering the whole model on every
  rank would defeat the point of splitting it): the summary's per-rank checksums agree within a
  stage.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ringtrain import optimizer_spec, runtime
from ringtrain.errors import UserError, printable
from ringtrain.output import checkpoint
from ringtrain.output.progress import Loss
from ringtrain.strategies.pipeline import memory, transport
from ringtrain.strategies.pipeline.engine import BF16, Boundary, EvalRelay, run_step
from ringtrain.strategies.pipeline.options import microbatches_note
from ringtrain.strategies.pipeline.partition import Stage
from ringtrain.strategies.pipeline.placement import Placement, check_world
from ringtrain.strategies.pipeline.schedule import bubble_formula, in_flight, stage_ops
from ringtrain.training import startup
from ringtrain.training.run import FrameworkRun, StepTag
from ringtrain.training.world import World

_SETS: dict[tuple[int, int], list[Any]] = {}  # (stages, world size) -> Horovod's process sets


def before_init(args: argparse.Namespace, hvd) -> list[Any]:
    """Before ``hvd.init()``, on every rank: the environment Horovod needs
    (:func:`ringtrain.runtime.before_init`); MPI, the transport (refused under Gloo, whose
    Horovod has no messages between two ranks), initialised here by mpi4py; S must divide the
    world size.  Returns the stage process sets to initialise Horovod with."""
    runtime.before_init(args.stall_timeout)
    if runtime.uses_gloo(os.environ):
        raise UserError("--pipeline-stages needs Horovod's MPI controller: a pipeline's "
                        "activations travel between two ranks over MPI, and Gloo has no such "
                        "messages; run horovodrun without --gloo, mpirun or srun")
    size = transport.world_size()
    check_world(args.pipeline_stages, size)
    return stage_sets(hvd, args.pipeline_stages, size)


def stage_sets(hvd, stages: int, size: int) -> list[Any]:
    """One Horovod process set per stage, the same list in the same order on every rank (what
    ``hvd.init(process_sets=...)`` requires); made once per process (a second run in the same
    process, as the test probes make, finds Horovod initialised with them)."""
    key = (stages, size)
    if key not in _SETS:
        if _SETS or hvd.is_initialized():
            raise RuntimeError("Horovod is already initialised in this process with other "
                               "process sets; run one pipeline layout per process")
        _SETS[key] = [hvd.ProcessSet(list(range(s, size, stages))) for s in range(stages)]
    return _SETS[key]


def micro_rows(rows: int, size: int) -> list[int]:
    """A step's ``rows`` cut into micro-batches of ``size`` (the last one shorter if the step is:
    an epoch's last batch may be partial)."""
    return [size] * (rows // size) + ([rows % size] if rows % size else [])


def resume_epoch(world: World, place: Placement, args: argparse.Namespace,
                 find: Callable[[int | None], tuple[int, Any] | None],
                 load: Callable[[Any], None]) -> int:
    """The epoch every stage continues after.  Each stage's first replica finds its newest intact
    checkpoint (``find(at_most)``: ``(epoch, payload)`` or None); the stages' epochs are gathered,
    and all resume from the oldest of them (a stage whose newest file was damaged, or not
    written for want of space, holds everyone back), each writer loading its stage's file of that
    epoch (``load``).  A problem on any rank ends every rank with its line."""
    if not args.resume:
        return 0
    found: dict[str, Any] = {}

    def newest() -> int:
        if place.replica == 0:
            found["it"] = find(None)
        return found["it"][0] if found.get("it") else 0

    epochs = world.gather(startup.every_rank(world, newest), "pipeline.resume")
    per_stage = [epochs[place.rank_of(s, 0)] for s in range(place.stages)]
    epoch = min(per_stage)
    if world.rank == 0:
        if max(per_stage) != epoch:
            sys.stderr.write(f"warning: the stages' newest intact checkpoints are of epochs "
                             f"{per_stage}; every stage resumes from epoch {epoch}\n")
            sys.stderr.flush()
        elif epoch == 0:
            print(f"resume: no checkpoint in {args.checkpoint_dir} yet; starting from epoch 1",
                  flush=True)

    def apply() -> None:
        if place.replica != 0 or epoch == 0:
            return
        it = found["it"] if found["it"][0] == epoch else find(epoch)
        if it is None or it[0] != epoch:
            raise UserError(f"--resume: stage {place.stage} has no intact checkpoint of epoch "
                            f"{epoch}, the newest every stage has; use another --checkpoint-dir")
        load(it[1])

    startup.every_rank(world, apply)
    return epoch


class PipelineRun(FrameworkRun):
    """A rank's share of a pipeline run; the framework's subclass opens it (Horovod with the stage
    process sets, the stage's layers, its optimizer, the resume, the per-stage broadcast) and
    sets ``place``, ``link``, ``stages`` (every stage's :class:`Stage`, the same on every rank),
    ``weights_built`` (the banner's line on how the stage's weights were made),
    ``inbound``/``outbound`` (the cuts around this stage), then does each micro-batch's maths
    (:meth:`forward`, :meth:`backward`) and the step around them."""

    place: Placement
    link: transport.Link
    stages: list[Stage]
    weights_built: str  # how the stage's weights were made: "built stage by stage", or whole
    inbound: Boundary | None
    outbound: Boundary | None

    def locate(self, hvd, sets: list[Any]) -> None:
        """After ``hvd.init()``: this rank's place, and its stage's process set."""
        self.place = Placement(self.args.pipeline_stages, hvd.size(), hvd.rank())
        self.stage_set = sets[self.place.stage]

    def keep(self, stages: list[Stage], cuts: list[Boundary]) -> int:
        """The split's facts, the cuts around this rank's stage; returns the stage's index."""
        self.stages = stages
        if self.args.precision == "bf16":
            # --precision bf16: the activations and their gradients cross the cuts in bfloat16,
            # half float32's bytes (the stages compute in it; a float64 cut stays what it is).
            cuts = [Boundary(c.shape, BF16) if np.dtype(c.dtype) == np.float32 else c
                    for c in cuts]
        self.inbound = cuts[self.place.stage - 1] if not self.place.first else None
        self.outbound = cuts[self.place.stage] if not self.place.last else None
        return self.place.stage

    def open_pipeline(self, args: argparse.Namespace) -> None:
        """The shared state, once ``place`` is known (after ``hvd.init()``)."""
        self.micro = args.batch_size // args.microbatches
        self.loss_sum = 0.0  # the last stage's summed loss since take_loss_sum
        self.step_loss = 0.0  # this step's, on the last stage
        self.nonfinite = False
        self.times: list[tuple[float, float, float]] = []  # seconds of each step: all of it,
        #                                                   the schedule's, computing
        self.sent: list[int] = []  # bytes of activations and gradients sent, each step
        self.peak_held = self.peak_sends = self.peak_eval = 0  # measured, over the run's steps
        self.memory_needs: memory.StageNeeds | None = None  # the per-rank formula, once known
        self.saved: dict[int, Any] = {}  # the framework's tensors kept per micro-batch

    def fits(self, stage: int, weight_bytes: int, activation_bytes: int) -> None:
        """Before the stage's weights exist: what it will hold by the per-rank formula (its
        weights, their gradients, the optimizer's state, the activations its schedule keeps:
        ``in_flight`` of its op list, each micro-batch's rows x ``activation_bytes`` per
        example), against this rank's limit; one line when it cannot fit."""
        args = self.args
        held = in_flight(stage_ops(args.schedule, self.place.stages, stage, args.microbatches))
        self.memory_needs = memory.needs(stage, weight_bytes, optimizer_spec.state_slots(args),
                                         activation_bytes, self.micro, held)
        memory.check_fits(self.memory_needs, memory.rank_limit(memory.local_size()),
                          self.place.stages)

    # --- who reads what, who writes -------------------------------------------------------------

    @property
    def shard_rank(self) -> int:
        return self.place.replica

    @property
    def shard_size(self) -> int:
        return self.place.replicas

    @property
    def writes_checkpoints(self) -> bool:
        return self.place.replica == 0

    @property
    def reads_data(self) -> bool:
        return self.place.first or self.place.last

    # --- one step ----------------------------------------------------------------------------------

    @abstractmethod
    def stage_batches(self, steps: Sequence[np.ndarray]) -> Iterator[Any]:
        """The framework's batches of ``steps`` (first and last stage only)."""

    @abstractmethod
    def begin_step(self, data: Any, rows: list[int], lr: float) -> None:
        """Before the schedule: the LR, the gradients zeroed, the step's data (None on the
        stages between) cut into micro-batches of ``rows``."""

    @abstractmethod
    def forward(self, m: int, x: np.ndarray | None) -> np.ndarray | None: ...

    @abstractmethod
    def backward(self, m: int, grad: np.ndarray | None) -> np.ndarray | None: ...

    def held(self) -> int:
        """The micro-batches whose tensors this stage keeps now, between their forward and their
        backward: both frameworks keep them in ``self.saved`` (the engine measures it)."""
        return len(self.saved)

    @abstractmethod
    def end_step(self) -> bool:
        """After the schedule: the optimizer step (the stage's allreduce inside); whether this
        stage's weights are still finite numbers."""

    def clip_scale(self, squares: float) -> float:
        """``--clip-grad-norm``: the factor every stage scales its averaged gradients by, from
        this stage's sum of squared gradients (``squares``).  The model's global norm is over
        every stage: one float64 allreduce over every rank (each rank sends its own stage's sum;
        the replicas of a stage hold the same averaged gradients, so the total counts each stage
        R times: divided by R).  Every rank of every stage calls it once per step, in the same
        place (after its stage's allreduce, before its optimizer step), so the collectives match."""
        total = self.link.allreduce_sum(np.array([squares]), "the gradients' global norm")
        return self.clip_factor(math.sqrt(float(total[0]) / self.place.replicas))

    @abstractmethod
    def clip_factor(self, norm: float) -> float:
        """The framework's own clipping factor for a global norm (its ring's formula)."""

    def batches(self, steps: Sequence[np.ndarray]) -> Iterator[tuple[int, Any]]:
        data = self.stage_batches(steps) if self.reads_data else None
        for indices in steps:
            yield len(indices), (next(data) if data is not None else None)

    def step(self, batch: tuple[int, Any], lr: float) -> tuple[Loss, int]:
        t0 = time.perf_counter()
        rows_total, data = batch
        rows = micro_rows(rows_total, self.micro)
        self.step_rows = rows_total
        self.step_loss = 0.0
        self.begin_step(data, rows, lr)
        ops = stage_ops(self.args.schedule, self.place.stages, self.place.stage, len(rows))
        try:
            took = run_step(self.place, self.link, self, ops, rows, self.inbound, self.outbound)
            finite = self.end_step()
        except Exception as err:  # an allocation that failed: one line, not "diverged" or a trace
            if not memory.out_of_memory(err):
                raise
            raise memory.ran_out(self.place.stage, self.place.stages, self.memory_needs,
                                 memory.rank_limit(), "a training step") from None
        # Every rank learns its replica's loss (the progress bar, the divergence line) and whether
        # any stage's weights stopped being finite: slot 0 counts those, slot 1 + r holds replica
        # r's loss, from its last stage.
        mine = np.zeros(1 + self.place.replicas)
        mine[0] = 0.0 if finite else 1.0
        if self.place.last:
            mine[1 + self.place.replica] = self.step_loss
        total = self.link.allreduce_sum(mine, "the step's loss and weight check")
        self.nonfinite = bool(total[0])
        self.loss_sum += self.step_loss
        self.times.append((time.perf_counter() - t0, took.wall, took.busy))
        self.peak_held = max(self.peak_held, took.held)
        self.peak_sends = max(self.peak_sends, took.sends)
        self.sent.append(took.sent)
        return float(total[1 + self.place.replica]) / rows_total, rows_total

    def take_loss_sum(self) -> float:
        total, self.loss_sum = self.loss_sum, 0.0
        return total

    def train_sums(self, images: int) -> list[float]:
        total = self.take_loss_sum()
        return [total, images] if self.place.last else [0.0, 0.0]

    def diverged(self, tag: StepTag) -> StepTag | None:
        return tag if self.nonfinite else None

    # --- evaluation, checkpoints -----------------------------------------------------------------

    @property
    def problem(self) -> str | None:
        return self.data.problem

    @abstractmethod
    def evaluator(self, relay: EvalRelay) -> Any:
        """What the framework's data evaluates with (``self.data.eval_sums(evaluator, rank,
        size)``): the stage, its input from and output to the relay."""

    def eval_sums(self) -> list[float]:
        """This rank's test sums as the loop adds them up: the last stage's (loss, correct,
        count), zeros elsewhere, and this rank's data problems.  Every stage of a replica walks
        the replica's share of the test set; stage 0 reads the inputs, the last the labels."""
        relay = EvalRelay(self.place, self.link, self.inbound, self.outbound)
        sums = self.data.eval_sums(self.evaluator(relay), self.place.replica, self.place.replicas)
        relay.finish()
        self.peak_eval = max(self.peak_eval, relay.peak)
        return sums if self.place.last else [0.0, 0.0, 0.0, sums[3]]

    # The framework's checkpoint module (torch_models.checkpoints, tf_models.checkpoints): its
    # save(..., stage), find(dir, identity, stage, at_most) -> (epoch, (payload, path)), and
    # load(payload, path, model, optimizer); and how to read a payload's metadata.
    checkpoints: Any

    @abstractmethod
    def meta_of(self, payload: Any) -> dict: ...

    def stage_record(self) -> dict:
        """What a stage's checkpoint says it holds (:func:`checkpoint.metadata`'s ``pipeline``)."""
        return {**self.stages[self.place.stage].record(), "stages": self.place.stages}

    def save(self, epoch: int) -> None:
        self.checkpoints.save(self.args.checkpoint_dir, epoch, self.stage, self.optimizer,
                              self.identity, self.args, self.stage_record())

    def find(self, at_most: int | None):
        return self.checkpoints.find(self.args.checkpoint_dir, self.identity,
                                     (self.place.stage, self.place.stages), at_most)

    def load(self, found) -> None:
        payload, path = found
        self.check_loaded(self.meta_of(payload), path)
        self.checkpoints.load(payload, path, self.stage, self.optimizer)

    # --- what the run says about itself ------------------------------------------------------------

    @property
    def recomputes(self) -> bool:
        """Whether a stage keeps only its input between a micro-batch's forward and backward and
        computes the forward again in the backward (``--checkpoint-activations``)."""
        return bool(self.args.checkpoint_activations)

    def facts(self) -> dict[str, Any]:
        a, place = self.args, self.place
        micro = a.microbatches * a.backward_passes_per_step
        return {"stages": place.stages, "replicas": place.replicas, "schedule": a.schedule,
                "microbatches": a.microbatches, "microbatch_size": self.micro,
                "ideal_bubble": bubble_formula(place.stages, micro),
                "checkpoint_activations": self.recomputes,
                # the schedule's bound on each stage's held micro-batches, from its op list
                # (1F1B: S - s; GPipe: M x K); the ranks' measured peaks are beside their times
                "in_flight_formula": [in_flight(stage_ops(a.schedule, place.stages, s, micro))
                                      for s in range(place.stages)],
                "split": [s.record() for s in self.stages],
                # what balanced the stages (--partition) and, under time, each stage's share of
                # the layers' timed seconds (rank 0's timing, the same on every rank); None under
                # params, where nothing is timed
                "partition": getattr(a, "partition", "params"),
                "stage_time_share": (None if any(s.time_share is None for s in self.stages)
                                     else [s.time_share for s in self.stages])}

    def check_loaded(self, meta: dict, where) -> None:
        """A stage's checkpoint must hold this stage's layers (the split depends on the model and
        S only, so this fails only if the model itself changed)."""
        had = meta.get("optimizer", checkpoint.DEFAULT_OPTIMIZER)
        if had != self.args.optimizer:  # its state fits another optimizer's, or would misfit
            raise UserError(f"{where} holds the state of --optimizer {had}, this run has "
                            f"--optimizer {self.args.optimizer}; resume with --optimizer {had}, "
                            f"or use another --checkpoint-dir to start {self.args.optimizer} afresh")
        saved = meta["pipeline"]  # its shape checked by checkpoint.check_stage
        mine = self.stages[self.place.stage]
        if saved["params"] != mine.params or saved["layers"] != list(mine.layers):
            raise UserError(f"--resume: {where} holds stage {self.place.stage} as "
                            f"{printable(', '.join(saved['layers']), 120)} ({saved['params']} "
                            f"params), this run's is {', '.join(mine.layers)} ({mine.params}); "
                            f"resume with the same --model")

    def describe(self) -> list[str]:
        f = self.facts()
        return [f"pipeline: {f['stages']} stages x {f['replicas']} replica(s), rank = replica x "
                f"{f['stages']} + stage; {f['schedule']}, {f['microbatches']} micro-batches of "
                f"{f['microbatch_size']}"
                + microbatches_note(self.args)
                + f"; ideal bubble (S-1)/(M+S-1) = {f['ideal_bubble']:.1%}"
                + ("; forward recomputed in the backward" if f["checkpoint_activations"] else ""),
                f"stage weights: {self.weights_built}"
                + ("; stages balanced by timed compute (--partition time: rank 0 timed each "
                   "layer's forward and backward on a micro-batch)"
                   if f["partition"] == "time" else ""),
                *(s.line() for s in self.stages),
                # each stage's own optimizer, clipped by the whole model's norm (when not the default)
                *filter(None, [optimizer_spec.describe(self.args)])]

    def summary_fields(self) -> dict[str, Any]:
        """The pipeline's facts and each rank's measured steps, in mean seconds per step (the
        first left out: it traces and allocates): the whole step, its schedule (the stages start
        a step together, after the previous step's allreduce over every rank, so the longest
        schedule of a replica is its pipeline's length) and the time the stage computed; and the
        measured bubble of each replica, 1 - (mean computing time of its stages) / (its longest
        schedule).  Per rank also what it held, measured over every training step: the most
        micro-batches whose activations it kept at once (``peak_activations_held``), the most
        sends not yet completed (``peak_send_buffers``), and the most test batches sent and not
        yet taken during evaluation (``peak_eval_in_flight``), and the bytes of activations and
        gradients it sent per training step (``sent_bytes_per_step``, mean over every step:
        ``--precision bf16`` halves float32's)."""
        times = self.times[1:] or self.times
        mean = [sum(t[i] for t in times) / max(len(times), 1) for i in range(3)]
        ranks = self.world.gather({"rank": self.world.rank, "stage": self.place.stage,
                                   "replica": self.place.replica, "step_seconds": mean[0],
                                   "schedule_seconds": mean[1], "busy_seconds": mean[2],
                                   "steps": len(times), "param_bytes": self.stage_param_bytes(),
                                   "peak_activations_held": self.peak_held,
                                   "peak_send_buffers": self.peak_sends,
                                   "peak_eval_in_flight": self.peak_eval,
                                   "sent_bytes_per_step": sum(self.sent) / max(len(self.sent), 1)},
                                  "pipeline.measured")
        bubbles = []
        for r in range(self.place.replicas):
            mine = [m for m in ranks if m["replica"] == r]
            longest = max(m["schedule_seconds"] for m in mine)
            busy = sum(m["busy_seconds"] for m in mine) / len(mine)
            bubbles.append(1 - busy / longest if longest else 0.0)
        return {"pipeline": {**self.facts(), "ranks": ranks, "measured_bubble": bubbles}}

    @abstractmethod
    def stage_param_bytes(self) -> int:
        """The bytes of this rank's weights (its stage's)."""
