"""Part ``ps``: parameter servers (``--strategy ps``) against the ring, on the real trainer
(PyTorch, MNIST's CNN).  Three tables, each from one run per cell:

* **staleness**: the test accuracy after a fixed number of gradient applications (the same
  epochs of the same data) for staleness 0, 1, 4, 16 and inf, with momentum 0 and 0.9, and the
  staleness the servers measured (mean, largest, updates behind per applied gradient);
* **straggler**: one of the workers computing at half speed (``bench/workers/straggler.py``: a sleep as
  long as each of its forward + backward passes), and the training seconds to a target test
  accuracy for the ring, and the servers at staleness 0, 4 and inf;
* **link** (root: network-namespace hosts, ``bench/common/netns_hosts.py``): bytes per step through the
  server's host link, counted by the kernel, against T_ps = 2(N-1) x K (in (N-1) x K, out
  (N-1) x K), next to the ring's per host link against T_ring = 2(N-1)/N x K each way, on 2 and
  4 hosts.  Bytes per step = the difference between a run of ``2e`` and one of ``e`` epochs,
  divided by the steps in between, so that start-up (Horovod's, the data's, the first weights)
  cancels out; what is left is the steps' traffic plus each epoch's end (the servers' last
  weights to every worker, the next epoch's first pull, the evaluation's sums).

Everything runs on this machine's cores, shared by every rank: the ranks of a cell compete for 2
cores, so times compare cells measured in one run, at the load recorded with it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import costmodel, util
from bench.common import netns_hosts as nh
from bench.common.metrics import time_to_target

MODULE = "launch.torch_mnist"
STALENESS = ["0", "1", "4", "16", "inf"]


@dataclass
class PSConfig:
    quick: bool = False
    workers: int = 4                       # staleness table: 4 workers + 1 server
    train_samples: int = 8192
    test_samples: int = 2000
    epochs: int = 2
    staleness: list[str] = field(default_factory=lambda: list(STALENESS))
    momenta: list[float] = field(default_factory=lambda: [0.0, 0.9])
    straggler_workers: int = 3
    straggler_factor: float = 1.0          # its compute takes 1 + F times as long
    straggler_samples: int = 6144
    straggler_epochs: int = 6
    straggler_staleness: list[str] = field(default_factory=lambda: ["0", "4", "inf"])
    straggler_ring: bool = True            # the ring's cell too (the smoke run leaves it out)
    target: float = 0.95
    link_hosts: list[int] = field(default_factory=lambda: [2, 4])
    link_samples: int = 3072
    link_epochs: int = 1                   # the short run; the long one runs twice as many
    batch_size: int = 32
    timeout_s: float = 900

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> PSConfig:
    return PSConfig()


def quick() -> PSConfig:
    return PSConfig(quick=True, train_samples=2048, test_samples=500, epochs=1, momenta=[0.9],
                    staleness=["0", "inf"], straggler_samples=1536, straggler_epochs=2,
                    straggler_staleness=["inf"], target=0.5, link_hosts=[2], link_samples=1024)


def smoke() -> PSConfig:
    """One cell of each table, a few steps each (the straggler's: the servers under the
    wrapper; the ring's cell is the same wrapper around the ring's trainer)."""
    return PSConfig(quick=True, workers=2, train_samples=256, test_samples=100, epochs=1,
                    staleness=["inf"], momenta=[0.9], straggler_workers=2, straggler_samples=256,
                    straggler_epochs=1, straggler_staleness=["4"], straggler_ring=False,
                    target=0.0, link_hosts=[2],
                    link_samples=256, timeout_s=300)


def trainer_args(cfg: PSConfig, samples: int, epochs: int, metrics: Path) -> list[str]:
    return ["--train-samples", str(samples), "--test-samples", str(cfg.test_samples),
            "--batch-size", str(cfg.batch_size), "--epochs", str(epochs), "--no-progress",
            "--metrics-out", str(metrics)]


def ps_args(staleness: str, servers: int = 1) -> list[str]:
    return ["--strategy", "ps", "--ps-servers", str(servers), "--staleness", staleness]


def launch(name: str, np: int, inner: list[str], out: Path, timeout: float) -> dict:
    """One horovodrun job on this host; its summary (``--metrics-out``, the last flag pair of
    ``inner``) or the tail of its output."""
    work = out / "tmp" / "ps" / name.replace("/", "_")
    metrics = Path(inner[inner.index("--metrics-out") + 1])
    metrics.unlink(missing_ok=True)
    res = util.run(util.horovodrun(np, inner), env=util.base_env(OMP_NUM_THREADS="1"),
                   timeout=timeout, log=work / "output.log")
    rec = {"name": name, "np": np, "ok": res.ok and metrics.exists(),
           "wall_seconds": round(res.seconds, 1)}
    if rec["ok"]:
        rec["summary"] = util.read_json(metrics)
    else:
        rec["error"] = util.tail(res.output, 25)
        util.say(f"{name} FAILED; log: {work / 'output.log'}")
    return rec


def staleness_stats(ps: dict) -> dict:
    """Mean and largest staleness (updates behind) of the applied gradients, from server 0's
    histogram."""
    hist = {int(k): v for k, v in ps["staleness_histogram"].items()}
    n = sum(hist.values())
    return {"mean": sum(k * v for k, v in hist.items()) / n if n else 0.0,
            "max": max(hist) if hist else 0, "applied": n}


def staleness_table(cfg: PSConfig, out: Path) -> list[dict]:
    rows = []
    for momentum in cfg.momenta:
        for k in cfg.staleness:
            name = f"staleness/m{momentum:g}/k{k}"
            metrics = out / "tmp" / "ps" / f"staleness_m{momentum:g}_k{k}.json"
            metrics.parent.mkdir(parents=True, exist_ok=True)
            inner = [util.PY, "-m", MODULE, *ps_args(k), "--momentum", str(momentum),
                     *trainer_args(cfg, cfg.train_samples, cfg.epochs, metrics)]
            util.say(f"{name} ...")
            rec = launch(name, cfg.workers + 1, inner, out, cfg.timeout_s)
            row = {"name": name, "momentum": momentum, "staleness": k, "ok": rec["ok"],
                   "wall_seconds": rec["wall_seconds"]}
            if rec["ok"]:
                s = rec["summary"]
                row.update(test_accuracy=s["final_test_accuracy"], test_loss=s["final_test_loss"],
                           train_seconds=s["total_seconds"], applied=s["ps"]["gradients_applied"][0],
                           histogram=s["ps"]["staleness_histogram"], **{
                               f"staleness_{key}": v for key, v in staleness_stats(s["ps"]).items()})
                util.say(f"{name}: {100 * row['test_accuracy']:.2f}% after {row['applied']} "
                         f"gradients, staleness mean {row['staleness_mean']:.2f} max "
                         f"{row['staleness_max']}")
            else:
                row["error"] = rec["error"]
            rows.append(row)
    return rows


def straggler_table(cfg: PSConfig, out: Path) -> list[dict]:
    n, rows = cfg.straggler_workers, []
    cells = [("ring", [], n, n - 1)] if cfg.straggler_ring else []
    cells += [(f"ps staleness {k}", ps_args(k), n + 1, n) for k in cfg.straggler_staleness]
    for label, extra, np, slow in cells:
        name = f"straggler/{label.replace(' ', '-')}"
        metrics = out / "tmp" / "ps" / f"{name.replace('/', '_')}.json"
        metrics.parent.mkdir(parents=True, exist_ok=True)
        inner = [util.PY, "-m", "bench.workers.straggler", "--slow-rank", str(slow), "--factor",
                 str(cfg.straggler_factor), *extra,
                 *trainer_args(cfg, cfg.straggler_samples, cfg.straggler_epochs, metrics)]
        util.say(f"{name} (rank {slow} at 1/{1 + cfg.straggler_factor:g} speed) ...")
        rec = launch(name, np, inner, out, cfg.timeout_s)
        row = {"name": name, "label": label, "np": np, "slow_rank": slow, "ok": rec["ok"],
               "wall_seconds": rec["wall_seconds"]}
        if rec["ok"]:
            s = rec["summary"]
            seconds, epoch = time_to_target(s["epochs"], cfg.target)
            row.update(seconds_to_target=seconds, epoch_reached=epoch,
                       accuracies=[e["test_accuracy"] for e in s["epochs"]],
                       epoch_seconds=[e["seconds"] for e in s["epochs"]],
                       final_test_accuracy=s["final_test_accuracy"])
            if s.get("ps"):
                ps = s["ps"]
                row.update(worker_batches=ps["worker_batches"], handed_over=ps["batches_handed_over"],
                           worker_wait_seconds=ps["worker_wait_seconds"],
                           worker_seconds=ps["worker_seconds"], **{
                               f"staleness_{key}": v for key, v in staleness_stats(ps).items()})
            util.say(f"{name}: {seconds if seconds is None else round(seconds, 1)} s to "
                     f"{cfg.target:.0%}, epochs {[round(x, 1) for x in row['epoch_seconds']]} s")
        else:
            row["error"] = rec["error"]
        rows.append(row)
    return rows


def link_table(cfg: PSConfig, out: Path) -> dict:
    """The server's host link against T_ps, the ring's against T_ring (root only)."""
    reason = nh.why_unavailable()
    if reason:
        return {"skipped": reason}
    from bench.parts.emulated_cluster import IFACE, PREFIX, Cluster

    names = [f"rtc-h{i}" for i in range(1, max(cfg.link_hosts) + 1)]
    rows = []
    with nh.make_hosts(names, prefix=PREFIX, subnet="10.252.0", iface=IFACE, hostnames=True) as hosts:
        cl = Cluster(hosts, out, cfg.timeout_s)
        head = hosts.hosts[0]
        for n in cfg.link_hosts:
            for strategy, extra in (("ring", []), ("ps", ps_args("inf"))):
                counted = {}
                for epochs in (cfg.link_epochs, 2 * cfg.link_epochs):
                    name = f"link/{strategy}/h{n}/e{epochs}"
                    metrics = cl.work(name) / "metrics.json"
                    metrics.unlink(missing_ok=True)
                    inner = [util.PY, "-m", MODULE, *extra,
                             *trainer_args(cfg, cfg.link_samples, epochs, metrics)]
                    before = hosts.counters(head)
                    util.say(f"{name} ...")
                    res = cl.run(name, "horovodrun", n, 1, inner)
                    after = hosts.counters(head)
                    if not (res.ok and metrics.exists()):
                        rows.append({"name": name, "ok": False, "error": util.tail(res.output, 25)})
                        break
                    counted[epochs] = ({d: after[d] - before[d] for d in ("rx", "tx")},
                                       util.read_json(metrics))
                if len(counted) < 2:
                    continue
                (short, s1), (long_, s2) = counted[cfg.link_epochs], counted[2 * cfg.link_epochs]
                # a step: one optimizer step of the ring; one round of the N - 1 workers' gradients
                # at the server (rank 0 alone on host 1, a worker on each other host)
                ranks = n
                steps = (len(s2["epochs"]) - len(s1["epochs"])) * _steps(cfg, strategy, n)
                model_bytes = 4 * s2["param_count"]
                per_step = {d: (long_[d] - short[d]) / steps for d in ("rx", "tx")}
                each_way = (costmodel.ps_link_bytes(model_bytes, ranks) if strategy == "ps"
                            else costmodel.ring_link_bytes(model_bytes, ranks))
                row = {"name": f"link/{strategy}/h{n}", "ok": True, "strategy": strategy, "hosts": n,
                       "steps": steps, "model_bytes": model_bytes, "rx_per_step": per_step["rx"],
                       "tx_per_step": per_step["tx"], "formula_each_way": each_way,
                       "formula_total": 2 * each_way}
                if strategy == "ps":
                    row["server_counted_in_per_step"] = s2["ps"]["bytes_in_per_step"][0]
                    row["server_counted_out_per_step"] = s2["ps"]["bytes_out_per_step"][0]
                util.say(f"link/{strategy}/h{n}: rx {per_step['rx'] / 1e6:.3f} MB, tx "
                         f"{per_step['tx'] / 1e6:.3f} MB per step; formula {each_way / 1e6:.3f} MB "
                         f"each way")
                rows.append(row)
    return {"rows": rows}


def _steps(cfg: PSConfig, strategy: str, hosts: int) -> int:
    """Optimizer steps per epoch: of the ring's ``hosts`` ranks, of the servers' ``hosts - 1``
    workers (ringtrain.data.sharding.optimizer_steps)."""
    from ringtrain.data.sharding import optimizer_steps

    width = hosts - 1 if strategy == "ps" else hosts
    return optimizer_steps(cfg.link_samples, width, cfg.batch_size, 1)


def run_part(cfg: PSConfig, out: Path) -> dict:
    data = {"config": cfg.to_dict(), "model": "mnist-cnn-v1 (184,586 parameters, PyTorch)",
            "load_average_at_start": list(_load())}
    data["staleness"] = staleness_table(cfg, out)
    util.write_json(out / "ps.partial.json", data)
    data["straggler"] = straggler_table(cfg, out)
    util.write_json(out / "ps.partial.json", data)
    data["link"] = link_table(cfg, out)
    data["load_average_at_end"] = list(_load())
    (out / "ps.partial.json").unlink(missing_ok=True)
    return data


def _load() -> tuple[float, float, float]:
    import os

    return os.getloadavg()

