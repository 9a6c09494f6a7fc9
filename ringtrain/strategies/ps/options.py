"""The parameter servers' flags (``--ps-servers``, ``--staleness``) and their checks, and what
``--strategy ps`` cannot be combined with (each with why)."""

from __future__ import annotations

import argparse

from ringtrain import optimizer_spec
from ringtrain.errors import UserError

NAME = "ps"
HELP = ("ps: parameter servers, asynchronous SGD with bounded staleness (MPI launchers only; see "
        "docs/parameter-servers.md)")
PS_NEEDS_MPI = ("--strategy ps moves the parameters point to point with MPI (mpi4py), which {what} "
                "does not start: Gloo has no point-to-point API that Python can reach; run it "
                "under horovodrun without --gloo, or mpirun")
NEEDS_MPI = PS_NEEDS_MPI.format(what="Ray (horovod.ray, over Gloo)")


def add_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parameter servers (--strategy ps)")
    g.add_argument("--ps-servers", type=int, default=None, metavar="P",
                   help="with --strategy ps: ranks 0..P-1 hold the parameters and the optimizer, "
                        "the rest compute gradients (default 1)")
    g.add_argument("--staleness", default=None, metavar="K|inf",
                   help="with --strategy ps: a worker may run at most K steps ahead of the "
                        "slowest; 0 (default) is synchronous, the ring's math; inf never waits")


def staleness(args: argparse.Namespace) -> int | None:
    """``--staleness`` as a number of steps; None for ``inf``; 0 when not given."""
    raw = "0" if args.staleness is None else str(args.staleness).strip()
    if raw.lower() in ("inf", "infinity"):
        return None
    if not raw.isdigit():
        raise UserError(f"--staleness must be a whole number of steps >= 0 or inf, got {raw!r}")
    return int(raw)


def ps_servers(args: argparse.Namespace) -> int:
    return 1 if args.ps_servers is None else args.ps_servers


def implied(args: argparse.Namespace) -> bool:
    return False  # only --strategy ps asks for servers


def check_unused(args: argparse.Namespace) -> None:
    if args.ps_servers is not None or args.staleness is not None:
        raise UserError("--ps-servers and --staleness set up parameter servers: add "
                        "--strategy ps, or drop them for the ring")


def validate(args: argparse.Namespace) -> None:
    staleness(args)
    optimizer_spec.check_servers(args, "--strategy ps")  # built-ins only, no --shard-optimizer
    if ps_servers(args) < 1:
        raise UserError(f"--ps-servers must be at least 1, got {args.ps_servers}")
    refused = [
        (args.elastic, "--elastic", "an elastic job re-forms the ring when workers come and go; "
                                    "the parameter servers' ranks are fixed"),
        (args.adasum, "--adasum", "Adasum is a way for the ring's allreduce to combine gradients; "
                                  "the servers apply each gradient themselves"),
        (getattr(args, "pipeline_stages", None) not in (None, 1), "--pipeline-stages",
         "pipeline stages split the model across ranks, and the servers need every worker to "
         "compute the whole model's gradient"),
        (args.fp16_allreduce, "--fp16-allreduce", "it compresses the ring's allreduce, which "
                                                  "--strategy ps does not run"),
        (args.gradient_predivide_factor != 1.0, "--gradient-predivide-factor",
         "it splits the ring's average, which --strategy ps does not run"),
        (args.amp, "--amp", "the servers apply float32 gradients without loss scaling"),
        (args.timeline_out is not None, "--timeline-out", "Horovod's timeline records its "
                                                          "collectives, and Horovod is shut down "
                                                          "once a parameter-server run is open"),
        (args.autotune is not None, "--autotune", "Horovod's autotuner tunes the ring's "
                                                  "allreduce, which --strategy ps does not run"),
    ]
    for given, flag, why in refused:
        if given:
            raise UserError(f"--strategy ps cannot run with {flag}: {why}; drop one of the two")


def check_world(args: argparse.Namespace, world_size: int) -> None:
    if ps_servers(args) >= world_size:
        raise UserError(f"--ps-servers {ps_servers(args)} leaves no worker among {world_size} "
                        f"processes (ranks 0..P-1 serve, the rest compute); run at least "
                        f"{ps_servers(args) + 1} processes, or fewer servers")
