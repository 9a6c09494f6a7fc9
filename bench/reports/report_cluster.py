"""BENCHMARKS.md's emulated-cluster section (``cluster.json``, :mod:`bench.parts.emulated_cluster`).  Renders
only; the cost model is fitted here, from the stored measurements, so re-rendering never re-runs
anything.  (Section 7, the one-host floor: :mod:`bench.reports.report_floor`.)"""

from __future__ import annotations

from pathlib import Path

from bench.common import costmodel
from bench.common.tables import num, pct, size, table, x
from bench.reports import projection

ANALYSIS = Path(__file__).parent.parent / "cluster_analysis.md"  # the hand-written reading of section 6

FW = {"torch": "PyTorch", "tf": "TensorFlow/Keras 3"}
MODEL_NAMES = {"resnet18": "ResNet-18", "resnet50": "ResNet-50"}
PS = "mpi4py-param-server"
# which measured collective stands for each training setup's gradient exchange
# ("default": as python -m launch.horovodrun runs a job across hosts, horovodrun --gloo; "mpi":
# horovodrun's own default)
EXCHANGE = {("torch", "horovod", "default"): "horovod-gloo", ("torch", "ddp", "default"): "torch-gloo",
            ("torch", "horovod", "mpi"): "horovod-mpi", ("tf", "horovod", "mpi"): "horovod-mpi",
            ("tf", "horovod", "default"): "horovod-gloo",
            ("torch", "horovod", "mpi-ring"): "horovod-mpi-ring",
            ("torch", "horovod", "mpi-ring+fp16"): "horovod-mpi-ring", ("torch", "ddp", "fp16"): "torch-gloo"}


def mb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e6:.0f}"


def ms(v: float | None) -> str:
    return "n/a" if v is None else (f"{v * 1e3:.3g}" if v < 1 else f"{v * 1e3:.0f}")


def shaped(cl: dict) -> list[str]:
    return [p for p, d in cl.get("profiles", {}).items() if d.get("rate_bit")]


def link_rate(cl: dict, profile: str) -> float | None:
    """The link's rate in bytes/s each way (None when unshaped)."""
    rate = cl["profiles"].get(profile, {}).get("rate_bit")
    return rate / 8 if rate else None


def data_rate(cl: dict, profile: str) -> float | None:
    """What a TCP stream can carry through the shaper: the rate x payload per frame."""
    rate = link_rate(cl, profile)
    return rate * cl.get("tcp_payload_fraction", costmodel.TCP_PAYLOAD_FRACTION) if rate else None


def coll(cl: dict, profile: str, impl: str, hosts: int, slots: int = 1) -> dict | None:
    for r in cl.get("collectives", []):
        if (r["profile"], r["impl"], r["hosts"], r["slots"]) == (profile, impl, hosts, slots) and r.get("ok"):
            return r
    return None


def row(rec: dict | None, nbytes: int) -> dict | None:
    return next((r for r in rec["rows"] if r["bytes"] == nbytes), None) if rec else None


def step(cl: dict, fw: str, wrapper: str, profile: str, hosts: int, variant: str = "default",
         slots: int = 1) -> float | None:
    for r in cl.get("training", []):
        if (r["framework"], r["wrapper"], r["variant"], r["profile"], r["hosts"], r["slots"]) == \
                (fw, wrapper, variant, profile, hosts, slots) and r.get("ok"):
            return r["result"]["seconds_per_step"]
    return None


def train_rec(cl: dict, fw: str) -> dict | None:
    return next((r for r in cl.get("training", []) if r["framework"] == fw and r.get("ok")), None)


def fits(cl: dict) -> dict[tuple[str, str], costmodel.AlphaBeta]:
    """One alpha-beta model per (implementation, profile), over every size and host count."""
    points: dict[tuple[str, str], list] = {}
    for r in cl.get("collectives", []):
        if r.get("ok") and r["slots"] == 1:
            points.setdefault((r["impl"], r["profile"]), []).extend(
                (row_["bytes"], r["ranks"], row_["seconds"]) for row_ in r["rows"])
    return {key: costmodel.fit_alpha_beta(pts, "ps" if key[0] == PS else "ring")
            for key, pts in points.items() if len(pts) >= 3}


def section(res: dict) -> list[str]:
    cl = res.get("cluster")
    if not cl:
        return []
    lines = ["## 6. Emulated cluster: Horovod over network links", ""]
    if cl.get("skipped"):
        return lines + [f"Not measured: {cl['skipped']}. `make bench-cluster` needs root (network "
                        "namespaces, tc, sshd).", ""]
    quick = res["meta"].get("quick") or cl.get("quick")
    lines += setup(res, cl)
    lines += collectives(res, cl, quick)
    lines += training(res, cl, quick)
    if not quick:
        lines += projection_table(res, cl)
        if ANALYSIS.exists():
            lines += [ANALYSIS.read_text().strip(), ""]
    return lines


CELL_NAMES = {"collectives": "collective", "torch": "PyTorch training", "tf": "Keras training"}


def reruns(cl: dict) -> str:
    """Which cells were measured again later (``python -m bench --only cluster --cells ...``)."""
    said = []
    for r in cl.get("reruns", []):
        load = (r.get("machine") or {}).get("load_average_at_start")
        streams = ", ".join(f"{p['label'].split(' (')[0]} {mb(p['probe'].get('stream_bytes_per_s'))} MB/s"
                            for p in (r.get("profiles") or {}).values() if p.get("probe"))
        cells = " and ".join(CELL_NAMES.get(c, c) for c in r["cells"])
        said.append(f" The {cells} cells were measured again {r.get('started', '?')}, "
                    f"{(r.get('duration_s') or 0) / 60:.0f} min, load average at start "
                    f"{', '.join(f'{a:.2f}' for a in load) if load else 'n/a'} (`{r['command']}`; one TCP "
                    f"stream then: {streams or 'n/a'}): their rows are from that run.")
    return "".join(said)


def setup(res: dict, cl: dict) -> list[str]:
    m = cl.get("machine") or res["machine"]
    load = m.get("load_average_at_start")
    cfg = cl.get("config", {})
    netem = cl.get("netem_missing")
    lines = [
        f"{cl['hosts']} Linux network namespaces on this one machine ({m['cpu_model']}, {m['cores']} "
        "cores), each a \"host\" with its own address, hostname and sshd, every host's veth on one "
        "bridge (`bench/common/netns_hosts.py: make_hosts`, `bench/parts/emulated_cluster.py`). "
        "Jobs start the way they "
        "would on a cluster: `horovodrun -H rtc-h1:1,rtc-h2:1,...` and `mpirun -H ...` over ssh from "
        "host 1; DDP and torch.distributed as one process per host. Each host's link is shaped in "
        "both directions (tc HTB at the host's egress and at its bridge port: full duplex, "
        "bucket 200 us at line rate). One rank per host, one compute thread per rank; MPI ranks "
        "yield while they wait (`OMPI_MCA_mpi_yield_when_idle=1`), since here a spinning rank "
        "would take a core from another \"host\". Part measured "
        f"{cl.get('started', '?')}, {cl.get('duration_s', 0) / 60:.0f} min, load average at start "
        f"{', '.join(f'{a:.2f}' for a in load) if load else 'n/a'}." + reruns(cl), ""]
    if netem:
        lines += [f"**No delay or loss was applied:** {netem}. The profiles' 0.2 ms and 0.05 ms are "
                  "therefore not in these numbers; the links have their natural round trip (table "
                  "below), which the alpha terms of the cost model absorb. Bandwidth, the term that "
                  "dominates from about 1 MiB up, is shaped as specified.", ""]
    rows = []
    for p in cl.get("profiles", {}).values():
        probe = p.get("probe", {})
        rate = p.get("rate_bit")
        stream = probe.get("stream_bytes_per_s")
        asked = p.get("requested", p["label"])
        rows.append([p["label"] + (f" (asked: {asked})" if asked != p["label"] else ""),
                     f"{rate / 1e9:g} Gbit/s = {rate / 8e6:.0f} MB/s" if rate else "none",
                     f"{p.get('delay_s_applied', 0) * 1e3:g} ms of {p.get('delay_s_requested', 0) * 1e3:g}",
                     f"{mb(stream)} MB/s" + (f" ({pct(stream / (rate / 8))} of the rate)" if rate and stream
                                              else ""),
                     f"{probe['rtt_s'] * 1e6:.0f} us" if probe.get("rtt_s") else "n/a"])
    lines += [table(["profile", "rate each way", "delay applied", "one TCP stream (64 MiB, best of 3)",
                     "round trip (8 B, median)"], rows), "",
              "The kernel's counters count a TCP segment of 1448 data bytes as a 1514-byte frame when "
              "the shaper charges it, so data can use at most "
              f"{pct(cl.get('tcp_payload_fraction', costmodel.TCP_PAYLOAD_FRACTION))} of a shaped "
              "rate; that is the *data rate* the time formulas below use. The *link limit* the issue "
              "sets (busbw >= 80% of it) is the rate itself. Message sizes "
              f"{size(min(cfg.get('coll_sizes', [65536])))} to {size(max(cfg.get('coll_sizes', [65536])))}"
              "; median over repetitions of the slowest rank.", ""]
    return lines


def collectives(res: dict, cl: dict, quick: bool) -> list[str]:
    recs = [r for r in cl.get("collectives", []) if r.get("ok") and r["slots"] == 1]
    if not recs:
        return []
    plots = res["meta"].get("plots_rel", "bench/results")
    sizes = sorted({r["bytes"] for rec in recs for r in rec["rows"]})
    big = largest(cl)
    lines = ["### 6.1 Allreduce on the links", "",
             "*busbw* = 2(N-1)/N x bytes / time for every implementation (as in section 4), held "
             "against the link's rate. *Busiest link* is what the kernel counted through the busiest "
             "host interface in one direction per repetition (each rank reads `/proc/net/dev` in its "
             "namespace around each size's repetitions), against the algorithm's formula: "
             "2(N-1)/N x K for a ring, (N-1) x K into (and again out of) the parameter server. "
             "`horovod-mpi` is Horovod's MPI controller, horovodrun's default: CPU tensors go to "
             "`MPI_Allreduce`, "
             "and Open MPI's tuned component picks the algorithm; `-ring` variants set "
             "`OMPI_MCA_coll_tuned_use_dynamic_rules=1 OMPI_MCA_coll_tuned_allreduce_algorithm=4` "
             "(Open MPI's ring). `horovod-gloo` and `torch-gloo` use Gloo's ring.", "",
             f"![busbw]({plots}/cluster_busbw.png)", ""]
    for profile in cl["profiles"]:
        at = [r for r in recs if r["profile"] == profile]
        if not at:
            continue
        n = max(r["hosts"] for r in at)
        impls = [r["impl"] for r in at if r["hosts"] == n]
        rate = link_rate(cl, profile)
        cells = []
        for k in sizes:
            line = [size(k)]
            for impl in impls:
                rw = row(coll(cl, profile, impl, n), k)
                if rw is None:
                    line.append("n/a")
                elif rate and not quick:
                    line.append(f"{ms(rw['seconds'])} ms / {pct(rw['busbw'] / rate)}")
                else:
                    line.append(f"{ms(rw['seconds'])} ms / {rw['busbw'] / 1e6:.0f} MB/s")
            cells.append(line)
        unit = "busbw of link rate" if rate and not quick else "busbw"
        lines += [f"**{cl['profiles'][profile]['label']}, {n} hosts: time / {unit}**", "",
                  table(["size", *impls], cells), ""]
    lines += [f"![time vs hosts]({plots}/cluster_time_vs_hosts.png)", ""]
    lines += scaling_with_n(cl, big, quick)
    lines += hierarchical(cl, big)
    if not quick:
        lines += model_fits(cl)
    return lines


def scaling_with_n(cl: dict, big: int, quick: bool) -> list[str]:
    lines = []
    for profile in shaped(cl):
        recs = [r for r in cl["collectives"] if r.get("ok") and r["profile"] == profile and r["slots"] == 1]
        ns = sorted({r["hosts"] for r in recs})
        impls = list(dict.fromkeys(r["impl"] for r in recs))
        if len(ns) < 2:
            continue
        rate, drate = link_rate(cl, profile), data_rate(cl, profile)
        rows = []
        for impl in impls:
            for n in ns:
                rec = coll(cl, profile, impl, n)
                rw = row(rec, big)
                if rw is None:
                    continue
                kind = rec["formula"]
                formula_s = costmodel.formula_seconds(kind, big, n, n, drate)
                cells = [impl, str(n), ms(rw["seconds"])]
                if not quick:
                    cells += [f"{ms(formula_s)} ({kind})", x(rw["seconds"] / formula_s),
                              pct(rw["busbw"] / rate),
                              f"{rw['busiest_link_bytes'] / 2**20:.1f} / "
                              f"{rw['formula_link_bytes'] / 2**20:.1f}",
                              x(rw["busiest_link_bytes"] / rw["formula_link_bytes"])]
                rows.append(cells)
        head = ["impl", "hosts", "time ms"]
        if not quick:
            head += ["formula ms", "time / formula", "busbw of link rate",
                     "busiest link MiB counted / formula", "counted / formula"]
        lines += [f"**{cl['profiles'][profile]['label']}: {size(big)} as hosts are added**", "",
                  "Formula: the busiest link's bytes at the data rate "
                  f"({drate / 1e6:.0f} MB/s): ring 2(N-1)/N x K, parameter server 2(N-1) x K "
                  "(in, then out).", "", table(head, rows), ""]
        if profile == "1g" and not quick:
            lines += done_when(cl, big) + across_hosts(cl, big)
    return lines


HOROVOD_RINGS = ("horovod-mpi-ring", "horovod-gloo")  # Horovod with a ring underneath (6.1)
BUSBW_TARGET, FORMULA_TARGET = 0.80, 0.20  # issue 16's done-when: busbw of the link rate; time vs formula


def largest(cl: dict) -> int | None:
    """The largest message of 6.1 (one rank per host): the size the done-when check judges."""
    sizes = {r["bytes"] for rec in cl.get("collectives", []) if rec.get("ok") and rec["slots"] == 1
             for r in rec["rows"]}
    return max(sizes) if sizes else None


def horovod_busbw(cl: dict, big: int) -> tuple[int, dict[str, float], str | None]:
    """On the 1 Gbit/s links at the most hosts measured, for ``big`` bytes: (hosts, busbw of the
    link rate of Horovod as shipped and of each Horovod ring, the best of the rings)."""
    rate = link_rate(cl, "1g")
    recs = [r for r in cl["collectives"] if r["profile"] == "1g" and r["slots"] == 1 and r.get("ok")]
    n = max((r["hosts"] for r in recs), default=0)
    busbw = {}
    for impl in ("horovod-mpi", *HOROVOD_RINGS):
        rw = row(coll(cl, "1g", impl, n), big)
        if rw:
            busbw[impl] = rw["busbw"] / rate
    best = max((i for i in busbw if i in HOROVOD_RINGS), key=busbw.get, default=None)
    return n, busbw, best


def done_when(cl: dict, big: int) -> list[str]:
    """Issue 16's first done-when item, judged from the data: met or not met, with the numbers."""
    drate = data_rate(cl, "1g")
    recs = [r for r in cl["collectives"] if r["profile"] == "1g" and r["slots"] == 1 and r.get("ok")]
    n, busbw, best = horovod_busbw(cl, big)
    if not busbw:
        return []
    met = best is not None and busbw[best] >= BUSBW_TARGET
    lines = [f"**Done-when check, 1 Gbit/s, {n} hosts, {size(big)}.** Horovod's ring at >= "
             f"{pct(BUSBW_TARGET)} of the link rate: **{'met' if met else 'not met'}**; busbw of the "
             "link rate: " + ", ".join(f"`{i}` {pct(v)}" for i, v in busbw.items()) + "."]
    within, outside = [], []
    for impl in dict.fromkeys(r["impl"] for r in recs):
        worst = []
        for r in recs:
            rw = row(r, big) if r["impl"] == impl else None
            if rw:
                worst.append(rw["seconds"] / costmodel.formula_seconds(r["formula"], big, r["hosts"],
                                                                       r["hosts"], drate) - 1)
        if worst:
            dev = max(worst, key=abs)
            (within if abs(dev) <= FORMULA_TARGET else outside).append(f"`{impl}` {100 * dev:+.0f}%")
    lines[0] += (f" Time within {pct(FORMULA_TARGET)} of its formula at every host count (worst "
                 "deviation): " + (", ".join(within) or "none") + "; outside: "
                 + (", ".join(outside) or "none") + ".")
    return lines + [""]


LINK_TARGET, MPI4PY_TARGET, DDP_TARGET = 0.90, 1.2, 1.0  # issue 41's done-when, across hosts
LIKE_MPI4PY = "horovod-mpi-ring"  # Horovod on the algorithm mpi4py-ring runs: like against like
VERDICT = {True: "met", False: "**not met**"}


def over_mpi4py(cl: dict, impl: str, hosts: int, profile: str = "1g") -> list[tuple[int, float]]:
    """(bytes, ``impl``'s time / mpi4py-ring's) per size on ``hosts`` hosts, one rank each."""
    a, b = coll(cl, profile, impl, hosts), coll(cl, profile, "mpi4py-ring", hosts)
    if not a or not b:
        return []
    theirs = {r["bytes"]: r["seconds"] for r in b["rows"]}
    return [(r["bytes"], r["seconds"] / theirs[r["bytes"]]) for r in a["rows"] if r["bytes"] in theirs]


def hosts_1g(cl: dict) -> list[int]:
    """The host counts the collectives ran on over the 1 Gbit/s links, one rank each."""
    return sorted({r["hosts"] for r in cl.get("collectives", []) if r["profile"] == "1g" and r["slots"] == 1})


def within_from(ratios: list[tuple[int, float]], limit: float) -> int | None:
    """The smallest size from which every larger size's ratio is <= ``limit`` (None: not even
    the largest)."""
    ok = None
    for k, v in sorted(ratios, reverse=True):
        if v > limit:
            break
        ok = k
    return ok


def mpi4py_ratios(cl: dict) -> dict[int, list[tuple[int, float]]]:
    """Per host count on 1 Gbit/s (where both were measured): ``over_mpi4py`` of Horovod on
    Open MPI's ring."""
    per_n = {n: over_mpi4py(cl, LIKE_MPI4PY, n) for n in hosts_1g(cl)}
    return {n: ratios for n, ratios in per_n.items() if ratios}


def mpi4py_figure(per_n: dict[int, list[tuple[int, float]]]) -> str:
    """Per host count (``mpi4py_ratios``): the worst ratio to mpi4py-ring and from which size on
    it is within the target."""
    said = []
    for n, ratios in per_n.items():
        k, worst = max(ratios, key=lambda kv: kv[1])
        start = within_from(ratios, MPI4PY_TARGET)
        said.append(f"{n} hosts: worst {x(worst)} ({size(k)}), "
                    + (f"<= {x(MPI4PY_TARGET)} from {size(start)} up" if start else
                       f"over {x(MPI4PY_TARGET)} at every size"))
    return "; ".join(said)


def ddp_over_horovod(cl: dict, variant: str = "default", profile: str = "1g") -> list[tuple[int, float]]:
    """(hosts, DDP's seconds per step / Horovod's) for ResNet-18 on ``profile``: >= 1 where
    Horovod trains at least as fast as DDP's default."""
    out = []
    for n in sorted({r["hosts"] for r in cl.get("training", []) if r["profile"] == profile}):
        h, d = step(cl, "torch", "horovod", profile, n, variant), step(cl, "torch", "ddp", profile, n)
        if h and d:
            out.append((n, d / h))
    return out


def ddp_figure(cl: dict) -> str:
    said = []
    for variant, name in (("default", "as shipped (`launch.horovodrun`: Gloo across hosts)"),
                          ("mpi", "with horovodrun's MPI default"), ("mpi-ring", "with Open MPI's ring")):
        pairs = ddp_over_horovod(cl, variant)
        if pairs:
            said.append(f"{name} " + ", ".join(f"{x(v)} at {n} hosts" for n, v in pairs))
    return "; ".join(said)


def across_hosts(cl: dict, big: int) -> list[str]:
    """Issue 41's done-when across hosts, judged from the data: the ring's share of the link at
    the most hosts, Horovod's allreduce against mpi4py's from the smallest size up, and
    Horovod's training step against DDP's (6.3), on the 1 Gbit/s links."""
    n, busbw, best = horovod_busbw(cl, big)
    if best is None:
        return []
    text = (f"**Done-when check across hosts (issue 41), 1 Gbit/s.** The best Horovod ring at >= "
            f"{pct(LINK_TARGET)} of the link at {n} hosts, {size(big)}: "
            f"{VERDICT[busbw[best] >= LINK_TARGET]} (`{best}` {pct(busbw[best])}).")
    per_n = mpi4py_ratios(cl)
    if per_n:
        smallest = min(k for ratios in per_n.values() for k, _ in ratios)
        met = all(v <= MPI4PY_TARGET for ratios in per_n.values() for _, v in ratios)
        text += (f" `{LIKE_MPI4PY}` (Open MPI's ring under Horovod) within {x(MPI4PY_TARGET)} of "
                 f"`mpi4py-ring`'s time from {size(smallest)} up: {VERDICT[met]} ({mpi4py_figure(per_n)}).")
    return [text + " Horovod's training step against DDP's: 6.3.", ""]


def ddp_check(cl: dict) -> list[str]:
    """Issue 41's done-when for training across hosts: Horovod's ResNet-18 step as shipped at
    least as fast as DDP's at every host count on the 1 Gbit/s links."""
    pairs = ddp_over_horovod(cl)
    if not pairs:
        return []
    met = all(v >= DDP_TARGET for _, v in pairs)
    return [f"**Done-when check across hosts (issue 41): Horovod's training step at >= {x(DDP_TARGET)} "
            f"DDP's speed on the 1 Gbit/s links** (DDP's seconds per step / Horovod's): {VERDICT[met]} "
            f"({ddp_figure(cl)}).", ""]


def hierarchical(cl: dict, big: int) -> list[str]:
    recs = [r for r in cl.get("collectives", []) if r.get("ok") and r["slots"] > 1]
    if not recs:
        return []
    rows = []
    for r in recs:
        rw = row(r, big)
        if rw:
            rows.append([r["impl"], f"{r['hosts']} x {r['slots']}", ms(rw["seconds"]),
                         f"{rw['busiest_link_bytes'] / 2**20:.1f}",
                         f"{costmodel.ring_link_bytes(big, r['ranks']) / 2**20:.1f} / "
                         f"{costmodel.ring_link_bytes(big, r['hosts']) / 2**20:.1f}"])
    return ["**Two ranks per host (1 Gbit/s)**", "",
            "Horovod 0.28.1 turns `HOROVOD_HIERARCHICAL_ALLREDUCE` off unless it was built with NCCL or "
            "DDL (`horovod/common/operations.cc`: \"Hierarchical allreduce is not supported without "
            "NCCL or DDL\"), so on CPU `--hierarchical-allreduce` changes nothing: the link carries a "
            "flat ring's bytes either way. `mpi4py-hierarchical` is the two-level allreduce built by "
            "hand (`bench/workers/coll_worker.py: hier_allreduce`: reduce to one rank per host over shared "
            "memory, ring among the hosts, broadcast on each host).", "",
            table(["impl", "hosts x ranks", f"{size(big)} ms", "busiest link MiB counted",
                   "formula MiB: flat ring / hierarchical"], rows), ""]


def single_n(cl: dict) -> str:
    """Which profiles were measured at one host count only (their fit has no alpha)."""
    ns: dict[str, set[int]] = {}
    for r in cl.get("collectives", []):
        if r.get("ok") and r["slots"] == 1:
            ns.setdefault(r["profile"], set()).add(r["hosts"])
    one = [f"{cl['profiles'][p]['label']} ({next(iter(v))} hosts)" for p, v in ns.items() if len(v) == 1]
    return ("Measured at one host count only, where c and alpha cannot be told apart (alpha left "
            f"out): {', '.join(one)}." if one else "")


def model_fits(cl: dict) -> list[str]:
    fitted = fits(cl)
    if not fitted:
        return []
    rows = [[impl, cl["profiles"][profile]["label"], f"{m.c * 1e3:.2f}", f"{m.alpha * 1e6:.0f}",
             f"{m.bandwidth / 1e6:.0f}", f"{m.points}", pct(m.median_rel_error), pct(m.max_rel_error)]
            for (impl, profile), m in sorted(fitted.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    return ["### 6.2 A cost model fitted to these collectives", "",
            "T(K, N) = c + 2(N-1) x alpha + w x beta, w the bytes the algorithm pushes through its "
            "busiest link in sequence (ring: 2(N-1)/N x K; parameter server: 2(N-1) x K), fitted per "
            "implementation and profile over every size and host count by least squares on relative "
            "error (`bench/common/costmodel.py: fit_alpha_beta`). 1/beta is the bandwidth the implementation "
            "gets; c its fixed cost per call (Horovod: negotiation and the 1 ms cycle); alpha the cost "
            "of one of the ring's 2(N-1) steps. " + single_n(cl), "",
            table(["impl", "profile", "c ms", "alpha us", "1/beta MB/s", "points", "median error",
                   "max error"], rows), ""]


# -- training -------------------------------------------------------------------------------------

def training(res: dict, cl: dict, quick: bool) -> list[str]:
    runs = [r for r in cl.get("training", []) if r.get("ok")]
    if not runs:
        failed = [r for r in cl.get("training", []) if not r.get("ok")]
        return [f"- training `{r['name']}` failed: {(r.get('error') or '?').splitlines()[-1:]}"
                for r in failed] + ([""] if failed else [])
    plots = res["meta"].get("plots_rel", "bench/results")
    cfg = cl.get("config", {})
    lines = ["### 6.3 Training where the network matters", "",
             "Horovod's synthetic benchmark setting (`examples/pytorch/pytorch_synthetic_benchmark.py`): "
             "an ImageNet model with its full 1000-class head, one fixed random batch per rank, SGD, "
             f"{cfg.get('train_warmup')} warm-up then {cfg.get('train_steps')} timed steps, time per step "
             "of the slowest rank; images "
             f"{cfg.get('image_size')}x{cfg.get('image_size')} instead of 224x224 so that a step stays "
             "short on a CPU, while the gradients keep the model's full size "
             "(`bench/workers/bigmodel_torch.py`, `bench/workers/bigmodel_tf.py`)." + one_process_cpu(cl), "",
             "This machine has 2 cores for all hosts, so from 3 ranks on the ranks also slow each other "
             "down for reasons that have nothing to do with the network. So that this does not pass for "
             "a network cost, every row has its own compute-only baseline: ", "",
             "- *alone*: the same N processes on the same hosts computing side by side with no "
             "gradient exchange at all (they meet at a TCP barrier before and after);",
             "- *exchange efficiency* = alone / step: the share of the compute-only speed kept once the "
             "gradients are exchanged over that link; the network's cost, including the CPU the "
             "exchange itself burns on these shared cores;",
             "- *link efficiency* = unshaped / step: the same against the same exchange over the "
             "unshaped veth (GB/s, CPU-bound): what the link's rate costs and nothing else;",
             "- *conventional* = 1 process / step = T(N) / (N x T(1)), for reference only: here it "
             "mostly measures core sharing.", "",
             f"![training]({plots}/cluster_training.png)", ""]
    busy = [r["result"]["rank0_cores_busy"] for r in runs if r["result"].get("rank0_cores_busy")]
    if busy:
        lines += [f"How much CPU a rank got: rank 0's CPU time over wall time during the timed steps was "
                  f"{min(busy):.2f} to {max(busy):.2f} of a core across these runs (one compute thread "
                  "each; a rank that had its core to itself would show about 1).", ""]
    for fw in ("torch", "tf"):
        rec = train_rec(cl, fw)
        if rec is None:
            continue
        lines += training_table(cl, fw, rec, quick)
    lines += knobs(cl, quick)
    if not quick:
        lines += ddp_check(cl) + model_check(cl)
    failed = [r for r in cl.get("training", []) if not r.get("ok")]
    lines += [f"- training `{r['name']}` failed: {(r.get('error') or '?').splitlines()[-1:]}" for r in failed]
    return lines + ([""] if failed else [])


def one_process_cpu(cl: dict) -> str:
    """What one process alone spent per step, wall and CPU (the compute a quiet core would need)."""
    said = []
    for r in cl.get("training", []):
        res = r.get("result") or {}
        if r.get("ok") and r["wrapper"] == "none" and r["hosts"] == 1 and res.get("rank0_cores_busy"):
            t = res["seconds_per_step"]
            said.append(f"{FW[r['framework']]} {MODEL_NAMES.get(res['model'], res['model'])} {t:.2f} s "
                        f"of which {t * res['rank0_cores_busy']:.2f} s of CPU")
    return (" One process alone, per step: " + "; ".join(said) + " (the rest is time it waited for a "
            "core).") if said else ""


def training_table(cl: dict, fw: str, rec: dict, quick: bool) -> list[str]:
    model = rec["result"]["model"]
    grad = rec["result"]["gradient_bytes"]
    wrappers = ["horovod", "ddp"] if fw == "torch" else ["horovod"]
    profiles = list(cl["profiles"])
    ns = sorted({r["hosts"] for r in cl["training"] if r["framework"] == fw and r["slots"] == 1})
    t1 = step(cl, fw, "none", "unshaped", 1)
    head = ["hosts", "alone s"] + [f"{w} {cl['profiles'][p]['label'].split(' (')[0]} s"
                                   for w in wrappers for p in profiles]
    rows, eff = [], []
    for n in ns:
        alone = t1 if n == 1 else step(cl, fw, "alone", "unshaped", n)
        cells = [str(n), num(alone, "{:.2f}")]
        for w in wrappers:
            for p in profiles:
                cells.append(num(step(cl, fw, w, p, n) if n > 1 else None, "{:.2f}"))
        rows.append(cells)
        if n > 1 and not quick:
            for w in wrappers:
                base = step(cl, fw, w, "unshaped", n)
                for p in profiles:
                    t = step(cl, fw, w, p, n)
                    if t is None:
                        continue
                    eff.append([str(n), w, cl["profiles"][p]["label"], num(t, "{:.2f}"),
                                pct(alone / t if alone else None),
                                pct(base / t if base and p != "unshaped" else None),
                                pct(t1 / t if t1 else None)])
    lines = [f"**{FW[fw]}, {MODEL_NAMES.get(model, model)} ({grad / 1e6:.1f} MB of float32 gradients), "
             f"batch {rec['result']['batch_size_per_rank']} per rank: seconds per step**", "",
             table(head, rows), ""]
    if eff:
        lines += [table(["hosts", "exchange", "link", "s/step", "exchange efficiency (alone / step)",
                         "link efficiency (unshaped / step)", "conventional (1 process / step)"], eff), ""]
    return lines


def knobs(cl: dict, quick: bool) -> list[str]:
    knob = cl.get("config", {}).get("knob_profile")
    runs = [r for r in cl.get("training", []) if r.get("ok") and r["framework"] == "torch"
            and (r["variant"] != "default" or r["slots"] > 1) and r["profile"] in (knob, None)]
    if not runs:
        return []
    profile, n = runs[0]["profile"], max(r["hosts"] * r["slots"] for r in runs)
    ref = step(cl, "torch", "horovod", profile, n)
    ring = step(cl, "torch", "horovod", profile, n, "mpi-ring")
    rows = []
    for w, variant, hosts, slots in [("horovod", "default", n, 1)] + [
            (r["wrapper"], r["variant"], r["hosts"], r["slots"]) for r in runs] + [("ddp", "default", n, 1)]:
        t = step(cl, "torch", w, profile, hosts, variant, slots)
        if t is None:
            continue
        rows.append([f"{w} {variant}", f"{hosts} x {slots}", num(t, "{:.2f}")]
                    + ([] if quick else [x(ref / t if ref else None), x(ring / t if ring else None)]))
    head = ["setting", "hosts x ranks", "s/step"] + ([] if quick else ["speed-up vs Horovod default",
                                                                       "vs Horovod + MPI ring"])
    return [f"**What Horovod's knobs buy ({cl['profiles'][profile]['label']}, {n} ranks, PyTorch)**", "",
            "`default`: as `python -m launch.horovodrun` runs it across hosts, `horovodrun --gloo`. "
            "`mpi`: horovodrun's own default, Open MPI's tuned allreduce. "
            "`mpi-ring`: Open MPI's ring allreduce (as in 6.1). `fp16`: `hvd.Compression.fp16` (DDP: "
            "`fp16_compress_hook`). `fusion-0`: `--fusion-threshold-mb 0`, one allreduce per tensor. "
            "`cycle-<t>ms`: `--cycle-time-ms <t>` (default 1). `hierarchical`: "
            "`--hierarchical-allreduce` at 2 ranks per host (a no-op without NCCL, see 6.1).", "",
            table(head, rows), ""]


def model_check(cl: dict) -> list[str]:
    fitted = fits(cl)
    rows = []
    for r in cl.get("training", []):
        key = (r["framework"], r["wrapper"], r["variant"])
        if not r.get("ok") or key not in EXCHANGE or r["slots"] != 1 or r["hosts"] < 2:
            continue
        m = fitted.get((EXCHANGE[key], r["profile"]))
        alone = step(cl, r["framework"], "alone", "unshaped", r["hosts"])
        if m is None or alone is None:
            continue
        grad = r["result"]["gradient_bytes"] / (2 if r["result"].get("fp16") else 1)
        ar = m.seconds(grad, r["hosts"])
        pred = costmodel.predicted_step(alone, ar)
        t = r["result"]["seconds_per_step"]
        rows.append([f"{FW[r['framework']]} {r['wrapper']} {r['variant']}",
                     cl["profiles"][r["profile"]]["label"],
                     str(r["hosts"]), num(alone, "{:.2f}"), num(ar, "{:.2f}"), num(pred, "{:.2f}"),
                     num(t, "{:.2f}"), f"{100 * (t / pred - 1):+.0f}%",
                     pct(max(0.0, min(1.0, (pred - t) / ar))) if ar > 0 else "n/a"])
    if not rows:
        return []
    within = sum(1 for r in rows if abs(float(r[7].rstrip("%"))) <= 15)
    return ["**The cost model against the training runs**", "",
            "Predicted step = alone + allreduce of the gradients, the allreduce from the fitted model "
            "of the collective that does the exchange (Horovod: `horovod-mpi` or `-ring`; DDP: "
            "`torch-gloo`; fp16: half the bytes), nothing hidden behind the backward pass. *Hidden* "
            "= (predicted - measured) / allreduce: the share of the allreduce that must have overlapped "
            f"compute (0% when the step took longer than predicted). {within} of {len(rows)} within 15% "
            f"(issue 16's target for the model: every run within 15%: "
            f"**{'met' if within == len(rows) else 'not met'}**).",
            "", table(["run", "link", "hosts", "alone s", "allreduce s (model)", "predicted s",
                       "measured s", "measured vs predicted", "hidden"], rows), ""]


# -- projection ------------------------------------------------------------------------------------

def horovod_fixed_cost(res: dict) -> tuple[float, str] | None:
    """Horovod's own cost per allreduce on a quiet host: the smallest message at -np 2 in
    section 4 (collectives part), less mpi4py's time for the same message."""
    coll = res.get("collectives", {})
    at = {r["impl"]: r for r in coll.get("runs", []) if r.get("ok") and r["np"] == 2}
    if "horovod-mpi" not in at:
        return None
    hv, ref = at["horovod-mpi"]["rows"][0], (at.get("mpi4py-allreduce") or {}).get("rows", [{}])[0]
    c = hv["seconds"] - ref.get("seconds", 0.0)
    cpu = (coll.get("machine") or {}).get("cpu_model", "an earlier machine")
    return c, (f"{c * 1e3:.2f} ms: Horovod's {size(hv['bytes'])} allreduce at -np 2 on one host "
               f"(section 4, measured on {cpu}, "
               f"load {loadavg(coll)}), less mpi4py's")


def projection_params(res: dict, cl: dict) -> tuple[float, float, str] | None:
    """(alpha, c, where they come from) for the projection.  alpha: the per-step latency of the
    ring whose fit on the 1 Gbit/s links is cleanest (least median error); c: Horovod's fixed
    cost measured on a quiet host, else its fit here."""
    fitted = {impl: m for (impl, profile), m in fits(cl).items() if profile == "1g" and impl != PS}
    if not fitted:
        return None
    impl, m = min(fitted.items(), key=lambda kv: kv[1].median_rel_error)
    fixed = horovod_fixed_cost(res)
    hv = fitted.get("horovod-mpi-ring")
    if fixed is None and hv is None:
        return None
    c, c_src = fixed or (hv.c, f"{hv.c * 1e3:.2f} ms, the fit of horovod-mpi-ring above")
    why = (f"alpha = {m.alpha * 1e6:.0f} us per ring step from the fit of `{impl}` on the 1 Gbit/s links "
           f"(median error {pct(m.median_rel_error)}, the cleanest of the rings); Horovod's fixed cost per "
           f"fusion buffer c = {c_src}")
    if hv is not None:
        why += (f". Horovod's own fit on these links (c = {hv.c * 1e3:.1f} ms, alpha = "
                f"{hv.alpha * 1e6:.0f} us, median error {pct(hv.median_rel_error)}) is not used: at the "
                "load this part ran under, "
                "its small messages measured the machine's scheduler, not the link (section 6.1's "
                "64 KiB column)")
    return m.alpha, c, why


def projection_table(res: dict, cl: dict) -> list[str]:
    params = cl.get("models", {})
    chosen = projection_params(res, cl)
    if chosen is None or any(k not in params for k in projection.NAMES):
        return []
    alpha, c, why = chosen
    rows = projection.table(params, alpha, c)
    head = ["model", "gradients", "link"] + [str(w) for w in projection.WORKERS] + ["paper, 512 GPUs"]
    cells = []
    for model, name in projection.NAMES.items():
        for link in projection.LINKS:
            sel = [r for r in rows if r["model"] == model and r["link"] == link]
            cells.append([name, f"{sel[0]['grad_bytes'] / 1e6:.0f} MB", link]
                         + [f"{pct(r['efficiency_serial'])}-{pct(r['efficiency_overlapped'])}" for r in sel]
                         + [pct(projection.PAPER_512[model]) if link == "25 GbE" else "-"])
    r512 = {(r["model"], r["link"]): r for r in rows if r["workers"] == 512}
    verdicts = []
    for model, name in projection.NAMES.items():
        r, paper = r512[(model, "25 GbE")], projection.PAPER_512[model]
        lo, hi = r["efficiency_serial"], r["efficiency_overlapped"]
        where = "inside" if lo <= paper <= hi else ("above" if paper > hi else "below")
        hidden = costmodel.implied_overlap(r["compute_s"], r["comm_s"], paper)
        verdicts.append(f"{name}: {pct(lo)} to {pct(hi)}, the paper's {pct(paper)} {where} that range; "
                        f"{r['transfer_s'] * 1e3:.0f} ms of gradient transfer and "
                        f"{r['latency_s'] * 1e3:.0f} ms of latency terms per step against "
                        f"{r['compute_s'] * 1e3:.0f} ms of compute, so {pct(paper)} needs "
                        f"{pct(max(0.0, hidden))} of the communication hidden behind the backward pass")
    return ["### 6.4 Projection to hundreds of workers", "",
            "Scaling efficiency = compute / (compute + exposed communication) for synchronous data "
            "parallelism with 4 GPUs per server, as in the paper: per step, a ring allreduce of the "
            "float32 gradients among the servers (2(S-1)/S x K through each server's link at the data "
            f"rate), plus per fusion buffer ({projection.FUSION_BYTES >> 20} MiB, Horovod's default) a "
            f"fixed cost c and 2(S-1) steps of alpha: {why}. Gradient sizes: "
            f"torchvision's parameter counts (ResNet-101 {params['resnet101'] / 1e6:.1f} M, VGG-16 "
            f"{params['vgg16'] / 1e6:.1f} M). Compute per step: one Tesla P100 at batch 64 from "
            f"TensorFlow's published benchmarks (VGG16 {projection.P100_IMAGES_PER_S['vgg16']:g} images/s; "
            f"ResNet-101 {1 / projection.seconds_per_image('resnet101'):.0f}, interpolated by FLOPs "
            "between ResNet-50 and ResNet-152; sources in `bench/reports/projection.py`). Each cell is a "
            "range: no overlap (allreduce after the backward pass) to full overlap (allreduce hidden "
            "behind compute up to the compute time).", "",
            table(head, cells), "",
            "At 512 GPUs on 25 GbE. " + "; ".join(verdicts) + ". Horovod as the paper ran it does "
            "overlap: `DistributedOptimizer` puts one allreduce per gradient into TensorFlow's graph "
            "(tf_cnn_benchmarks, TF1), which runs it as soon as that gradient exists, and the PyTorch "
            "optimizer does the same from backward hooks. (Our Keras 3 trainer and "
            "`bench/workers/bigmodel_tf.py` use the same `DistributedOptimizer`: one allreduce per gradient "
            "in the train step's `tf.function` graph.) VGG-16 "
            "loses more than ResNet-101 because it has 3x the gradients for less compute. What the "
            "model leaves out, and where it may disagree with the paper for that reason: RDMA (the "
            "paper's RoCE costs less per byte and per step than TCP), NCCL inside each server (4 "
            "GPUs reduce over PCIe/NVLink before anything crosses the network, which this model "
            "takes as free), how the fusion buffer fills in time, and stragglers. At 100 GbE the "
            "transfer shrinks 4x and the 2(S-1) latency steps per buffer become a larger share of "
            "what is left.", ""]


def loadavg(part: dict) -> str:
    load = (part.get("machine") or {}).get("load_average_at_start")
    return ", ".join(f"{a:.2f}" for a in load) if load else "n/a"
