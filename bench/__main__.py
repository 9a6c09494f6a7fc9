"""``python -m bench [--quick] [--only PARTS] [--out DIR]``: run the suite, write JSON, plots and
BENCHMARKS.md.

Parts: ``throughput`` (training throughput and scaling, Horovod's cost at -np 1, and the peers
DDP / MultiWorkerMirroredStrategy: one part, because they share runs), ``collectives`` and
``accuracy`` (time to 99%): the default; ``cluster`` (an emulated cluster of network-namespace
hosts with shaped links: collectives, bandwidth-bound training, cost model and projection; root
only) and ``floor`` (Horovod's small-message floor on one host): ``--only cluster,floor``, what
``make bench-cluster`` runs; ``data`` (image folders read while training: memory against the
folder's size, throughput against one fixed batch; PyTorch): ``--only data``; ``ps`` (parameter
servers against the ring: staleness against accuracy, a straggler, the server's link as root;
PyTorch): ``--only ps``; ``pipeline`` (model parallelism: GPipe and 1F1B against the bubble
formula, against data parallelism, a model too large for one rank's memory cap, and, as root, the
bytes on a link between two emulated hosts; PyTorch): ``--only pipeline``; ``fault_recovery`` (the
seconds one rank SIGKILLed mid-epoch costs under the ring with ``--resume``, ``--elastic``, the
pipeline with ``--resume`` and the parameter servers; PyTorch): ``--only fault_recovery``;
``optimizers`` (SGD and AdamW, ``--shard-optimizer`` or not, at -np 2 and 4: images/s and each
rank's peak memory against the state's formula; bf16 against fp32; both frameworks):
``--only optimizers``.  Each part
is a module of bench/parts/: its own name, or ``allreduce`` (collectives), ``emulated_cluster`` (cluster),
``owndata`` (data), ``param_servers`` (ps), ``model_parallel`` (pipeline), ``update_cost``
(optimizers).
Each part's JSON is written to ``<out>/<part>.json`` as soon as it finishes; ``results.json``
merges the latest of each, so ``--only`` reruns one part and keeps the others.  ``--profile RUN``
runs only that run (names as printed, e.g. ``torch/trainer/horovod/mnist/np2``) under py-spy,
optionally with Horovod's timeline.  ``--smoke --out DIR``: the smallest run of each part
(:mod:`bench.parts.smoke`), to check it still runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import util
from bench.parts import (
    accuracy,
    allreduce,
    config,
    emulated_cluster,
    fault_recovery,
    floor,
    machine,
    model_parallel,
    owndata,
    param_servers,
    profiling,
    smoke,
    throughput,
    update_cost,
)
from bench.parts.training_runs import Profiling, execute, parse_run
from bench.reports import report

PARTS = report.PARTS
ALIASES = {"scaling": "throughput", "peers": "throughput", "horovod-cost": "throughput",
           "time-to-accuracy": "accuracy"}
RESULTS = util.REPO / "bench" / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="a few minutes: -np 1,2, short runs, proxy accuracy")
    p.add_argument("--smoke", action="store_true",
                   help="the smallest run of each part, to check that it still runs (numbers meaningless); "
                        "needs --out, a scratch folder; the report goes to OUT/BENCHMARKS.md")
    p.add_argument("--only", default=",".join(report.DEFAULT_PARTS),
                   help=f"comma-separated parts: {', '.join(PARTS)} "
                        f"(default: {', '.join(report.DEFAULT_PARTS)})")
    p.add_argument("--frameworks", default="torch,tf", help="torch, tf or both (default)")
    p.add_argument("--cells", default=None,
                   help=f"with --only cluster: which of its cells to run "
                        f"({', '.join(emulated_cluster.CELLS)}); with --only pipeline: "
                        f"{', '.join(model_parallel.CELLS)}; default all; a subset replaces those "
                        "cells' records in OUT/<part>.json and keeps the rest (with --smoke and no "
                        "earlier part there: the subset alone)")
    p.add_argument("--data-models", default=None,
                   help="data part: which of its models to measure (cnn, resnet18; default both)")
    p.add_argument("--data-rounds", type=int, default=None, metavar="N",
                   help="data part: rounds of its throughput comparison (default 2; each round runs "
                        "every side once, in alternating order)")
    p.add_argument("--out", default=None, help="results folder (default bench/results)")
    p.add_argument("--markdown", default=None, help="report to (re)generate (default BENCHMARKS.md)")
    p.add_argument("--profile", metavar="RUN", default=None,
                   help="run only RUN with py-spy on rank 0 (e.g. torch/loop/horovod/synthetic/np2)")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native (C/C++ frames too)")
    p.add_argument("--timeline", action="store_true",
                   help="with --profile on a Horovod run: also record Horovod's timeline")
    return p


def bad_input(message: str) -> SystemExit:
    """One line on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    return SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke and args.quick:
        raise bad_input("--smoke and --quick: choose one")
    if args.smoke and args.out is None:
        raise bad_input("--smoke needs --out DIR, a scratch folder: its numbers must not land in "
                        "bench/results")
    given_out = util.REPO / (args.out or RESULTS)
    out = given_out.resolve()
    default_md = out / "BENCHMARKS.md" if args.smoke else "BENCHMARKS.md"
    markdown = (util.REPO / (args.markdown or default_md)).resolve()
    if args.smoke and (out == RESULTS.resolve() or markdown == (util.REPO / "BENCHMARKS.md").resolve()):
        raise bad_input("--smoke writes meaningless numbers: give --out and --markdown outside bench/results "
                        "and BENCHMARKS.md")
    parts = []
    for name in args.only.split(","):
        name = ALIASES.get(name.strip(), name.strip())
        if name not in PARTS:
            raise bad_input(f"--only: unknown part {name!r}; choose from {', '.join(PARTS)}")
        parts.append(name)
    known_cells = {"cluster": emulated_cluster.CELLS, "pipeline": model_parallel.CELLS}
    rerun_part = parts[0] if len(parts) == 1 and parts[0] in known_cells else None
    every = known_cells[rerun_part] if rerun_part else emulated_cluster.CELLS
    cells = list(every) if args.cells is None else [c.strip() for c in args.cells.split(",")
                                                    if c.strip()]
    if args.cells is not None and rerun_part is None:
        raise bad_input("--cells reruns some cells of one part: use it with --only cluster or "
                        "--only pipeline")
    if not cells or any(c not in every for c in cells):
        raise bad_input(f"--cells: {args.cells!r}: choose from {', '.join(every)}")
    rerun = set(cells) != set(every)
    # a subset replaces those cells of the earlier part; under --smoke with none, it stands alone
    merge_into = rerun and (out / f"{rerun_part}.json").exists()
    if rerun and not merge_into and not args.smoke:
        raise bad_input(f"--cells reruns some cells of an earlier {rerun_part} part, but {out} "
                        f"holds no {rerun_part}.json: run the whole part first, or point --out at "
                        "its folder")
    try:
        run = parse_run(args.profile) if args.profile else None
    except ValueError as err:
        raise bad_input(f"--profile: {err}") from None
    data_models = None if args.data_models is None else [m for m in args.data_models.split(",") if m]
    known = [m.name for m in owndata.full().models]
    if data_models is not None and (not data_models or any(m not in known for m in data_models)):
        raise bad_input(f"--data-models: {args.data_models!r}: choose from {', '.join(known)}")
    if data_models is not None and "data" not in parts:
        raise bad_input("--data-models chooses the data part's models: use it with --only data")
    if args.data_rounds is not None and (args.data_rounds < 1 or "data" not in parts):
        raise bad_input(f"--data-rounds {args.data_rounds}: a count of 1 or more, with --only data")
    cfg = smoke.config() if args.smoke else config.quick() if args.quick else config.full()
    why = util.private_dir(given_out)  # before resolve() could follow a symlink planted as --out
    if why:
        raise bad_input(f"--out: {why}; give a folder of yours that only you can write to")
    frameworks = [f for f in args.frameworks.split(",") if f]
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    t0 = time.perf_counter()
    command = "python -m bench " + " ".join(argv if argv is not None else sys.argv[1:])

    if args.profile:
        prof = Profiling(args.profile, args.profile_native, args.timeline)
        for stale in ("pyspy.txt", "timeline.json"):
            (out / "profile" / stale).unlink(missing_ok=True)
        record = execute(run, cfg, out, prof)
        summary = {"target": args.profile, "quick": cfg.quick, "started": started, "run": record,
                   "native": args.profile_native, **(profiling.collect(out) or {})}
        util.write_json(out / "profile.json", summary)
        util.say(f"profile summary: {out / 'profile.json'}; raw: {out / 'profile'}")
        return 0 if record["ok"] else 1

    util.say("describing the machine (cores, memory bandwidth) ...")
    util.write_json(out / "machine.json", machine.describe(copy_bytes=cfg.copy_bytes))
    for part in parts:
        util.say(f"=== {part} ===")
        if part == "throughput":
            data = throughput.run_part(cfg, out, frameworks)
        elif part == "collectives":
            data = allreduce.run_part(cfg, out)
        elif part == "cluster":
            scale = emulated_cluster.quick if args.quick else emulated_cluster.full
            ccfg = smoke.cluster_config() if args.smoke else scale()
            data = emulated_cluster.run_part(ccfg.only(cells), out)
        elif part == "floor":
            data = floor.run_part(smoke.floor_config() if args.smoke else floor.quick() if args.quick
                                  else floor.full(), out)
        elif part == "data":
            supported = [f for f in frameworks if f in owndata.FRAMEWORKS]
            if not supported:
                util.say(f"data: measures {', '.join(owndata.FRAMEWORKS)} only; skipped")
                continue
            scale = owndata.smoke if args.smoke else owndata.quick if args.quick else owndata.full
            dcfg = scale(supported).only_models(data_models).with_rounds(args.data_rounds)
            data = owndata.run_part(dcfg, out)
        elif part == "ps":
            scale = (param_servers.smoke if args.smoke else param_servers.quick if args.quick
                     else param_servers.full)
            data = param_servers.run_part(scale(), out)
        elif part == "pipeline":
            if "torch" not in frameworks:
                util.say("pipeline: measures torch only; skipped")
                continue
            scale = (model_parallel.smoke if args.smoke else model_parallel.quick if args.quick
                     else model_parallel.full)
            data = model_parallel.run_part(scale(), out, cells if rerun else None)
        elif part == "fault_recovery":
            if "torch" not in frameworks:
                util.say("fault_recovery: measures torch only; skipped")
                continue
            scale = (fault_recovery.smoke if args.smoke else fault_recovery.quick if args.quick
                     else fault_recovery.full)
            data = fault_recovery.run_part(scale(), out)
        elif part == "optimizers":
            scale = (update_cost.smoke if args.smoke else update_cost.quick if args.quick
                     else update_cost.full)
            ocfg = scale()
            ocfg.frameworks = [f for f in ocfg.frameworks if f in frameworks]
            data = update_cost.run_part(ocfg, out)
        else:
            data = accuracy.run_part(cfg, out, frameworks)
        data["quick"] = cfg.quick or args.smoke
        data["started"] = started
        data["machine"] = util.read_json(out / "machine.json")  # the limits its numbers meet
        if part == "cluster" and merge_into and "skipped" not in data:
            data = emulated_cluster.merge_rerun(util.read_json(out / "cluster.json"), data, command)
        if part == "pipeline" and merge_into:
            data = model_parallel.merge_rerun(util.read_json(out / "pipeline.json"), data, command)
        util.write_json(out / f"{part}.json", data)

    results = merge(out, {"quick": cfg.quick or args.smoke, "started": started, "command": command,
                          "duration_s": time.perf_counter() - t0, "config": cfg.to_dict()})
    util.write_json(out / "results.json", results)
    md = report.write(out / "results.json", markdown)
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
    with util.terminate_as_exit():  # SIGTERM ends the running job and tears the cluster down
        sys.exit(main())
