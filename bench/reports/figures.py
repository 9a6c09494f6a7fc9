"""The comparisons sections 1, 3 and 4 of BENCHMARKS.md print, as numbers.

Computed here once, for the sections' tables (:mod:`bench.reports.report`) and for the headline table
(:mod:`bench.reports.report_headline`), so that a figure quoted at the top of the report is the figure its
section shows, never a second calculation that could drift from it.
"""

from __future__ import annotations

from bench.common import metrics
from bench.common.tables import ips

PEER = {"torch": ("ddp", "DDP (gloo, torchrun)"), "tf": ("mwms", "MultiWorkerMirroredStrategy")}


def trainer_nps(runs: list[dict], fw: str) -> list[int]:
    """The -np values the real trainer ran at (section 1's rows)."""
    return sorted({r["np"] for r in runs if r["framework"] == fw and r["kind"] == "trainer"})


def trainer_efficiency(runs: list[dict], fw: str, n: int) -> float | None:
    """Section 1's *scaling eff. (trainer)*: T(N) / (N x T(1)) of the trainer on MNIST."""
    tr = ips(runs, fw, "trainer", "horovod", "mnist", n)
    t1 = ips(runs, fw, "trainer", "horovod", "mnist", 1)
    return metrics.scaling_efficiency(tr, t1, n) if tr and t1 else None


def peer_nps(runs: list[dict], fw: str) -> list[int]:
    """The -np values the peer (DDP, MultiWorkerMirroredStrategy) ran at (section 3's rows)."""
    return sorted({r["np"] for r in runs if r["framework"] == fw and r["wrapper"] == PEER[fw][0]})


def peer_ratio(runs: list[dict], fw: str, n: int, wrapper: str = "horovod") -> float | None:
    """Section 3: the synthetic bench loop's images/s under Horovod (``horovod``: the MPI
    controller; ``horovod-gloo``) over the same loop under the peer, at -np ``n``."""
    return metrics.ratio(ips(runs, fw, "loop", wrapper, "synthetic", n),
                         ips(runs, fw, "loop", PEER[fw][0], "synthetic", n))


def allreduce_rows(runs: list[dict], n: int) -> dict[str, dict[int, dict]]:
    """Section 4 at -np ``n``: each implementation that ran, its rows by message size."""
    return {r["impl"]: {row["bytes"]: row for row in r["rows"]} for r in runs
            if r["np"] == n and r.get("ok")}


def horovod_over_mpi4py(by: dict[str, dict[int, dict]], nbytes: int) -> float | None:
    """Section 4's last column: Horovod's (MPI controller) allreduce time over mpi4py's
    ``Allreduce`` for one message size (``by``: :func:`allreduce_rows`)."""
    hv = by.get("horovod-mpi", {}).get(nbytes)
    ref = by.get("mpi4py-allreduce", {}).get(nbytes)
    return metrics.ratio(hv["seconds"], ref["seconds"]) if hv and ref else None
