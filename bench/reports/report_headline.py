"""BENCHMARKS.md's headline table: the report's main comparisons on one screen, each with the
section it comes from, the date it was measured and the Horovod build it ran on (issue 41).

Parts are measured days and builds apart, so a figure without its date and build could be read as
the current build's.  Every figure here is computed at render time by the function its section
prints it with (:mod:`bench.reports.figures`, :mod:`bench.reports.report_cluster`,
:mod:`bench.reports.report_floor`, :mod:`bench.reports.report_data`, :mod:`bench.reports.report_ps`,
:mod:`bench.reports.report_pipeline`), so the headline cannot disagree with the section below
it.  A part missing from the results leaves its rows out; in a quick part, whose few steps are
mostly warm-up, the figures read ``-`` as in its section.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bench.common.tables import FW_NAMES, num, pct, size, table, x
from bench.reports import (
    figures,
    report_builds,
    report_cluster,
    report_data,
    report_floor,
    report_pipeline,
    report_ps,
)

WITHHELD = "-"


@dataclass(frozen=True)
class Row:
    compared: str
    figure: str
    section: str
    part: str
    cell: str | None = None  # the cluster cell whose rerun, if any, holds the figure


def _quick(res: dict, part: str) -> bool:
    return bool(res.get("meta", {}).get("quick") or res[part].get("quick"))


def _joined(res: dict, part: str, pairs: Iterable[tuple[str, float | None]],
            fmt: Callable[[float | None], str]) -> str:
    """``fmt(value) at WHERE`` for each measured value, or ``-`` for a quick part."""
    said = [f"{fmt(v)} {where}" for where, v in pairs if v is not None]
    if not said:
        return ""
    return WITHHELD if _quick(res, part) else ", ".join(said)


def scaling(res: dict) -> list[Row]:
    runs = res.get("throughput", {}).get("runs", [])
    out = []
    for fw in ("torch", "tf"):
        figure = _joined(res, "throughput", ((f"at -np {n}", figures.trainer_efficiency(runs, fw, n))
                                             for n in figures.trainer_nps(runs, fw) if n > 1), pct)
        if figure:
            out.append(Row(f"{FW_NAMES[fw]} trainer, scaling efficiency T(N) / (N x T(1))", figure, "1",
                           "throughput"))
    return out


def peers(res: dict) -> list[Row]:
    runs = res.get("throughput", {}).get("runs", [])
    out = []
    for fw in ("torch", "tf"):
        figure = _joined(res, "throughput", ((f"at -np {n}", figures.peer_ratio(runs, fw, n))
                                             for n in figures.peer_nps(runs, fw)), x)
        if figure:
            out.append(Row(f"{FW_NAMES[fw]}: Horovod (MPI) / {figures.PEER[fw][1]}, images/s of the same "
                           "loop", figure, "3", "throughput"))
    return out


def allreduce(res: dict) -> list[Row]:
    coll = res.get("collectives", {})
    runs, sizes = coll.get("runs", []), coll.get("sizes", [])
    if not runs or not sizes:
        return []
    out = []
    nps = sorted({r["np"] for r in runs})
    for k in sorted({min(sizes), max(sizes)}):  # the small-message floor and bandwidth's end
        figure = _joined(res, "collectives", ((f"at -np {n}", figures.horovod_over_mpi4py(
            figures.allreduce_rows(runs, n), k)) for n in nps), x)
        if figure:
            out.append(Row(f"Horovod (MPI) allreduce time / mpi4py's, {size(k)}, one host", figure, "4",
                           "collectives"))
    return out


def links(res: dict) -> list[Row]:
    cl = res.get("cluster") or {}
    if cl.get("skipped") or "1g" not in report_cluster.shaped(cl):
        return []
    big = report_cluster.largest(cl)
    if big is None:
        return []
    n, busbw, best = report_cluster.horovod_busbw(cl, big)
    if best is None:
        return []
    label = cl["profiles"]["1g"]["label"].split(" (")[0]
    figure = WITHHELD if _quick(res, "cluster") else f"{pct(busbw[best])} (`{best}`)"
    rows = [Row(f"Horovod's best ring, {size(big)} on {n} hosts' {label} links: busbw / link rate "
                f"(target >= {pct(report_cluster.LINK_TARGET)})", figure, "6.1", "cluster", "collectives")]
    said = report_cluster.mpi4py_figure(report_cluster.mpi4py_ratios(cl))
    if said:
        rows.append(Row(f"Horovod (Open MPI's ring) allreduce time / mpi4py's (the same ring) on {label} "
                        f"links (target <= {x(report_cluster.MPI4PY_TARGET)})",
                        WITHHELD if _quick(res, "cluster") else said, "6.1", "cluster", "collectives"))
    said = report_cluster.ddp_figure(cl)
    if said:
        rows.append(Row(f"PyTorch ResNet-18 on {label} links: Horovod's speed / DDP's (target >= "
                        f"{x(report_cluster.DDP_TARGET)})", WITHHELD if _quick(res, "cluster") else said,
                        "6.3", "cluster", "torch"))
    return rows


def floor(res: dict) -> list[Row]:
    fl = res.get("floor") or {}
    if "collectives" not in fl:
        return []
    coll, out = fl["collectives"], []
    smallest = min(fl["config"]["sizes"])
    nps = sorted({r["np"] for r in coll})

    def loop_ratios(loop: str) -> str:
        return _joined(res, "floor", [(f"at -np {n}", report_floor.mpi_over_mpi4py(coll, n, loop, smallest))
                                      for n in nps], x)

    # both loops of one run and one build, so that section 4's small-message figure (from whichever
    # loop its build had) can be read against them
    said = [(report_floor.LOOP_NAMES[loop], loop_ratios(loop)) for loop in ("patched", "upstream")]
    said = [(name, figure) for name, figure in said if figure]
    if said:
        out.append(Row(f"Horovod (MPI) allreduce time / mpi4py's, {size(smallest)}, one host, the same "
                       "build with either background loop",
                       WITHHELD if _quick(res, "floor") else "; ".join(f"{n}: {f}" for n, f in said),
                       "7.1", "floor"))
    figure = _joined(res, "floor", ((f"at -np {n}", row.get("trainer_patched_over_upstream"))
                                    for n, row in report_floor.training_summary(fl)), x)
    if figure:
        out.append(Row("PyTorch trainer, images/s with the patch's loop / with 0.28.1's (same build)", figure,
                       "7.4", "floor"))
    return out


def data(res: dict) -> list[Row]:
    d = res.get("data")
    if not d:
        return []
    cfg, out = d["config"], []
    for fw in cfg["frameworks"]:
        said = []
        for m in cfg["models"]:
            figure = _joined(res, "data", ((f"at -np {n}", report_data.throughput_rows(
                d, fw, m["name"], n)["trainer_ratio"]) for n in cfg["nps"]), report_data.pct_of_target)
            if figure:
                said.append(f"{m['name']}: {figure}")
        if said:
            out.append(Row(f"{FW_NAMES[fw]} trainer on a JPEG folder / one fixed batch, images/s "
                           f"(target >= {pct(report_data.TARGET)})",
                           WITHHELD if _quick(res, "data") else "; ".join(said), "8.2", "data"))
    return out


def ps(res: dict) -> list[Row]:
    p = res.get("ps") or {}
    if "config" not in p:
        return []
    cfg, out = p["config"], []
    quick = _quick(res, "ps")
    cells = [r for r in p.get("staleness") or [] if r.get("ok")]
    if cells:
        lo, hi = cells[0]["staleness"], cells[-1]["staleness"]
        said = []
        for momentum in dict.fromkeys(r["momentum"] for r in cells):
            ends = [next((r for r in cells if (r["momentum"], r["staleness"]) == (momentum, k)), None)
                    for k in (lo, hi)]
            if all(ends):
                said.append(f"{' / '.join(report_ps.accuracy(r) for r in ends)} (momentum {momentum:g})")
        if said:
            out.append(Row(f"Parameter servers: test accuracy at --staleness {lo} / {hi}, the same "
                           "count of gradients applied", WITHHELD if quick else ", ".join(said), "9.1", "ps"))
    runs = [r for r in p.get("straggler") or [] if r.get("ok")]
    if runs:
        figure = ", ".join(f"{r['label']}: {report_ps.seconds(r)}" for r in runs)
        out.append(Row(f"Seconds to {cfg['target']:.0%} test accuracy, one of {cfg['straggler_workers']} "
                       f"workers at 1/{1 + cfg['straggler_factor']:g} speed", WITHHELD if quick else figure,
                       "9.2", "ps"))
    link = [r for r in (p.get("link") or {}).get("rows") or [] if r.get("ok") and r["strategy"] == "ps"]
    if link:
        def over(r: dict) -> float:
            measured, formula, _ = report_ps.link_measured(r)
            return measured / formula

        out.append(Row("Bytes per step on the server's host link / T_ps = 2(N-1) x K",
                       WITHHELD if quick else ", ".join(f"{num(over(r), '{:.2f}')} at {r['hosts']} hosts"
                                                        for r in link), "9.3", "ps"))
    return out


def pipeline(res: dict) -> list[Row]:
    d = res.get("pipeline")
    if not d:
        return []
    figure = _joined(res, "pipeline", ((f"({r['kind']}, -np {r['np']})", ratio)
                                       for r, ratio in report_pipeline.versus_ratios(d, comparing=True)
                                       if r["kind"] != "data-parallel"), x)
    if not figure:
        return []
    return [Row("Pipeline / data parallel, images/s, the same MLP, global batch and cores", figure,
                "10", "pipeline")]


def rows(res: dict) -> list[Row]:
    """Every headline row the results hold, in the report's order."""
    return [*scaling(res), *peers(res), *allreduce(res), *links(res), *floor(res), *data(res), *ps(res),
            *pipeline(res)]


def section(res: dict, now: report_builds.Measured | None) -> list[str]:
    body = []
    for r in rows(res):
        m = report_builds.holding(res, r.part, r.cell)
        if m is not None:
            body.append([r.compared, r.figure, r.section, m.date,
                         f"`{m.build}`" if m.build else "not recorded"])
    if not body:
        return []
    current = (f" The current build is `{now.build}`, that of the latest part measured ({now.part}, "
               f"{now.started}); a row on another build has not been rerun on it.") if now else ""
    return ["## Headline", "",
            "The main comparisons, each computed from the results when this page is rendered, by "
            "the code that prints it in its section. Parts are measured on different days and "
            "Horovod builds (`0.28.1+ringtrain.<hash>` names the patch series a build was made "
            "from; parts measured before the version named it record `0.28.1`)." + current, "",
            table(["compared", "figure", "section", "measured", "Horovod build"], body), ""]
