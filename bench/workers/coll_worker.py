"""One rank of the collectives benchmark: ``python -m bench.workers.coll_worker --impl IMPL ...``.

IMPL is ``hvd`` (``horovod.torch`` allreduce; the controller, MPI or Gloo, is the launcher's
choice; ``hvd-sleep``: the same, waited for by ``poll`` and a 0.5 ms sleep), ``mpi4py``
(``Comm.Allreduce``), ``torch`` (``torch.distributed`` over gloo, under ``torchrun``) or ``ps``
(a parameter server written with mpi4py point-to-point calls: every worker ``Send``s its buffer
to rank 0, which ``Recv``s and sums them and ``Send``s the sum back, so all traffic is explicit
and counted) or ``hier`` (hierarchical, with mpi4py: ``Reduce`` to one rank
per host, ``Allreduce`` among those, ``Bcast`` back on each host; a host is a network namespace)
or ``mpi4py-negotiated`` (the least a negotiating library must do per call: first an ``Allreduce``
of one 64-bit word with bitwise AND, which is Horovod's per-cycle ``CrossRankBitwiseAnd`` of its
response cache's bit vector for one cached tensor (``common/response_cache.cc``), then the data's
``Allreduce``; what Horovod costs beyond this is its own implementation, not its protocol).
Every op sums float32 buffers in place; before each timed repetition the buffer is refilled with
ones and the ranks meet at a barrier, and after it the result is checked (it must be N
everywhere).

``--count-iface IF``: every rank also reads the kernel's byte counters of interface IF (in its
own network namespace, ``/proc/net/dev``) before and after each size's timed repetitions, so the
bytes that really crossed each host's link are known per repetition (the emulated cluster,
``bench/parts/emulated_cluster.py``).  Every rank also records, over the same repetitions, its wall time, its
CPU time (all threads) and from the scheduler (``/proc/self/task/*/schedstat``) the time its
threads ran and the time they sat runnable on a run queue without a core: the last one is the
time a busy machine took from the collective (``bench/parts/cluster_cells.py``).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import numpy as np

from bench.common.metrics import median_of_max


class PSCounter:
    """Bytes a rank moved in the parameter-server exchange (checked against the formula)."""

    def __init__(self) -> None:
        self.sent = 0
        self.received = 0


def iface_bytes(iface: str, path: str = "/proc/net/dev") -> tuple[int, int]:
    """(tx, rx) bytes of ``iface`` so far, in the reading process's network namespace."""
    with open(path) as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise RuntimeError(f"no interface {iface!r} in {path}")


def parse_schedstat(text: str) -> tuple[float, float]:
    """One thread's ``schedstat`` line (``run_ns wait_ns slices``): (seconds on a CPU, seconds
    runnable but waiting for one)."""
    fields = text.split()
    return int(fields[0]) / 1e9, int(fields[1]) / 1e9


def sched_times(task_dir: str = "/proc/self/task") -> dict[str, tuple[float, float]]:
    """Per live thread of this process: (run, run-queue wait) seconds so far."""
    out = {}
    for tid in os.listdir(task_dir):
        try:
            with open(os.path.join(task_dir, tid, "schedstat")) as fh:
                out[tid] = parse_schedstat(fh.read())
        except OSError:  # the thread ended meanwhile
            continue
    return out


def sched_delta(before: dict, after: dict) -> dict:
    """Run and run-queue wait between two :func:`sched_times`, summed over the threads alive at
    both, and for the thread that ran most (the one doing the collective's work)."""
    deltas = [(after[t][0] - before[t][0], after[t][1] - before[t][1]) for t in after if t in before]
    busiest = max(deltas, default=(0.0, 0.0))
    return {"run_s": sum(d[0] for d in deltas), "runqueue_wait_s": sum(d[1] for d in deltas),
            "busiest_thread_run_s": busiest[0], "busiest_thread_wait_s": busiest[1],
            "threads": len(deltas)}


def autogroup(path: str = "/proc/self/autogroup") -> str | None:
    """The scheduler group of this process's session and its nice (``/autogroup-7887 nice 0``);
    None where the kernel has no autogroups."""
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return None


def host_id() -> str:
    """Which emulated host this rank is on: its network namespace (``net:[inode]``)."""
    return os.readlink("/proc/self/ns/net")


def hier_allreduce(comms, buf: np.ndarray) -> None:
    """Sum over all ranks in two levels: to the host's first rank, among hosts, back on the host."""
    local, cross, MPI = comms
    if local.Get_rank() == 0:
        local.Reduce(MPI.IN_PLACE, buf, op=MPI.SUM, root=0)
        cross.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        local.Reduce(buf, None, op=MPI.SUM, root=0)
    local.Bcast(buf, root=0)


def ps_allreduce(comm, buf: np.ndarray, tmp: np.ndarray, counter: PSCounter | None = None) -> None:
    """Sum ``buf`` over all ranks through rank 0: workers send, the server sums and sends back."""
    rank, size = comm.Get_rank(), comm.Get_size()
    counter = counter or PSCounter()
    if rank == 0:
        for src in range(1, size):
            comm.Recv(tmp, source=src, tag=7)
            counter.received += tmp.nbytes
            np.add(buf, tmp, out=buf)
        for dst in range(1, size):
            comm.Send(buf, dest=dst, tag=8)
            counter.sent += buf.nbytes
    else:
        comm.Send(buf, dest=0, tag=7)
        counter.sent += buf.nbytes
        comm.Recv(buf, source=0, tag=8)
        counter.received += buf.nbytes


class Backend:
    """The handful of calls the timing loop needs, per implementation."""

    def __init__(self, impl: str, numpy_buffers: bool = False) -> None:
        self.numpy_buffers = numpy_buffers
        # hvd-sleep: Horovod, but the rank waits for each allreduce by polling with a sleep
        # instead of horovod.torch's synchronous wait, which spins on std::this_thread::yield()
        # (torch/mpi_ops_v2.cc: WaitAndClear) and so takes a core for the whole collective
        self.sleep_wait = impl == "hvd-sleep"
        impl = self.impl = "hvd" if self.sleep_wait else impl
        self.counter = PSCounter()
        if impl == "hvd":
            import horovod.torch as hvd
            import torch

            hvd.init()
            torch.set_num_threads(1)
            self.hvd, self.torch = hvd, torch
            self.rank, self.size = hvd.rank(), hvd.size()
            self.controller = "mpi" if hvd.mpi_enabled() else "gloo"
        elif impl == "torch":
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")
            torch.set_num_threads(1)
            self.dist, self.torch = dist, torch
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.controller = "gloo"
        else:
            from mpi4py import MPI

            self.comm, self.MPI = MPI.COMM_WORLD, MPI
            self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
            self.controller = "mpi"
            self.bits = np.full(1, -1, dtype=np.int64)  # every bit set: the AND keeps them all
            if impl == "hier":
                hosts = sorted(set(self.comm.allgather(host_id())))
                local = self.comm.Split(hosts.index(host_id()), self.rank)
                cross = self.comm.Split(local.Get_rank(), self.rank)
                self.hier = (local, cross, MPI)

    def buffer(self, nbytes: int) -> Any:
        n = nbytes // 4
        if self.impl in ("hvd", "torch"):
            if self.numpy_buffers:
                return self.torch.from_numpy(np.ones(n, dtype=np.float32))
            return self.torch.ones(n, dtype=self.torch.float32)
        self.tmp = np.empty(n, dtype=np.float32)
        return np.ones(n, dtype=np.float32)

    def refill(self, buf) -> None:
        if self.impl in ("hvd", "torch"):
            buf.fill_(1.0)
        else:
            buf.fill(1.0)

    def allreduce(self, buf) -> None:
        if self.impl == "hvd" and self.sleep_wait:
            handle = self.hvd.allreduce_async_(buf, op=self.hvd.Sum, name="bench")
            while not self.hvd.poll(handle):
                time.sleep(0.5e-3)
            self.hvd.synchronize(handle)
        elif self.impl == "hvd":
            self.hvd.allreduce_(buf, op=self.hvd.Sum, name="bench")
        elif self.impl == "torch":
            self.dist.all_reduce(buf)
        elif self.impl == "mpi4py":
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        elif self.impl == "mpi4py-negotiated":
            self.comm.Allreduce(self.MPI.IN_PLACE, self.bits, op=self.MPI.BAND)
            self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        elif self.impl == "hier":
            hier_allreduce(self.hier, buf)
        else:
            ps_allreduce(self.comm, buf, self.tmp, self.counter)

    def barrier(self) -> None:
        if self.impl == "hvd":
            self.hvd.barrier()
        elif self.impl == "torch":
            self.dist.barrier()
        else:
            self.comm.Barrier()

    def bcast(self, obj):
        if self.impl == "hvd":
            return self.hvd.broadcast_object(obj, root_rank=0, name="bench_bcast")
        if self.impl == "torch":
            box = [obj]
            self.dist.broadcast_object_list(box, src=0)
            return box[0]
        return self.comm.bcast(obj, root=0)

    def close(self) -> None:
        """End torch.distributed cleanly: a rank 0 that hosts the rendezvous store (launched
        without torchrun) otherwise aborts at exit ("terminate called without an active
        exception")."""
        if self.impl == "torch":
            self.dist.destroy_process_group()

    def gather(self, obj) -> list:
        if self.impl == "hvd":
            return self.hvd.allgather_object(obj, name="bench_gather")
        if self.impl == "torch":
            out = [None] * self.size
            self.dist.all_gather_object(out, obj)
            return out
        return self.comm.allgather(obj)


def measure(be: Backend, nbytes: int, warmup: int, reps: int, budget: float,
            iface: str | None = None, warmup_s: float = 0.0) -> dict:
    buf = be.buffer(nbytes)
    t_est = 0.0
    for _ in range(warmup):
        be.refill(buf)
        t0 = time.perf_counter()
        be.allreduce(buf)
        t_est = time.perf_counter() - t0
    # Then enough more for about ``warmup_s`` seconds (rank 0's estimate decides for all): at a
    # job's start two busy ranks can share one core for a few milliseconds before the scheduler
    # moves one (seen: 4-64 KiB Horovod allreduces 4x slower in the first ~10 ms of a job at -np 2
    # on 2 cores), longer than a small size's whole measurement.
    if warmup_s > 0:
        for _ in range(be.bcast(int(min(100_000, warmup_s // max(t_est, 1e-6))))):
            be.refill(buf)
            be.allreduce(buf)
    # as many repetitions as fit in the budget, between 3 and ``reps``; rank 0 decides for all
    n = be.bcast(int(min(reps, max(3, budget // max(t_est, 1e-6)))))
    be.counter.sent = be.counter.received = 0
    times = []
    if iface:
        be.barrier()
        before = iface_bytes(iface)
    clock0, cpu0, sched0 = time.perf_counter(), time.process_time(), sched_times()
    for _ in range(n):
        be.refill(buf)
        be.barrier()
        t0 = time.perf_counter()
        be.allreduce(buf)
        times.append(time.perf_counter() - t0)
        if float(buf[0]) != be.size or float(buf[-1]) != be.size:
            raise RuntimeError(f"{be.impl}: wrong sum {float(buf[0])} (expected {be.size})")
    cpu = {"wall_s": time.perf_counter() - clock0, "cpu_s": time.process_time() - cpu0,
           "nice": os.getpriority(os.PRIO_PROCESS, 0), "autogroup": autogroup(),
           "cores": sorted(os.sched_getaffinity(0)), "host": host_id(),
           **sched_delta(sched0, sched_times())}
    link = None
    if iface:
        be.barrier()  # every rank's sends have left: all of this size's frames are counted
        after = iface_bytes(iface)
        link = be.gather({"host": host_id(), "tx": (after[0] - before[0]) / n,
                          "rx": (after[1] - before[1]) / n})
    all_times = be.gather(times)
    counts = be.gather((be.counter.sent // n, be.counter.received // n))
    return {"bytes": nbytes, "reps": n, "seconds": median_of_max(all_times),
            "min_seconds": min(max(rep) for rep in zip(*all_times, strict=True)),
            "moved_bytes_per_rank": [list(c) for c in counts] if be.impl == "ps" else None,
            "link_bytes_per_rank": link, "cpu_per_rank": be.gather(cpu)}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--impl", required=True,
                   choices=("hvd", "hvd-sleep", "mpi4py", "mpi4py-negotiated", "torch", "ps", "hier"))
    p.add_argument("--sizes", required=True, help="comma-separated byte counts")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--warmup-s", type=float, default=0.0,
                   help="warm up each size for at least this many seconds too")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--budget", type=float, default=4.0, help="seconds per size, roughly")
    p.add_argument("--out", required=True)
    p.add_argument("--count-iface", default=None, help="count this interface's bytes per size")
    # numpy advises the kernel to back arrays of 4 MiB and up with huge pages, torch's allocator
    # does not, and at 16 MiB that alone moved an allreduce at -np 2 by 1.4-1.6x for either
    # library (horovod.torch 1.64-1.87 ms on a numpy-allocated tensor against 2.30-2.57 on
    # torch.ones; mpi4py 1.47-1.59 against 2.39-2.40; 2026-11-26)
    p.add_argument("--numpy-buffers", action="store_true",
                   help="torch implementations reduce numpy-allocated memory too (torch.from_numpy), "
                        "so every implementation works on the same kind of buffer")
    args = p.parse_args()
    be = Backend(args.impl, numpy_buffers=args.numpy_buffers)
    rows = [measure(be, int(s), args.warmup, args.reps, args.budget, args.count_iface, args.warmup_s)
            for s in args.sizes.split(",")]
    if be.rank == 0:
        from bench.common.util import write_json

        write_json(args.out, {"impl": args.impl, "controller": be.controller, "world_size": be.size,
                              "rows": rows})
    be.close()


if __name__ == "__main__":
    main()
