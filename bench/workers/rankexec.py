"""``python -m bench.workers.rankexec MODULE ARGS...``: run ``python -m MODULE ARGS`` as one rank, and on
exit write that rank's peak resident memory (``ru_maxrss``) to ``$BENCH_RSS_DIR/rank<r>.json``.

Why a wrapper: the trainers, DDP and MultiWorkerMirrored jobs have no common way to report memory,
and gathering it through each side's own collectives would make the sides differ.  The wrapper is
identical for every side.  With ``$BENCH_CHILDREN=1`` it also samples the rank's descendants
(:mod:`bench.workers.procs`: the DataLoader workers' peak memory and CPU seconds, which ``ru_maxrss``
does not see) and the rank's own resident set by kind (anonymous, file-backed, shared), and adds
them to that file.  With ``$BENCH_PYSPY_OUT`` set, rank 0 re-executes itself under
``py-spy record`` (raw collapsed stacks) so a profile of exactly the measured run comes out.
"""

from __future__ import annotations

import atexit
import os
import resource
import runpy
import shutil
import sys
from pathlib import Path

from bench.common.util import launcher_rank, write_json
from bench.workers.procs import PeakParts, Watcher


def _write_rss(watcher: Watcher | None = None, parts: PeakParts | None = None) -> None:
    folder = os.environ.get("BENCH_RSS_DIR")
    if not folder:
        return
    rank = launcher_rank()
    name = f"rank{rank}" if rank is not None else f"pid{os.getpid()}"
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    record = {"rank": rank, "peak_rss_mib": peak_kib / 1024}
    if parts is not None:
        record["peak_rss_parts_mib"] = parts.stop()
    if watcher is not None:
        record["descendants"] = watcher.stop()
    write_json(Path(folder, f"{name}.json"), record, indent=None)


def _maybe_profile(argv: list[str]) -> None:
    """Replace this process with ``py-spy record -- python -m bench.workers.rankexec ...`` on rank 0."""
    out = os.environ.get("BENCH_PYSPY_OUT")
    if not out or os.environ.get("BENCH_PYSPY_ACTIVE") or launcher_rank() not in (0, None):
        return
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if pyspy is None:
        print("[bench] py-spy not installed (pip install -e .[bench]); not profiling", file=sys.stderr)
        return
    os.environ["BENCH_PYSPY_ACTIVE"] = "1"
    cmd = [pyspy, "record", "--format", "raw", "--rate", os.environ.get("BENCH_PYSPY_RATE", "100"),
           "-o", out]
    # --nonblocking (no pausing of the process per sample) keeps the profile from slowing the
    # run, but py-spy cannot unwind native stacks without pausing
    cmd.append("--native" if os.environ.get("BENCH_PYSPY_NATIVE") == "1" else "--nonblocking")
    cmd += ["--", sys.executable, "-m", "bench.workers.rankexec", *argv]
    os.execv(pyspy, cmd)


def main() -> None:
    argv = sys.argv[1:]
    if not argv:
        sys.exit("usage: python -m bench.workers.rankexec MODULE [ARGS...]")
    _maybe_profile(argv)
    watcher = parts = None
    if os.environ.get("BENCH_CHILDREN") == "1":
        watcher = Watcher()
        watcher.start()
        parts = PeakParts(os.getpid())
        parts.start()
    atexit.register(_write_rss, watcher, parts)
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
