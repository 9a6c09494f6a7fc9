"""The pipeline's flags (``--pipeline-stages``, ``--microbatches``, ``--schedule``,
``--checkpoint-activations``, ``--partition``) and their checks; ``--pipeline-stages S`` with S > 1
chooses this strategy."""

from __future__ import annotations

import argparse

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline.placement import check_world as check_stages_divide
from ringtrain.strategies.pipeline.schedule import SCHEDULES

PARTITIONS = ("params", "time")  # what balances the stages: ringtrain/strategies/pipeline/timing.py

NAME = "pipeline"
HELP = ("pipeline: the model split by layers into --pipeline-stages S stages (model "
        "parallelism; implied by S > 1)")
# Horovod on Ray runs Gloo, and a pipeline's activations travel between two ranks over MPI.
NEEDS_MPI = ("--pipeline-stages: Horovod on Ray runs with Gloo, which has no messages between two "
             "ranks (a pipeline's activations travel over MPI); run the pipeline with horovodrun, "
             "mpirun or srun")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("pipeline (model parallelism; docs/pipeline.md)")
    g.add_argument("--pipeline-stages", type=int, default=1, metavar="S",
                   help="split the model by layers into S stages on S ranks, micro-batches "
                        "pipelined through them; the world is S x R ranks, R replicas trained "
                        "data-parallel (default 1: every rank holds the whole model)")
    g.add_argument("--microbatches", type=int, default=None, metavar="M",
                   help="with --pipeline-stages: micro-batches per batch, M must divide "
                        "--batch-size (default: the smallest divisor of --batch-size that is at "
                        "least 4S, so the idle bubble (S-1)/(M+S-1) is under 20%%; for a batch "
                        "below 4S, the most micro-batches of at least 2 rows)")
    g.add_argument("--schedule", choices=SCHEDULES, default=None,
                   help="with --pipeline-stages: gpipe (all forwards, then all backwards) or "
                        "1f1b (one forward, one backward: fewer activations held; the default)")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="with --pipeline-stages: a stage keeps only its input between a "
                        "micro-batch's forward and backward, and computes the forward again in "
                        "the backward (less memory, about one more forward of compute; "
                        "PyTorch; Keras stages always do)")
    g.add_argument("--partition", choices=PARTITIONS, default=None,
                   help="with --pipeline-stages: balance the stages by parameter count (params, "
                        "the default: memory) or by each layer's forward and backward time on a "
                        "micro-batch, timed on rank 0 and broadcast (time: the slowest stage)")


def implied(args: argparse.Namespace) -> bool:
    """Whether the flags ask for a pipeline without ``--strategy``."""
    return args.pipeline_stages > 1


def check_unused(args: argparse.Namespace) -> None:
    """Another strategy runs: the pipeline's flags must not be given (S = 1 is no pipeline)."""
    if args.pipeline_stages < 1:
        raise UserError(f"--pipeline-stages must be a positive integer, got {args.pipeline_stages}")
    for flag, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule),
                        ("--partition", args.partition)):
        if value is not None:
            raise UserError(f"{flag} works with --pipeline-stages 2 or more; add it or drop "
                            f"{flag}")
    if args.checkpoint_activations:
        raise UserError("--checkpoint-activations works with --pipeline-stages 2 or more (it "
                        "recomputes a stage's forward pass); add it or drop "
                        "--checkpoint-activations")


def default_microbatches(stages: int, batch_size: int) -> int:
    """The default M: the smallest divisor of the batch size that is at least 4S (GPipe: the
    bubble (S-1)/(M+S-1) is small from M >= 4S on); for a batch below that, the largest divisor
    that leaves every micro-batch at least 2 rows (BatchNorm cannot train on 1), else 1."""
    return next((d for d in range(4 * stages, batch_size + 1) if batch_size % d == 0),
                max((d for d in range(1, batch_size // 2 + 1) if batch_size % d == 0),
                    default=1))


def microbatches_note(args: argparse.Namespace) -> str:
    """What the banner adds after "M micro-batches of K" when M is the default."""
    if not getattr(args, "microbatches_default", False):
        return ""
    if args.microbatches >= 4 * args.pipeline_stages:
        return " (the default: M >= 4S)"
    return " (the default: the batch is below 4S)"


def validate(args: argparse.Namespace) -> None:
    """The pipeline runs: its flags' checks; fills in their defaults."""
    stages = args.pipeline_stages
    if stages < 2:
        raise UserError(f"--strategy pipeline needs --pipeline-stages S of 2 or more (the model "
                        f"split into S stages), got {stages}; add --pipeline-stages 2")
    if args.microbatches is None:  # recorded for the banner (validate may run twice)
        args.microbatches = default_microbatches(stages, args.batch_size)
        args.microbatches_default = True
    elif not hasattr(args, "microbatches_default"):
        args.microbatches_default = False
    if args.elastic:
        elastic_checks(args)
    args.schedule = args.schedule or "1f1b"
    args.partition = args.partition or "params"
    if args.microbatches < 1:
        raise UserError(f"--microbatches must be a positive integer, got {args.microbatches}")
    if args.batch_size % args.microbatches:
        raise UserError(f"--microbatches {args.microbatches} must divide --batch-size "
                        f"{args.batch_size} (equal micro-batches); change one of them")
    if args.adasum:
        raise UserError("--adasum with --pipeline-stages: each stage's gradients are combined "
                        "within its own process set, and Horovod 0.28.1's Adasum works on the "
                        "whole world only; drop --adasum")
    if args.amp:
        raise UserError("--amp with --pipeline-stages is not supported yet; drop one of the two "
                        "flags")
    # Horovod 0.28.1 scores the autotuner's samples on the global process set only (operations.cc:
    # "process_set_id == 0"), and its timeline is written by rank 0, which negotiates only the
    # sets it belongs to: a pipeline allreduces each stage's gradients in the stage's own set.
    if args.autotune is not None:
        raise UserError("--autotune with --pipeline-stages: Horovod's autotuner scores only "
                        "allreduces over every rank, and a pipeline allreduces each stage's "
                        "gradients within the stage's ranks; drop one of the two flags")
    if args.timeline_out is not None:
        raise UserError("--timeline-out with --pipeline-stages: rank 0 writes Horovod's timeline "
                        "and sees only its own stage's allreduces (the other stages' would be "
                        "missing); drop one of the two flags")


def elastic_checks(args: argparse.Namespace) -> None:
    """``--elastic``: the elastic pipeline (lockstep GPipe over global collectives,
    ringtrain/strategies/pipeline/lockstep.py) and what it does not do."""
    if args.schedule not in (None, "gpipe"):
        raise UserError(f"--schedule {args.schedule} with --elastic --pipeline-stages: the elastic "
                        f"pipeline runs GPipe in lockstep ticks; drop --schedule or use gpipe")
    args.schedule = "gpipe"
    refused = [("--checkpoint-activations", args.checkpoint_activations),
               ("--partition time", args.partition == "time"),
               ("--precision bf16", getattr(args, "precision", "fp32") != "fp32"),
               ("--clip-grad-norm", getattr(args, "clip_grad_norm", None) is not None),
               ("--fp16-allreduce", args.fp16_allreduce),
               ("--gradient-predivide-factor", args.gradient_predivide_factor != 1.0),
               ("--shard-optimizer", getattr(args, "shard_optimizer", False)),
               ("--resume", args.resume)]
    for flag, given in refused:
        if given:
            raise UserError(f"{flag} with --elastic --pipeline-stages is not supported by the "
                            f"elastic pipeline yet (docs/pipeline.md, \"Elastic pipeline\"); drop "
                            f"{flag.split()[0]}")


def check_world(args: argparse.Namespace, world_size: int) -> None:
    """Right after ``hvd.init()``, on every rank: S divides the world (elastic: at least S
    ranks, the rest spares)."""
    if args.elastic:
        if world_size < args.pipeline_stages:
            raise UserError(f"--elastic --pipeline-stages {args.pipeline_stages} needs at least "
                            f"{args.pipeline_stages} processes, got {world_size}")
        return
    check_stages_divide(args.pipeline_stages, world_size)
