"""The formulas the report rests on, kept pure so tests can pin them down.

Bandwidth conventions follow nccl-tests: *algorithm bandwidth* is what the caller sees (bytes of
the buffer / time); *bus bandwidth* rescales it by the traffic the algorithm puts through each
rank, so that it can be compared with a link's (here: memory's) bandwidth regardless of N.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import median


def algbw(nbytes: int, seconds: float) -> float:
    """Bytes per second as seen by the caller: buffer size / time."""
    return nbytes / seconds


def ring_bytes_per_rank(nbytes: int, world: int) -> float:
    """What each rank sends, and again receives, in a ring allreduce: reduce-scatter then
    allgather, each N-1 steps of K/N bytes, so 2(N-1)/N x K in each direction."""
    return 2 * (world - 1) / world * nbytes


def busbw(nbytes: int, seconds: float, world: int) -> float:
    """Ring allreduce bus bandwidth: 2(N-1)/N x bytes / time (nccl-tests' definition)."""
    return ring_bytes_per_rank(nbytes, world) / seconds


def ps_bytes_at_server(nbytes: int, world: int) -> int:
    """What the parameter server (rank 0) moves per exchange, both directions together: it
    receives K from each of the N-1 workers and sends K back to each, 2(N-1) x K."""
    return 2 * (world - 1) * nbytes


def ps_bytes_each_way_at_server(nbytes: int, world: int) -> int:
    """The server's traffic in one direction, (N-1) x K: N/2 times a ring rank's 2(N-1)/N x K,
    and it grows with N while the ring's stays below 2K."""
    return (world - 1) * nbytes


def ps_bytes_per_worker(nbytes: int) -> int:
    """A worker sends its K once and receives the K-byte sum once."""
    return 2 * nbytes


def median_of_max(per_rank_times: Sequence[Sequence[float]]) -> float:
    """Median over repetitions of the slowest rank's time: a collective is done when the last
    rank is done."""
    reps = zip(*per_rank_times, strict=True)
    return median(max(rep) for rep in reps)


def scaling_efficiency(throughput: float, base: float, world: int) -> float:
    """Conventional weak-scaling efficiency: T(N) / (N x T(1))."""
    return throughput / (world * base)


def core_limit(per_core: float, world: int, cores: int) -> float:
    """Images/s the machine's cores could do for N ranks: one single-thread rank's throughput
    per busy core, at most ``cores`` of them (a rank on a shared core gets a fraction of it)."""
    return per_core * min(world, cores)


def time_to_target(epochs: Iterable[dict], target: float) -> tuple[float | None, int | None]:
    """(cumulative training seconds, epoch number) of the first epoch whose test accuracy
    reaches ``target``; (None, None) if none did."""
    total = 0.0
    for rec in epochs:
        total += rec["seconds"]
        if rec["test_accuracy"] >= target:
            return total, rec["epoch"]
    return None, None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
