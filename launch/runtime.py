"""Per-process facts every trainer needs right after ``hvd.init()``."""

from __future__ import annotations

import os


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def threads_per_rank(local_size: int) -> int:
    """Intra-op threads for one rank: the host's cores split among its ranks.

    Without this every rank starts one thread per core, and -np 4 on 2 cores runs 8 busy threads
    on 2 cores: the ranks spend their time preempting each other instead of computing.
    """
    return max(1, available_cores() // max(1, local_size))


def controller(hvd) -> str:
    """Which Horovod controller runs this job: 'mpi' (horovodrun, mpirun, plain python) or 'gloo'."""
    if hvd.mpi_enabled():
        return "mpi"
    if hvd.gloo_enabled():
        return "gloo"
    return "unknown"


def launcher() -> str:
    """Who started us, from the environment the launcher leaves behind."""
    if "HOROVOD_HOSTNAME" in os.environ or "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ:
        return "horovodrun"
    if "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ:
        return "mpirun"
    return "single-process"


def configure_stall_check(timeout_seconds: float) -> None:
    """Make a stuck or dead rank end the job instead of hanging it; call before ``hvd.init()``.

    Horovod's stall inspector warns when some ranks wait on a collective the others never issue,
    and shuts Horovod down after the shutdown time (off by default).  An explicit environment
    setting from the user wins.
    """
    if timeout_seconds <= 0:
        return
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, int(timeout_seconds // 2))))
    os.environ.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(max(1, int(timeout_seconds))))
