"""Part 4: allreduce implementations against each other and against the memory's bandwidth.

Same float32 buffers, same sizes, same timing loop (:mod:`bench.workers.coll_worker`) for: Horovod with
its MPI controller and with Gloo (both under ``horovodrun``), mpi4py's ``Allreduce`` (raw
``mpirun``), ``torch.distributed`` gloo (``torchrun``), and the mpi4py parameter server.
"""

from __future__ import annotations

from pathlib import Path

from bench.common import metrics, util
from bench.parts.config import Config

IMPLS = {  # name -> (worker --impl, launcher)
    "horovod-mpi": ("hvd", "horovodrun"),
    "horovod-gloo": ("hvd", "horovodrun-gloo"),
    "mpi4py-allreduce": ("mpi4py", "mpirun"),
    "torch-gloo": ("torch", "torchrun"),
    "mpi4py-param-server": ("ps", "mpirun"),
}


def command(impl: str, launcher: str, np: int, args: list[str]) -> list[str]:
    inner = [util.PY, "-m", "bench.workers.coll_worker", "--impl", impl, *args]
    if launcher == "horovodrun":
        return util.horovodrun(np, inner)
    if launcher == "horovodrun-gloo":
        return util.horovodrun(np, inner, gloo=True)
    if launcher == "mpirun":
        return util.mpirun(np, inner)
    return util.torchrun(np, inner)


def enrich(rows: list[dict], np: int, ps: bool) -> list[dict]:
    """Add algorithm bandwidth, bus bandwidth and the bytes through the busiest rank.

    ``busbw`` is the ring formula for every implementation (the same rescaling of the time for
    all, so curves compare like times); ``busiest_rank_bytes`` is what the busiest rank really
    sends (and again receives): 2(N-1)/N x K in a ring, (N-1) x K at the parameter server.
    """
    for row in rows:
        k, t = row["bytes"], row["seconds"]
        row["algbw"] = metrics.algbw(k, t)
        if ps:
            row["busiest_rank_bytes"] = metrics.ps_bytes_each_way_at_server(k, np)
        else:
            row["busiest_rank_bytes"] = metrics.ring_bytes_per_rank(k, np)
        row["busbw"] = metrics.busbw(k, t, np)
        row["busiest_rank_bw"] = row["busiest_rank_bytes"] / t
    return rows


def run_part(cfg: Config, out: Path) -> dict:
    records = []
    for np in cfg.coll_nps:
        for name, (impl, launcher) in IMPLS.items():
            work = out / "tmp" / f"coll_{name}_np{np}"
            work.mkdir(parents=True, exist_ok=True)
            res_path = work / "result.json"
            res_path.unlink(missing_ok=True)
            args = ["--sizes", ",".join(map(str, cfg.coll_sizes)), "--warmup", str(cfg.coll_warmup),
                    "--reps", str(cfg.coll_reps), "--budget", str(cfg.coll_budget_s),
                    "--out", str(res_path)]
            util.say(f"collectives {name} np{np} ...")
            res = util.run(command(impl, launcher, np, args), timeout=cfg.timeout_s,
                           log=work / "output.log")
            rec = {"impl": name, "np": np, "launcher": launcher, "ok": res.ok and res_path.exists(),
                   "wall_seconds": round(res.seconds, 1)}
            if rec["ok"]:
                doc = util.read_json(res_path)
                rec["controller"] = doc["controller"]
                rec["rows"] = enrich(doc["rows"], np, ps=impl == "ps")
                big = rec["rows"][-1]
                util.say(f"collectives {name} np{np}: {big['bytes'] >> 20} MiB in "
                         f"{big['seconds'] * 1e3:.1f} ms, busbw {big['busbw'] / 1e9:.2f} GB/s")
            else:
                rec["error"] = util.tail(res.output, 25)
                util.say(f"collectives {name} np{np} FAILED; log: {work / 'output.log'}")
            records.append(rec)
    return {"sizes": cfg.coll_sizes, "runs": records}
