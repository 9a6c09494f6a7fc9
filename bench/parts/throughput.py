"""Parts 1-3: training throughput and scaling, Horovod's own cost, and the peers.

For each framework and -np, back to back so that drift on a shared machine hits all sides alike:

* ``trainer/horovod/mnist``: the real trainer (``launch.*_mnist`` under ``horovodrun``), images/s
  of its 2nd epoch (the 1st pays for tracing and first-touch);
* ``loop/horovod/mnist``: the bench loop with Horovod, gathering MNIST batches like the trainer;
* ``loop/horovod/synthetic``: the same with one fixed batch: compute + communication only;
* at -np > 1, ``loop/horovod-gloo/synthetic``: the same under ``horovodrun --gloo`` (Horovod's
  Gloo controller instead of MPI: on a small shared machine the controller matters, see
  bench/analysis.md);
* the peer: ``loop/ddp/synthetic`` (``torchrun``, gloo) or ``loop/mwms/synthetic``;

and once per framework at -np 1: ``loop/none/synthetic`` (no Horovod at all, plain ``python``),
and ``loop/none/synthetic`` with 1 thread: one core's throughput, from which the cores' limit
follows.
"""

from __future__ import annotations

from pathlib import Path

from bench.parts.config import Config
from bench.parts.training_runs import Profiling, Run, execute, parse_run

PEER = {"torch": "ddp", "tf": "mwms"}


def plan(cfg: Config, frameworks: list[str]) -> list[Run]:
    if cfg.runs is not None:
        return [run for run in map(parse_run, cfg.runs) if run.framework in frameworks]
    runs: list[Run] = []
    for fw in frameworks:
        runs.append(Run(fw, "loop", "none", "synthetic", 1, threads=1))
        runs.append(Run(fw, "loop", "none", "synthetic", 1))
        for np in cfg.nps:
            runs.append(Run(fw, "trainer", "horovod", "mnist", np))
            if cfg.loop_mnist:
                runs.append(Run(fw, "loop", "horovod", "mnist", np))
            runs.append(Run(fw, "loop", "horovod", "synthetic", np))
            if np > 1 and cfg.gloo_loops:
                runs.append(Run(fw, "loop", "horovod-gloo", "synthetic", np))
                runs.append(Run(fw, "loop", PEER[fw], "synthetic", np))
    return runs


def run_part(cfg: Config, out: Path, frameworks: list[str], prof: Profiling | None = None) -> dict:
    records = [execute(run, cfg, out, prof) for run in plan(cfg, frameworks)]
    return {"runs": records}
