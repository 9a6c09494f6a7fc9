"""``python -m bench.workers.memlimit --budget-mb N --report FILE -- ARGS``: one rank of a PyTorch trainer
(``launch.torch_mnist ARGS``) whose memory beyond the framework's own footprint is capped at N MB.

The cap is ``RLIMIT_DATA`` (private writable memory: the heap and anonymous mappings, where
tensors live), set in this process after PyTorch, Horovod and MPI are imported and initialised
(their own ~1 GB of mostly unresident address space is measured, not guessed: it differs between
machines and builds) and before the trainer builds anything.  Past the cap an allocation fails:
PyTorch raises "not enough memory", and the rank ends.  What stays under the cap trains.  At the
end each rank writes its peak resident memory (``VmHWM``) and the cap to ``FILE.<rank>.json``.

Used by the pipeline bench's memory part (:mod:`bench.parts.model_parallel`): the same model, the same cap,
S = 1 (every rank holds the whole model, its gradients and momentum) against S = 2.
"""

from __future__ import annotations

import argparse
import atexit
import os
import re
import resource
import runpy
import sys
from pathlib import Path

from bench.common import util


def status(key: str) -> int:
    """A field of /proc/self/status, in bytes."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) * 1024


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.workers.memlimit")
    parser.add_argument("--budget-mb", type=float, required=True)
    parser.add_argument("--report", required=True, help="writes FILE.<rank>.json at exit")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    a = parser.parse_args(argv)
    trainer_args = a.args[1:] if a.args[:1] == ["--"] else a.args
    import horovod.torch  # noqa: F401 - the framework's footprint, before the cap
    import torch  # noqa: F401
    from mpi4py import MPI  # initialises MPI (what the pipeline trainer does first)

    rank = MPI.COMM_WORLD.Get_rank()
    base = status("VmData")
    limit = base + int(a.budget_mb * 2**20)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))

    def report() -> None:
        util.write_json(f"{a.report}.{rank}.json", {
            "rank": rank, "base_data_bytes": base, "limit_data_bytes": limit,
            "budget_bytes": limit - base, "peak_rss_bytes": status("VmHWM"), "pid": os.getpid()}, indent=None)

    atexit.register(report)
    sys.argv = ["launch.torch_mnist", *trainer_args]
    runpy.run_module("launch.torch_mnist", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
