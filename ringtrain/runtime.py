"""Per-process facts every trainer needs right before and after ``hvd.init()``."""

from __future__ import annotations

import fcntl
import os
import re
import socket
import struct

from ringtrain.errors import UserError


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
    Measured with bench/workers/torch_loop.py on 2 cores (BENCHMARKS.md): -np 2 went from 1156-1344 to
    1683-1899 images/s, -np 4 from 872-901 to 1739-1780.  A user's explicit setting wins.
    """
    env = os.environ if env is None else env
    local = ranks_on_this_host(env)
    if local and local >= available_cores():
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


def ranks_on_this_host(env: dict[str, str]) -> int | None:
    """How many ranks of this job share this host, as the launcher tells its ranks before
    ``MPI_Init``: mpirun and horovodrun (``OMPI_COMM_WORLD_LOCAL_SIZE``), else Slurm's ``srun``
    (``--mpi=pmix`` sets no ``OMPI_*`` rank variables; ``SLURM_STEP_TASKS_PER_NODE`` reads like
    ``2(x3),1``, one count per node, ``SLURM_NODEID`` picks ours).  None when nobody says."""
    local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    if local.isdigit():
        return int(local)
    per_node, node = env.get("SLURM_STEP_TASKS_PER_NODE", ""), env.get("SLURM_NODEID", "0")
    if not per_node or not node.isdigit():
        return None
    counts: list[int] = []
    for part in per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def first_on_this_host(env: dict[str, str] | None = None) -> bool:
    """Whether this process is its host's first rank (local rank 0) as the launcher says before
    ``hvd.init()`` (mpirun and horovodrun: ``OMPI_COMM_WORLD_LOCAL_RANK``; Gloo, elastic and Ray
    jobs: ``HOROVOD_LOCAL_RANK``; Slurm: ``SLURM_LOCALID``); True when nobody says (one process).
    For what one rank per host says: the host's own folders."""
    env = os.environ if env is None else env
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "SLURM_LOCALID"):
        value = env.get(name, "")
        if value.isdigit():
            return int(value) == 0
    return True


def uses_gloo(env: dict[str, str]) -> bool:
    """Whether ``hvd.init()`` will start Gloo: horovodrun --gloo and elastic jobs say so through
    these variables, and a user may set them for mpirun or a single process."""
    wanted = (env.get("HOROVOD_CONTROLLER", ""), env.get("HOROVOD_CPU_OPERATIONS", ""))
    return "gloo" in (w.lower() for w in wanted)


def interface_has_address(name: str) -> bool:
    """``name`` is a network interface here with an IPv4 or IPv6 address (what Gloo binds to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:  # SIOCGIFADDR: the interface's IPv4 address
            fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            return True
        except OSError:
            pass
    try:
        with open("/proc/net/if_inet6") as fh:
            return any(line.split()[-1] == name for line in fh if line.strip())
    except OSError:
        return False


def check_gloo_address(env: dict[str, str] | None = None) -> None:
    """Raise :class:`UserError` when Gloo could not find this host's address; call before
    ``hvd.init()``.

    Gloo binds to ``HOROVOD_GLOO_IFACE`` (horovodrun sets it) or, without it, to whatever this
    host's own name resolves to.  On a host whose name does not resolve (common in containers and
    on clusters) or with an interface that is not there, Horovod 0.28.1 crashed inside Gloo:
    a segfault in ``gloo::transport::tcp::CreateDeviceAttr`` on Debian 13, an abort here.  The
    patched build says it in one line; this says it before any framework or Horovod state exists.
    """
    env = os.environ if env is None else env
    if not uses_gloo(env):
        return
    iface = env.get("HOROVOD_GLOO_IFACE", "")
    if iface:
        if not hasattr(socket, "if_nameindex") or not os.path.exists("/proc/net"):
            return  # not Linux: let Gloo judge
        names = sorted(name for _, name in socket.if_nameindex())
        if iface not in names:
            raise UserError(f"HOROVOD_GLOO_IFACE={iface}: there is no such network interface on "
                            f"{socket.gethostname()} (it has: {', '.join(names)}); set it to one of "
                            f"those, or pick one with horovodrun --network-interfaces")
        if not interface_has_address(iface):
            raise UserError(f"HOROVOD_GLOO_IFACE={iface}: that interface has no IP address on "
                            f"{socket.gethostname()}; give it one or choose another interface")
        return
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise UserError(f"this host's name '{host}' does not resolve ({getattr(err, 'strerror', err)}) "
                        f"and Horovod's Gloo needs its address: add a line '127.0.1.1 {host}' (or its "
                        f"real address) to /etc/hosts, or set HOROVOD_GLOO_IFACE to a network "
                        f"interface ('ip -brief addr' lists them)") from None


def check_gpu_count(local_rank: int, local_size: int, gpus: int) -> None:
    """One GPU per rank: NCCL refuses two ranks on one GPU."""
    if local_rank >= gpus:
        raise UserError(f"{local_size} ranks on this host but only {gpus} GPU(s); run at most "
                        f"{gpus} processes per host")


def before_init(stall_timeout: float) -> None:
    """Everything that must be in the environment before ``hvd.init()``."""
    check_gloo_address()
    configure_stall_check(stall_timeout)
    configure_mpi_progress()
