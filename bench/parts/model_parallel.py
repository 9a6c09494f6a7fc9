"""``python -m bench --only pipeline``: model parallelism (``--pipeline-stages``), measured with the
real trainers (docs/pipeline.md).

* **Schedules.** GPipe and 1F1B at M = 1, 2, 4, 8 micro-batches, S = 2 stages at -np 2, on an MLP
  of equal hidden layers (:func:`mlp`: split by parameters, its stages are also equal in work, so
  the (S-1)/(M+S-1) formula applies): images/s and the measured bubble (the trainer's own
  per-stage timing: 1 - mean computing time / the longest schedule), beside the formula and a
  replay of the schedule on the measured stage times
  (:func:`ringtrain.strategies.pipeline.schedule.simulate`).
* **Pipeline vs data parallel** on the same cores: the same MLP and global batch, -np 2, S = 2 x
  R = 1 against S = 1 x R = 2.
* **Memory.** An MLP whose weights, gradients and momentum exceed a per-rank cap
  (:mod:`bench.workers.memlimit`: ``RLIMIT_DATA`` beyond the framework's own footprint), at -np 2: S = 1
  (each rank holds all of it) fails to allocate, S = 2 trains; each rank's parameter bytes.
  And (full runs) :data:`DEEP`, whose weights alone nearly fill the cap, at S = 8 on -np 8, each
  rank building only its stage (:func:`deep_memory`), against one rank; each rank's peak RSS.
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

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> PipelineConfig:
    return PipelineConfig()


def quick() -> PipelineConfig:
    return PipelineConfig(quick=True, micro=[1, 4], steps=12, link_steps=(3, 6), deep_memory=False)


def smoke() -> PipelineConfig:
    """Each kind of run once, two steps, small models; the memory cells at a scale where the cap
    still separates S = 1 from S = 2 (a 2048 x 12 MLP, 208 MB of weights, 690 MB budget: see
    docs/pipeline.md for the window measured); the link cells where hosts can be made (root)."""
    from bench.common import netns_hosts

    return PipelineConfig(quick=True, schedules=["1f1b"], micro=[2], steps=2, mlp=(256, 2),
                          memory_mlp=(2048, 12), memory_budget_mb=690,
                          link=netns_hosts.why_unavailable() is None, link_steps=(1, 2),
                          timeout_s=240, deep_memory=False)


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
    cfg, rows = runner.cfg, []
    for schedule in cfg.schedules:
        for m in cfg.micro:
            args = [*runner.steps_args(cfg.steps, cfg.batch), "--model", MODEL,
                    "--pipeline-stages", "2", "--schedule", schedule, "--microbatches", str(m)]
            rec = runner.trainer(f"{schedule}-m{m}", 2, args, cfg.mlp)
            rec.update(schedule=schedule, micro=m, stages=2,
                       formula_bubble=bubble_formula(2, m))
            if rec["ok"]:
                fig = step_figures(rec.pop("summary"))
                # The schedule replayed on this run's own stage times (F = 1/3, B = 2/3 of a
                # micro-batch's computing time): what its imbalance alone predicts.
                busy = fig["busy_seconds"]
                fig["replayed_bubble"] = simulate(schedule, 2, m, [b / (3 * m) for b in busy],
                                                  [2 * b / (3 * m) for b in busy]).bubble()
                rec.update(fig)
                util.say(f"pipeline/{schedule}-m{m}: {fig['images_per_second']:.0f} img/s, bubble "
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


def run_part(cfg: PipelineConfig, out: Path) -> dict:
    runner = Runner(cfg, out)
    data: dict = {"config": cfg.to_dict(), "load_before": loadavg(),
                  "mlp_params": mlp_params(*cfg.mlp)}
    data["schedules"] = schedules(runner)
    if cfg.versus_dp:
        data["versus_dp"] = versus_dp(runner)
    data["memory"] = memory(runner, out)
    if cfg.deep_memory:
        data["deep_memory"] = deep_memory(runner)
    if cfg.link:
        data["link"] = link(runner, out)
    data["load_after"] = loadavg()
    return data
