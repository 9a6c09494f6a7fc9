"""Figures of the emulated cluster: busbw against size per link profile, time against the number
of hosts for the ring and the parameter server, training efficiency against the number of hosts.
Each figure names the machine and the link profile (figures travel alone)."""

from __future__ import annotations

import io
from pathlib import Path

from bench.common import costmodel, util
from bench.reports import report_cluster as rc

STYLE = {"horovod-mpi": "o-", "horovod-mpi-ring": "o--", "horovod-gloo": "s-", "mpi4py-ring": "^--",
         "mpi4py-allreduce": "^-", "torch-gloo": "v-", "mpi4py-param-server": "x-"}


def _machine(results: dict) -> str:
    cl = results.get("cluster", {})
    m = cl.get("machine") or results.get("machine", {})
    quick = "QUICK MODE  |  " if results.get("meta", {}).get("quick") or cl.get("quick") else ""
    load = m.get("load_average_at_start")
    at_load = f", load average {load[0]:.1f} at the start" if load else ""
    return (f"{quick}{cl.get('hosts', '?')} netns hosts on one machine\n{m.get('cpu_model', '?')}, "
            f"{m.get('cores', '?')} cores; measured {cl.get('started', '?')}{at_load}")


def busbw(results: dict, path: Path, plt) -> Path | None:
    cl = results.get("cluster", {})
    recs = [r for r in cl.get("collectives", []) if r.get("ok") and r["slots"] == 1]
    profiles = [p for p in cl.get("profiles", {}) if any(r["profile"] == p for r in recs)]
    if not profiles:
        return None
    fig, axes = plt.subplots(1, len(profiles), figsize=(6.2 * len(profiles), 4.8), squeeze=False)
    for ax, profile in zip(axes[0], profiles, strict=True):
        at = [r for r in recs if r["profile"] == profile]
        n = max(r["hosts"] for r in at)
        for rec in (r for r in at if r["hosts"] == n):
            ax.plot([r["bytes"] for r in rec["rows"]], [r["busbw"] / 1e6 for r in rec["rows"]],
                    STYLE.get(rec["impl"], "o-"), ms=3, label=rec["impl"])
        rate = rc.link_rate(cl, profile)
        if rate:
            ax.axhline(rate / 1e6, color="k", ls=":", label=f"link rate {rate / 1e6:.0f} MB/s")
            ax.axhline(0.8 * rate / 1e6, color="grey", ls=":", lw=0.8, label="80% of link rate")
        ax.set_xscale("log", base=2)
        _finish(ax, "message size (bytes)", "busbw = 2(N-1)/N x bytes / time (MB/s)",
                f"{cl['profiles'][profile]['label']}, {n} hosts x 1 rank")
    return _save(fig, results, path, plt)


def time_vs_hosts(results: dict, path: Path, plt) -> Path | None:
    cl = results.get("cluster", {})
    profile = next((p for p in rc.shaped(cl)), None)
    if profile is None:
        return None
    recs = [r for r in cl["collectives"] if r.get("ok") and r["profile"] == profile and r["slots"] == 1]
    ns = sorted({r["hosts"] for r in recs})
    if len(ns) < 2:
        return None
    big = max(r["bytes"] for rec in recs for r in rec["rows"])
    fig, ax = plt.subplots(figsize=(7.2, 5))
    for impl in dict.fromkeys(r["impl"] for r in recs):
        pts = [(n, rc.row(rc.coll(cl, profile, impl, n), big)) for n in ns]
        pts = [(n, r["seconds"]) for n, r in pts if r]
        if pts:
            ax.plot(*zip(*pts, strict=True), STYLE.get(impl, "o-"), label=impl)
    drate = rc.data_rate(cl, profile)
    dense = [min(ns) + i / 10 for i in range(10 * (max(ns) - min(ns)) + 1)]
    for kind, label in (("ring", "ring formula 2(N-1)/N K / B"), ("ps", "server formula 2(N-1) K / B")):
        ax.plot(dense, [costmodel.formula_seconds(kind, big, n, n, drate) for n in dense],
                "k:" if kind == "ring" else "k--", lw=1, label=label)
    ax.set_xticks(ns)
    _finish(ax, "hosts (one rank each)", f"seconds per allreduce of {big >> 20} MiB",
            f"ring vs parameter server, {cl['profiles'][profile]['label']} (B = {drate / 1e6:.0f} MB/s data)")
    return _save(fig, results, path, plt)


def training(results: dict, path: Path, plt) -> Path | None:
    cl = results.get("cluster", {})
    runs = [r for r in cl.get("training", [])
            if r.get("ok") and r["variant"] == "default" and r["slots"] == 1]
    frameworks = [fw for fw in ("torch", "tf") if any(r["framework"] == fw and r["hosts"] > 1 for r in runs)]
    if not frameworks:
        return None
    fig, axes = plt.subplots(1, len(frameworks), figsize=(6.4 * len(frameworks), 4.8), squeeze=False)
    for ax, fw in zip(axes[0], frameworks, strict=True):
        ns = sorted({r["hosts"] for r in runs if r["framework"] == fw and r["hosts"] > 1})
        model = rc.train_rec(cl, fw)["result"]["model"]
        for wrapper, marker in (("horovod", "o"), ("ddp", "s")):
            for profile, ls in zip(cl["profiles"], ("-", "--", ":"), strict=False):
                pts = []
                for n in ns:
                    t, alone = rc.step(cl, fw, wrapper, profile, n), rc.step(cl, fw, "alone", "unshaped", n)
                    if t and alone:
                        pts.append((n, 100 * alone / t))
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker + ls,
                            label=f"{wrapper}, {cl['profiles'][profile]['label']}")
        ax.axhline(100, color="k", lw=0.6)
        ax.set_xticks(ns)
        _finish(ax, "hosts (one rank each)", "exchange efficiency: alone / step (%)",
                f"{rc.FW[fw]} {rc.MODEL_NAMES.get(model, model)}: what the gradient exchange costs")
        ax.set_ylim(0, 110)
    return _save(fig, results, path, plt)


def render(results: dict, folder: Path, plt) -> dict[str, str]:
    made = {}
    for name, fn in (("cluster_busbw", busbw), ("cluster_time_vs_hosts", time_vs_hosts),
                     ("cluster_training", training)):
        out = fn(results, folder / f"{name}.png", plt)
        if out:
            made[name] = out.name
    return made


def _finish(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def png_bytes(fig, dpi: int) -> bytes:
    """The figure as a PNG, for :func:`bench.common.util.write_bytes` (``savefig`` to a path
    writes through a symlink planted there)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _save(fig, results: dict, path: Path, plt) -> Path:
    quick = "QUICK MODE" in _machine(results)
    fig.suptitle(_machine(results), fontsize=8, color="red" if quick else "black")
    fig.tight_layout()
    util.write_bytes(path, png_bytes(fig, 100))
    plt.close(fig)
    return path
