"""One rank of the background-loop checks (tests/test_horovod_loop.py), under horovodrun -np 2.

``python tests/loop_probe.py MODE OUT``; rank 0 writes OUT (JSON: every rank's results).

- ``threads``: three Python threads per rank issue collectives at once: synchronous
  ``allreduce_`` calls (whose thread runs the loop's rounds itself), batches of
  ``allreduce_async_`` waited for later (the background thread's rounds, as gradient hooks do),
  and synchronous ``broadcast_`` calls (enqueued with a wake-up, then driven by their thread).
  Every result is checked against its closed form.
- ``orders``: the ranks enqueue two synchronous allreduces from two threads in opposite orders, so
  the first rounds match nothing and the loop must retry until both are ready everywhere.
- ``sync``: the main thread alone makes 100 synchronous allreduces, then 20 batches of 5
  asynchronous ones waited for later; the loop counters say how many rounds a waiting caller ran
  (``caller_rounds``) in each part.
- ``names``: for allreduce, allgather, broadcast and reducescatter, an asynchronous collective
  named "dup" is polled until it is done, then the same name is enqueued again before the first
  handle is synchronized (refused: the name is still taken), and once more after it (accepted,
  and its result checked).
- ``late``: rank 1 comes 0.2 s late to each of 6 asynchronous allreduces of one name (from the
  second on, the response cache's rounds: the coordination's nonblocking wait, where the
  doorbell acts under MPI at -np 2); rank 0 records its whole process's CPU time and the wall
  time over those waits (the first, a cache miss, not counted), and every result is checked.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback

import horovod.torch as hvd
import torch
from horovod.torch.mpi_ops import _basics

from bench.workers import loopcounters, wait_worker


def in_threads(*targets) -> list[str]:
    """Run each target in its own thread; the errors they raised, as text."""
    errors: list[str] = []

    def guarded(fn):
        try:
            fn()
        except Exception:  # noqa: BLE001 - reported to the test, which fails on it
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=guarded, args=(fn,)) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def threads_mode(rank: int, size: int) -> dict:
    wrong: list[str] = []
    ranks_sum = size * (size - 1) / 2

    def sync_allreduces():
        for i in range(150):
            t = torch.full((1000,), float(rank + i))
            hvd.allreduce_(t, op=hvd.Sum, name=f"sync.{i}")
            if not torch.all(t == size * i + ranks_sum):
                wrong.append(f"sync.{i}: {t[0].item()}")

    def async_batches():
        for i in range(30):
            ts = [torch.full((300 + j,), float(10 * rank + j)) for j in range(5)]
            handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"async.{i}.{j}")
                       for j, t in enumerate(ts)]
            for j, (t, h) in enumerate(zip(ts, handles, strict=True)):
                hvd.synchronize(h)
                if not torch.all(t == 10 * ranks_sum + size * j):
                    wrong.append(f"async.{i}.{j}: {t[0].item()}")

    def sync_broadcasts():
        for i in range(60):
            t = torch.full((500,), float(rank))
            root = i % size
            hvd.broadcast_(t, root_rank=root, name=f"bcast.{i}")
            if not torch.all(t == root):
                wrong.append(f"bcast.{i}: {t[0].item()}")

    errors = in_threads(sync_allreduces, async_batches, sync_broadcasts)
    return {"errors": errors, "wrong": wrong}


def orders_mode(rank: int, size: int) -> dict:
    got: dict[str, float] = {}

    def reduce(name: str, delay: float):
        time.sleep(delay)
        t = torch.full((64,), float(rank + 1))
        hvd.allreduce_(t, op=hvd.Sum, name=name)
        got[name] = t[0].item()

    first, second = ("x", "y") if rank == 0 else ("y", "x")
    errors = in_threads(lambda: reduce(first, 0.0), lambda: reduce(second, 0.3))
    return {"errors": errors, "got": got, "expected": size * (size + 1) / 2}


def sync_mode(rank: int, size: int) -> dict:
    t = torch.zeros(1024)
    hvd.allreduce_(t, op=hvd.Sum, name="warm")
    before = loopcounters.read(_basics)
    wrong = 0
    for i in range(100):
        t.fill_(float(i))
        hvd.allreduce_(t, op=hvd.Sum, name="sync")
        wrong += int(not torch.all(t == size * i))
    after = loopcounters.read(_basics)
    # Then asynchronous ones, waited for later as a DistributedOptimizer does: the background
    # thread's rounds, whoever synchronizes.
    for _ in range(20):
        ts = [torch.full((256,), float(j)) for j in range(5)]
        handles = [hvd.allreduce_async_(t, op=hvd.Sum, name=f"async.{j}") for j, t in enumerate(ts)]
        for j, (t, h) in enumerate(zip(ts, handles, strict=True)):
            hvd.synchronize(h)
            wrong += int(not torch.all(t == size * j))
    final = loopcounters.read(_basics)
    return {"wrong": wrong, **{k: after[k] - before[k] for k in loopcounters.NAMES},
            "async_allreduce_calls": final["allreduce_calls"] - after["allreduce_calls"],
            "async_caller_rounds": final["caller_rounds"] - after["caller_rounds"]}


def names_mode(rank: int, size: int) -> dict:
    starts = {
        "allreduce": lambda t: hvd.allreduce_async_(t, op=hvd.Sum, name="dup"),
        "allgather": lambda t: hvd.allgather_async(t, name="dup"),
        "broadcast": lambda t: hvd.broadcast_async_(t, root_rank=0, name="dup"),
        "reducescatter": lambda t: hvd.reducescatter_async(t, op=hvd.Sum, name="dup"),
    }
    expected = {"allreduce": [size] * 4, "allgather": [1.0] * 4 * size, "broadcast": [1.0] * 4,
                "reducescatter": [size] * (4 // size)}
    refused: dict[str, str | None] = {}
    right: dict[str, bool] = {}
    for op, start in starts.items():
        first = start(torch.ones(4))
        while not hvd.poll(first):  # done on this rank: 0.28.1 had freed the name by now
            time.sleep(0.001)
        try:
            second = start(torch.ones(4))
        except ValueError as e:
            refused[op] = str(e)
        else:  # accepted on every rank alike: wait for it, so that the ranks stay in step
            hvd.synchronize(second)
            refused[op] = None
        hvd.synchronize(first)
        third = start(torch.ones(4))
        right[op] = hvd.synchronize(third).tolist() == expected[op]
    return {"refused": refused, "right": right}


def late_mode(rank: int, size: int) -> dict:
    results: list[list[float]] = []

    def call():
        i = len(results)
        results.append(hvd.synchronize(hvd.allreduce_async_(
            torch.full((1024,), float(rank + i)), op=hvd.Sum, name="late")).tolist())

    rows = wait_worker.late_calls(call, hvd.barrier, rank, 0.2, 5)
    wrong = sum(out != [float(size * i + size * (size - 1) // 2)] * 1024 for i, out in enumerate(results))
    return {"wrong": wrong, "cpu": sum(c for _, c in rows), "wall": sum(w for w, _ in rows)}


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    result = {"threads": threads_mode, "orders": orders_mode, "sync": sync_mode,
              "names": names_mode, "late": late_mode}[mode](rank, size)
    results = hvd.allgather_object(result, name="results")
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)
    hvd.shutdown()


if __name__ == "__main__":
    main()
