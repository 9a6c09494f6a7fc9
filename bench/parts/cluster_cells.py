"""``python -m bench.parts.cluster_cells``: rerun a few collective cells of the cluster part, each as the
bench runs it and with its ranks at high CPU priority, interleaved (A/B/A/B).

    python -m bench.parts.cluster_cells --profile 1g --hosts 4 --sizes 16M,64M \\
        --impls horovod-mpi-ring,horovod-gloo,horovod-mpi,torch-gloo --rounds 2 \\
        --out bench/results/cluster_cpu_check.json

A cell is what ``bench/parts/emulated_cluster.py`` runs (same hosts, tc profile, launch line and
``bench/workers/coll_worker.py`` arguments); the ``nice`` mode only starts every rank under ``nice -n -15``
with its session's autogroup at the same nice, and the ``pinned`` mode pins host N's rank to the
(N - 1)-th core, mod the cores it may use (the hosts share the cores evenly; ``--impls`` may include
``mpi4py-ring-negotiated``, the floor of Horovod's protocol: see ``bench/workers/coll_worker.py``).
Every rank records its wall, CPU and run-queue wait seconds over the timed repetitions
(``coll_worker.sched_times``); the load average is read before each cell.  The hosts live under
their own prefix (``rcc-``), so this can run beside ``make bench-cluster``.

``--train`` adds training cells (``bench/parts/emulated_cluster.py``'s ResNet-18 step, its
``TrainRun``), run after each round's collectives, in the order given; each is a base with
optional variables for every rank (``horovod:HOROVOD_UPSTREAM_LOOP=1``; several joined by ``;``)::

    python -m bench.parts.cluster_cells --profile 1g --hosts 2,4 --impls '' --rounds 2 \\
        --train 'ddp,horovod,horovod:HOROVOD_UPSTREAM_LOOP=1,horovod-ring,horovod-gloo' \\
        --out bench/results/cluster_train_check.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

from bench.common import netns_hosts as nh
from bench.common import util
from bench.parts import emulated_cluster

PREFIX = "rcc-"
SUBNET = "10.253.0"
# With autogroups (kernel.sched_autogroup_enabled=1) the scheduler first shares the cores among
# sessions, then among a session's processes by nice: a rank's nice alone only ranks it against
# its own session (sshd/orted), so "nice" also sets its session's autogroup nice.
NICE = -15
PRIORITISE = f'echo {NICE} > /proc/self/autogroup 2>/dev/null; exec nice -n {NICE} "$@"'
# "pinned": host N's rank runs on core (N - 1) mod cores, so the hosts split the cores evenly, as
# real hosts would each have their own.  Unpinned, the scheduler sometimes leaves one rank a core
# of its own and the other three one core between them (per-rank CPU 0.97 against 0.24-0.32 of
# the wall, 4 hosts on 2 cores), and any implementation's 64 KiB time then rose by 1.4-2x:
# which implementation drew that split decided their ratio (bench/cluster_analysis.md).
# The core is the (N-1)-th of those the rank may use (its affinity), so a machine whose cpuset
# leaves some online cores out still pins.
PIN = ("import os, socket, sys; cores = sorted(os.sched_getaffinity(0)); "
       "n = int(socket.gethostname().rsplit('h', 1)[1]); "
       "os.sched_setaffinity(0, {cores[(n - 1) % len(cores)]}); os.execvp(sys.argv[1], sys.argv[1:])")
MODES = {"plain": (), "nice": ("sh", "-c", PRIORITISE, "sh"), "pinned": (util.PY, "-c", PIN)}
UNITS = {"K": 2 ** 10, "M": 2 ** 20}
# --train's bases: (wrapper, horovodrun flags, variables for every rank)
TRAIN_BASES = {"ddp": ("ddp", (), ()), "horovod": ("horovod", (), ()),
               "horovod-ring": ("horovod", (), tuple(emulated_cluster.RING.items())),
               "horovod-gloo": ("horovod", ("--gloo",), ())}


def parse_train(spec: str, hosts: int, profile: str) -> emulated_cluster.TrainRun:
    """``base[:K=V[;K=V...]]`` (a base of :data:`TRAIN_BASES`) -> the torch training cell."""
    base, _, extra = spec.partition(":")
    if base not in TRAIN_BASES:
        raise ValueError(f"unknown training cell {base!r} (from {', '.join(TRAIN_BASES)})")
    wrapper, flags, env = TRAIN_BASES[base]
    pairs = [kv.split("=", 1) for kv in extra.split(";") if kv]
    if any(len(kv) != 2 or not kv[0] for kv in pairs):
        raise ValueError(f"training cell {spec!r}: variables go as K=V;K=V")
    return emulated_cluster.TrainRun("torch", wrapper, hosts, profile, variant=spec.replace(":", "+"),
                            flags=flags, env=env + tuple(tuple(kv) for kv in pairs))


def parse_size(text: str) -> int:
    """``64M`` -> 67108864, ``64K``, or plain bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(text[:-1]) * UNITS[text[-1]] if text[-1:] in UNITS else int(text)


STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq")


def parse_proc_stat(text: str) -> dict[str, int]:
    """The machine's CPU time so far by kind, in clock ticks (``/proc/stat``'s ``cpu`` line)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return dict(zip(STAT_FIELDS, map(int, fields[1:1 + len(STAT_FIELDS)]), strict=True))
    raise ValueError("no cpu line in /proc/stat")


def machine_cpu() -> dict[str, float]:
    """Seconds of CPU so far, all cores, by kind, plus what the ``ksoftirqd`` threads ran: the
    emulated links (veth, bridge, HTB, TCP) are processed in softirqs on these same cores."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as fh:
        out = {k: v / tick for k, v in parse_proc_stat(fh.read()).items()}
    out["ksoftirqd"] = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "(ksoftirqd/" in text:
            fields = text.rsplit(")", 1)[1].split()
            out["ksoftirqd"] += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def rank_shares(cpu_per_rank: list[dict]) -> dict:
    """Per rank, shares of the timed wall time: CPU (all threads), and for its busiest thread
    (the one that ran most) the time it ran and the time it sat runnable without a core."""
    def of_wall(key: str) -> list[float]:
        return [round(r[key] / r["wall_s"], 3) for r in cpu_per_rank]
    return {"cpu_of_wall": of_wall("cpu_s"), "busiest_run_of_wall": of_wall("busiest_thread_run_s"),
            "busiest_wait_of_wall": of_wall("busiest_thread_wait_s"),
            "nice": [r["nice"] for r in cpu_per_rank]}


def summarize(cells: list[dict]) -> list[dict]:
    """One line per (impl, hosts, size, mode): busbw of the link rate and time over the formula in
    each round, the ranks' CPU and run-queue shares (the largest rank's, per round) and the cores
    all ranks used together."""
    lines: dict[tuple, dict] = {}
    for cell in cells:
        for row in cell.get("rows", []) if cell["ok"] else []:
            key = (cell["impl"], cell["hosts"], row["bytes"], cell["mode"])
            line = lines.setdefault(key, {
                "impl": key[0], "hosts": key[1], "bytes": key[2], "mode": key[3], "busbw_of_link": [],
                "over_formula": [], "max_busiest_wait_of_wall": [], "max_busiest_run_of_wall": [],
                "max_cpu_of_wall": [], "ranks_cores": [], "nice": [], "load_before": []})
            shares = rank_shares(row["cpu_per_rank"])
            line["busbw_of_link"].append(round(row["busbw_of_link"], 3))
            line["over_formula"].append(round(row["seconds"] / row["formula_seconds"] - 1, 3))
            line["max_busiest_wait_of_wall"].append(max(shares["busiest_wait_of_wall"]))
            line["max_busiest_run_of_wall"].append(max(shares["busiest_run_of_wall"]))
            line["nice"].append(max(shares["nice"]))
            line["max_cpu_of_wall"].append(max(shares["cpu_of_wall"]))
            # cores the ranks used together; near the machine's count, the ranks' own work is the limit
            line["ranks_cores"].append(round(sum(r["cpu_s"] for r in row["cpu_per_rank"])
                                             / max(r["wall_s"] for r in row["cpu_per_rank"]), 2))
            line["load_before"].append(cell["load_before"])
    return list(lines.values())


def summarize_training(cells: list[dict]) -> list[dict]:
    """One line per (training cell, hosts): seconds per step in each round, and where the round
    also ran ``ddp`` on as many hosts, this cell's speed over DDP's (DDP's s/step over its own)."""
    ddp = {(c["hosts"], c["round"]): c["result"]["seconds_per_step"]
           for c in cells if c["ok"] and c["spec"] == "ddp"}
    lines: dict[tuple, dict] = {}
    for cell in cells:
        line = lines.setdefault((cell["spec"], cell["hosts"]), {
            "spec": cell["spec"], "hosts": cell["hosts"], "seconds_per_step": [], "speed_over_ddp": []})
        if not cell["ok"]:
            continue
        s = cell["result"]["seconds_per_step"]
        line["seconds_per_step"].append(round(s, 4))
        if (cell["hosts"], cell["round"]) in ddp:
            line["speed_over_ddp"].append(round(ddp[cell["hosts"], cell["round"]] / s, 3))
    return list(lines.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.parts.cluster_cells", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--profile", default="1g",
                   choices=[k for k, v in emulated_cluster.PROFILES.items() if v.rate_bit])
    p.add_argument("--hosts", default="4", help="comma-separated host counts (default 4)")
    p.add_argument("--sizes", default="16M,64M")
    p.add_argument("--impls", default="horovod-mpi-ring,horovod-gloo,horovod-mpi,torch-gloo",
                   help=f"from {', '.join(emulated_cluster.COLLECTIVES)}")
    p.add_argument("--modes", default="plain,nice", help=f"from {', '.join(MODES)}, run in this order")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="extra variable for every rank")
    p.add_argument("--train", default="", help="training cells, comma-separated (see above; from "
                   f"{', '.join(TRAIN_BASES)}), after each round's collectives")
    p.add_argument("--out", required=True, help="JSON to write")
    args = p.parse_args(argv)
    impls, modes = [x for x in args.impls.split(",") if x], args.modes.split(",")
    bad = [x for x in impls if x not in emulated_cluster.COLLECTIVES] + [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown impl or mode {bad[0]!r}; see --help")
    extra = tuple(tuple(kv.split("=", 1)) for kv in args.env)
    hosts = [int(h) for h in args.hosts.split(",")]
    trains = [t for t in args.train.split(",") if t]
    try:
        for spec in trains:
            parse_train(spec, 2, args.profile)
    except ValueError as err:
        raise SystemExit(f"cluster_cells: {err}") from None
    cfg = emulated_cluster.ClusterConfig(coll_sizes=[parse_size(s) for s in args.sizes.split(",")],
                                         timeout_s=300)
    out = util.REPO / args.out
    why = util.private_dir(out.parent)  # as root: a folder another user can write to is theirs
    if why:
        print(f"cluster_cells: --out: {why}; give a file in a folder of yours that only you can "
              "write to", file=sys.stderr)
        raise SystemExit(2)
    work = out.parent / "tmp" / "cells"
    given = argv if argv is not None else sys.argv[1:]
    data = {"command": "python -m bench.parts.cluster_cells " + " ".join(given),
            "started": time.strftime("%Y-%m-%d %H:%M %Z"), "profile": args.profile, "env": dict(extra),
            "modes": {m: list(MODES[m]) for m in modes}, "config": cfg.to_dict(), "cells": [],
            "training": []}
    reason = nh.why_unavailable()
    if reason:
        raise SystemExit(f"cluster_cells: {reason}")
    names = [f"{PREFIX}h{i}" for i in range(1, max(hosts) + 1)]
    with util.terminate_as_exit(), nh.make_hosts(names, prefix=PREFIX, subnet=SUBNET,
                                                    iface=emulated_cluster.IFACE, hostnames=True) as made:
        prof = emulated_cluster.PROFILES[args.profile]
        shape = nh.LinkShape(prof.rate_bit, 0.0 if nh.netem_missing() else prof.delay_s)
        made.shape(shape)
        cl = emulated_cluster.Cluster(made, work, cfg.timeout_s)
        cl.profile = args.profile
        data["link"] = {"label": shape.describe(), "probe": cl.probe()}
        for rnd in range(args.rounds):
            for n in hosts:
                for impl in impls:
                    coll = emulated_cluster.COLLECTIVES[impl]
                    coll = dataclasses.replace(coll, env=coll.env + extra)
                    for mode in modes:
                        load, cpu0, t0 = os.getloadavg()[0], machine_cpu(), time.perf_counter()
                        rec = cl.collective(cfg, impl, coll, n, wrap=MODES[mode], tag=mode)
                        cpu1, wall = machine_cpu(), time.perf_counter() - t0
                        rec.update(mode=mode, round=rnd, load_before=round(load, 2),
                                   load_after=round(os.getloadavg()[0], 2),
                                   machine_cores={k: round((cpu1[k] - cpu0[k]) / wall, 3) for k in cpu1})
                        data["cells"].append(rec)
                        util.write_json(out, {**data, "summary": summarize(data["cells"])})
                for spec in trains:
                    load, t0 = os.getloadavg()[0], time.perf_counter()
                    run = parse_train(spec, n, args.profile)
                    rec = cl.train(cfg, dataclasses.replace(run, env=run.env + extra))
                    rec.update(spec=spec, round=rnd, load_before=round(load, 2),
                               cell_seconds=round(time.perf_counter() - t0, 1))
                    data["training"].append(rec)
                    util.write_json(out, {**data, "summary": summarize(data["cells"]),
                                          "training_summary": summarize_training(data["training"])})
    data["summary"] = summarize(data["cells"])
    data["training_summary"] = summarize_training(data["training"])
    util.write_json(out, data)
    for line in data["summary"]:
        util.say(f"{line['impl']} h{line['hosts']} {line['bytes'] >> 20} MiB {line['mode']}: busbw/link "
                 f"{line['busbw_of_link']}, busiest thread waiting/wall {line['max_busiest_wait_of_wall']}, "
                 f"running/wall {line['max_busiest_run_of_wall']}, "
                 f"load {line['load_before']}")
    for line in data["training_summary"]:
        util.say(f"train {line['spec']} h{line['hosts']}: s/step {line['seconds_per_step']}, "
                 f"speed over DDP {line['speed_over_ddp']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
