"""What machine the numbers come from, and its physical limits.

The limits the report holds results against: the cores (compute) and the memory's copy bandwidth
(a collective on one host moves every byte through memory).  Versions are read from package
metadata, without importing the frameworks into the driver process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
import signal
import subprocess
import time
from importlib import metadata

import numpy as np

from ringtrain.runtime import available_cores

PACKAGES = ("torch", "tensorflow-cpu", "tensorflow", "keras", "horovod", "mpi4py", "numpy")


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return round(pages * size / 2**30, 1)
    except (ValueError, OSError):
        return None


def open_mpi_version() -> str | None:
    try:
        out = subprocess.run(["mpirun", "--version"], capture_output=True, text=True, timeout=30).stdout
        return out.splitlines()[0].strip() if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str]:
    found = {}
    for pkg in PACKAGES:
        try:
            found[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    found["python"] = platform.python_version()
    mpi = open_mpi_version()
    if mpi:
        found["mpi"] = mpi
    return found


def copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    """Bytes copied per second by one core (numpy ``copyto``, best of ``reps``): STREAM's "copy"
    counted once per byte, the way collective bandwidths are counted."""
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def _copy_worker(args: tuple[int, int, object]) -> float:
    nbytes, reps, barrier = args
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(reps):
        np.copyto(dst, src)
    return nbytes * reps / (time.perf_counter() - t0)


def aggregate_copy_bandwidth(procs: int, nbytes: int = 128 << 20, reps: int = 8) -> float:
    """All cores copying at once (one process each): the memory system's total copy rate."""
    ctx = mp.get_context("fork")
    # The forked helpers must die on the SIGTERM that Pool and Manager end them with: with the
    # driver's SystemExit handler (util.terminate_as_exit) they inherit, 1 run in 6 hung there.
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with ctx.Manager() as manager:
            barrier = manager.Barrier(procs)
            with ctx.Pool(procs) as pool:
                rates = pool.map(_copy_worker, [(nbytes, reps, barrier)] * procs)
    finally:
        signal.signal(signal.SIGTERM, handler)
    return float(sum(rates))


def describe(measure: bool = True, copy_bytes: int = 256 << 20) -> dict:
    cores = available_cores()
    info = {"cpu_model": cpu_model(), "cores": cores, "logical_cpus": os.cpu_count(),
            "memory_gib": memory_gib(), "os": f"{platform.system()} {platform.release()}",
            "hostname": platform.node(), "versions": versions()}
    if measure:
        info["copy_bandwidth_1core"] = copy_bandwidth(copy_bytes)
        info["copy_bandwidth_all_cores"] = aggregate_copy_bandwidth(cores, copy_bytes // 2)
        try:
            info["load_average_at_start"] = list(os.getloadavg())
        except OSError:
            pass
    return info
