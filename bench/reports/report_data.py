"""BENCHMARKS.md's "Your own data" section, from ``data.json`` (:mod:`bench.parts.owndata`).

Renders only.  Every number is a measurement of that run or arithmetic on them (means over
rounds, ratios, the cores bound of 8.5, whose formula is printed beside it).  In a quick or smoke
run, comparisons read ``-``, as in the rest of the report.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any

from bench.common.tables import FW_NAMES, load_text, num, pct, table

ANALYSIS = Path(__file__).parent.parent / "data_analysis.md"  # the hand-written reading of section 8
TARGET = 0.90  # the trainer on a folder against one fixed batch (issue #21)
MEMORY_SLACK = 0.10  # the larger folder's rank within 10% (+ its file-name list) of the smaller's
MODEL_NAMES = {"cnn": "the built-in CNN (`--model cnn`)",
               "resnet18": "ResNet-18 (`--model torchvision.models:resnet18`)"}
WITHHELD = "-"


def pct_of_target(ratio: float | None) -> str:
    """``ratio`` as a percentage, with a decimal where a whole one would read as the target
    itself but the ratio is below it (89.7% is not "90%", which meets it)."""
    if ratio is not None and ratio < TARGET and round(100 * ratio) >= round(100 * TARGET):
        return f"{100 * ratio:.1f}%"
    return pct(ratio)


def _ok(runs: list[dict], **match: Any) -> list[dict]:
    return [r for r in runs if r.get("ok") and all(r.get(k) == v for k, v in match.items())]


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


def _largest(run: dict, key: str) -> float | None:
    values = [q.get(key) for q in run["ranks"] if q.get(key) is not None]
    return max(values) if values else None


def memory_summary(data: dict, fw: str) -> dict[int, dict[str, Any]]:
    """Per training-set size: the largest rank's peak RSS in each run and their mean, the same
    for the workers, and the file-name list's size."""
    out = {}
    for n in data["config"]["memory_sizes"]:
        runs = _ok(data.get("memory", []), folder_key=f"mem-{n}", framework=fw)
        ranks = [max(r["peak_rss_mib"]) for r in runs if r["peak_rss_mib"]]
        workers = [[q["workers_peak_rss_mib"] for q in r["ranks"] if q["workers"]] for r in runs]
        uss = [[q["workers_max_uss_mib"] for q in r["ranks"] if q["workers"]] for r in runs]
        out[n] = {"runs": runs, "rank_peaks": ranks, "rank": _mean(ranks),
                  "workers": _mean([max(w) for w in workers if w]),
                  "workers_uss": _mean([max(w) for w in uss if w]),
                  "workers_count": sorted({q["workers"] for r in runs for q in r["ranks"]}),
                  "cache": _mib(_mean([r.get("decoded_cache_bytes") for r in runs])),
                  "server": _mean([_largest(r, "forkserver_peak_rss_mib") for r in runs]),
                  "server_uss": _mean([_largest(r, "forkserver_max_uss_mib") for r in runs]),
                  "list_mib": _mib(data["folders"].get(f"mem-{n}", {}).get("list_bytes"))}
    return out


def memory_verdict(data: dict, fw: str) -> dict[str, Any] | None:
    """The larger folder's rank peak against the smaller's: the growth, and what the claim
    allows (10% of the smaller's + the larger's file-name list)."""
    small, large = data["config"]["memory_sizes"]
    mem = memory_summary(data, fw)
    a, b = mem[small]["rank"], mem[large]["rank"]
    if a is None or b is None:
        return None
    allowed = MEMORY_SLACK * a + (mem[large]["list_mib"] or 0.0)
    return {"small": small, "large": large, "growth_mib": b - a, "growth": b / a - 1,
            "allowed_mib": allowed, "holds": b - a <= allowed}


def with_cache(data: dict) -> bool:
    """Whether the run's trainers had the decoded cache (runs before it record no ``cache``)."""
    return any("cache" in r for r in data.get("throughput", []))


def throughput_rows(data: dict, fw: str, model: str, n: int) -> dict[str, Any]:
    runs = data.get("throughput", [])
    fixed = _ok(runs, framework=fw, model=model, np=n, kind="loop", data="fixed")
    trainers = _ok(runs, framework=fw, model=model, np=n, kind="trainer", data="folder", workers=None)
    trainer = [r for r in trainers if r.get("cache", True)]  # runs before the cache had none
    nocache = [r for r in trainers if not r.get("cache", True)]
    loop = _ok(runs, framework=fw, model=model, np=n, kind="loop", data="folder", workers=None)
    f = _mean([r["images_per_second"] for r in fixed])
    t = _mean([r["images_per_second"] for r in trainer])
    tn = _mean([r["images_per_second"] for r in nocache])
    lp = _mean([r["images_per_second"] for r in loop])
    per_round = [_ratio(tr["images_per_second"], fx["images_per_second"])
                 for tr in trainer for fx in fixed if tr["round"] == fx["round"]]
    workers = sorted({r["workers_used"] for r in trainer + loop if r.get("workers_used") is not None})
    return {"fixed": f, "trainer": t, "loop": lp, "trainer_ratio": _ratio(t, f), "loop_ratio": _ratio(lp, f),
            "nocache": tn, "nocache_ratio": _ratio(tn, f),
            "per_round": per_round, "workers": workers,
            "fixed_busy": _mean([r.get("rank0_cores_busy") for r in fixed]),
            "loop_busy": _mean([r.get("rank0_cores_busy") for r in loop]),
            "loop_workers_busy": _mean([r.get("rank0_workers_cores_busy") for r in loop]),
            "rounds": len(fixed), "failed": [r["name"] for r in runs if not r.get("ok")
                                             and (r["framework"], r["model"], r["np"]) == (fw, model, n)]}


def loop_steps_text(data: dict, fw: str, m: dict) -> str:
    """The bench loop's timed steps for ``m``: its fixed count, or (``loop_steps`` None: the
    trainer's batches per epoch) the count each -np ran."""
    if m.get("loop_steps") is not None:
        return str(m["loop_steps"])
    steps = {r["np"]: r["timed_steps"] for r in data.get("throughput", [])
             if (r["framework"], r["model"], r["kind"]) == (fw, m["name"], "loop") and "timed_steps" in r}
    counts = ", ".join(f"{s} at -np {n}" for n, s in sorted(steps.items()))
    return "as many as the trainer's epoch" + (f" ({counts})" if counts else "")


def item_cost_s(data: dict, model: str, fw: str) -> float | None:
    """CPU seconds per image of what the framework's pipeline runs for it, for the model's folder
    (8.4): a PyTorch worker's whole item, or TensorFlow's batch read per image."""
    rec = next((d for d in data.get("decode", []) if d["folder"] == f"model-{model}" and d.get("ok")), None)
    key = "item" if fw == "torch" else "batch"
    return rec[key]["cpu_us"] / 1e6 if rec and key in rec else None


def cores_bound(data: dict, row: dict, n: int, cost: float | None) -> float | None:
    """R <= cores / (K / F + c): at rate R the training takes R x K / F core-seconds per second
    (K cores busy over all ranks at the fixed-batch rate F, rank 0's x -np) and decoding R x c;
    together they cannot exceed the cores."""
    if row["fixed"] is None or row["fixed_busy"] is None or cost is None:
        return None
    return data["cores"] / (row["fixed_busy"] * n / row["fixed"] + cost)


def section(res: dict) -> list[str]:
    data = res.get("data")
    if not data:
        return []
    comparing = not data.get("quick")
    cfg = data["config"]

    def rx(v: float | None) -> str:
        return pct(v) if comparing else WITHHELD

    load0, load1 = data.get("load_average_at_start"), data.get("load_average_at_end")
    lines = ["## 8. Your own data: image folders read while training", ""]
    if data.get("quick"):
        how = "python -m bench --only data --quick" if cfg["scale"] == "quick" else \
            f"python -m bench.parts.owndata --scale {cfg['scale']}"
        lines += [f"> **{cfg['scale'].upper()} RUN** (`{how}`): small folders and few steps; the numbers "
                  f"show that the part works, and no comparison is printed (`{WITHHELD}`).", ""]
    fws = ", ".join(FW_NAMES[f] for f in cfg["frameworks"])
    lines += [f"`python -m bench --only data` (`bench/parts/owndata.py`), {data.get('started', '?')}, on "
              f"{data['cores']} cores: load average (1, 5, 15 min) "
              f"{load_text(load0)} at the start and {load_text(load1)} at the end; each run's 1-minute "
              f"load at its start is in `bench/results/data.json`. Frameworks measured: {fws}"
              + ("" if "tf" in cfg["frameworks"] else " (TensorFlow's `tf.data` path: not measured yet)")
              + ". The folders are JPEG pictures written for the run and deleted after it (a filled "
              "circle, square or triangle, one class each, of random size, position and colour on a "
              "random background: `tests/image_folders.py`). Trainer flags: `--data folder:DIR "
              f"--batch-size {cfg['batch']}`, the model's, `--max-steps` where given, default `--workers` "
              "(the cores a rank has), "
              + ("a decoded cache of the job's own (`--decode-cache DIR`) unless it says *no cache*"
                 if with_cache(data) else "no decoded cache (this run predates it: every epoch decoded)")
              + ", under `horovodrun -np N`.", ""]
    lines += _memory(data, rx)
    lines += _throughput(data, rx)
    lines += _sweep(data, rx)
    lines += _decode(data)
    lines += _where(data, rx)
    if ANALYSIS.exists() and not data.get("quick"):
        lines += [ANALYSIS.read_text().strip(), ""]
    return lines


def _memory(data: dict, rx) -> list[str]:
    cfg = data["config"]
    lines = ["### 8.1 Memory: a rank does not hold the folder", "",
             f"The real trainer (`--model cnn`, {cfg['memory_image_size']}x{cfg['memory_image_size']} "
             f"RGB, `--epochs 1 --max-steps {cfg['memory_steps']} --test-samples {cfg['memory_test']}`, "
             f"-np {cfg['memory_np']}) on folders of {' and '.join(f'{n:,}' for n in cfg['memory_sizes'])} "
             f"training images ({cfg['memory_distinct']} distinct pictures each, written in turn), "
             f"{cfg['memory_rounds']} round(s) in alternating order. *Rank peak RSS*: `ru_maxrss` of "
             "the rank process (the largest rank of each run, then their mean; TensorFlow's decode "
             "threads are part of it). *Workers* (PyTorch): the rank's DataLoader worker processes "
             "(training and evaluation loaders), sampled every 0.5 s from `/proc` (`bench/workers/procs.py`; "
             "one that lives less than that can be missed): the largest one's peak RSS (`VmHWM`) and "
             "USS (its private pages: what it adds to the machine; its RSS also counts the library "
             "pages it shares); the *fork server* they are forked from holds PyTorch once per rank. "
             "*File-name list*: the bytes of the paths and labels arrays a rank keeps "
             "(`ringtrain/data/folder.py`). *Decoded cache*: the bytes of the host's cache files (both "
             "splits), a row per image, allocated whole when made and mapped by every rank and worker "
             "(a rank's RSS counts only the pages it touches; `n/a`: a run before the cache).", ""]
    found = False
    for fw in cfg["frameworks"]:
        mem = memory_summary(data, fw)
        if not any(m["runs"] for m in mem.values()):
            continue
        found = True
        rows = []
        for n, m in mem.items():
            rows.append([f"{n:,}", f"{1024 * m['list_mib']:.0f}" if m["list_mib"] is not None else "n/a",
                         num(m["cache"], "{:.0f}"),
                         str(len(m["runs"])), " / ".join(f"{v:.0f}" for v in m["rank_peaks"]), num(m["rank"]),
                         ", ".join(str(c) for c in m["workers_count"]), num(m["workers"]),
                         num(m["workers_uss"]), f"{num(m['server'])} / {num(m['server_uss'])}"])
        lines += [f"**{FW_NAMES[fw]}**", "",
                  table(["training images", "file-name list KiB", "decoded cache MiB", "runs",
                         "rank peak RSS MiB (each run)",
                         "mean", "workers seen per rank", "worker peak RSS MiB", "worker USS MiB",
                         "fork server peak RSS / USS MiB"], rows), ""]
        verdict = memory_verdict(data, fw)
        if verdict:
            withheld = rx(1.0) == WITHHELD
            status = WITHHELD if withheld else "**holds**" if verdict["holds"] else "**does not hold**"
            growth = WITHHELD if withheld else f"{100 * verdict['growth']:+.1f}%"
            lines += [f"{verdict['large']:,} against {verdict['small']:,} images: the rank's peak RSS "
                      f"{verdict['growth_mib']:+.1f} MiB ({growth}); the claim (within "
                      f"{MEMORY_SLACK:.0%} + the file-name list) allows {verdict['allowed_mib']:.1f} MiB: "
                      f"{status}.", ""]
    return lines if found else []


def _throughput(data: dict, rx) -> list[str]:
    cfg = data["config"]
    lines = ["### 8.2 Throughput: the trainer on a JPEG folder against one fixed batch", "",
             "Images/s summed over ranks; each side is the mean of its rounds, the sides run back to "
             "back in alternating order (fixed, trainer, folder loop; then the other way round). "
             "*Fixed batch*: the bench loop (`bench/workers/torch_loop.py`, `bench/workers/tf_loop.py`) with "
             "`--data synthetic`, the model and the folder's shape: one batch made once, no input "
             "pipeline, Horovod (`DistributedOptimizer`; TensorFlow: its grouped allreduce), the "
             "same threads per rank. *Trainer*: `launch.torch_mnist` / `launch.tf_mnist` with "
             "`--data folder:DIR`, its 2nd epoch "
             + ("(the first starts the pipeline, in TensorFlow traces, and decodes every image of "
                "the rank's shards into the decoded cache, a folder of the job's own; the 2nd reads "
                "the cache: `ringtrain/data/decoded_cache.py`). *No cache*: the same trainer with "
                "`--no-decode-cache`, every epoch decoding. " if with_cache(data) else
                "of `--max-steps` steps (the first starts the pipeline and, in TensorFlow, traces; "
                "this run predates the decoded cache, so both decode). ")
             + "*Folder loop*: the same loop as *fixed batch*, "
             "reading the folder through the trainer's own input pipeline (PyTorch: the DataLoader "
             "of `torch_models/data.py`; TensorFlow: the `tf.data` pipeline of `tf_models/data.py`); "
             "*cores busy* are rank 0's process CPU seconds (TensorFlow's decode threads included) "
             "and its worker processes' (PyTorch) over the timed steps' wall time. *Per round*: "
             f"trainer / fixed batch of each round. Target: the trainer at >= {TARGET:.0%} of the "
             "fixed batch.", ""]
    for fw in cfg["frameworks"]:
        for m in cfg["models"]:
            rows, verdicts = [], []
            for n in cfg["nps"]:
                r = throughput_rows(data, fw, m["name"], n)
                if r["fixed"] is None and r["trainer"] is None:
                    continue
                rows.append([str(n), ", ".join(map(str, r["workers"])) or "n/a", num(r["fixed"], "{:.1f}"),
                             num(r["trainer"], "{:.1f}"), rx(r["trainer_ratio"]),
                             " / ".join(rx(v) for v in r["per_round"]) or "n/a",
                             num(r["nocache"], "{:.1f}"), rx(r["nocache_ratio"]),
                             num(r["loop"], "{:.1f}"), rx(r["loop_ratio"]),
                             num(r["fixed_busy"], "{:.2f}"),
                             f"{num(r['loop_busy'], '{:.2f}')} + {num(r['loop_workers_busy'], '{:.2f}')}"])
                if r["trainer_ratio"] is not None and rx(1.0) != WITHHELD:
                    short = TARGET - r["trainer_ratio"]
                    points = f"{100 * short:.0f}" if short >= 0.005 else f"{100 * short:.1f}"
                    met = "target met" if short <= 0 else (
                        f"**missed by {points} point{'' if points == '1' else 's'}**")
                    verdicts.append(f"-np {n}: {pct_of_target(r['trainer_ratio'])}, {met}")
                if r["failed"]:
                    verdicts.append(f"-np {n}: failed runs {', '.join(f'`{f}`' for f in r['failed'])} "
                                    "(output tails in data.json)")
            if not rows:
                continue
            lines += [f"**{FW_NAMES[fw]}, {MODEL_NAMES.get(m['name'], m['spec'])}**, "
                      f"{m['image_size']}x{m['image_size']} RGB, {m['train']:,} training images, "
                      f"loop {m['loop_warmup']} + {loop_steps_text(data, fw, m)} timed steps, trainer "
                      + (f"`--max-steps {m['trainer_steps']}`:" if m.get("trainer_steps") is not None
                         else "whole epochs:"), "",
                      table(["-np", "workers per rank", "fixed batch img/s", "trainer on folder img/s",
                             "trainer / fixed", "per round", "no cache img/s", "no cache / fixed",
                             "folder loop img/s", "folder loop / fixed",
                             "cores busy, fixed (rank 0)", "cores busy, folder loop (rank 0 + its workers)"],
                            rows), ""]
            if verdicts:
                lines += ["Target: " + "; ".join(verdicts) + ".", ""]
    return lines


def _sweep(data: dict, rx) -> list[str]:
    cfg = data["config"]
    runs = [r for r in data.get("throughput", []) if r["kind"] == "loop" and r["data"] == "folder"]
    lines = []
    for fw in cfg["frameworks"]:
        for m in cfg["models"]:
            if not m.get("sweep"):
                continue
            rows = []
            for n in cfg["nps"]:
                fixed = throughput_rows(data, fw, m["name"], n)["fixed"]
                here = [r for r in runs
                        if (r["framework"], r["model"], r["np"], r["round"]) == (fw, m["name"], n, 1)]
                for r in sorted(here, key=lambda r: r.get("workers_used") or 0):
                    count = str(r.get("workers_used")) + (" (default)" if r["workers"] is None else "")
                    if not r.get("ok"):
                        rows.append([str(n), count, "failed", "", "", ""])
                        continue
                    ips = r["images_per_second"]
                    rows.append([str(n), count, num(ips, "{:.1f}"), rx(_ratio(ips, fixed)),
                                 num(r.get("rank0_cores_busy"), "{:.2f}"),
                                 num(r.get("rank0_workers_cores_busy"), "{:.2f}")])
            if rows:
                lines += [f"**{FW_NAMES[fw]}, {MODEL_NAMES.get(m['name'], m['spec'])}**", "",
                          table(["-np", "--workers", "folder loop img/s", "of fixed batch",
                                 "rank 0 cores busy", "its workers' cores busy"], rows), ""]
    if not lines:
        return []
    return ["### 8.3 `--workers`", "",
            "The folder loop of 8.2 (round 1) with each worker count. PyTorch: worker processes, `0` "
            "decodes in the rank's own process between its steps; TensorFlow: `tf.data` threads in "
            "the rank's process (at least one), so their CPU is in the rank's cores busy.", ""] + lines


def _decode(data: dict) -> list[str]:
    rows = []
    for d in data.get("decode", []):
        if not d.get("ok"):
            rows.append([d["folder"], "failed", "", "", "", "", "", "", ""])
            continue
        h, w, c = d["shape"]
        rh, rw, _ = d["load_resize_to"]
        rows.append([d["folder"].removeprefix("model-"), f"{h}x{w}x{c}", f"{d['mean_file_bytes']:.0f}",
                     f"{d['load']['cpu_us']:.0f}", f"{d['load_resize']['cpu_us']:.0f} (to {rh}x{rw})",
                     f"{d['item']['cpu_us']:.0f}",
                     f"{d['batch']['cpu_us']:.0f}" if "batch" in d else "n/a",
                     f"{d['cached_batch']['cpu_us']:.0f}" if "cached_batch" in d else "n/a",
                     f"{1e6 / d['item']['cpu_us']:.0f}"])
    if not rows:
        return []
    n = next((d["images"] for d in data["decode"] if d.get("ok")), "?")
    return ["### 8.4 What one image costs", "",
            f"`bench/workers/decodecost.py`: CPU microseconds per image over {n} images of the model's "
            "folder, "
            "one process, one thread (as a DataLoader worker runs), the second of two passes (the "
            "files in the page cache). *decode*: `ringtrain.data.images.load` at the folder's size "
            "(PIL decodes and converts); *decode + resize*: the same to half the size (bilinear); "
            "*worker's item*: `FolderImages[i]`, everything a PyTorch worker does per image "
            "(decode, normalise, channels first, a tensor), before batching; *batch read*: "
            "`FolderData.batch` on 64 images, per image (what TensorFlow's `tf.data` map runs); "
            "*cached batch read*: the same from a decoded cache that holds every image "
            "(`ringtrain/data/decoded_cache.py`: what both frameworks read from the second epoch on).",
            "",
            table(["folder (model)", "pixels", "mean file bytes", "decode us", "decode + resize us",
                   "worker's item us", "batch read us", "cached batch read us",
                   "items/s one core makes"], rows), ""]


def _where(data: dict, rx) -> list[str]:
    cfg = data["config"]
    rows = []
    for fw in cfg["frameworks"]:
        for m in cfg["models"]:
            cost = item_cost_s(data, m["name"], fw)
            for n in cfg["nps"]:
                r = throughput_rows(data, fw, m["name"], n)
                bound = cores_bound(data, r, n, cost)
                # the bound holds for a trainer that decodes every image: the no-cache one, where
                # the run has it (runs before the cache had only that trainer)
                decoding = r["nocache"] if r["nocache"] is not None else r["trainer"]
                if decoding is None or cost is None:
                    continue
                rows.append([f"{FW_NAMES[fw]}, {m['name']}", str(n), num(r["fixed"], "{:.1f}"),
                             num(None if r["fixed_busy"] is None else r["fixed_busy"] * n, "{:.2f}"),
                             f"{cost * 1e6:.0f}", num(decoding * cost, "{:.2f}"),
                             num(bound, "{:.1f}"), rx(_ratio(bound, r["fixed"])), num(decoding, "{:.1f}"),
                             rx(_ratio(decoding, bound))])
    if not rows:
        return []
    return ["### 8.5 Where the time goes", "",
            f"Arithmetic on the measurements above, with the machine's {data['cores']} cores as the "
            "limit. Training at the fixed-batch rate F keeps K cores busy (rank 0's cores busy x "
            "-np, 8.2); every image also costs c CPU seconds to read (8.4: PyTorch's *worker's "
            "item*, TensorFlow's *batch read*). At "
            "R images/s the two need R x (K / F + c) cores, so **R <= cores / (K / F + c)**: the "
            "*cores bound* of a trainer that decodes every image (the *no cache* trainer of 8.2; "
            "the decoded cache takes c out of later epochs). *Decoding at the trainer's rate* = "
            "trainer img/s x c, in cores. Where "
            "the bound is below the target, no worker count can reach it on these cores; where the "
            "trainer is below the bound, the rest is waiting (workers and training threads "
            "preempting each other, the pipeline's fill at each epoch's start).", "",
            table(["framework, model", "-np", "fixed batch F img/s", "K cores", "c us",
                   "decoding at the trainer's rate, cores", "cores bound img/s", "bound / F",
                   "no-cache trainer img/s", "trainer / bound"], rows), ""]
