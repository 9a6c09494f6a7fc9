"""BENCHMARKS.md's section 7: Horovod's small-message floor with the patch's background loop and
with Horovod 0.28.1's (``floor.json``, :mod:`bench.parts.floor`).  Renders only."""

from __future__ import annotations

from pathlib import Path

from bench.common.tables import num, size, table, x
from bench.parts import floor

ANALYSIS = Path(__file__).parent.parent / "floor_analysis.md"  # the hand-written reading of section 7
LOOP_NAMES = {"upstream": "0.28.1 loop", "patched": "patched loop"}


def ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1e3:.3g}"


def loads(fl: dict) -> str:
    """The range of the 1-minute load average over the part's cells."""
    vals = [c["load_average"][0] for key in ("collectives", "fusion", "wait", "training")
            for c in fl.get(key, []) if c.get("load_average")]
    if not vals:
        return "n/a"
    return f"{min(vals):.2f}-{max(vals):.2f}"


def mpi_over_mpi4py(coll: list[dict], np: int, loop: str, nbytes: int) -> float | None:
    """7.1's *0.28.1 MPI / mpi4py* and *patched MPI / mpi4py*: Horovod's allreduce time (MPI
    controller, ``loop``) over mpi4py's for one message size at -np ``np``."""
    return floor.ratio(floor.seconds_of(coll, np, "horovod-mpi", loop).get(str(nbytes)),
                       floor.seconds_of(coll, np, "mpi4py", "-").get(str(nbytes)))


def collectives(fl: dict, comparing: bool) -> list[str]:
    coll = fl.get("collectives", [])
    lines = []
    for np in sorted({r["np"] for r in coll}):
        impls = [(impl, loop) for impl in ("horovod-mpi", "horovod-gloo") for loop in floor.LOOPS
                 if any(r["np"] == np and r["impl"] == impl and r["loop"] == loop for r in coll)]
        ref = floor.seconds_of(coll, np, "mpi4py", "-")
        rows = []
        for k in fl["config"]["sizes"]:
            cells = [size(k)]
            for impl, loop in impls:
                cells.append(ms(floor.seconds_of(coll, np, impl, loop).get(str(k))))
            cells.append(ms(ref.get(str(k))))
            up = floor.seconds_of(coll, np, "horovod-mpi", "upstream").get(str(k))
            pa = floor.seconds_of(coll, np, "horovod-mpi", "patched").get(str(k))
            cells += [x(mpi_over_mpi4py(coll, np, "upstream", k)) if comparing else "-",
                      x(mpi_over_mpi4py(coll, np, "patched", k)) if comparing else "-",
                      x(floor.ratio(up, pa)) if comparing else "-"]
            rows.append(cells)
        failed = [r for r in coll if r["np"] == np and not r.get("ok")]
        head = ["size", *[f"{impl.split('-')[1].upper() if impl != 'mpi4py' else impl}, "
                          f"{LOOP_NAMES[loop]}" for impl, loop in impls],
                "mpi4py", "0.28.1 MPI / mpi4py", "patched MPI / mpi4py", "0.28.1 / patched (MPI)"]
        lines += [f"#### -np {np}: milliseconds per allreduce", "", table(head, rows), ""]
        lines += [f"Failed: `{r['impl']}` {r['loop']} ({(r.get('error') or '').splitlines()[-1:]})"
                  for r in failed]
    return lines


def fusion(fl: dict) -> list[str]:
    rows = []
    for rec in fl.get("fusion", []):
        if not rec.get("ok"):
            rows.append([str(rec["np"]), LOOP_NAMES[rec["loop"]], "failed", "", "", "", "", "", ""])
            continue
        r0 = rec["per_rank"][0]
        rows.append([str(rec["np"]), LOOP_NAMES[rec["loop"]], f"{r0['allreduce_calls_per_step']:.2f}",
                     num(r0["tensors_per_call"], "{:.1f}"), num((r0["bytes_per_call"] or 0) / 1024, "{:.0f}"),
                     f"{r0['rounds_per_step']:.1f}", f"{r0['rounds_with_work_per_step']:.1f}",
                     num(r0.get("caller_rounds_per_step"), "{:.1f}"), ms(r0["step_seconds"])])
    if not rows:
        return []
    recs = [r for r in fl["fusion"] if r.get("ok")]
    grads = f"{recs[0]['gradients']} gradients, {recs[0]['gradient_bytes'] / 1024:.0f} KiB" if recs else ""
    cfg = fl["config"]
    return ["### 7.2 Tensor fusion with 20 small gradients", "",
            f"`bench/workers/fusion_worker.py`: {cfg['fusion_layers']} Linear layers of "
            f"{cfg['fusion_width']} "
            f"units ({grads} per step), `hvd.DistributedOptimizer`, one fixed batch, "
            f"{cfg['fusion_steps']} timed steps; rank 0's counts per step from Horovod's loop counters "
            "(`horovod_loop_counters`, one allreduce call = one MPI/Gloo operation on the fused "
            "buffer). *Rounds* are turns of the background loop, *with work* those that performed an "
            "operation, *by the caller* those that the thread waiting in `synchronize` ran itself "
            "(the patched loop; the others ran on Horovod's background thread).", "",
            table(["-np", "loop", "allreduce calls / step", "tensors / call", "KiB / call",
                   "rounds / step", "rounds with work / step", "rounds by the caller / step",
                   "ms / step"], rows), ""]


def waits(fl: dict) -> list[str]:
    rows = []
    for rec in fl.get("wait", []):
        if not rec.get("ok"):
            rows.append([f"`{rec['op']}`", LOOP_NAMES[rec["loop"]], "failed", "", ""])
            continue
        rows.append([f"`{rec['op']}`", LOOP_NAMES[rec["loop"]], ms(rec["wall_seconds"]),
                     ms(rec["cpu_seconds"]), f"{rec['cores_busy']:.2f}"])
    if not rows:
        return []
    late = fl["config"]["wait_late_ms"]
    return ["### 7.3 What a waiting rank costs", "",
            f"`bench/workers/wait_worker.py` at -np 2: rank 1 calls the collective {late:g} ms after rank 0; "
            "rank 0's wall and CPU time (its whole process) over the call, median of "
            f"{fl['config']['wait_reps']} repetitions. *Cores held* = CPU / wall.", "",
            table(["op", "loop", "wall ms", "CPU ms", "cores held"], rows), ""]


def training_summary(fl: dict) -> list[tuple[str, dict]]:
    """7.4's rows: (-np, the medians and ratios the part summarised), by -np."""
    summ = fl.get("summary", {}).get("training", {})
    return sorted(summ.items(), key=lambda kv: int(kv[0]))


def training(fl: dict, comparing: bool) -> list[str]:
    summ = training_summary(fl)
    if not summ:
        return []
    rows = []
    for np, row in summ:
        def r(v):
            return x(v) if comparing else "-"
        rows.append([np, num(row["trainer_upstream"]), num(row["trainer_patched"]),
                     r(row["trainer_patched_over_upstream"]), num(row["loop_upstream"]),
                     num(row["loop_patched"]), num(row["ddp_loop"]), r(row["loop_upstream_over_ddp"]),
                     r(row["loop_patched_over_ddp"]), r(row["trainer_patched_over_ddp"])])
    runs = fl.get("training", [])
    per_run = {}
    for rec in runs:
        key = (rec["np"], rec["kind"], rec["wrapper"], rec["loop"])
        per_run.setdefault(key, []).append(num(rec.get("images_per_second")))
    detail = [[str(np), kind, "DDP" if wrapper == "ddp" else LOOP_NAMES[loop], ", ".join(v)]
              for (np, kind, wrapper, loop), v in per_run.items()]
    cfg = fl["config"]
    return ["### 7.4 Training", "",
            f"Images/s summed over ranks, median of {cfg['train_rounds']} round(s); each round runs, per "
            "-np, the bench loop with both Horovod loops, the DDP loop and the real trainer with both "
            "loops, the patched loop first in odd rounds. *Trainer*: `launch.torch_mnist` under "
            "`horovodrun` (its 2nd epoch of "
            f"{cfg['trainer_steps']} steps, MNIST); *loop*: `bench/workers/torch_loop.py` on one synthetic "
            f"batch ({cfg['train_steps']} timed steps), Horovod under `horovodrun`, DDP under "
            "`torchrun` (gloo), as in section 3.", "",
            table(["-np", "trainer, 0.28.1 loop", "trainer, patched", "trainer patched / 0.28.1",
                   "loop, 0.28.1", "loop, patched", "DDP loop", "loop 0.28.1 / DDP",
                   "loop patched / DDP", "trainer patched / DDP loop"], rows), "",
            "Every run, in run order:", "",
            table(["-np", "kind", "side", "images/s"], detail), ""]


def section(res: dict) -> list[str]:
    fl = res.get("floor")
    if not fl or "collectives" not in fl:
        return []
    comparing = not (res["meta"].get("quick") or fl.get("quick"))
    m = fl.get("machine") or {}
    lines = ["## 7. Horovod's small-message floor: the patch's loop against 0.28.1's", "",
             "`bench/parts/floor.py` (`python -m bench --only floor`), one run, the same Horovod build both "
             "ways: *patched loop* is the project's patch (the background loop wakes when a tensor is "
             "enqueued, waits sleep), *0.28.1 loop* the same build with `HOROVOD_UPSTREAM_LOOP=1` "
             f"(Horovod 0.28.1's fixed 1 ms cycle and spinning waits). One host ({m.get('cpu_model', '?')}, "
             f"{m.get('cores', '?')} cores). Load average (1 min) at the part's start "
             f"{', '.join(f'{v:.2f}' for v in fl.get('load_average_start', []))}, over its cells "
             f"{loads(fl)}, at its end {', '.join(f'{v:.2f}' for v in fl.get('load_average_end', []))}: "
             "the cores are shared with other jobs.", "",
             "### 7.1 Allreduce", "",
             "`bench/workers/coll_worker.py --impl hvd` (`horovod.torch.allreduce_`, float32 sum in place) "
             "under "
             "`horovodrun` (MPI controller) and `horovodrun --gloo`, against mpi4py's `Allreduce` under "
             "`mpirun`; median over repetitions of the slowest rank's time; MPI ranks yield while "
             "waiting (`OMPI_MCA_mpi_yield_when_idle=1`).", ""]
    lines += collectives(fl, comparing) + fusion(fl) + waits(fl) + training(fl, comparing)
    if ANALYSIS.exists():
        lines += [ANALYSIS.read_text().strip(), ""]
    return lines
