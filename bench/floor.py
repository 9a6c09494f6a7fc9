"""Part ``floor``: can Horovod's ~1.1 ms small-message floor on one host come down without
hurting training?

Every Horovod collective waits for the background thread's next cycle (``HOROVOD_CYCLE_TIME``,
1 ms by default: the thread sleeps out the rest of the cycle, ``horovod/common/operations.cc:
RunLoopOnce``), then negotiates (a bit-vector allreduce when the response cache knows the tensor),
then runs the MPI call.  This part measures the allreduce of small messages under ``horovodrun
-np 2`` on this host with one setting changed at a time (cycle time, response cache, fusion
threshold, Horovod's autotuner), against mpi4py's ``Allreduce`` as the reference, then trains the
bench loop (``bench/torch_loop.py``, synthetic MNIST batches) with the default and with the
settings that cut the floor, alternating runs, because a shorter cycle wakes the background
thread more often on cores the training needs.  Nothing is changed in the trainers: the verdict
says which setting, if any, the measurements support.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from bench import util

# As the trainers run when a host's ranks fill its cores (ringtrain/runtime.py:
# configure_mpi_progress; the bench loop sets it itself): without it, a waiting rank busy-polls
# on the core its peer needs, which on a loaded machine puts tens of ms on every small allreduce.
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}
TRAIN_BATCH = 64  # per rank, bench/loopcommon.py's default: what the floor part's training used
# A setting that takes d ms off one allreduce can save the loop about d ms per step (one fused
# allreduce per step).  A gain per step far above that is not the floor (run of 2026-11-23 18:00:
# HOROVOD_CYCLE_TIME=0.3 saved 133 ms per step, 48x its 2.8 ms cut, at load 16.5 while 0.1 saved
# nothing): the verdict then says so and adopts nothing.
EXPLAINED = 10
VARIANTS = [
    ("default (cycle 1 ms, cache on, fusion 128 MiB)", {}),
    ("HOROVOD_CYCLE_TIME=0.1", {"HOROVOD_CYCLE_TIME": "0.1"}),
    ("HOROVOD_CYCLE_TIME=0.3", {"HOROVOD_CYCLE_TIME": "0.3"}),
    ("HOROVOD_CACHE_CAPACITY=0", {"HOROVOD_CACHE_CAPACITY": "0"}),
    ("HOROVOD_FUSION_THRESHOLD=0", {"HOROVOD_FUSION_THRESHOLD": "0"}),
    ("HOROVOD_AUTOTUNE=1", {"HOROVOD_AUTOTUNE": "1"}),
]


@dataclass
class FloorConfig:
    quick: bool = False
    np: int = 2
    sizes: list[int] = field(default_factory=lambda: [4096, 65536, 1 << 20])
    variants: int = len(VARIANTS)
    warmup: int = 5
    reps: int = 40
    budget_s: float = 1.5
    candidates: int = 2       # settings (best floor first) that get a training check
    min_cut: float = 0.8      # ... if they cut the smallest message's time below this x default
    rounds: int = 2           # alternating training rounds
    train_warmup: int = 8
    train_steps: int = 40
    timeout_s: float = 300

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def full() -> FloorConfig:
    return FloorConfig()


def quick() -> FloorConfig:
    return FloorConfig(quick=True, sizes=[4096, 1 << 20], variants=2, reps=15, budget_s=0.7,
                       candidates=1, rounds=1, train_warmup=3, train_steps=15)


def _collective(cfg: FloorConfig, out: Path, label: str, impl: str, env: dict[str, str]) -> dict:
    work = out / "tmp" / "floor" / label.split(" ")[0].replace("=", "-")
    work.mkdir(parents=True, exist_ok=True)
    res_path = work / f"{impl}.json"
    res_path.unlink(missing_ok=True)
    inner = [util.PY, "-m", "bench.coll_worker", "--impl", impl, "--sizes", ",".join(map(str, cfg.sizes)),
             "--warmup", str(cfg.warmup), "--reps", str(cfg.reps), "--budget", str(cfg.budget_s),
             "--out", str(res_path)]
    cmd = util.horovodrun(cfg.np, inner) if impl == "hvd" else util.mpirun(cfg.np, inner)
    util.say(f"floor {label} ({impl}) ...")
    res = util.run(cmd, env=util.base_env(**YIELD, **env), timeout=cfg.timeout_s, log=work / f"{impl}.log")
    rec = {"label": label, "env": env, "ok": res.ok and res_path.exists()}
    if rec["ok"]:
        rows = util.read_json(res_path)["rows"]
        rec["seconds"] = {str(r["bytes"]): r["seconds"] for r in rows}
        util.say(f"floor {label}: " + ", ".join(f"{k} B {v * 1e3:.3f} ms" for k, v in rec["seconds"].items()))
    else:
        rec["error"] = util.tail(res.output, 20)
    return rec


def _train(cfg: FloorConfig, out: Path, label: str, env: dict[str, str], round_: int) -> dict:
    work = out / "tmp" / "floor" / f"train-{round_}-{label.split(' ')[0].replace('=', '-')}"
    work.mkdir(parents=True, exist_ok=True)
    res_path = work / "loop.json"
    res_path.unlink(missing_ok=True)
    inner = [util.PY, "-m", "bench.torch_loop", "--wrapper", "horovod", "--data", "synthetic",
             "--warmup-steps", str(cfg.train_warmup), "--steps", str(cfg.train_steps),
             "--batch-size", str(TRAIN_BATCH), "--out", str(res_path)]
    res = util.run(util.horovodrun(cfg.np, inner), env=util.base_env(**env), timeout=cfg.timeout_s,
                   log=work / "output.log")
    ips = util.read_json(res_path)["images_per_second"] if res.ok and res_path.exists() else None
    util.say(f"floor training {label} round {round_}: {ips and round(ips)} img/s")
    return {"label": label, "env": env, "round": round_, "images_per_second": ips}


def candidates(variants: list[dict], size: int, count: int, min_cut: float) -> list[dict]:
    """The settings worth a training check: those that cut the smallest message's time below
    ``min_cut`` x the default's, best first."""
    base = variants[0]
    if not base.get("ok"):
        return []
    ref = base["seconds"][str(size)]
    cut = [v for v in variants[1:] if v.get("ok") and v["seconds"][str(size)] < min_cut * ref]
    return sorted(cut, key=lambda v: v["seconds"][str(size)])[:count]


def verdict(variants: list[dict], training: list[dict], size: int, step_images: int | None = None) -> str:
    """Adopt a setting only if every training run with it beat every default run by no more than
    the floor it cuts can explain (``step_images``: images per step over all ranks, to turn
    images/s into time per step); reject it if every run lost; otherwise its effect on training is
    within the noise (not adopted either)."""
    if not variants or not variants[0].get("ok"):
        return "The default could not be measured; no verdict."
    base = variants[0]
    runs: dict[str, list[float]] = {}
    for r in training:
        if r.get("images_per_second"):
            runs.setdefault(r["label"], []).append(r["images_per_second"])
    default = runs.get(base["label"], [])
    parts = []
    for v in variants[1:]:
        if v["label"] not in runs:
            continue
        mine = runs[v["label"]]
        cut = base["seconds"][str(size)] - v["seconds"][str(size)]
        floor = f"{size} B: {base['seconds'][str(size)] * 1e3:.2f} -> {v['seconds'][str(size)] * 1e3:.2f} ms"
        against = f"median {median(mine):.0f} against {median(default):.0f} images/s" if default else ""
        if not default:
            parts.append(f"`{v['label']}` ({floor}): no default training run to compare with.")
        elif min(mine) > max(default):
            gain = step_images / median(default) - step_images / median(mine) if step_images else None
            if gain is not None and cut > 0 and gain > EXPLAINED * cut:
                parts.append(f"`{v['label']}` ({floor}) trained faster in every run ({against}), but by "
                             f"{gain * 1e3:.0f} ms per step, {gain / cut:.0f}x the {cut * 1e3:.2f} ms it "
                             "takes off one allreduce: more than the floor can explain, so not adopted "
                             "(rerun on a quiet machine).")
            else:
                parts.append(f"`{v['label']}` ({floor}) trained faster in every run ({against}): worth "
                             "setting in the trainers.")
        elif max(mine) < min(default):
            parts.append(f"`{v['label']}` ({floor}) trained slower in every run ({against}): not adopted.")
        else:
            parts.append(f"`{v['label']}` ({floor}): training within the run-to-run spread ({against}): "
                         "not adopted, training pays the floor once per step.")
    return " ".join(parts) if parts else "No setting cut the floor enough to be worth a training check."


def run_part(cfg: FloorConfig, out: Path) -> dict:
    variants = [_collective(cfg, out, label, "hvd", env) for label, env in VARIANTS[:cfg.variants]]
    ref = _collective(cfg, out, "mpi4py", "mpi4py", {})
    smallest = min(cfg.sizes)
    picked = candidates(variants, smallest, cfg.candidates, cfg.min_cut)
    training = []
    if picked:
        for round_ in range(cfg.rounds):
            for v in [variants[0], *picked]:
                training.append(_train(cfg, out, v["label"], v["env"], round_))
    return {"config": cfg.to_dict(), "np": cfg.np, "sizes": cfg.sizes, "variants": variants,
            "mpi4py": ref.get("seconds", {}), "training": training,
            "verdict": verdict(variants, training, smallest, TRAIN_BATCH * cfg.np)}
