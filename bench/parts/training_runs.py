"""One measured training run: build its launch line, run it, collect images/s and per-rank RSS.

A run is named ``framework/kind/wrapper/data/npN`` (e.g. ``torch/loop/ddp/synthetic/np2``); that
name is what ``--profile`` selects.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import util

TRAINER_MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
LOOP_MODULES = {"torch": "bench.workers.torch_loop", "tf": "bench.workers.tf_loop"}


@dataclass
class Run:
    framework: str
    kind: str  # "trainer" (the real launch.*_mnist) or "loop" (bench.*_loop)
    wrapper: str  # none | horovod | horovod-gloo | ddp | mwms
    data: str  # mnist | synthetic
    np: int
    threads: int = 0  # 0: cores // local ranks
    extra: list[str] = field(default_factory=list)
    label: str = ""  # a variant of the same run (bench/parts/floor.py: the Horovod loop), in its name
    env: dict[str, str] = field(default_factory=dict)  # added to the job's environment

    @property
    def name(self) -> str:
        suffix = f"-{self.threads}thread" if self.threads else ""
        label = f"~{self.label}" if self.label else ""
        return f"{self.framework}/{self.kind}/{self.wrapper}/{self.data}/np{self.np}{suffix}{label}"


RUN_NAME = re.compile(r"^(torch|tf)/(trainer|loop)/(none|horovod|horovod-gloo|ddp|mwms)/"
                      r"(mnist|synthetic)/np(\d+)(?:-(\d+)thread)?$")


def parse_run(name: str) -> Run:
    """The run a name like ``torch/trainer/horovod/mnist/np2`` (as the suite prints it) stands for."""
    m = RUN_NAME.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a run name like torch/trainer/horovod/mnist/np2 "
                         f"or tf/loop/horovod/synthetic/np1")
    return Run(m[1], m[2], m[3], m[4], int(m[5]), threads=int(m[6] or 0))


@dataclass
class Profiling:
    """Which run to profile, and how (see ``python -m bench --help``)."""

    target: str | None = None
    native: bool = False
    timeline: bool = False


def _command(run: Run, work: Path, cfg, timeline: str | None) -> tuple[list[list[str]], list[dict]]:
    env = util.base_env(BENCH_RSS_DIR=str(work / "rss"), **run.env)
    if run.kind == "trainer":
        args = ["--epochs", "2", "--max-steps", str(cfg.trainer_steps), "--test-samples", "1000",
                "--no-progress", "--metrics-out", str(work / "metrics.json"), *run.extra]
        return [util.horovodrun(run.np, util.rank_exec(TRAINER_MODULES[run.framework], args),
                                timeline=timeline)], [env]
    loop_wrapper = "horovod" if run.wrapper == "horovod-gloo" else run.wrapper
    args = ["--wrapper", loop_wrapper, "--data", run.data, "--warmup-steps", str(cfg.warmup_steps),
            "--steps", str(cfg.steps), "--out", str(work / "loop.json"), *run.extra]
    if run.threads:
        args += ["--threads", str(run.threads)]
    inner = util.rank_exec(LOOP_MODULES[run.framework], args)
    if run.wrapper == "none":
        return [inner], [env]
    if run.wrapper in ("horovod", "horovod-gloo"):
        return [util.horovodrun(run.np, inner, gloo=run.wrapper == "horovod-gloo",
                                timeline=timeline)], [env]
    if run.wrapper == "ddp":
        return [util.torchrun(run.np, inner)], [env]
    if run.wrapper == "mwms":
        ports = [util.free_port() for _ in range(run.np)]
        workers = [f"localhost:{p}" for p in ports]
        envs = [{**env, "BENCH_RANK": str(i), "TF_CONFIG": json.dumps(
            {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})}
            for i in range(run.np)]
        return [inner] * run.np, envs
    raise ValueError(run.wrapper)


def _images_per_second(run: Run, work: Path) -> float | None:
    if run.kind == "trainer":
        path = work / "metrics.json"
        if not path.exists():
            return None
        epochs = util.read_json(path)["epochs"]
        return epochs[-1]["images_per_second"]  # the 2nd epoch: no tracing, no first-touch costs
    path = work / "loop.json"
    return util.read_json(path)["images_per_second"] if path.exists() else None


def _cores_busy(run: Run, work: Path) -> float | None:
    """Loops only: cores rank 0's process kept busy during the timed steps (CPU / wall)."""
    path = work / "loop.json"
    if run.kind != "loop" or not path.exists():
        return None
    value = util.read_json(path).get("rank0_cores_busy")
    return round(value, 2) if value is not None else None


def rank_records(work: Path) -> list[dict[str, Any]]:
    """What :mod:`bench.workers.rankexec` wrote for each rank of the run in ``work``, by rank."""
    return sorted((util.read_json(p) for p in (work / "rss").glob("*.json")),
                  key=lambda r: (r["rank"] is None, r["rank"] or 0))


def execute(run: Run, cfg, out: Path, prof: Profiling | None = None) -> dict[str, Any]:
    """Run it; return the record that goes into the results JSON (``ok`` false with the output's
    tail when it failed, so one broken side does not sink the suite)."""
    work = out / "tmp" / run.name.replace("/", "_")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    profiling = prof is not None and prof.target == run.name
    timeline = None
    if profiling and prof.timeline and run.wrapper.startswith("horovod"):
        timeline = str((out / "profile" / "timeline.json").resolve())
        Path(timeline).parent.mkdir(parents=True, exist_ok=True)
    cmds, envs = _command(run, work, cfg, timeline)
    if profiling:
        (out / "profile").mkdir(parents=True, exist_ok=True)
        for env in envs:
            env["BENCH_PYSPY_OUT"] = str((out / "profile" / "pyspy.txt").resolve())
            env["BENCH_PYSPY_NATIVE"] = "1" if prof.native else "0"
    util.say(f"{run.name} ...")
    if len(cmds) == 1:
        res = util.run(cmds[0], env=envs[0], timeout=cfg.timeout_s, log=work / "output.log")
    else:
        res = util.run_parallel(cmds, envs, timeout=cfg.timeout_s, log=work / "output.log")
    ips = _images_per_second(run, work) if res.ok else None
    rss = rank_records(work)
    record = {"name": run.name, "label": run.label or None, "framework": run.framework, "kind": run.kind,
              "wrapper": run.wrapper, "data": run.data, "np": run.np, "threads": run.threads or None,
              "ok": res.ok and ips is not None, "images_per_second": ips,
              "rank0_cores_busy": _cores_busy(run, work),
              "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in rss],
              "wall_seconds": round(res.seconds, 1), "profiled": profiling}
    if not record["ok"]:
        record["error"] = util.tail(res.output, 25)
        util.say(f"{run.name} FAILED (rc {res.returncode}); log: {work / 'output.log'}")
    else:
        util.say(f"{run.name}: {ips:.0f} img/s, peak RSS {max(record['peak_rss_mib'] or [0]):.0f} MiB, "
                 f"{res.seconds:.0f}s wall")
    return record
