"""``python -m bench --only pipeline``: model parallelism (``--pipeline-stages``), measured with the
real trainers (docs/pipeline.md).

* **Schedules.** GPipe and 1F1B at M = 1, 2, 4, 8 micro-batches, S = 2 stages at -np 2 and S = 4
  at -np 4, on an MLP of equal hidden layers (:func:`mlp`: split by parameters, its stages are
  also about equal in work, so the (S-1)/(M+S-1) formula applies): images/s and the measured
  bubble (the trainer's own per-stage timing: 1 - mean computing time / the longest schedule),
  beside the formula and a replay of the schedule on the measured stage times
  (:func:`ringtrain.strategies.pipeline.schedule.simulate`).
* **Pipeline vs data parallel** on the same cores: the same MLP and global batch, -np 2, S = 2 x
  R = 1 against S = 1 x R = 2.
* **Memory.** An MLP whose weights, gradients and momentum exceed a per-rank cap
  (:mod:`bench.workers.memlimit`: ``RLIMIT_DATA`` beyond the framework's own footprint), at -np 2: S = 1
  (each rank holds all of it) fails to allocate, S = 2 trains; each rank's parameter bytes.
  And (full runs) :data:`DEEP`, whose weights alone nearly fill the cap, at S = 8 on -np 8, each
  rank building only its stage (:func:`deep_memory`), against one rank; each rank's peak RSS.
* **The largest model under one cap** (:func:`largest`): an MLP of growing depth, each rank
  allowed the same ``largest_budget_mb`` (:mod:`bench.workers.memlimit`), at S = 1 (-np 1), 2 and
  4 (-np S): a few probes per S (a search over depth, from an estimate at S = 1 and from
  ``0.9 x S`` times S = 1's largest at S > 1), each one launch that trains or does not.
* **Peak memory per stage** (:func:`stage_memory`): the built-in CNN at S = 4, M = 8, GPipe against
  1F1B: each rank's peak resident memory (``VmHWM``, :mod:`bench.workers.memlimit` with a cap
  that never binds) and its measured ``peak_activations_held`` beside the schedule's bound.
* **--partition time against params** (:func:`partition`): :func:`costly`, a wide Linear then
  convolutions with few weights and most of the work, at S = 2: images/s, and each stage's share
  of the computing time measured in the run (the slowest stage's is what a step waits for).
* **Bytes on the link** (root: two network-namespace hosts, :mod:`bench.common.netns_hosts`, one rank
  each, launched as :mod:`bench.parts.emulated_cluster` does): the kernel's byte counters of a host's link per
  training step, for data parallelism (the gradient allreduce) and the pipeline (activations
  forward, their gradients back), beside the formulas (:mod:`bench.common.costmodel`): a ring moves
  2(N-1)/N x G each way per step (G = the gradients' bytes), a cut between two stages B x A x 4
  (B rows per step, A values per example at the cut).  Per step: the difference of two runs of
  different lengths, so start-up, broadcast and evaluation cancel.

Every run is one launch of ``launch.torch_mnist`` with ``--metrics-out``; the numbers come from its
summary.  The machine's load average is recorded before and after (others' jobs share the cores).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import costmodel, util
from ringtrain.strategies.pipeline.schedule import bubble_formula, simulate

MODEL = "bench.parts.model_parallel:mlp"
MEMORY_FAILURES = ("can't allocate memory", "not enough memory", "Cannot allocate memory",
                   "can't start new thread", "MemoryError")


def mlp(input_shape, num_classes):
    """An MLP of ``depth`` hidden layers of ``width`` (``BENCH_MLP=width,depth``, default 1024,8),
    as an ``nn.Sequential`` a pipeline splits between its layers."""
    from torch import nn

    width, depth = (int(v) for v in os.environ.get("BENCH_MLP", "1024,8").split(","))
    layers: list = [nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


DEEP = (4096, 20)  # the stage-build demonstration: 20 x Linear(4096, 4096), 1.34 GB of weights


class Rows:
    """A map-style dataset of float rows and int labels (``--data``'s contract), with ``classes``."""

    def __init__(self, x, y) -> None:
        self.x, self.y, self.classes = x, y, [str(c) for c in range(10)]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], int(self.y[i])


def deep_rows(split: str) -> Rows:
    """``--data bench.parts.model_parallel:deep_rows``: 64 train or 32 test rows of 4096 random
    floats (what they hold does not matter: the demonstration is whether a rank can hold the
    model, its gradients and momentum)."""
    import numpy as np

    rng = np.random.default_rng(0 if split == "train" else 1)
    n = 64 if split == "train" else 32
    return Rows(rng.standard_normal((n, DEEP[0])).astype(np.float32), rng.integers(0, 10, n))


def deep_torch(input_shape, num_classes):
    """``DEEP``'s layers of Linear + ReLU on a flat row, then the logits: a ``nn.Sequential``
    built under the meta device and split (docs/pipeline.md, "What is built where")."""
    from torch import nn

    width, depth = DEEP
    layers: list = [nn.Flatten()]
    for i in range(depth):
        layers += [nn.Linear(math.prod(input_shape) if i == 0 else width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, num_classes))


def deep_keras(input_shape, num_classes):
    """The same layers as an unbuilt ``keras.Sequential`` (no ``keras.Input``): a pipeline
    builds only its rank's stage."""
    import keras

    width, depth = DEEP
    return keras.Sequential([keras.layers.Flatten(),
                             *(keras.layers.Dense(width, activation="relu") for _ in range(depth)),
                             keras.layers.Dense(num_classes)])


def costly(input_shape, num_classes):
    """``--partition``'s model: a wide Linear (784 x 2048, 1.6M weights, 3.2 MFLOP per example
    forward) then convolutions of ``channels`` on 32 x 32 with few weights and most of the work
    (``BENCH_COSTLY=channels,convs``, default 64,5: 36,928 weights and 75.5 MFLOP each).  Split by
    parameters the Linear is a stage of its own; by time the convolutions are shared out."""
    from torch import nn

    channels, convs = (int(v) for v in os.environ.get("BENCH_COSTLY", "64,5").split(","))
    layers: list = [nn.Flatten(), nn.Linear(math.prod(input_shape), 2048), nn.ReLU(),
                    nn.Unflatten(1, (2, 32, 32)), nn.Conv2d(2, channels, 3, padding=1), nn.ReLU()]
    for _ in range(convs):
        layers += [nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(channels, num_classes))


def mlp_params(width: int, depth: int, inputs: int = 784, classes: int = 10) -> int:
    return (inputs + 1) * width + depth * (width + 1) * width + (width + 1) * classes


@dataclass
class PipelineConfig:
    quick: bool = False
    schedules: list[str] = field(default_factory=lambda: ["gpipe", "1f1b"])
    micro: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    batch: int = 64  # per replica
    steps: int = 40
    mlp: tuple[int, int] = (1024, 8)
    versus_dp: bool = True
    memory_mlp: tuple[int, int] = (4096, 6)  # 104M parameters: 416 MB of float32 weights
    memory_budget_mb: float = 1100
    memory_steps: int = 2
    # The stage build (docs/pipeline.md, "What is built where"): DEEP at S = 8, -np 8, against
    # -np 1 (ring), each rank allowed deep_budget_mb; full runs only (8 ranks: ~2 min).
    deep_memory: bool = True
    deep_budget_mb: float = 1450
    link: bool = True
    link_steps: tuple[int, int] = (5, 15)
    timeout_s: float = 900
    schedule_stages: list[int] = field(default_factory=lambda: [2, 4])  # S of the schedule cells
    # The largest MLP (of largest_width, depth searched) that trains under one cap per rank, at
    # each S of largest_stages (-np S), at most largest_probes launches per S.
    largest_stages: list[int] = field(default_factory=lambda: [1, 2, 4])
    largest_width: int = 1024
    # Large beside the per-rank overhead that counts against RLIMIT_DATA (the frameworks'
    # threads' malloc arenas; a pipeline rank's more than the ring's): at 300 MB a quick run's
    # S = 4 reached 1.8-3.3x S = 1's parameters, varying from run to run near the cap.
    largest_budget_mb: float = 1500
    largest_probes: int = 4
    largest_steps: int = 2
    # Peak memory per stage, GPipe against 1F1B: --model cnn at S = stage_memory_stages, M = 8.
    stage_memory_stages: int = 4
    stage_memory_batch: int = 1024
    stage_memory_micro: int = 8
    stage_memory_steps: int = 3
    # --partition time against params on costly() (channels, convolutions), S = 2.
    partition_model: tuple[int, int] = (64, 5)
    partition_batch: int = 64
    partition_micro: int = 4
    partition_steps: int = 20

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> PipelineConfig:
    return PipelineConfig()


def quick() -> PipelineConfig:
    return PipelineConfig(quick=True, micro=[1, 4], steps=12, link_steps=(3, 6), deep_memory=False,
                          largest_width=512, largest_budget_mb=300, largest_probes=3,
                          stage_memory_batch=512, stage_memory_steps=2, partition_steps=8)


def smoke() -> PipelineConfig:
    """Each kind of run once, two steps, small models; the memory cells at a scale where the cap
    still separates S = 1 from S = 2 (a 2048 x 12 MLP, 208 MB of weights, 690 MB budget: see
    docs/pipeline.md for the window measured); the link cells where hosts can be made (root)."""
    from bench.common import netns_hosts

    # The new cells' smoke paths: the largest-model search one probe at S = 1 and 2, the peak
    # memory per stage and the partition at S = 2 on small models (S = 4 needs -np 4: full and
    # quick runs).
    return PipelineConfig(quick=True, schedules=["1f1b"], micro=[2], steps=2, mlp=(256, 2),
                          memory_mlp=(2048, 12), memory_budget_mb=690,
                          link=netns_hosts.why_unavailable() is None, link_steps=(1, 2),
                          timeout_s=240, deep_memory=False, schedule_stages=[2],
                          largest_stages=[1, 2], largest_width=256, largest_budget_mb=300,
                          largest_probes=1, stage_memory_stages=2, stage_memory_batch=64,
                          stage_memory_micro=4, stage_memory_steps=2, partition_model=(8, 1),
                          partition_steps=2)


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


class Runner:
    def __init__(self, cfg: PipelineConfig, out: Path) -> None:
        self.cfg, self.work = cfg, out / "tmp" / "pipeline"

    def trainer(self, name: str, np_: int, args: list[str], width_depth: tuple[int, int],
                wrap: list[str] | None = None, env: dict[str, str] | None = None,
                launch=None) -> dict:
        """One launch of the PyTorch trainer (under ``wrap``, e.g. bench.workers.memlimit); its summary."""
        work = self.work / name
        work.mkdir(parents=True, exist_ok=True)
        metrics = work / "m.json"
        metrics.unlink(missing_ok=True)
        inner = [*(wrap or [util.PY, "-m", "launch.torch_mnist"]), *args, "--no-progress",
                 "--metrics-out", str(metrics)]
        extra = {"BENCH_MLP": f"{width_depth[0]},{width_depth[1]}", "OMP_NUM_THREADS": "1",
                 **(env or {})}
        util.say(f"pipeline/{name} ...")
        if launch is None:
            res = util.run(util.horovodrun(np_, inner), env=util.base_env(**extra),
                           timeout=self.cfg.timeout_s, log=work / "output.log")
        else:
            res = launch(name, inner, extra)
        rec = {"name": name, "np": np_, "args": args, "ok": res.ok and metrics.exists(),
               "wall_seconds": round(res.seconds, 1)}
        if rec["ok"]:
            rec["summary"] = util.read_json(metrics)
        else:
            rec["error"] = util.tail(res.output, 12)
            util.say(f"pipeline/{name} FAILED ({res.returncode}); log: {work / 'output.log'}")
        return rec

    def steps_args(self, steps: int, batch: int) -> list[str]:
        return ["--epochs", "1", "--max-steps", str(steps), "--train-samples", str(steps * batch),
                "--test-samples", "100", "--batch-size", str(batch)]


def step_figures(summary: dict) -> dict:
    """images/s of the epoch (the trainer's own figure) and, for a pipeline, its step timing."""
    epoch = summary["epochs"][-1]
    fig = {"images_per_second": epoch["images_per_second"],
           "global_batch": summary["global_batch_size"]}
    pipe = summary.get("pipeline")
    if pipe:
        ranks = sorted(pipe["ranks"], key=lambda r: r["rank"])
        fig.update(measured_bubble=pipe["measured_bubble"][0],
                   step_seconds=ranks[0]["step_seconds"],
                   schedule_seconds=[r["schedule_seconds"] for r in ranks],
                   busy_seconds=[r["busy_seconds"] for r in ranks],
                   param_bytes=[r["param_bytes"] for r in ranks])
    return fig


def schedules(runner: Runner) -> list[dict]:
    """GPipe and 1F1B at each M, S = 2 at -np 2 and (full and quick runs) S = 4 at -np 4; at S =
    4 the ranks outnumber a 2-core machine's cores (the report gives the count)."""
    cfg, rows = runner.cfg, []
    for stages in cfg.schedule_stages:
        for schedule in cfg.schedules:
            for m in cfg.micro:
                name = f"{schedule}-m{m}" if stages == 2 else f"s{stages}-{schedule}-m{m}"
                args = [*runner.steps_args(cfg.steps, cfg.batch), "--model", MODEL,
                        "--pipeline-stages", str(stages), "--schedule", schedule,
                        "--microbatches", str(m)]
                rec = runner.trainer(name, stages, args, cfg.mlp)
                rec.update(schedule=schedule, micro=m, stages=stages,
                           formula_bubble=bubble_formula(stages, m))
                if rec["ok"]:
                    fig = step_figures(rec.pop("summary"))
                    # The schedule replayed on this run's own stage times (F = 1/3, B = 2/3 of a
                    # micro-batch's computing time): what its imbalance alone predicts.
                    busy = fig["busy_seconds"]
                    fig["replayed_bubble"] = simulate(
                        schedule, stages, m, [b / (3 * m) for b in busy],
                        [2 * b / (3 * m) for b in busy]).bubble()
                    rec.update(fig)
                    util.say(f"pipeline/{name}: {fig['images_per_second']:.0f} img/s, bubble "
                             f"{fig['measured_bubble']:.1%} (formula {rec['formula_bubble']:.1%})")
                rows.append(rec)
    return rows


def versus_dp(runner: Runner) -> list[dict]:
    """The same MLP and global batch (2 x the per-replica batch) on -np 2: data parallel, and the
    pipeline with the most micro-batches of the schedule runs."""
    cfg, rows = runner.cfg, []
    g = 2 * cfg.batch
    m = max(cfg.micro)
    runs = [("data-parallel", [*runner.steps_args(cfg.steps, cfg.batch), "--model", MODEL]),
            (f"pipeline-1f1b-m{m}", [*runner.steps_args(cfg.steps, g), "--model", MODEL,
                                     "--pipeline-stages", "2", "--microbatches", str(m)])]
    for name, args in runs:
        if name == "data-parallel":  # steps of the global batch, as the pipeline's
            args[args.index("--train-samples") + 1] = str(cfg.steps * g)
        rec = runner.trainer(f"versus/{name}", 2, args, cfg.mlp)
        rec["kind"] = name
        if rec["ok"]:
            rec.update(step_figures(rec.pop("summary")))
            util.say(f"pipeline/versus/{name}: {rec['images_per_second']:.0f} img/s "
                     f"(global batch {rec['global_batch']})")
        rows.append(rec)
    return rows


def memory(runner: Runner, out: Path) -> dict:
    cfg = runner.cfg
    width, depth = cfg.memory_mlp
    params = mlp_params(width, depth)
    cells = []
    for stages in (1, 2):
        report = runner.work / f"memory-s{stages}" / "rank"
        report.parent.mkdir(parents=True, exist_ok=True)
        for old in report.parent.glob("rank.*.json"):
            old.unlink()
        wrap = [util.PY, "-m", "bench.workers.memlimit", "--budget-mb", str(cfg.memory_budget_mb),
                "--report", str(report), "--"]
        # M = S, as the recorded memory cells ran (before the default became M >= 4S)
        args = [*runner.steps_args(cfg.memory_steps, 32), "--model", MODEL,
                "--pipeline-stages", str(stages), "--stall-timeout", "30",
                *(["--microbatches", str(stages)] if stages > 1 else [])]
        # A fixed 16 MiB fusion buffer (Horovod's default is 64 MiB, allocated as two): the same
        # in both cells, and a smaller share of the budget.
        rec = runner.trainer(f"memory-s{stages}", 2, args, cfg.memory_mlp, wrap=wrap,
                             env={"HOROVOD_FUSION_THRESHOLD": str(16 << 20)})
        ranks = [util.read_json(p) for p in sorted(report.parent.glob("rank.*.json"))]
        log = (runner.work / f"memory-s{stages}" / "output.log").read_text()
        # Past the cap PyTorch's allocator fails, or Python cannot start a thread (a thread's
        # stack is capped memory too), whichever asks first.
        rec.update(stages=stages, ranks=ranks,
                   allocation_failed=any(why in log for why in MEMORY_FAILURES))
        if rec["ok"]:
            summary = rec.pop("summary")
            pipe = summary.get("pipeline")
            rec["param_bytes"] = ([r["param_bytes"] for r in sorted(pipe["ranks"], key=lambda r: r["rank"])]
                                  if pipe else [4 * summary["param_count"]] * 2)
            rec["final_test_accuracy"] = summary["final_test_accuracy"]
        util.say(f"pipeline/memory-s{stages}: {'trained' if rec['ok'] else 'failed'}"
                 f"{' (allocation failed)' if rec['allocation_failed'] else ''}")
        cells.append(rec)
    return {"width": width, "depth": depth, "params": params, "weight_bytes": 4 * params,
            "budget_mb": cfg.memory_budget_mb, "cells": cells}


def deep_memory(runner: Runner) -> dict:
    """:data:`DEEP` (1.34 GB of float32 weights) under a cap of ``deep_budget_mb`` per rank: one
    rank (ring: the weights, their gradients and momentum, 4 GB) against S = 8 at -np 8, where
    each rank builds and trains only its stage.  One epoch of 8 steps of 8 rows."""
    cfg, cells = runner.cfg, []
    data = ["--data", "bench.parts.model_parallel:deep_rows", "--model",
            "bench.parts.model_parallel:deep_torch", "--epochs", "1", "--batch-size", "8",
            "--train-samples", "64", "--test-samples", "32"]
    for name, np_, extra in (("deep-ring-np1", 1, []),
                             ("deep-s8-np8", 8, ["--pipeline-stages", "8", "--stall-timeout", "120"])):
        report = runner.work / name / "rank"
        report.parent.mkdir(parents=True, exist_ok=True)
        for old in report.parent.glob("rank.*.json"):
            old.unlink()
        wrap = [util.PY, "-m", "bench.workers.memlimit", "--budget-mb", str(cfg.deep_budget_mb),
                "--report", str(report), "--"]
        rec = runner.trainer(name, np_, [*data, *extra], DEEP, wrap=wrap,
                             env={"HOROVOD_FUSION_THRESHOLD": str(16 << 20)})
        log = (runner.work / name / "output.log").read_text()
        ranks = [util.read_json(p) for p in sorted(report.parent.glob("rank.*.json"))]
        rec.update(np=np_, stages=8 if extra else 1, ranks=ranks,
                   peak_rss_mb=[round(r["peak_rss_bytes"] / 2**20) for r in ranks],
                   allocation_failed=any(why in log for why in MEMORY_FAILURES),
                   stage_by_stage="stage weights: built stage by stage" in log)
        if rec["ok"]:
            pipe = rec.pop("summary").get("pipeline")
            rec["param_bytes"] = [r["param_bytes"] for r in sorted(pipe["ranks"], key=lambda r: r["rank"])] \
                if pipe else None
        util.say(f"pipeline/{name}: {'trained' if rec['ok'] else 'failed'}, peak RSS per rank "
                 f"{rec['peak_rss_mb']} MB")
        cells.append(rec)
    return {"width": DEEP[0], "depth": DEEP[1], "budget_mb": cfg.deep_budget_mb, "cells": cells}


def capped(runner: Runner, name: str, np_: int, args: list[str], width_depth: tuple[int, int],
           budget_mb: float, model_env: dict[str, str] | None = None) -> dict:
    """One launch of the trainer with each rank capped at ``budget_mb`` beyond the framework's
    footprint (:mod:`bench.workers.memlimit`): its record with each rank's report (peak resident
    memory), whether an allocation failed, and whether the pipeline's own check refused a stage
    before its weights existed."""
    report = runner.work / name / "rank"
    report.parent.mkdir(parents=True, exist_ok=True)
    for old in report.parent.glob("rank.*.json"):
        old.unlink()
    wrap = [util.PY, "-m", "bench.workers.memlimit", "--budget-mb", str(budget_mb),
            "--report", str(report), "--"]
    rec = runner.trainer(name, np_, args, width_depth, wrap=wrap,
                         env={"HOROVOD_FUSION_THRESHOLD": str(16 << 20), **(model_env or {})})
    log_path = runner.work / name / "output.log"
    log = log_path.read_text() if log_path.exists() else ""
    ranks = [util.read_json(p) for p in sorted(report.parent.glob("rank.*.json"))]
    # Near the cap an allocation may fail in a thread of a rank (Horovod's, MPI's) that then
    # stops answering without a line of its own: its neighbour's --stall-timeout ends the job.
    rec.update(ranks=ranks, peak_rss_mb=[round(r["peak_rss_bytes"] / 2**20) for r in ranks],
               allocation_failed=any(why in log for why in MEMORY_FAILURES),
               refused_by_check=" needs " in log and "under RLIMIT_DATA" in log,
               # the trainer's own line for an allocation that failed in a step
               ran_out=" ran out of memory during " in log,
               stalled="(--stall-timeout" in log and "frozen, dead or cut off" in log)
    return rec


def search_depth(trains, start: int, probes: int, known_ok: int = 0) -> tuple[int, int | None]:
    """The largest depth ``trains(depth)`` accepts, in at most ``probes`` calls: from ``start``,
    up by half again while it trains and nothing above failed, else bisecting between the
    largest that trained and the smallest that failed; stops once they are within 5% (or one
    layer).  Returns (largest that trained, 0 if none; smallest that failed, None if none)."""
    lo, hi, depth = known_ok, None, max(1, start)
    for _ in range(probes):
        if trains(depth):
            lo = depth
        else:
            hi = depth
        if hi is not None and hi - lo <= max(1, lo // 20):
            break
        depth = (lo + hi) // 2 if hi is not None else max(lo + 1, lo * 3 // 2)
        if hi is not None and depth <= lo:
            break
    return lo, hi


def largest(runner: Runner) -> dict:
    """The deepest MLP of ``largest_width`` (``mlp``: a first layer from the 784 inputs, ``depth``
    square hidden layers, the logits) that trains two steps of 32 rows with each rank capped at
    ``largest_budget_mb``, at each S (-np S; S = 1 the ring), M = S.  S = 1 starts from an
    estimate, each S > 1 from the depth of 0.9 x S times S = 1's largest parameter count (the
    target: met when that depth trains)."""
    cfg = runner.cfg
    width, budget = cfg.largest_width, cfg.largest_budget_mb
    cells: list[dict] = []
    base = None  # S = 1's largest parameter count
    for stages in cfg.largest_stages:
        probes: list[dict] = []

        def trains(depth: int, stages=stages, probes=probes) -> bool:
            args = [*runner.steps_args(cfg.largest_steps, 32), "--model", MODEL,
                    "--pipeline-stages", str(stages), "--stall-timeout", "60",
                    *(["--microbatches", str(stages)] if stages > 1 else [])]
            rec = capped(runner, f"largest-s{stages}-d{depth}", stages, args, (width, depth),
                         budget)
            probes.append({"depth": depth, "params": mlp_params(width, depth), "ok": rec["ok"],
                           "allocation_failed": rec["allocation_failed"],
                           "refused_by_check": rec["refused_by_check"],
                           "ran_out": rec["ran_out"],
                           "stalled": rec["stalled"],
                           "peak_rss_mb": rec["peak_rss_mb"], "wall_seconds": rec["wall_seconds"],
                           **({} if rec["ok"] else {"error": rec["error"]})})
            short = rec["allocation_failed"] or rec["refused_by_check"] or rec["ran_out"]
            outcome = ("trained" if rec["ok"] else "did not fit" if short
                       else "a rank stopped answering" if rec["stalled"] else "FAILED")
            util.say(f"pipeline/largest S={stages} depth {depth} "
                     f"({mlp_params(width, depth) / 1e6:.1f}M params): {outcome}")
            return rec["ok"]

        if base is None:
            # Under RLIMIT_DATA the ring on one rank needs far more than the formula's 12 bytes
            # a weight (malloc's arenas for the framework's threads count against the cap too):
            # in 300 MB a 512-wide MLP of 10.7M parameters trained, one of 15.9M and a 256-wide
            # one of 14.8M did not (quick runs).  Start at 32 bytes a weight, likely to train;
            # its largest is every later target's base, so it gets two probes more.
            start = depth_for(width, budget * 2**20 / 32)
            target, probes_here = None, cfg.largest_probes + (2 if cfg.largest_probes > 1 else 0)
        else:
            target, probes_here = 0.9 * stages * base, cfg.largest_probes
            start = depth_for(width, target)
        lo, hi = search_depth(trains, start, probes_here)
        cell = {"stages": stages, "np": stages, "probes": probes, "largest_depth": lo or None,
                "largest_params": mlp_params(width, lo) if lo else None,
                "smallest_failed_depth": hi, "target_params": target}
        if stages == cfg.largest_stages[0] and lo:
            base = cell["largest_params"]
        if base and lo and target is not None:
            cell["vs_first"] = cell["largest_params"] / base
            cell["meets_target"] = cell["largest_params"] >= target
        cells.append(cell)
        if base is None:
            break  # nothing trained at the first S: no target for the others
    return {"width": width, "budget_mb": budget, "steps": cfg.largest_steps, "cells": cells}


def depth_for(width: int, params: float) -> int:
    """The least depth of the ``mlp`` of ``width`` with at least ``params`` parameters."""
    fixed = mlp_params(width, 0)
    return max(1, math.ceil((params - fixed) / ((width + 1) * width)))


def stage_memory(runner: Runner) -> dict:
    """The built-in CNN at S stages, M micro-batches, GPipe against 1F1B: each rank's peak
    resident memory and the most micro-batches' activations it held (measured by the trainer),
    beside the schedule's bound (1F1B: S - s; GPipe: M).  The cap (1 TB) never binds: the
    wrapper is here for its report."""
    cfg = runner.cfg
    stages, m, batch = cfg.stage_memory_stages, cfg.stage_memory_micro, cfg.stage_memory_batch
    cells = []
    for schedule in ("gpipe", "1f1b"):
        args = [*runner.steps_args(cfg.stage_memory_steps, batch), "--model", "cnn",
                "--pipeline-stages", str(stages), "--schedule", schedule, "--microbatches", str(m),
                "--stall-timeout", "120"]
        rec = capped(runner, f"stage-memory-{schedule}", stages, args, cfg.mlp, 1 << 20)
        cell = {"schedule": schedule, "ok": rec["ok"], "wall_seconds": rec["wall_seconds"]}
        if rec["ok"]:
            pipe = rec.pop("summary")["pipeline"]
            rss = {r["rank"]: r["peak_rss_bytes"] for r in rec["ranks"]}
            cell["stages"] = [{"stage": r["stage"], "rank": r["rank"],
                               "peak_activations_held": r["peak_activations_held"],
                               "in_flight_formula": pipe["in_flight_formula"][r["stage"]],
                               "peak_rss_bytes": rss.get(r["rank"]),
                               "param_bytes": r["param_bytes"]}
                              for r in sorted(pipe["ranks"], key=lambda r: r["rank"])]
            cell["cut_values"] = [math.prod(s["output_shape"]) for s in pipe["split"][:-1]]
            util.say(f"pipeline/stage-memory-{schedule}: peak RSS "
                     f"{[round((c['peak_rss_bytes'] or 0) / 2**20) for c in cell['stages']]} MB, "
                     f"held {[c['peak_activations_held'] for c in cell['stages']]}")
        else:
            cell["error"] = rec["error"]
        cells.append(cell)
    return {"model": "cnn", "stages": stages, "micro": m, "batch": batch,
            "microbatch_rows": batch // m, "cells": cells}


def partition(runner: Runner) -> dict:
    """:func:`costly` at S = 2 (-np 2), split by parameters and by timed compute: images/s, each
    stage's computing seconds per step (the trainer's own), the slowest stage's share of them,
    and under time the shares rank 0's timing predicted."""
    cfg = runner.cfg
    channels, convs = cfg.partition_model
    cells = []
    for mode in ("params", "time"):
        args = [*runner.steps_args(cfg.partition_steps, cfg.partition_batch), "--model",
                "bench.parts.model_parallel:costly", "--pipeline-stages", "2",
                "--microbatches", str(cfg.partition_micro), "--partition", mode]
        rec = runner.trainer(f"partition-{mode}", 2, args, cfg.mlp,
                             env={"BENCH_COSTLY": f"{channels},{convs}"})
        cell = {"partition": mode, "ok": rec["ok"], "wall_seconds": rec["wall_seconds"]}
        if rec["ok"]:
            summary = rec.pop("summary")
            fig = step_figures(summary)
            busy = fig["busy_seconds"]
            pipe = summary["pipeline"]
            cell.update(images_per_second=fig["images_per_second"], busy_seconds=busy,
                        measured_bubble=fig["measured_bubble"],
                        slowest_share=max(busy) / sum(busy) if sum(busy) else None,
                        layers=[len(s["layers"]) for s in pipe["split"]],
                        params=[s["params"] for s in pipe["split"]],
                        timed_share=pipe.get("stage_time_share"),
                        recorded_partition=pipe.get("partition"))
            util.say(f"pipeline/partition-{mode}: {fig['images_per_second']:.0f} img/s, stages "
                     f"of {cell['layers']} layers, slowest stage {cell['slowest_share']:.0%} of "
                     f"the computing time")
        else:
            cell["error"] = rec["error"]
        cells.append(cell)
    return {"model": "bench.parts.model_parallel:costly", "channels": channels, "convs": convs,
            "stages": 2, "micro": cfg.partition_micro, "batch": cfg.partition_batch,
            "steps": cfg.partition_steps, "cells": cells}


def link(runner: Runner, out: Path) -> dict:
    """Bytes per step through host a's link, data parallel vs pipeline, on two emulated hosts."""
    from bench.common import netns_hosts
    from bench.parts import emulated_cluster

    cfg = runner.cfg
    batch = cfg.batch
    try:
        with netns_hosts.two_hosts() as hosts:
            lab = emulated_cluster.Cluster(hosts, out, cfg.timeout_s)

            def launch(name, inner, extra):
                return lab.run(f"pipeline/{name}", "horovodrun", 2, 1, inner, env=extra)

            kinds = {"data-parallel": ["--batch-size", str(batch // 2)],
                     "pipeline": ["--batch-size", str(batch), "--pipeline-stages", "2",
                                  "--microbatches", "4"]}
            rows = []
            for kind, extra in kinds.items():
                counts = {}
                for steps in cfg.link_steps:
                    before = hosts.counters(hosts.a)
                    args = ["--epochs", "1", "--max-steps", str(steps), "--train-samples",
                            str(steps * batch), "--test-samples", "100", *extra]
                    rec = runner.trainer(f"link/{kind}-{steps}", 2, args, cfg.mlp, launch=launch)
                    after = hosts.counters(hosts.a)
                    if not rec["ok"]:
                        rows.append({"kind": kind, "ok": False, "error": rec["error"]})
                        break
                    counts[steps] = (after["tx"] - before["tx"], after["rx"] - before["rx"],
                                     rec["summary"])
                else:
                    (s1, (tx1, rx1, _)), (s2, (tx2, rx2, summary)) = sorted(counts.items())
                    rows.append({"kind": kind, "ok": True, "steps": [s1, s2],
                                 "tx_per_step": (tx2 - tx1) / (s2 - s1),
                                 "rx_per_step": (rx2 - rx1) / (s2 - s1),
                                 "formula_each_way": link_formula(kind, summary, batch)})
            return {"hosts": 2, "model": "cnn", "global_batch": batch, "rows": rows}
    except netns_hosts.Unavailable as err:
        return {"skipped": str(err)}


def link_formula(kind: str, summary: dict, batch: int) -> float:
    """Bytes each way per step: a ring allreduce of the float32 gradients over 2 ranks, or the
    activations crossing the one cut (float32, ``batch`` rows)."""
    if kind == "data-parallel":
        return costmodel.ring_link_bytes(4 * summary["param_count"], summary["world_size"])
    cut = summary["pipeline"]["split"][0]["output_shape"]
    return batch * math.prod(cut) * 4


# The part's cells, for ``python -m bench --only pipeline --cells ...``: a subset is measured
# again and replaces those cells of the part's JSON (:func:`merge_rerun`), the rest kept as
# measured; the report names the rerun, its time and load.
CELLS = ("schedules-s2", "schedules-s4", "versus_dp", "memory", "deep_memory", "largest",
         "stage_memory", "partition", "link")


def run_part(cfg: PipelineConfig, out: Path, cells: list[str] | None = None) -> dict:
    """Every cell of the part (``cells``: only those, of :data:`CELLS`)."""
    chosen = set(CELLS if cells is None else cells)
    runner = Runner(cfg, out)
    runner.cfg.schedule_stages = [s for s in cfg.schedule_stages if f"schedules-s{s}" in chosen]
    data: dict = {"config": {**cfg.to_dict(), "cells": sorted(chosen, key=CELLS.index)},
                  "load_before": loadavg(), "mlp_params": mlp_params(*cfg.mlp)}
    if runner.cfg.schedule_stages:
        data["schedules"] = schedules(runner)
    if cfg.versus_dp and "versus_dp" in chosen:
        data["versus_dp"] = versus_dp(runner)
    if "memory" in chosen:
        data["memory"] = memory(runner, out)
    if cfg.deep_memory and "deep_memory" in chosen:
        data["deep_memory"] = deep_memory(runner)
    for name, cell in (("largest", largest), ("stage_memory", stage_memory),
                       ("partition", partition)):
        if name in chosen:
            data[name] = cell(runner)
    if cfg.link and "link" in chosen:
        data["link"] = link(runner, out)
    data["load_after"] = loadavg()
    return data


def merge_rerun(part: dict, rerun: dict, command: str) -> dict:
    """``part`` (the whole pipeline part as measured before) with the cells ``rerun`` measured
    again in place of its own (a schedule cell: the rows of its S); everything else stays, and
    when and how the rerun ran is kept in ``reruns`` (the report names it beside its tables)."""
    cells = rerun["config"]["cells"]
    merged = dict(part)
    stages = {int(c.split("-s")[1]) for c in cells if c.startswith("schedules-s")}
    if stages:
        merged["schedules"] = [r for r in part.get("schedules", [])
                               if r.get("stages", 2) not in stages] + rerun.get("schedules", [])
    for cell in cells:
        key = cell
        if not cell.startswith("schedules-") and key in rerun:
            merged[key] = rerun[key]
    merged["quick"] = bool(part.get("quick") or rerun.get("quick"))
    merged["reruns"] = [*part.get("reruns", []), {
        "cells": cells, "command": command, **{k: rerun.get(k) for k in (
            "started", "machine", "load_before", "load_after")}}]
    return merged
