"""The PNG figures: scaling curves, bandwidth against message size, accuracy against time."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.common import tables, util  # noqa: E402
from bench.reports import plots_cluster  # noqa: E402
from bench.reports.plots_cluster import png_bytes  # noqa: E402

FW_NAMES = tables.FW_NAMES
SERIES = [  # (kind, wrapper, data, label, style)
    ("trainer", "horovod", "mnist", "our trainer (Horovod, MNIST)", "o-"),
    ("loop", "horovod", "mnist", "bench loop, Horovod, MNIST", "s--"),
    ("loop", "horovod", "synthetic", "bench loop, Horovod, synthetic", "^-"),
    ("loop", "horovod-gloo", "synthetic", "bench loop, Horovod (Gloo), synthetic", "^:"),
    ("loop", "ddp", "synthetic", "bench loop, DDP (gloo), synthetic", "v-"),
    ("loop", "mwms", "synthetic", "bench loop, MWMS, synthetic", "v-"),
]


def _stamp(fig, results: dict, part: str) -> None:
    """Say on the figure itself which machine and mode it comes from (figures travel alone): the
    machine and time of the part it shows (parts run hours, or machines, apart)."""
    m = results.get(part, {}).get("machine") or results.get("machine", {})
    quick = "QUICK MODE (not a benchmark)  |  " if results.get("meta", {}).get("quick") else ""
    started = results.get(part, {}).get("started") or results.get("meta", {}).get("started", "")
    fig.suptitle(f"{quick}{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, {started}", fontsize=9,
                 color="red" if quick else "black")


def scaling(results: dict, path: Path) -> Path | None:
    runs = results.get("throughput", {}).get("runs", [])
    frameworks = [fw for fw in ("torch", "tf") if any(r["framework"] == fw for r in runs)]
    if not frameworks:
        return None
    cores = results["machine"]["cores"]
    fig, axes = plt.subplots(1, len(frameworks), figsize=(6.2 * len(frameworks), 5.6), squeeze=False)
    for ax, fw in zip(axes[0], frameworks, strict=True):
        nps = sorted({r["np"] for r in runs if r["framework"] == fw and r["kind"] == "trainer"})
        for kind, wrapper, data, label, style in SERIES:
            pts = [(n, tables.ips(runs, fw, kind, wrapper, data, n)) for n in nps]
            pts = [(n, v) for n, v in pts if v]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, label=label)
        per_core = tables.ips(runs, fw, "loop", "none", "synthetic", 1, threads=1)
        if per_core:
            ax.plot(nps, [per_core * min(n, cores) for n in nps], "k:",
                    label=f"core limit ({cores} cores x 1-thread rate)")
        ax.set_title(f"{FW_NAMES[fw]}: training throughput")
        ax.set_xlabel("processes (-np)")
        ax.set_ylabel("images / s (all ranks)")
        ax.set_xticks(nps)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    return _save(fig, results, path, "throughput")


def bandwidth(results: dict, path: Path) -> Path | None:
    coll = results.get("collectives", {}).get("runs", [])
    nps = sorted({r["np"] for r in coll if r.get("ok")})
    if not nps:
        return None
    fig, axes = plt.subplots(1, len(nps), figsize=(6.2 * len(nps), 4.6), squeeze=False)
    limit = tables.memory_limit(results.get("collectives", {}).get("machine") or results["machine"])
    for ax, np in zip(axes[0], nps, strict=True):
        for rec in coll:
            if rec["np"] != np or not rec.get("ok"):
                continue
            sizes = [r["bytes"] for r in rec["rows"]]
            ax.plot(sizes, [r["busbw"] / 1e9 for r in rec["rows"]], "o-", ms=3, label=rec["impl"])
        if limit:
            ax.axhline(limit / np / 1e9, color="k", ls=":",
                       label=f"memory copy limit / N ({limit / np / 1e9:.1f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"allreduce, -np {np}: bus bandwidth 2(N-1)/N x bytes / time")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("GB/s")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return _save(fig, results, path, "collectives")


def accuracy(results: dict, path: Path) -> Path | None:
    acc = results.get("accuracy", {})
    runs = [r for r in acc.get("runs", []) if r.get("epochs")]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for r in runs:
        t, xs, ys = 0.0, [], []
        for e in r["epochs"]:
            t += e["seconds"]
            xs.append(t)
            ys.append(100 * e["test_accuracy"])
        ax.plot(xs, ys, "o-", label=f"{FW_NAMES[r['framework']]} -np {r['np']}")
    ax.axhline(100 * acc["target"], color="k", ls=":", label=f"target {acc['target']:.0%}")
    ax.set_xlabel("training seconds (cumulative)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("time to accuracy" + (" (QUICK PROXY)" if acc.get("proxy") else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, results, path, "accuracy")


def render_all(results: dict, folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, fn in (("scaling", scaling), ("bandwidth", bandwidth), ("accuracy", accuracy)):
        out = fn(results, folder / f"{name}.png")
        if out:
            made[name] = out.name
    made.update(plots_cluster.render(results, folder, plt))
    return made


def _save(fig, results: dict, path: Path, part: str) -> Path:
    """Stamp the machine and run time, write the PNG, free the figure."""
    _stamp(fig, results, part)
    fig.tight_layout()
    util.write_bytes(path, png_bytes(fig, 110))
    plt.close(fig)
    return path
