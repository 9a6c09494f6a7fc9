"""Part ``data``: your own data at any size (``--data folder:DIR``), measured.

``python -m bench --only data [--quick]``, or alone: ``python -m bench.parts.owndata --scale
{smoke,quick,full} --out DIR`` (``DIR/data.json``; ``smoke`` is the smallest size, for the smoke
test).  Folders of real JPEG pictures (``tests/image_folders.py: shapes_folder``) are written
under ``<out>/tmp/data/`` and removed at the end.

* **Decode cost** (``bench/workers/decodecost.py``): CPU seconds per image, one process, one thread, of
  ``ringtrain.data.images.load`` (PIL decode; and decode + resize) and of the whole item a
  DataLoader worker produces (decode, normalise, to a tensor).
* **Memory**: the real trainer on a folder of ``memory_sizes[0]`` and of ``memory_sizes[1]``
  images, the same flags, a short run; each rank's ``ru_maxrss`` and its DataLoader workers' peak
  RSS (``VmHWM``, :mod:`bench.workers.procs`), next to the size of the file-name list the rank holds.
* **Throughput**: per model (the built-in CNN, torchvision's ResNet-18) and -np, back to back and
  in alternating order round after round: the bench loop on one fixed in-memory batch of the
  folder's shape (``fixed``: no input pipeline), the real trainer on the folder (its 2nd epoch:
  the first decodes every image into a decoded cache of the job's own, the second reads it), the
  same trainer with ``--no-decode-cache`` (every epoch decodes), and the bench loop reading the
  folder through the trainer's own pipeline (``folder``: rank and
  worker cores busy during the timed steps); for the CNN, that loop again with other
  ``--workers`` counts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from bench.common import util
from bench.parts.training_runs import LOOP_MODULES, TRAINER_MODULES, rank_records
from ringtrain.data import folder
from ringtrain.data.sharding import batches_per_epoch
from ringtrain.runtime import available_cores, threads_per_rank
from tests.image_folders import shapes_folder  # the tests' folders: one writer for both

RESNET = "torchvision.models:resnet18"
FRAMEWORKS = ("torch", "tf")


@dataclass
class Model:
    name: str  # in run names and the report
    spec: str  # --model
    image_size: int  # the folder's square RGB pictures, in pixels
    train: int  # training images in its folder
    test: int
    loop_warmup: int  # bench loop: untimed steps, then timed steps
    # None: as many as the trainer's timed epoch at that -np (timed over 50 steps, about 2.5 s
    # against the trainer's 6 s epoch, the fixed batch scattered 1,234-1,472 img/s between rounds
    # of one run and moved the folder ratio by 10-25 points)
    loop_steps: int | None
    # trainer: --max-steps of each of its 2 epochs (the 2nd is timed); None: whole epochs, so that
    # the first decodes every image of the rank's shards into the cache the second reads
    trainer_steps: int | None
    sweep: bool = False  # also the folder loop at every count in DataConfig.sweep_workers
    frameworks: tuple[str, ...] = ("torch", "tf")  # ResNet-18 is torchvision's: PyTorch only


@dataclass
class DataConfig:
    scale: str
    frameworks: list[str] = field(default_factory=lambda: ["torch"])
    batch: int = 64
    nps: list[int] = field(default_factory=lambda: [1, 2])
    rounds: int = 2
    models: list[Model] = field(default_factory=list)
    sweep_workers: list[int] = field(default_factory=lambda: [0, 1, 2])
    memory_sizes: tuple[int, int] = (5000, 200000)
    memory_test: int = 500
    memory_distinct: int = 999  # pictures drawn per memory folder; the rest are copies of them
    memory_np: int = 2
    memory_steps: int = 20
    memory_rounds: int = 2
    memory_image_size: int = 32
    decode_images: int = 2000
    eval_images: int = 256  # --test-samples of the throughput trainers
    timeout_s: float = 900

    def to_dict(self) -> dict:
        return asdict(self)

    def with_rounds(self, rounds: int | None) -> DataConfig:
        """The same part with ``rounds`` rounds of the throughput comparison (None: as it is)."""
        return self if rounds is None else replace(self, rounds=rounds)

    def only_models(self, names: list[str] | None) -> DataConfig:
        """The same part with only the models named (None: all of them)."""
        if names is None:
            return self
        return replace(self, models=[m for m in self.models if m.name in names])


def full(frameworks: list[str] | None = None) -> DataConfig:
    return DataConfig("full", frameworks=frameworks or ["torch"], models=[
        Model("cnn", "cnn", 32, 8000, 500, 10, None, None, sweep=True),
        Model("resnet18", RESNET, 64, 3000, 300, 2, 10, None, frameworks=("torch",))])


def quick(frameworks: list[str] | None = None) -> DataConfig:
    """A few minutes: one round, no --workers sweep, a 20x memory ratio instead of 40x."""
    return DataConfig("quick", frameworks=frameworks or ["torch"], rounds=1, models=[
        Model("cnn", "cnn", 32, 2000, 200, 5, 20, None),
        Model("resnet18", RESNET, 64, 600, 100, 2, 4, None, frameworks=("torch",))],
        memory_sizes=(2000, 40000), memory_np=1, memory_steps=10, memory_rounds=1,
        decode_images=500, timeout_s=300)


def smoke(frameworks: list[str] | None = None) -> DataConfig:
    """The smallest size, for tests/test_bench_data.py: every kind of run once, at -np 1, the
    loops as many steps as the trainer's epoch (3); the numbers mean nothing."""
    return DataConfig("smoke", frameworks=frameworks or ["torch"], batch=8, nps=[1], rounds=1,
                      models=[Model("cnn", "cnn", 16, 24, 6, 1, None, None)],
                      memory_sizes=(24, 48), memory_test=6, memory_distinct=6, memory_np=1,
                      memory_steps=1, memory_rounds=1, memory_image_size=16, decode_images=12,
                      eval_images=6, timeout_s=120)


SCALES = {"full": full, "quick": quick, "smoke": smoke}


@dataclass
class Job:
    name: str
    framework: str
    kind: str  # trainer | loop
    data: str  # fixed | folder
    model: str
    np: int
    round: int
    workers: int | None = None  # --workers given (None: the trainers' default)
    folder_key: str = ""
    cache: bool = True  # trainer: a decoded cache of the job's own (False: --no-decode-cache)


def load_average() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def write_folders(cfg: DataConfig, root: Path) -> dict[str, dict[str, Any]]:
    """Every folder the part reads: its path, sizes, the seconds it took to write, and the bytes
    of the file-name list a rank holds for it (paths and labels of both splits)."""
    folders: dict[str, dict[str, Any]] = {}
    specs = [(f"mem-{n}", n, cfg.memory_test, cfg.memory_image_size, cfg.memory_distinct)
             for n in cfg.memory_sizes]
    specs += [(f"model-{m.name}", m.train, m.test, m.image_size, None) for m in cfg.models]
    for key, n_train, n_test, px, distinct in specs:
        path = root / key
        shutil.rmtree(path, ignore_errors=True)
        util.say(f"writing {key}: {n_train} + {n_test} JPEGs of {px}x{px} RGB ...")
        t0 = time.perf_counter()
        shapes_folder(path, n_train, n_test, size=px, distinct=distinct)
        seconds = time.perf_counter() - t0
        index = folder.scan(str(path))
        list_bytes = sum(s.paths.nbytes + s.labels.nbytes for s in (index.train, index.test))
        folders[key] = {"path": str(path), "train": n_train, "test": n_test, "image_size": px,
                        "distinct": distinct, "write_seconds": round(seconds, 1),
                        "list_bytes": int(list_bytes),
                        "mean_file_bytes": round(sum(f.stat().st_size for f in
                                                     list((path / "train").rglob("*.jpg"))[:200])
                                                 / min(200, n_train))}
    return folders


def decode_costs(cfg: DataConfig, folders: dict, work: Path) -> list[dict]:
    out = []
    for key in sorted(k for k in folders if k.startswith("model-")):
        path = work / f"decode-{key}.json"
        cmd = [util.PY, "-m", "bench.workers.decodecost", "--folder", folders[key]["path"],
               "--images", str(cfg.decode_images), "--out", str(path)]
        util.say(f"decode cost of {key} ...")
        res = util.run(cmd, timeout=cfg.timeout_s, log=work / f"decode-{key}.log")
        record = {"folder": key, "ok": res.ok}
        if res.ok:
            record.update(util.read_json(path))
        else:
            record["error"] = util.tail(res.output, 15)
        out.append(record)
    return out


def _trainer_args(cfg: DataConfig, path: str, spec: str, epochs: int, steps: int | None, test: int,
                  job: Job, work: Path) -> list[str]:
    # Each job decodes into a cache folder of its own (removed with the job's folder): another
    # run's file would let the first epoch read instead of decode.
    args = ["--data", f"folder:{path}", "--model", spec, "--epochs", str(epochs),
            "--batch-size", str(cfg.batch), "--test-samples", str(test),
            "--no-progress", "--metrics-out", str(work / "metrics.json")]
    args += ["--max-steps", str(steps)] if steps is not None else []
    args += ["--decode-cache", str(work / "decoded")] if job.cache else ["--no-decode-cache"]
    return args + (["--workers", str(job.workers)] if job.workers is not None else [])


def loop_steps(cfg: DataConfig, m: Model, n: int) -> int:
    """The bench loop's timed steps for ``m`` at -np ``n``: the model's own count, or the
    trainer's batches per epoch (both sides of the ratio timed over the same work)."""
    return m.loop_steps if m.loop_steps is not None else batches_per_epoch(m.train, n, cfg.batch)


def command(cfg: DataConfig, job: Job, folders: dict, models: dict[str, Model],
            work: Path) -> list[str]:
    m = models.get(job.model)
    if job.kind == "trainer" and job.folder_key.startswith("mem-"):
        args = _trainer_args(cfg, folders[job.folder_key]["path"], "cnn", 1, cfg.memory_steps,
                             cfg.memory_test, job, work)
        return util.horovodrun(job.np, util.rank_exec(TRAINER_MODULES[job.framework], args))
    if job.kind == "trainer":
        args = _trainer_args(cfg, folders[job.folder_key]["path"], m.spec, 2, m.trainer_steps,
                             cfg.eval_images, job, work)
        return util.horovodrun(job.np, util.rank_exec(TRAINER_MODULES[job.framework], args))
    args = ["--wrapper", "horovod", "--model", m.spec, "--batch-size", str(cfg.batch),
            "--warmup-steps", str(m.loop_warmup), "--steps", str(loop_steps(cfg, m, job.np)),
            "--out", str(work / "loop.json")]
    if job.data == "fixed":
        args += ["--data", "synthetic", "--input-shape", f"{m.image_size}x{m.image_size}x3",
                 "--classes", "3"]
    else:
        args += ["--data", f"folder:{folders[job.folder_key]['path']}"]
        if job.workers is not None:
            args += ["--workers", str(job.workers)]
    return util.horovodrun(job.np, util.rank_exec(LOOP_MODULES[job.framework], args))


def execute(cfg: DataConfig, job: Job, folders: dict, models: dict[str, Model], out: Path) -> dict:
    work = out / "tmp" / "data" / "runs" / job.name.replace("/", "_")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = util.base_env(BENCH_RSS_DIR=str(work / "rss"), BENCH_CHILDREN="1")
    load = load_average()
    util.say(f"{job.name} (load {load[0] if load else '?'}) ...")
    res = util.run(command(cfg, job, folders, models, work), env=env, timeout=cfg.timeout_s,
                   log=work / "output.log")
    ranks = rank_records(work)
    cache = work / "decoded"  # what the job's cache held at its end, then gone (200,000 rows: 0.6 GB)
    cache_bytes = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) if cache.is_dir() else 0
    shutil.rmtree(cache, ignore_errors=True)
    record: dict[str, Any] = {**asdict(job), "ok": res.ok, "load_1min_at_start": load[0] if load else None,
                              "wall_seconds": round(res.seconds, 1),
                              "workers_used": (job.workers if job.workers is not None
                                               else default_workers(job.framework, job.np))
                              if job.data == "folder" else None,
                              "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in ranks],
                              "ranks": [rank_memory(r) for r in ranks], "images_per_second": None,
                              "decoded_cache_bytes": cache_bytes}
    if res.ok and job.kind == "trainer":
        summary = util.read_json(work / "metrics.json")
        record["images_per_second"] = summary["epochs"][-1]["images_per_second"]
        record["epoch_seconds"] = [round(e["seconds"], 2) for e in summary["epochs"]]
        record["train_size"] = summary["data"]["train_size"]
    elif res.ok:
        loop = util.read_json(work / "loop.json")
        record["images_per_second"] = loop["images_per_second"]
        record["timed_steps"] = loop_steps(cfg, models[job.model], job.np)
        record["rank0_cores_busy"] = round(loop["rank0_cores_busy"], 3)
        if "workers" in loop:
            record["workers_used"] = loop["workers"]
        if "rank0_workers_cores_busy" in loop:
            record["rank0_workers_cores_busy"] = round(loop["rank0_workers_cores_busy"], 3)
    record["ok"] = res.ok and record["images_per_second"] is not None
    if not record["ok"]:
        record["error"] = util.tail(res.output, 25)
        util.say(f"{job.name} FAILED (rc {res.returncode}); log: {work / 'output.log'}")
    else:
        util.say(f"{job.name}: {record['images_per_second']:.1f} img/s, rank peak RSS "
                 f"{max(record['peak_rss_mib'] or [0]):.0f} MiB, workers' (RSS/USS) "
                 f"{[(r['workers_peak_rss_mib'], r['workers_max_uss_mib']) for r in record['ranks']]} "
                 f"MiB, {res.seconds:.0f}s wall")
    return record


def rank_memory(record: dict) -> dict[str, Any]:
    """One rank's memory: its own peak RSS (and each kind's peak: anonymous, file-backed, shared;
    :class:`bench.workers.procs.PeakParts`), and its DataLoader workers' (how many were seen, the largest
    peak RSS, PSS and USS among them, their CPU seconds together)."""
    workers = [d for d in record.get("descendants", []) if d["role"] == "worker"]
    server = [d for d in record.get("descendants", []) if d["role"] == "forkserver"]

    def largest(key: str) -> float | None:
        return round(max(d[key] for d in workers), 1) if workers else None

    return {"rank": record["rank"], "peak_rss_mib": round(record["peak_rss_mib"], 1),
            "workers": len(workers), "workers_peak_rss_mib": largest("peak_rss_mib"),
            "workers_max_pss_mib": largest("max_pss_mib"), "workers_max_uss_mib": largest("max_uss_mib"),
            "workers_cpu_seconds": round(sum(d["cpu_seconds"] for d in workers), 2),
            "forkserver_peak_rss_mib": round(server[0]["peak_rss_mib"], 1) if server else None,
            "forkserver_max_uss_mib": round(server[0]["max_uss_mib"], 1) if server else None,
            "peak_rss_parts_mib": {k: round(v, 1) for k, v in record.get("peak_rss_parts_mib", {}).items()}}


def memory_jobs(cfg: DataConfig, fw: str) -> list[Job]:
    jobs = []
    for r in range(1, cfg.memory_rounds + 1):
        sizes = cfg.memory_sizes if r % 2 else tuple(reversed(cfg.memory_sizes))
        jobs += [Job(f"{fw}/trainer/folder-{n}/cnn/np{cfg.memory_np}/r{r}", fw, "trainer", "folder",
                     "cnn", cfg.memory_np, r, folder_key=f"mem-{n}") for n in sizes]
    return jobs


def default_workers(fw: str, n: int) -> int:
    """The trainers' --workers default at -np n on this host (TensorFlow runs at least one
    thread: 0 means 1 there)."""
    return threads_per_rank(n) if fw == "torch" else max(1, threads_per_rank(n))


def throughput_jobs(cfg: DataConfig, fw: str) -> list[Job]:
    """Per model and -np, round after round: fixed, trainer, trainer without the decoded cache,
    folder loop, then the other way round (ABCD DCBA: a drift in the machine's load hits every
    side alike); the --workers sweep of the folder loop in the first round."""
    jobs = []
    for m in cfg.models:
        if fw not in m.frameworks:
            continue
        for n in cfg.nps:
            key = f"model-{m.name}"
            default = default_workers(fw, n)
            for r in range(1, cfg.rounds + 1):
                sides = [Job(f"{fw}/loop/fixed/{m.name}/np{n}/r{r}", fw, "loop", "fixed", m.name, n, r),
                         Job(f"{fw}/trainer/folder/{m.name}/np{n}/r{r}", fw, "trainer", "folder",
                             m.name, n, r, folder_key=key),
                         Job(f"{fw}/trainer/folder-nocache/{m.name}/np{n}/r{r}", fw, "trainer", "folder",
                             m.name, n, r, folder_key=key, cache=False),
                         Job(f"{fw}/loop/folder/{m.name}/np{n}/r{r}", fw, "loop", "folder", m.name, n, r,
                             folder_key=key)]
                jobs += sides if r % 2 else sides[::-1]
                if r == 1 and m.sweep:
                    jobs += [Job(f"{fw}/loop/folder/{m.name}/np{n}-w{w}/r{r}", fw, "loop", "folder",
                                 m.name, n, r, workers=w, folder_key=key)
                             for w in cfg.sweep_workers if w != default and (fw == "torch" or w > 0)]
    return jobs


def run_part(cfg: DataConfig, out: Path) -> dict:
    root = out / "tmp" / "data"
    root.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"config": cfg.to_dict(), "cores": available_cores(),
                              "load_average_at_start": load_average()}
    models = {m.name: m for m in cfg.models}
    try:
        folders = write_folders(cfg, root / "folders")
        result["folders"] = {k: {kk: vv for kk, vv in v.items() if kk != "path"} for k, v in folders.items()}
        result["decode"] = decode_costs(cfg, folders, root)
        result["memory"] = [execute(cfg, job, folders, models, out)
                            for fw in cfg.frameworks for job in memory_jobs(cfg, fw)]
        result["throughput"] = [execute(cfg, job, folders, models, out)
                                for fw in cfg.frameworks for job in throughput_jobs(cfg, fw)]
    finally:
        shutil.rmtree(root / "folders", ignore_errors=True)  # 200,000 files: never kept
    result["load_average_at_end"] = load_average()
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.parts.owndata", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--scale", choices=tuple(SCALES), default="full")
    p.add_argument("--frameworks", default="torch", help=f"of {', '.join(FRAMEWORKS)} (default torch)")
    p.add_argument("--out", default="bench/results", help="results folder: <out>/data.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    frameworks = [f for f in args.frameworks.split(",") if f]
    if not frameworks or set(frameworks) - set(FRAMEWORKS):
        raise SystemExit(f"--frameworks: this part measures {', '.join(FRAMEWORKS)} only")
    cfg = SCALES[args.scale](frameworks)
    why = util.private_dir(util.REPO / args.out)  # before resolve() could follow a planted symlink
    if why:
        print(f"error: --out: {why}; give a folder of yours that only you can write to", file=sys.stderr)
        raise SystemExit(2)
    out = (util.REPO / args.out).resolve()
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    data = run_part(cfg, out)
    data["quick"] = cfg.scale != "full"
    data["started"] = started
    util.write_json(out / "data.json", data)
    util.say(f"wrote {out / 'data.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
