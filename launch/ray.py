"""``python -m launch.ray --framework {torch,tf} --num-workers N [trainer flags]``: the trainers on Ray.

The same job as ``horovodrun -np N python -m launch --framework X``, with Ray placing the workers:
on a local Ray this command starts for the job (the default), or on a running cluster
(``--address HOST:PORT`` of its head, or ``auto`` on one of its nodes: ``ray start``, KubeRay,
Ray's autoscaler).  Horovod's Ray executor (``horovod.ray.RayExecutor``) starts one Ray actor per
worker and its Gloo rendezvous; each actor runs :func:`run_trainer`, the very function
``python -m launch`` runs.  ``--elastic`` (with ``--min-workers``/``--max-workers``) uses the
executor's elastic mode, Horovod's elastic driver with Ray's live node list as host discovery: a
node lost or added mid-run re-forms the job through the trainers' elastic glue (rollback to the
last commit, re-shard, LR rescaled), as under ``horovodrun --min-np/--max-np``.

What the user sees is what horovodrun shows: rank 0's lines (Ray forwards every worker's output to
this process; the ``(pid=...)`` prefix is turned off), the ``--metrics-out`` summary, checkpoints
and TensorBoard files, written by rank 0 on its node.  Failures end in one line, from this
process: a lost node, a dead worker, a failed collective, or the trainers' own ``UserError``
(exit status 2).  Flags are checked before Ray or any framework is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import secrets

from launch import cli
from launch.cli import run_cli
from ringtrain import flags
from ringtrain.errors import UserError
from ringtrain.ray_jobs.cluster import LOCAL_OBJECT_STORE_MB, check_capacity, connect, import_ray
from ringtrain.ray_jobs.jobs import run_elastic, run_fixed
from ringtrain.ray_jobs.output import forwarded_output
from ringtrain.ray_jobs.worker import worker_main
from ringtrain.strategies import registry

PROG = "python -m launch.ray"
MIN_OBJECT_STORE_MB = 80  # Ray refuses less than 75 MiB
PATH_FLAGS = ("data_dir", "checkpoint_dir", "metrics_out", "tensorboard", "timeline_out", "autotune")


# --- the command line --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = cli.OneLineParser(
        prog=PROG, allow_abbrev=False,
        description="Data-parallel MNIST on PyTorch or TensorFlow/Keras 3 through Horovod, with the "
                    "workers on a Ray cluster (a local one by default). Every trainer flag works as "
                    "under horovodrun.")
    g = parser.add_argument_group("ray")
    g.add_argument("--framework", required=True, choices=flags.FRAMEWORKS,
                   help="torch (PyTorch, horovod.torch) or tf (TensorFlow/Keras 3, horovod.tensorflow)")
    g.add_argument("--address", default=None,
                   help="the Ray cluster to run on: its head's HOST:PORT (ray start --head prints it; "
                        "6379 by default) or 'auto' on a node of the cluster (default: $RAY_ADDRESS, "
                        "else a local Ray started for this job and stopped after it)")
    g.add_argument("--num-workers", type=int, default=None,
                   help="workers (Horovod ranks) of a fixed-size job")
    g.add_argument("--min-workers", type=int, default=None,
                   help="with --elastic: train on while at least this many workers are left (default 1)")
    g.add_argument("--max-workers", type=int, default=None,
                   help="with --elastic: never more workers than this (default: as many as the "
                        "cluster's CPUs hold; on a local Ray: --min-workers)")
    g.add_argument("--cpus-per-worker", type=int, default=1,
                   help="CPUs Ray reserves for each worker (default 1); a worker runs that many threads")
    g.add_argument("--gpus-per-worker", type=int, default=0,
                   help="GPUs Ray reserves for each worker (default 0; needs a Horovod built with "
                        "HOROVOD_GPU_OPERATIONS=NCCL)")
    g.add_argument("--network-interfaces", default=None, metavar="NICS",
                   help="comma-separated interfaces Horovod's Gloo uses between nodes (default: found "
                        "by Horovod's probe across the nodes; an elastic job that starts on one node "
                        "uses the interface that carries that node's Ray address)")
    g.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds to wait for the cluster to make room for the workers before saying "
                        "so (default 120)")
    g.add_argument("--object-store-memory", type=int, default=None, metavar="MB",
                   help=f"object store of the local Ray this command starts, in MB (default "
                        f"{LOCAL_OBJECT_STORE_MB}; the trainers do not use it); a cluster's nodes set "
                        f"theirs with ray start")
    registry.add_trainer_args(parser)
    return parser


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The trainer flags (:func:`ringtrain.strategies.registry.validate`) and the Ray flags; no
    Ray, no framework."""
    registry.validate(args)
    if registry.needs_mpi(args):  # a strategy whose transfers are MPI's; Ray's workers run Gloo
        raise UserError(registry.needs_mpi(args))
    if args.elastic:
        if args.num_workers is not None:
            raise UserError("an --elastic job sizes itself: give --min-workers (and --max-workers) "
                            "instead of --num-workers")
        args.min_workers = 1 if args.min_workers is None else args.min_workers
        if args.min_workers < 1:
            raise UserError(f"--min-workers must be at least 1, got {args.min_workers}")
        if args.max_workers is not None and args.max_workers < args.min_workers:
            raise UserError(f"--max-workers {args.max_workers} is smaller than --min-workers "
                            f"{args.min_workers}")
    else:
        if args.min_workers is not None or args.max_workers is not None:
            raise UserError("--min-workers/--max-workers size an elastic job: add --elastic, or give "
                            "--num-workers for a fixed-size one")
        if args.num_workers is None:
            raise UserError("say how many workers: --num-workers N (or --elastic --min-workers A "
                            "--max-workers B)")
        if args.num_workers < 1:
            raise UserError(f"--num-workers must be at least 1, got {args.num_workers}")
    if args.cpus_per_worker < 1:
        raise UserError(f"--cpus-per-worker must be at least 1, got {args.cpus_per_worker}")
    if args.gpus_per_worker < 0:
        raise UserError(f"--gpus-per-worker must be >= 0, got {args.gpus_per_worker}")
    if args.start_timeout <= 0:
        raise UserError(f"--start-timeout must be positive, got {args.start_timeout:g}")
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        if address.startswith("ray://"):
            raise UserError(f"--address {address}: Ray Client addresses are not supported; run this "
                            f"command on a node of the cluster (--address auto), e.g. with ray job "
                            f"submit -- python -m launch.ray ...")
        if address != "auto" and not address.rpartition(":")[2].isdigit():
            raise UserError(f"--address {address}: expected HOST:PORT of the cluster's head (ray "
                            f"start --head prints it; port 6379 by default) or 'auto'")
        if args.object_store_memory is not None:
            raise UserError("--object-store-memory sizes the local Ray this command starts; the nodes "
                            "of a cluster set theirs with ray start --object-store-memory")
    elif args.object_store_memory is not None and args.object_store_memory < MIN_OBJECT_STORE_MB:
        raise UserError(f"--object-store-memory must be at least {MIN_OBJECT_STORE_MB} MB (Ray's "
                        f"minimum), got {args.object_store_memory}")
    args.address = address
    # The workers may run in another folder, on another node: paths are the driver's.
    for name in PATH_FLAGS:
        value = getattr(args, name)
        if value:
            setattr(args, name, os.path.abspath(os.path.expanduser(value)))
    return args


# --- in each Ray worker: what python -m launch runs ----------------------------------------------

def run_trainer(framework: str, args: argparse.Namespace) -> int:
    """What every worker runs: what ``python -m launch --framework X ARGS`` runs, but the
    process's SIGTERM stays Ray's (the actor is Ray's to stop)."""
    registry.train(framework, args, own_signals=False)
    return 0


# --- the job ---------------------------------------------------------------------------------

def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    framework = args.__dict__.pop("framework")
    validate(args)
    ray, RayExecutor = import_ray(local=args.address is None)
    # The workers import this module under its own name (cloudpickle sends a function of
    # __main__ by value, with its globals): the trainer they run is this module's run_trainer.
    worker = functools.partial(worker_main, importlib.import_module("launch.ray").run_trainer)
    token, state = secrets.token_hex(8), {}
    with forwarded_output(token, state):
        try:
            where = connect(ray, args)
            check_capacity(ray, args, where)
            job = run_elastic if args.elastic else run_fixed
            return job(ray, RayExecutor, args, framework, token, state, worker)
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()


def main(argv=None) -> None:
    run_cli(lambda: run(argv))


if __name__ == "__main__":
    main()
