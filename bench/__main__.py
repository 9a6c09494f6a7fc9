"""``python -m bench [--quick] [--only PARTS] [--out DIR]``: run the suite, write JSON, plots and
BENCHMARKS.md.

Parts: ``throughput`` (training throughput and scaling, Horovod's cost at -np 1, and the peers
DDP / MultiWorkerMirroredStrategy: one part, because they share runs), ``collectives`` and
``accuracy`` (time to 99%): the default; ``cluster`` (an emulated cluster of network-namespace
hosts with shaped links: collectives, bandwidth-bound training, cost model and projection; root
only) and ``floor`` (Horovod's small-message floor on one host): ``--only cluster,floor``, what
``make bench-cluster`` runs; ``data`` (image folders read while training: memory against the
folder's size, throughput against one fixed batch; PyTorch): ``--only data``.
Each part's JSON is written to ``<out>/<part>.json`` as soon as it
finishes; ``results.json`` merges the latest of each, so ``--only`` reruns one part and keeps the
others.  ``--profile RUN`` runs only that run (names as printed, e.g.
``torch/trainer/horovod/mnist/np2``) under py-spy, optionally with Horovod's timeline.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from bench import (
    accuracy,
    cluster,
    collectives,
    config,
    floor,
    machine,
    owndata,
    profiling,
    report,
    throughput,
    util,
)
from bench.jobs import Profiling, Run, execute

PARTS = report.PARTS
ALIASES = {"scaling": "throughput", "peers": "throughput", "horovod-cost": "throughput",
           "time-to-accuracy": "accuracy"}
RUN_NAME = re.compile(r"^(torch|tf)/(trainer|loop)/(none|horovod|horovod-gloo|ddp|mwms)/"
                      r"(mnist|synthetic)/np(\d+)(?:-(\d+)thread)?$")


def parse_run(name: str) -> Run:
    m = RUN_NAME.match(name)
    if not m:
        raise SystemExit(f"--profile: {name!r} is not a run name like torch/trainer/horovod/mnist/np2 "
                         f"or tf/loop/horovod/synthetic/np1")
    return Run(m[1], m[2], m[3], m[4], int(m[5]), threads=int(m[6] or 0))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="a few minutes: -np 1,2, short runs, proxy accuracy")
    p.add_argument("--only", default=",".join(report.DEFAULT_PARTS),
                   help=f"comma-separated parts: {', '.join(PARTS)} "
                        f"(default: {', '.join(report.DEFAULT_PARTS)})")
    p.add_argument("--frameworks", default="torch,tf", help="torch, tf or both (default)")
    p.add_argument("--out", default="bench/results", help="results folder (default bench/results)")
    p.add_argument("--markdown", default="BENCHMARKS.md", help="report to (re)generate")
    p.add_argument("--profile", metavar="RUN", default=None,
                   help="run only RUN with py-spy on rank 0 (e.g. torch/loop/horovod/synthetic/np2)")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C/C++ frames too)")
    p.add_argument("--timeline", action="store_true",
                   help="with --profile on a Horovod run: also record Horovod's timeline")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config.quick() if args.quick else config.full()
    out = (util.REPO / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    frameworks = [f for f in args.frameworks.split(",") if f]
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    t0 = time.perf_counter()
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.profile:
        run = parse_run(args.profile)
        prof = Profiling(args.profile, args.profile_native, args.timeline)
        for stale in ("pyspy.txt", "timeline.json"):
            (out / "profile" / stale).unlink(missing_ok=True)
        record = execute(run, cfg, out, prof)
        summary = {"target": args.profile, "quick": cfg.quick, "started": started, "run": record,
                   "native": args.profile_native, **(profiling.collect(out) or {})}
        util.write_json(out / "profile.json", summary)
        util.say(f"profile summary: {out / 'profile.json'}; raw: {out / 'profile'}")
        return 0 if record["ok"] else 1

    parts = []
    for name in args.only.split(","):
        name = ALIASES.get(name.strip(), name.strip())
        if name not in PARTS:
            raise SystemExit(f"--only: unknown part {name!r}; choose from {', '.join(PARTS)}")
        parts.append(name)

    util.say("describing the machine (cores, memory bandwidth) ...")
    util.write_json(out / "machine.json", machine.describe())
    for part in parts:
        util.say(f"=== {part} ===")
        if part == "throughput":
            data = throughput.run_part(cfg, out, frameworks)
        elif part == "collectives":
            data = collectives.run_part(cfg, out)
        elif part == "cluster":
            data = cluster.run_part(cluster.quick() if args.quick else cluster.full(), out)
        elif part == "floor":
            data = floor.run_part(floor.quick() if args.quick else floor.full(), out)
        elif part == "data":
            supported = [f for f in frameworks if f in owndata.FRAMEWORKS]
            if not supported:
                util.say(f"data: measures {', '.join(owndata.FRAMEWORKS)} only; skipped")
                continue
            data = owndata.run_part((owndata.quick if args.quick else owndata.full)(supported), out)
        else:
            data = accuracy.run_part(cfg, out, frameworks)
        data["quick"] = cfg.quick
        data["started"] = started
        data["machine"] = util.read_json(out / "machine.json")  # the limits its numbers meet
        util.write_json(out / f"{part}.json", data)

    results = merge(out, {"quick": cfg.quick, "started": started, "command": command,
                          "duration_s": time.perf_counter() - t0, "config": cfg.to_dict()})
    util.write_json(out / "results.json", results)
    md = report.write(out / "results.json", util.REPO / args.markdown)
    util.say(f"done in {(time.perf_counter() - t0) / 60:.1f} min: {out / 'results.json'}, {md}")
    return 0


def merge(out: Path, meta: dict) -> dict:
    """results.json: machine + the latest JSON of every part + the profile, if any."""
    res: dict = {"meta": meta, "machine": util.read_json(out / "machine.json")}
    for part in PARTS:
        if (out / f"{part}.json").exists():
            res[part] = util.read_json(out / f"{part}.json")
            # a report that mixes quick and full parts is a quick report
            res["meta"]["quick"] = res["meta"]["quick"] or res[part].get("quick", False)
    if (out / "profile.json").exists():
        res["profile"] = util.read_json(out / "profile.json")
    return res


if __name__ == "__main__":
    sys.exit(main())
