"""BENCHMARKS.md's model-parallelism section, from ``pipeline.json`` (:mod:`bench.parts.model_parallel`).

Renders only: every number is a measurement of that run, a formula printed beside it, or a ratio
of two measurements of the same run of the part.  In a quick or smoke run, ratios read ``-``.
"""

from __future__ import annotations

from bench.common.tables import load_note, load_text, num, pct, table

WITHHELD = "-"


def _mb(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e6:.1f}"


def section(res: dict) -> list[str]:
    data = res.get("pipeline")
    if not data:
        return []
    comparing = not data.get("quick")
    cfg = data["config"]
    width, depth = cfg["mlp"]
    lines = ["## 10. Model parallelism: a pipeline of stages", ""]
    if data.get("quick"):
        lines += ["> **QUICK RUN**: few steps; the numbers show that the part works, and no ratio "
                  f"is printed (`{WITHHELD}`).", ""]
    lines += [f"`python -m bench --only pipeline` (`bench/parts/model_parallel.py`), "
              f"{data.get('started', '?')}: "
              f"load average (1, 5, 15 min) {load_text(data.get('load_before'))} at the start and "
              f"{load_text(data.get('load_after'))} at the end "
              f"({load_note(data.get('load_before'), (res.get('machine') or {}).get('cores'))}: "
              "compare rows of this run with each other, not with other sections). PyTorch, "
              "`horovodrun -np 2`, `OMP_NUM_THREADS=1`; each figure from the trainer's own "
              "`--metrics-out` summary. See docs/pipeline.md." + reruns(data, res), ""]
    lines += _schedules(data, width, depth, comparing, res)
    lines += _versus(data, comparing)
    lines += _memory(data)
    lines += _deep_memory(data)
    lines += _largest(data, comparing)
    lines += _stage_memory(data)
    lines += _partition(data, comparing)
    lines += _link(data, comparing)
    return lines


CELL_TABLES = {"schedules-s2": "S = 2 schedules", "schedules-s4": "S = 4 schedules",
               "versus_dp": "pipeline against data parallelism", "memory": "memory",
               "deep_memory": "stage build", "largest": "largest model", "stage_memory":
               "peak memory per stage", "partition": "`--partition`", "link": "link"}


def reruns(data: dict, res: dict) -> str:
    """Which cells were measured again later (``python -m bench --only pipeline --cells ...``):
    their tables are from that run, compared within it."""
    said = []
    cores = (res.get("machine") or {}).get("cores")
    for r in data.get("reruns", []):
        tables = ", ".join(CELL_TABLES.get(c, c) for c in r["cells"])
        load = r.get("load_before")
        said.append(f" The {tables} tables are from a later run, {r.get('started', '?')} "
                    f"(`{r['command']}`), load average {load_text(load)} at its start and "
                    f"{load_text(r.get('load_after'))} at its end ({load_note(load, cores)}): "
                    "compare their rows with each other.")
    return "".join(said)


def _schedules(data: dict, width: int, depth: int, comparing: bool, res: dict) -> list[str]:
    cfg = data["config"]
    cores = (res.get("machine") or data.get("machine") or {}).get("cores")
    out = []
    runs = data.get("schedules", [])  # none in a smoke test's share without schedule cells
    for stages in sorted({r.get("stages", 2) for r in runs}):
        rows = []
        for r in (r for r in runs if r.get("stages", 2) == stages):
            if not r["ok"]:
                rows.append([r["schedule"], str(r["micro"]), "failed", "", "",
                             pct(r["formula_bubble"]), ""])
                continue
            rows.append([r["schedule"], str(r["micro"]), num(r["images_per_second"]),
                         pct(r["measured_bubble"]), pct(r["replayed_bubble"]),
                         pct(r["formula_bubble"]),
                         " / ".join(f"{1e3 * b:.1f}" for b in r["busy_seconds"])])
        header = ["schedule", "M", "images/s", "bubble measured", "replayed", "formula",
                  "computing ms/step, stage " + " / ".join(str(i) for i in range(stages))]
        if stages == 2:
            out += [f"### Schedules: S = 2 stages, one replica, per-replica batch {cfg['batch']}, "
                    f"{cfg['steps']} steps", "",
                    f"An MLP of {depth} hidden layers of {width} ({data['mlp_params']:,} "
                    "parameters, `bench.parts.model_parallel:mlp`): split by parameter count, its "
                    "two stages also do about the same work, the case the formula describes. "
                    "Bubble measured: 1 - (mean computing time of the stages) / (the longer "
                    "stage's schedule), per step, the first step left out; replayed: the schedule "
                    "run on this run's own stage times (backward = 2 x forward); formula: "
                    "(S-1)/(M+S-1).", "", table(header, rows), ""]
            continue
        crowded = (f" The {stages} ranks share {cores} cores: a stage that waits polls for its "
                   "message, taking time from the stages that compute, so the bubble measured "
                   "here is an upper bound." if cores and stages > cores else "")
        out += [f"### Schedules: S = {stages} stages, one replica (-np {stages}), per-replica "
                f"batch {cfg['batch']}, {cfg['steps']} steps", "",
                f"The same MLP in {stages} stages (split by parameter count: about equal, the "
                "first and last hold the input layer and the logits beside hidden layers). "
                "Measured, replayed and formula as for S = 2; the bubble's formula is "
                f"(S-1)/(M+S-1) = {stages - 1}/(M+{stages - 1})." + crowded, "",
                table(header, rows), ""]
    return out


def versus_ratios(data: dict, comparing: bool) -> list[tuple[dict, float | None]]:
    """Each run of "pipeline against data parallelism" with its images/s over the data-parallel
    run's (None where either failed, or in a quick run)."""
    rows = data.get("versus_dp") or []
    dp = next((r for r in rows if r["ok"] and r["kind"] == "data-parallel"), None)
    return [(r, r["images_per_second"] / dp["images_per_second"] if comparing and r["ok"] and dp else None)
            for r in rows]


def _versus(data: dict, comparing: bool) -> list[str]:
    rows = versus_ratios(data, comparing)
    if not rows:
        return []
    out = []
    for r, ratio in rows:
        out.append([r["kind"], str(r.get("global_batch", "")),
                    num(r.get("images_per_second")) if r["ok"] else "failed",
                    f"{ratio:.2f}x" if ratio is not None else WITHHELD])
    return ["### Pipeline against data parallelism on the same 2 cores", "",
            "The same MLP, the same global batch, -np 2: data parallel (every rank the whole "
            "model, half the batch, one gradient allreduce per step) against the pipeline (S = 2, "
            "one replica: no allreduce between ranks, activations sent between them, and the "
            "bubble).", "",
            table(["run", "global batch", "images/s", "vs data parallel"], out), ""]


def _memory(data: dict) -> list[str]:
    mem = data.get("memory")
    if not mem:
        return []
    rows = []
    for c in mem["cells"]:
        peaks = [r["peak_rss_bytes"] for r in c.get("ranks", [])]
        rows.append([f"S = {c['stages']}", "trained" if c["ok"] else
                     ("failed: can't allocate memory" if c["allocation_failed"] else "failed"),
                     " / ".join(_mb(b) for b in c.get("param_bytes", [])) or "-",
                     " / ".join(_mb(b) for b in peaks) or "-"])
    return ["### Memory: a model that does not fit one rank", "",
            f"An MLP of {mem['depth']} hidden layers of {mem['width']}: {mem['params']:,} "
            f"parameters, {_mb(mem['weight_bytes'])} MB of float32 weights, as many again in "
            "gradients and in SGD's momentum. Each rank may allocate "
            f"{mem['budget_mb']:.0f} MB beyond what PyTorch, Horovod and MPI hold once imported "
            "(`bench/workers/memlimit.py`: `RLIMIT_DATA`), -np 2, 16 MiB fusion buffer:", "",
            table(["run", "outcome", "parameter MB per rank (rank 0 / 1)",
                   "peak resident MB per rank"], rows), ""]


def _deep_memory(data: dict) -> list[str]:
    deep = data.get("deep_memory")
    if not deep or not deep.get("cells"):
        return []
    rows = []
    for c in deep["cells"]:
        outcome = ("trained" if c["ok"] else "failed: can't allocate memory"
                   if c.get("allocation_failed") else "failed")
        built = ("its stage only" if c.get("stage_by_stage") else
                 "the whole model" if c["np"] == 1 else "the whole model (fallback)")
        peaks = c.get("peak_rss_mb") or []
        rows.append([f"-np {c['np']}" + (f", S = {c['stages']}" if c["stages"] > 1 else ", ring"),
                     outcome, built,
                     " / ".join(_mb(b) for b in c.get("param_bytes") or []) or "-",
                     f"{min(peaks)}-{max(peaks)}" if peaks else "-"])
    weights = 4 * (deep["width"] * deep["width"] + deep["width"]) * deep["depth"]
    return ["### What a rank builds: a model no rank can hold", "",
            f"{deep['depth']} x Linear({deep['width']}, {deep['width']}) (about "
            f"{weights / 1e9:.2f} GB of float32 weights; `bench.parts.model_parallel:deep_torch`, "
            "a plain `nn.Sequential`), each rank allowed "
            f"{deep['budget_mb']:.0f} MB beyond the started framework (`RLIMIT_DATA`), one epoch of "
            "8 steps of 8 rows. One rank must hold the weights, their gradients and momentum; at "
            "S = 8 each rank builds and trains only its stage (docs/pipeline.md, 'What is built "
            "where').", "",
            table(["run", "outcome", "built on each rank", "parameter MB per rank",
                   "peak resident MB per rank (min-max)"], rows), ""]


def _link(data: dict, comparing: bool) -> list[str]:
    link = data.get("link")
    if not link:
        return []
    if "skipped" in link:
        return ["### Bytes on the link", "", f"Not measured: {link['skipped']}", ""]
    rows = []
    for r in link["rows"]:
        if not r["ok"]:
            rows.append([r["kind"], "failed", "", "", ""])
            continue
        measured = max(r["tx_per_step"], r["rx_per_step"])
        rows.append([r["kind"], _mb(r["tx_per_step"]), _mb(r["rx_per_step"]),
                     _mb(r["formula_each_way"]),
                     f"{measured / r['formula_each_way']:.2f}" if comparing else WITHHELD])
    return ["### Bytes on the link between two hosts, per training step", "",
            f"Two network-namespace hosts, one rank each, the built-in CNN, global batch "
            f"{link['global_batch']}: data parallel (each host's rank, half the batch; a ring "
            "allreduce of the float32 gradients G moves 2(N-1)/N x G each way per step) against "
            "the pipeline (stage 0 on one host, stage 1 on the other; B x A x 4 bytes each way: "
            "B rows, A values per example at the cut). Counted by the kernel on host a's link "
            "(frames: headers included), per step as the difference of two runs of "
            f"{link['rows'][0].get('steps', ['?', '?'])[0]} and "
            f"{link['rows'][0].get('steps', ['?', '?'])[1]} steps.", "",
            table(["run", "MB out of host a", "MB into host a", "formula MB each way",
                   "measured / formula"], rows), ""]


def _outcome(p: dict) -> str:
    if p["ok"]:
        return "trained"
    if p.get("refused_by_check"):
        return "refused (the stage check)"
    if p.get("ran_out"):
        return "ran out of memory in a step (the trainer's line)"
    if p.get("allocation_failed"):
        return "can't allocate memory"
    return "a rank stopped answering (--stall-timeout)" if p.get("stalled") else "failed"


def _largest(data: dict, comparing: bool) -> list[str]:
    big = data.get("largest")
    if not big:
        return []
    rows, probes = [], []
    for c in big["cells"]:
        target = c.get("target_params")
        ratio = c.get("vs_first")
        rows.append([f"S = {c['stages']}", str(c["np"]),
                     str(c["largest_depth"]) if c["largest_depth"] else "none",
                     f"{c['largest_params'] / 1e6:.1f}M" if c["largest_params"] else "-",
                     str(c["smallest_failed_depth"] or "-"),
                     f"{target / 1e6:.1f}M" if target else "-",
                     f"{ratio:.2f}x" if ratio is not None and comparing else WITHHELD,
                     ("yes" if c.get("meets_target") else "no") if target else "-"])
        for p in c["probes"]:
            probes.append(f"S = {c['stages']} depth {p['depth']} ({p['params'] / 1e6:.1f}M): "
                          f"{_outcome(p)}"
                          + (f", peak {max(p['peak_rss_mb'])} MB" if p.get("peak_rss_mb") else ""))
    return ["### The largest model under one cap per rank", "",
            f"MLPs of width {big['width']} and growing depth (`bench.parts.model_parallel:mlp`), "
            f"each rank allowed {big['budget_mb']:.0f} MB beyond what PyTorch, Horovod and MPI "
            "hold once imported (`bench/workers/memlimit.py`: `RLIMIT_DATA`), "
            f"{big['steps']} steps of 32 rows, M = S, SGD with momentum (12 bytes a weight). "
            "S = 1 is the ring on one rank; a few probes per S, each one launch (largest: the "
            "deepest that trained; the search stops once the deepest that trained and the "
            "shallowest that did not are within 5%). Target: 0.9 x S times S = 1's parameters.",
            "", table(["stages", "-np", "largest depth", "parameters", "smallest depth that failed",
                       "target", "vs S = 1", "meets target"], rows), "",
            "Probes: " + "; ".join(probes) + ".", ""]


def _stage_memory(data: dict) -> list[str]:
    mem = data.get("stage_memory")
    if not mem:
        return []
    by = {c["schedule"]: c for c in mem["cells"]}
    stages = mem["stages"]
    rows = []
    for s in range(stages):
        row = [str(s)]
        for schedule in ("gpipe", "1f1b"):
            c = by.get(schedule)
            if not c or not c["ok"]:
                row += ["failed", ""]
                continue
            st = next(x for x in c["stages"] if x["stage"] == s)
            row += [f"{st['peak_activations_held']} / {st['in_flight_formula']}",
                    _mb(st["peak_rss_bytes"])]
        rows.append(row)
    return ["### Peak memory per stage: GPipe against 1F1B", "",
            f"The built-in CNN at S = {stages} (-np {stages}), M = {mem['micro']} micro-batches of "
            f"{mem['microbatch_rows']} rows (batch {mem['batch']}), one replica. Held: the most "
            "micro-batches whose activations the stage kept at once, measured by the trainer "
            "(`peak_activations_held`), / the schedule's bound (GPipe: M; 1F1B: S - s). Peak "
            "resident memory: each rank's `VmHWM` at exit (the imported frameworks included), "
            "MB; the first stage's activations are the largest (the convolutions' outputs).", "",
            table(["stage", "GPipe held / bound", "GPipe peak resident MB",
                   "1F1B held / bound", "1F1B peak resident MB"], rows), ""]


def _partition(data: dict, comparing: bool) -> list[str]:
    part = data.get("partition")
    if not part:
        return []
    base = next((c for c in part["cells"] if c["partition"] == "params" and c["ok"]), None)
    rows = []
    for c in part["cells"]:
        if not c["ok"]:
            rows.append([f"`--partition {c['partition']}`", "failed", "", "", "", "", "", ""])
            continue
        speed = (c["images_per_second"] / base["images_per_second"]
                 if comparing and base and c is not base else None)
        rows.append([f"`--partition {c['partition']}`",
                     " / ".join(str(n) for n in c["layers"]),
                     " / ".join(f"{n / 1e6:.2f}M" for n in c["params"]),
                     num(c["images_per_second"]),
                     " / ".join(f"{1e3 * b:.1f}" for b in c["busy_seconds"]),
                     pct(c["slowest_share"]),
                     " / ".join(pct(x) for x in c["timed_share"]) if c.get("timed_share") else "-",
                     f"{speed:.2f}x" if speed is not None else ("-" if c is base else WITHHELD)])
    return ["### Balancing the stages by time (`--partition time`)", "",
            "`bench.parts.model_parallel:costly`: a Linear(784, 2048) holding most of the "
            f"weights, then {part['convs'] + 1} convolutions of {part['channels']} channels on "
            "32 x 32 holding few and doing most of the work; S = 2 at -np 2, "
            f"M = {part['micro']}, batch {part['batch']}, {part['steps']} steps. Computing: each "
            "stage's computing time per step measured by the trainer; the slowest stage's share "
            "of the stages' sum (50% is even; a step waits for the slowest); timed: the shares "
            "rank 0's timing of the layers predicted for the split it chose.", "",
            table(["split", "layers per stage", "parameters per stage", "images/s",
                   "computing ms/step, stage 0 / 1", "slowest stage's share", "timed shares",
                   "images/s vs params"], rows), ""]
