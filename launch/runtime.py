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
    on 2 cores: the ranks spend their time preempting each other instead of computing.  A set
    ``OMP_NUM_THREADS`` wins (a batch system's cpus-per-task, or ranks that share cores with
    ranks Horovod counts as another host's).
    """
    requested = os.environ.get("OMP_NUM_THREADS", "")
    if requested.isdigit() and int(requested) > 0:
        return int(requested)
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


def configure_mpi_progress(env: dict[str, str] | None = None) -> None:
    """Let Open MPI yield the CPU while it waits when this host's ranks fill its cores; call before
    ``hvd.init()`` (MPI reads it at ``MPI_Init``).

    Open MPI busy-polls for messages unless it knows the host is oversubscribed, and horovodrun
    tells it every rank has its own slot.  With one rank per core (or more ranks than cores) the
    polling rank steals the core its peer needs to finish the step everyone is waiting for.
    Measured with bench/torch_loop.py on 2 cores (BENCHMARKS.md): -np 2 went from 1156-1344 to
    1683-1899 images/s, -np 4 from 872-901 to 1739-1780.  A user's explicit setting wins.
    """
    env = os.environ if env is None else env
    local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    if local and local.isdigit() and int(local) >= available_cores():
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def before_init(stall_timeout: float) -> None:
    """Everything that must be in the environment before ``hvd.init()``."""
    configure_stall_check(stall_timeout)
    configure_mpi_progress()
