"""The cost of an allreduce on a network, as formulas: what the textbook predicts, what the
kernel's byte counters say went through each link, an alpha-beta model fitted to measured times,
and training-step predictions from it.  Pure functions (no processes, no I/O), so tests pin them.

Conventions.  K: bytes of the buffer.  N: ranks.  B: a link's rate in bytes/s, each way (links
are full duplex).  A ring allreduce (reduce-scatter + allgather) sends and receives 2(N-1)/N x K
per rank, in 2(N-1) steps of K/N: T_ring = 2(N-1)/N x K / B.  The parameter server
(``bench/workers/coll_worker.py: ps_allreduce``) takes (N-1) x K in through its link, sums, and sends
(N-1) x K out; the sum needs every input first, so the two phases add up: T_ps = 2(N-1) x K / B.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# TCP payload per byte on the wire at MTU 1500: 1448 bytes of data (20 IP + 32 TCP header bytes
# with timestamps) per 1514-byte Ethernet frame as the kernel counts it.  A shaped link of rate
# B can carry at most this fraction of B as data.
TCP_PAYLOAD_FRACTION = 1448 / 1514


def ring_link_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each way through a host's link in a ring over ``ranks`` ranks placed host by host
    (one ring edge enters and one leaves each host, whatever the ranks per host)."""
    return 2 * (ranks - 1) / ranks * nbytes


def ps_link_bytes(nbytes: float, ranks: int) -> float:
    """Bytes each way through the server's link: (N-1) x K in, and again out."""
    return (ranks - 1) * nbytes


def formula_link_bytes(kind: str, nbytes: float, ranks: int, hosts: int) -> float:
    """What the busiest link should carry each way, by algorithm: ``ring``, ``ps``, or ``hier``
    (reduce on each host, a ring among the hosts' leaders, broadcast on each host)."""
    if kind == "ps":
        return ps_link_bytes(nbytes, ranks)
    if kind == "hier":
        return ring_link_bytes(nbytes, hosts)
    return ring_link_bytes(nbytes, ranks)


def formula_seconds(kind: str, nbytes: float, ranks: int, hosts: int, link_bytes_per_s: float) -> float:
    """The bandwidth term alone: the busiest link's bytes over its rate (a ring's send and
    receive overlap on a full-duplex link; the server's in and out phases do not)."""
    each_way = formula_link_bytes(kind, nbytes, ranks, hosts)
    return (2 * each_way if kind == "ps" else each_way) / link_bytes_per_s


def busiest_link(per_rank: Sequence[dict]) -> dict:
    """From every rank's counters for one size (``{"host", "tx", "rx"}`` per repetition), the
    hosts seen and the busiest link direction: ranks on one host read the same interface, so
    each host counts once."""
    by_host: dict[str, dict] = {}
    for rec in per_rank:
        by_host.setdefault(rec["host"], rec)
    top = max(by_host.values(), key=lambda r: max(r["tx"], r["rx"]))
    return {"hosts_seen": len(by_host), "busiest_bytes": max(top["tx"], top["rx"]),
            "per_host": [{"tx": r["tx"], "rx": r["rx"]} for r in by_host.values()]}


# -- alpha-beta -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class AlphaBeta:
    """T(K, N) = c + 2(N-1) x alpha + w(K, N) x beta, with w the bytes the algorithm serialises
    through the busiest link (ring: 2(N-1)/N x K; server: 2(N-1) x K): ``c`` is a fixed cost per
    collective (Horovod's negotiation and cycle), ``alpha`` the cost of one of the algorithm's
    sequential steps, ``1/beta`` the bandwidth it achieves."""

    c: float
    alpha: float
    beta: float
    kind: str = "ring"
    points: int = 0
    max_rel_error: float = 0.0
    median_rel_error: float = 0.0

    def seconds(self, nbytes: float, ranks: int) -> float:
        return self.c + 2 * (ranks - 1) * self.alpha + serial_bytes(self.kind, nbytes, ranks) * self.beta

    @property
    def bandwidth(self) -> float:
        return 1 / self.beta if self.beta > 0 else math.inf


def serial_bytes(kind: str, nbytes: float, ranks: int) -> float:
    return 2 * (ranks - 1) * nbytes if kind == "ps" else ring_link_bytes(nbytes, ranks)


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares by the normal equations on unit-norm columns (a handful of unknowns whose
    scales differ by 10^8: 1 s, 2(N-1) steps, bytes; no numpy needed)."""
    k = len(rows[0])
    norms = [math.sqrt(sum(r[i] ** 2 for r in rows)) or 1.0 for i in range(k)]
    rows = [[r[i] / norms[i] for i in range(k)] for r in rows]
    a = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    b = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gauss-Jordan with partial pivoting
        piv = max(range(col, k), key=lambda i: abs(a[i][col]))
        if abs(a[piv][col]) <= 1e-12:
            raise ValueError("singular fit: the points do not separate the terms")
        a[col], a[piv], b[col], b[piv] = a[piv], a[col], b[piv], b[col]
        for i in range(k):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
                b[i] -= f * b[col]
    return [b[i] / a[i][i] / norms[i] for i in range(k)]


def fit_alpha_beta(points: Iterable[tuple[float, int, float]], kind: str = "ring") -> AlphaBeta:
    """Fit c, alpha, beta >= 0 to (K, N, seconds) points, minimising relative error (so that
    64 KiB counts as much as 64 MiB).  A term whose best value would be negative is dropped
    (set to 0, the fixed cost before the per-step latency) and the rest refitted; with a single
    N, c and alpha cannot be told apart and alpha is left out."""
    pts = list(points)
    # one N only: c and 2(N-1) x alpha are the same term
    free = ["c", "alpha", "beta"] if len({n for _, n, _ in pts}) > 1 else ["c", "beta"]
    while True:
        def features(k: float, n: int) -> list[float]:
            f = {"c": 1.0, "alpha": 2.0 * (n - 1), "beta": serial_bytes(kind, k, n)}
            return [f[name] for name in free]
        rows = [[x / t for x in features(k, n)] for k, n, t in pts]
        sol = dict(zip(free, _lstsq(rows, [1.0] * len(pts)), strict=True))
        negative = [name for name in free if sol[name] < 0]
        if not negative:
            break
        free.remove(negative[0])  # c first, then alpha: the bandwidth term always stays
    model = AlphaBeta(sol.get("c", 0.0), sol.get("alpha", 0.0), sol.get("beta", 0.0), kind, len(pts))
    errs = sorted(abs(model.seconds(k, n) / t - 1) for k, n, t in pts)
    return AlphaBeta(model.c, model.alpha, model.beta, kind, len(pts), errs[-1], errs[len(errs) // 2])


# -- training -------------------------------------------------------------------------------------

def predicted_step(compute_s: float, allreduce_s: float, overlap: float = 0.0) -> float:
    """A data-parallel step: compute, then the gradient allreduce, of which ``overlap`` (0..1)
    hides behind the backward pass.  0: every allreduce after the backward pass (one grouped
    allreduce after the tape); up to 1 when allreduces start during backward as gradients become
    ready (Horovod's PyTorch optimizer from hooks, its TensorFlow optimizer in the step's graph)."""
    return compute_s + (1 - overlap) * allreduce_s


def implied_overlap(compute_s: float, comm_s: float, efficiency: float) -> float:
    """The share of the communication that must have been hidden behind compute for a step of
    ``compute_s`` + exposed communication to reach ``efficiency`` (inverse of
    :func:`predicted_step`)."""
    exposed = compute_s / efficiency - compute_s
    return 1 - exposed / comm_s if comm_s > 0 else 1.0


def projected_efficiency(compute_s: float, grad_bytes: float, workers: int, gpus_per_server: int,
                         link_bits_per_s: float, alpha: float, c: float, fusion_bytes: float,
                         payload_fraction: float = TCP_PAYLOAD_FRACTION, overlap: float = 0.0) -> dict:
    """Scaling efficiency of synchronous data parallelism at ``workers`` GPUs, 4 per server as in
    the Horovod paper: the gradient allreduce crosses servers once per fusion buffer (a ring among
    S = workers / gpus_per_server servers; traffic inside a server is not the bottleneck and is
    left out), each buffer paying the fixed cost c and 2(S-1) steps of alpha, and the bytes
    2(S-1)/S x K at the link's data rate.  efficiency = compute / step."""
    servers = max(1, workers // gpus_per_server)
    buffers = max(1, math.ceil(grad_bytes / fusion_bytes)) if servers > 1 else 0
    rate = link_bits_per_s / 8 * payload_fraction
    latency = buffers * (c + 2 * (servers - 1) * alpha)
    transfer = ring_link_bytes(grad_bytes, servers) / rate if servers > 1 else 0.0
    comm = latency + transfer
    step = predicted_step(compute_s, comm, overlap)
    return {"workers": workers, "servers": servers, "comm_s": comm, "latency_s": latency,
            "transfer_s": transfer, "step_s": step, "efficiency": compute_s / step}
