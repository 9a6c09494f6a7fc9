"""Part ``floor``: Horovod's small-message floor on one host, with the patch's background loop
and with Horovod 0.28.1's (``HOROVOD_UPSTREAM_LOOP=1``), in one run.

Horovod 0.28.1's background thread sleeps out ``HOROVOD_CYCLE_TIME`` (1 ms) between rounds
whether or not a tensor waits, and its waiting threads spin on ``std::this_thread::yield()``; the
project's patch wakes the loop when a tensor is enqueued and lets the waits sleep
(``horovod/common/loop_waker.h``; docs/horovod-suite.md).  The same build runs both ways, chosen by
the environment variable, back to back:

* collectives: ``bench/workers/coll_worker.py --impl hvd`` under ``horovodrun`` (MPI controller) and
  ``horovodrun --gloo``, both loops, against mpi4py's ``Allreduce`` (``mpirun``), 4 KiB-64 MiB,
  -np 2 and 4, every one on numpy-allocated buffers (``--numpy-buffers``: from 4 MiB up numpy's
  huge pages alone were worth 1.4-1.6x at 16 MiB);
* fusion: ``bench/workers/fusion_worker.py``, 20 small gradients per step through
  ``DistributedOptimizer``: allreduce calls per step, tensors and bytes per call (Horovod's loop
  counters);
* waiting: ``bench/workers/wait_worker.py``, a peer 50 ms late: the cores a waiting rank holds (PyTorch's
  ``synchronize``, TensorFlow's allreduce op and in-place broadcast);
* training: the real trainer (``launch.torch_mnist``) and the bench loop with both loops, and the
  DDP loop (``torchrun``, gloo), -np 1, 2 and 4, in rounds whose order alternates.

MPI ranks yield while waiting (``OMPI_MCA_mpi_yield_when_idle=1``), as ``ringtrain/runtime.py``
sets it when a host's ranks fill its cores.  The load average is recorded before every cell: the
cores are shared.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import median

from bench.common import util
from bench.common.tables import size
from bench.parts import config
from bench.parts.training_runs import Run, execute

# As the trainers run when a host's ranks fill its cores (ringtrain/runtime.py:
# configure_mpi_progress; the bench loop sets it itself): without it, a waiting rank busy-polls
# on the core its peer needs, which on a loaded machine puts tens of ms on every small allreduce.
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}
LOOPS = {"upstream": {"HOROVOD_UPSTREAM_LOOP": "1"}, "patched": {}}  # name -> environment
CONTROLLERS = ("mpi", "gloo")
WAIT_OPS = ("torch-allreduce", "tf-allreduce", "tf-broadcast-inplace")


@dataclass
class FloorConfig:
    quick: bool = False
    smoke: bool = False
    coll_nps: list[int] = field(default_factory=lambda: [2, 4])
    sizes: list[int] = field(default_factory=lambda: [4 ** k * 1024 for k in range(1, 9)])
    controllers: list[str] = field(default_factory=lambda: list(CONTROLLERS))
    loops: list[str] = field(default_factory=lambda: list(LOOPS))  # fusion, waiting, training
    warmup: int = 3
    warmup_s: float = 0.1  # per size: past the start's scheduling transient (coll_worker.measure)
    reps: int = 200
    budget_s: float = 1.5
    fusion_nps: list[int] = field(default_factory=lambda: [2, 4])
    fusion_layers: int = 10   # 2 tensors each: 20 gradients
    fusion_width: int = 128
    fusion_warmup: int = 5
    fusion_steps: int = 50
    wait_ops: list[str] = field(default_factory=lambda: list(WAIT_OPS))
    wait_late_ms: float = 50.0
    wait_reps: int = 10
    train_nps: list[int] = field(default_factory=lambda: [1, 2, 4])
    train_rounds: int = 4  # paired rounds: a single pair varied 0.87-1.11x here (floor_analysis.md)
    train_warmup: int = 8
    train_steps: int = 60
    trainer_steps: int = 60
    timeout_s: float = 600

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> FloorConfig:
    return FloorConfig()


def quick() -> FloorConfig:
    return FloorConfig(quick=True, coll_nps=[2], sizes=[4096, 65536, 1 << 20], reps=10, budget_s=0.5,
                       fusion_nps=[2], fusion_steps=15, wait_reps=3, train_nps=[1, 2], train_rounds=1,
                       train_warmup=3, train_steps=15, trainer_steps=15, timeout_s=300)


def smoke() -> FloorConfig:
    """The smallest run that goes through every cell kind: -np 2, 4 KiB, one step, the 0.28.1
    loop in the collectives only (tests)."""
    return FloorConfig(quick=True, smoke=True, coll_nps=[2], sizes=[4096], controllers=["mpi"],
                       loops=["patched"], warmup=1, warmup_s=0.0, reps=1, budget_s=0.1, fusion_nps=[2],
                       fusion_warmup=1,
                       fusion_steps=1, wait_ops=["torch-allreduce"], wait_late_ms=1.0, wait_reps=1,
                       train_nps=[2], train_rounds=1, train_warmup=1, train_steps=1,
                       trainer_steps=1, timeout_s=300)


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def _job(cfg: FloorConfig, out: Path, name: str, cmd: list[str], env: dict[str, str],
         result: Path) -> tuple[dict | None, dict]:
    """Run one cell; (its result JSON or None, the record's common fields)."""
    work = out / "tmp" / "floor" / name
    work.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    rec = {"load_average": load()}
    res = util.run(cmd, env=util.base_env(**YIELD, **env), timeout=cfg.timeout_s, log=work / "output.log")
    rec["ok"] = res.ok and result.exists()
    rec["job_seconds"] = round(res.seconds, 1)
    if not rec["ok"]:
        rec["error"] = util.tail(res.output, 20)
        util.say(f"floor {name} FAILED; log: {work / 'output.log'}")
        return None, rec
    return util.read_json(result), rec


def collective(cfg: FloorConfig, out: Path, np: int, impl: str, controller: str, loop: str) -> dict:
    """``impl`` hvd (with ``controller`` and ``loop``) or mpi4py: seconds per size."""
    name = f"coll_{impl}_{controller}_{loop}_np{np}" if impl == "hvd" else f"coll_mpi4py_np{np}"
    result = out / "tmp" / "floor" / name / "result.json"
    inner = [util.PY, "-m", "bench.workers.coll_worker", "--impl", impl,
             "--sizes", ",".join(map(str, cfg.sizes)),
             "--warmup", str(cfg.warmup), "--warmup-s", str(cfg.warmup_s), "--reps", str(cfg.reps),
             "--budget", str(cfg.budget_s), "--numpy-buffers",
             "--out", str(result)]
    if impl == "hvd":
        cmd, env = util.horovodrun(np, inner, gloo=controller == "gloo"), LOOPS[loop]
    else:
        cmd, env = util.mpirun(np, inner), {}
    util.say(f"floor {name} ...")
    doc, rec = _job(cfg, out, name, cmd, env, result)
    rec.update({"impl": "mpi4py" if impl == "mpi4py" else f"horovod-{controller}", "loop": loop, "np": np})
    if doc:
        rec["seconds"] = {str(r["bytes"]): r["seconds"] for r in doc["rows"]}
        util.say(f"floor {name}: " + ", ".join(f"{size(int(k))} {v * 1e3:.3g} ms"
                                               for k, v in rec["seconds"].items()))
    return rec


def fusion(cfg: FloorConfig, out: Path, np: int, loop: str) -> dict:
    name = f"fusion_{loop}_np{np}"
    result = out / "tmp" / "floor" / name / "result.json"
    inner = [util.PY, "-m", "bench.workers.fusion_worker", "--layers", str(cfg.fusion_layers),
             "--width", str(cfg.fusion_width), "--warmup-steps", str(cfg.fusion_warmup),
             "--steps", str(cfg.fusion_steps), "--out", str(result)]
    util.say(f"floor {name} ...")
    doc, rec = _job(cfg, out, name, util.horovodrun(np, inner), LOOPS[loop], result)
    rec.update({"loop": loop, "np": np})
    if doc:
        rec.update({k: doc[k] for k in ("gradients", "gradient_bytes")})
        rec["per_rank"] = doc["per_rank"]
        r0 = doc["per_rank"][0]
        util.say(f"floor {name}: {r0['allreduce_calls_per_step']:.2f} allreduce calls per step, "
                 f"{r0['bytes_per_call'] or 0:.0f} bytes per call")
    return rec


def wait(cfg: FloorConfig, out: Path, op: str, loop: str, np: int = 2) -> dict:
    name = f"wait_{op}_{loop}"
    result = out / "tmp" / "floor" / name / "result.json"
    inner = [util.PY, "-m", "bench.workers.wait_worker", "--op", op, "--late-ms", str(cfg.wait_late_ms),
             "--reps", str(cfg.wait_reps), "--out", str(result)]
    util.say(f"floor {name} ...")
    doc, rec = _job(cfg, out, name, util.horovodrun(np, inner), LOOPS[loop], result)
    rec.update({"op": op, "loop": loop, "np": np})
    if doc:
        rec.update({k: doc[k] for k in ("wall_seconds", "cpu_seconds", "cores_busy", "late_ms")})
        util.say(f"floor {name}: rank 0 held {doc['cores_busy']:.2f} cores for "
                 f"{doc['wall_seconds'] * 1e3:.0f} ms")
    return rec


def training_runs(np: int, round_: int, loops: list[str] | None = None) -> list[tuple[str, Run]]:
    """(loop name, run) for one -np in one round; odd rounds put the patched loop first."""
    order = [loop for loop in ("upstream", "patched") if loop in (loops or LOOPS)]
    order = order if round_ % 2 == 0 else order[::-1]
    runs = [(loop, Run("torch", "loop", "horovod", "synthetic", np, label=loop)) for loop in order]
    runs.append(("-", Run("torch", "loop", "ddp", "synthetic", np)))
    runs += [(loop, Run("torch", "trainer", "horovod", "mnist", np, label=loop)) for loop in order]
    return runs


def train(cfg: FloorConfig, out: Path) -> list[dict]:
    jobs_cfg = config.Config(warmup_steps=cfg.train_warmup, steps=cfg.train_steps,
                             trainer_steps=cfg.trainer_steps, timeout_s=cfg.timeout_s)
    records = []
    for round_ in range(cfg.train_rounds):
        for np in cfg.train_nps:
            for loop, run in training_runs(np, round_, cfg.loops):
                if loop in LOOPS:  # the trainer and the loop set Open MPI's yield themselves
                    run.env = dict(LOOPS[loop])
                avg = load()
                rec = execute(run, jobs_cfg, out / "tmp" / "floor")
                records.append({**rec, "loop": loop, "round": round_, "load_average": avg})
    return records


def run_part(cfg: FloorConfig, out: Path) -> dict:
    started_load = load()
    coll = []
    for np in cfg.coll_nps:
        for controller in cfg.controllers:
            for loop in LOOPS:
                coll.append(collective(cfg, out, np, "hvd", controller, loop))
        coll.append(collective(cfg, out, np, "mpi4py", "mpi", "-"))
    fus = [fusion(cfg, out, np, loop) for np in cfg.fusion_nps for loop in cfg.loops]
    waits = [wait(cfg, out, op, loop) for op in cfg.wait_ops for loop in cfg.loops]
    training = train(cfg, out)
    return {"config": cfg.to_dict(), "load_average_start": started_load, "load_average_end": load(),
            "collectives": coll, "fusion": fus, "wait": waits, "training": training,
            "summary": summary(coll, training)}


# -- what the report quotes (pure) ----------------------------------------------------------------

def seconds_of(coll: list[dict], np: int, impl: str, loop: str) -> dict[str, float]:
    for rec in coll:
        if rec.get("ok") and rec["np"] == np and rec["impl"] == impl and rec["loop"] == loop:
            return rec["seconds"]
    return {}


def train_median(training: list[dict], np: int, kind: str, wrapper: str, loop: str) -> float | None:
    vals = [r["images_per_second"] for r in training if r.get("ok") and r["np"] == np
            and r["kind"] == kind and r["wrapper"] == wrapper and r["loop"] == loop]
    return median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summary(coll: list[dict], training: list[dict]) -> dict:
    """The issue's targets, from this run's figures: per -np, Horovod MPI (patched) over mpi4py
    at each size, and per -np of the training runs the patched trainer and loop against DDP and
    against the upstream loop (medians over rounds)."""
    out: dict = {"collectives": {}, "training": {}}
    for np in sorted({r["np"] for r in coll}):
        ref = seconds_of(coll, np, "mpi4py", "-")
        cells = {}
        for loop in LOOPS:
            hv = seconds_of(coll, np, "horovod-mpi", loop)
            cells[loop] = {k: ratio(hv.get(k), ref.get(k)) for k in hv}
        out["collectives"][str(np)] = {"horovod_mpi_over_mpi4py": cells,
                                       "patched_ms": {k: v * 1e3 for k, v in
                                                      seconds_of(coll, np, "horovod-mpi", "patched").items()}}
    for np in sorted({r["np"] for r in training}):
        ddp = train_median(training, np, "loop", "ddp", "-")
        row = {"ddp_loop": ddp}
        for loop in LOOPS:
            row[f"loop_{loop}"] = train_median(training, np, "loop", "horovod", loop)
            row[f"trainer_{loop}"] = train_median(training, np, "trainer", "horovod", loop)
            row[f"loop_{loop}_over_ddp"] = ratio(row[f"loop_{loop}"], ddp)
            row[f"trainer_{loop}_over_ddp"] = ratio(row[f"trainer_{loop}"], ddp)
        row["trainer_patched_over_upstream"] = ratio(row["trainer_patched"], row["trainer_upstream"])
        row["loop_patched_over_upstream"] = ratio(row["loop_patched"], row["loop_upstream"])
        out["training"][str(np)] = row
    return out
