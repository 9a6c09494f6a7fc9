"""``python -m bench --only optimizers``: what ``--optimizer``, ``--shard-optimizer`` and
``--precision`` cost, with the real trainers (docs/training.md, "Choosing an optimizer").

* **State and speed of the update** (:func:`update_cells`): an MLP whose weights dominate the
  rank's memory (:func:`bench.parts.model_parallel.mlp` in PyTorch, :func:`mlp_keras` its Keras
  twin; ``mlp`` = width, depth), for each framework, SGD with momentum and AdamW, sharded
  (``--shard-optimizer``) or not, at each -np: images/s (the trainer's own figure, its last
  epoch) and every rank's peak resident memory (``ru_maxrss``, :mod:`bench.workers.rankexec`).
  Beside them the formula: W the weights' float32 bytes, the optimizer's state per rank is
  ``slots x W`` unsharded and ``slots x W / R`` sharded (SGD's momentum 1 slot, AdamW's moments
  2), so sharding saves ``slots x W x (1 - 1/R)``; measured: the largest rank's peak unsharded
  minus sharded, in the same run, each the median of ``repeats`` launches (the pair interleaved).
* **bf16 against fp32** (:func:`precision_cells`): the built-in CNN on MNIST, each framework,
  ``--precision fp32`` then ``bf16`` back to back at -np ``precision_np``: images/s, and whether
  this CPU has bfloat16 instructions (where it has none, bf16 is emulated).

Every run is one launch of ``launch.torch_mnist`` or ``launch.tf_mnist`` under ``horovodrun``
with ``--metrics-out``; the machine's load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench.common import util
from bench.parts.model_parallel import mlp_params
from bench.parts.training_runs import TRAINER_MODULES
from ringtrain import optimizer_spec

MODELS = {"torch": "bench.parts.model_parallel:mlp", "tf": "bench.parts.update_cost:mlp_keras"}
ADAMW = ["--optimizer", "adamw", "--base-lr", "0.001", "--weight-decay", "0.01"]
SLOTS = {"sgd": 1, "adamw": 2}  # tensors of state per weight (optimizer_spec.state_slots)


def mlp_keras(input_shape, num_classes):
    """:func:`bench.parts.model_parallel.mlp`'s layers as a Keras ``Sequential``
    (``BENCH_MLP=width,depth``)."""
    import keras

    width, depth = (int(v) for v in os.environ.get("BENCH_MLP", "1024,8").split(","))
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             *(keras.layers.Dense(width, activation="relu")
                               for _ in range(depth + 1)),
                             keras.layers.Dense(num_classes)])


@dataclass
class OptimizersConfig:
    quick: bool = False
    frameworks: list[str] = field(default_factory=lambda: ["torch", "tf"])
    optimizers: list[str] = field(default_factory=lambda: ["sgd", "adamw"])
    nps: list[int] = field(default_factory=lambda: [2, 4])
    # 2048 x 8: 35.2M parameters, 141 MB of float32 weights; AdamW's state 282 MB per rank
    # unsharded, so what sharding saves (141 MB at R = 2) stands well above the noise of a
    # peak resident figure (tens of MB between runs).
    mlp: tuple[int, int] = (2048, 8)
    batch: int = 32  # per rank
    steps: int = 10  # per epoch; two epochs, the second's images/s reported
    # Each pair (unsharded, sharded) launched this many times, interleaved; a cell reports the
    # median run: one launch's peak moves by a good part of W between runs (docs/benchmarks.md).
    repeats: int = 3
    precision_np: int = 2
    precision_batch: int = 64
    precision_steps: int = 30
    timeout_s: float = 900

    def to_dict(self) -> dict:
        return asdict(self)


def full() -> OptimizersConfig:
    return OptimizersConfig()


def quick() -> OptimizersConfig:
    return OptimizersConfig(quick=True, nps=[2], mlp=(1024, 4), steps=4, precision_steps=8,
                            repeats=1)


def smoke() -> OptimizersConfig:
    """Each kind of run once, PyTorch, two steps of a small MLP (sharded or not at -np 2; fp32 and
    bf16 at -np 1)."""
    return OptimizersConfig(quick=True, frameworks=["torch"], optimizers=["adamw"], nps=[2],
                            mlp=(64, 1), batch=8, steps=2, precision_np=1, precision_batch=16,
                            precision_steps=2, timeout_s=240, repeats=1)


def loadavg() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def run_trainer(cfg: OptimizersConfig, out: Path, name: str, framework: str, np_: int,
                args: list[str], env: dict[str, str] | None = None) -> dict:
    """One launch of ``framework``'s trainer at -np ``np_``, every rank wrapped by
    :mod:`bench.workers.rankexec`: its record, with the summary's figures and each rank's peak
    resident memory."""
    work = out / "tmp" / "optimizers" / name
    rss = work / "rss"
    rss.mkdir(parents=True, exist_ok=True)
    for old in rss.glob("*.json"):
        old.unlink()
    metrics = work / "m.json"
    metrics.unlink(missing_ok=True)
    inner = util.rank_exec(TRAINER_MODULES[framework],
                           [*args, "--no-progress", "--metrics-out", str(metrics)])
    util.say(f"optimizers/{name} ...")
    res = util.run(util.horovodrun(np_, inner),
                   env=util.base_env(BENCH_RSS_DIR=str(rss), OMP_NUM_THREADS="1", **(env or {})),
                   timeout=cfg.timeout_s, log=work / "output.log")
    rec: dict = {"name": name, "framework": framework, "np": np_, "args": args,
                 "ok": res.ok and metrics.exists(), "wall_seconds": round(res.seconds, 1)}
    if not rec["ok"]:
        rec["error"] = util.tail(res.output, 12)
        util.say(f"optimizers/{name} FAILED ({res.returncode}); log: {work / 'output.log'}")
        return rec
    summary = util.read_json(metrics)
    ranks = sorted((util.read_json(p) for p in rss.glob("rank*.json")),
                   key=lambda r: r.get("rank") or 0)
    rec.update(images_per_second=summary["epochs"][-1]["images_per_second"],
               test_accuracy=summary["epochs"][-1].get("test_accuracy"),
               peak_rss_mib=[round(r["peak_rss_mib"], 1) for r in ranks])
    util.say(f"optimizers/{name}: {rec['images_per_second']:.0f} img/s, peak RSS "
             f"{[round(v) for v in rec['peak_rss_mib']]} MiB")
    return rec


def median_run(runs: list[dict]) -> dict:
    """The cell of ``runs`` (one launch each, alike): the run whose largest rank's peak is the
    median (the lower middle one of an even count), with every run's largest peak
    (``largest_peaks_mib``, in launch order) and images/s beside it; a failed run fails the cell."""
    failed = [r for r in runs if not r["ok"]]
    if failed:
        return {**failed[0], "runs": len(runs)}
    ordered = sorted(runs, key=lambda r: max(r["peak_rss_mib"]))
    rec = dict(ordered[(len(ordered) - 1) // 2])
    rec.update(runs=len(runs), largest_peaks_mib=[max(r["peak_rss_mib"]) for r in runs],
               images_per_second_runs=[r["images_per_second"] for r in runs])
    return rec


def steps_args(steps: int, batch: int, np_: int) -> list[str]:
    return ["--epochs", "2", "--max-steps", str(steps), "--train-samples",
            str(steps * batch * np_), "--test-samples", "100", "--batch-size", str(batch)]


def update_cells(cfg: OptimizersConfig, out: Path) -> dict:
    """Each framework x optimizer x -np, unsharded then sharded back to back, with the formula's
    state per rank and what sharding saves beside the measured drop of the largest rank's peak."""
    width, depth = cfg.mlp
    weight_bytes = 4 * mlp_params(width, depth)
    cells = []
    for framework in cfg.frameworks:
        for optimizer in cfg.optimizers:
            flags = ADAMW if optimizer == "adamw" else []
            for np_ in cfg.nps:
                runs: dict[bool, list[dict]] = {False: [], True: []}
                for rep in range(cfg.repeats):  # interleaved: a drift of the machine hits both
                    for sharded in (False, True):
                        name = (f"{framework}-{optimizer}-np{np_}"
                                + ("-sharded" if sharded else "") + f"-{rep + 1}")
                        args = [*steps_args(cfg.steps, cfg.batch, np_), "--model",
                                MODELS[framework], *flags,
                                *(["--shard-optimizer"] if sharded else [])]
                        runs[sharded].append(run_trainer(cfg, out, name, framework, np_, args,
                                                         env={"BENCH_MLP": f"{width},{depth}"}))
                pair = {}
                for sharded in (False, True):
                    rec = median_run(runs[sharded])
                    rec.update(optimizer=optimizer, sharded=sharded,
                               state_bytes_formula=SLOTS[optimizer] * weight_bytes
                               / (np_ if sharded else 1))
                    pair[sharded] = rec
                    cells.append(rec)
                plain, shard = pair[False], pair[True]
                if plain["ok"] and shard["ok"]:
                    saved = (max(plain["peak_rss_mib"]) - max(shard["peak_rss_mib"])) * 2**20
                    shard.update(saved_bytes=saved,
                                 saved_bytes_formula=SLOTS[optimizer] * weight_bytes
                                 * (1 - 1 / np_),
                                 saved_vs_weights=saved / weight_bytes)
    return {"width": width, "depth": depth, "params": mlp_params(width, depth),
            "weight_bytes": weight_bytes, "batch": cfg.batch, "steps": cfg.steps, "cells": cells}


def precision_cells(cfg: OptimizersConfig, out: Path) -> dict:
    """The built-in CNN, fp32 then bf16, each framework, at -np ``precision_np``."""
    cells = []
    for framework in cfg.frameworks:
        for precision in optimizer_spec.PRECISIONS:
            args = [*steps_args(cfg.precision_steps, cfg.precision_batch, cfg.precision_np),
                    "--precision", precision]
            rec = run_trainer(cfg, out, f"{framework}-{precision}", framework, cfg.precision_np,
                              args)
            rec["precision"] = precision
            cells.append(rec)
    return {"np": cfg.precision_np, "batch": cfg.precision_batch, "steps": cfg.precision_steps,
            "cpu_bf16_instructions": optimizer_spec.cpu_has_bf16(), "cells": cells}


def run_part(cfg: OptimizersConfig, out: Path) -> dict:
    data: dict = {"config": cfg.to_dict(), "load_before": loadavg()}
    data["update"] = update_cells(cfg, out)
    util.write_json(out / "optimizers.partial.json", data)
    data["precision"] = precision_cells(cfg, out)
    data["load_after"] = loadavg()
    (out / "optimizers.partial.json").unlink(missing_ok=True)
    return data


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b and math.isfinite(a / b) else None


def main(argv: list[str] | None = None) -> int:
    """Run the part alone (``--scale smoke`` is what the bench's smoke test runs)."""
    p = argparse.ArgumentParser(prog="python -m bench.parts.update_cost", allow_abbrev=False)
    p.add_argument("--scale", choices=("full", "quick", "smoke"), default="full")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = {"full": full, "quick": quick, "smoke": smoke}[args.scale]()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = run_part(cfg, out)
    util.write_json(out / "optimizers.json", data)
    from bench.reports.report_optimizers import section

    print("\n".join(section({"optimizers": data})))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
