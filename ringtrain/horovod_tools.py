"""Horovod's own performance tools, one flag each: ``--timeline-out FILE`` and ``--autotune [LOG]``.

* ``--timeline-out FILE``: Horovod's timeline (a Chrome trace: every collective of every tensor,
  its negotiation and its phases), written by rank 0.  (Not ``--timeline``: horovodrun 0.28.1
  reads every word of the command that abbreviates one of its own flags, and ``--timeline``
  abbreviates two, ``--timeline-filename`` and ``--timeline-mark-cycles``: it stopped with
  "ambiguous option".)  ``HOROVOD_TIMELINE=DYNAMIC`` goes into every
  rank's environment before ``hvd.init()``, and the recording starts once rank 0 has checked the
  output folders (:func:`ringtrain.training.startup.check_output_folders`): Horovod opens the
  file itself and would write a line of its own into the run's output for a folder that is not
  there.  Rank 0 makes the file (a fresh one, renamed over the path: a symlink found there is
  replaced, never followed) and hands Horovod that open file (``/proc/self/fd/N``), not the name.
* ``--autotune [LOG]``: ``HOROVOD_AUTOTUNE=1``: Horovod's autotuner scores the allreduce
  throughput of each setting it tries and keeps the best.  Its log (one CSV row per scored sample)
  goes into an unnamed file of rank 0's, copied to ``LOG`` (atomically) at every epoch's end and at
  the end, when rank 0 also prints what was chosen and the summary records it.

What the autotuner tunes under ringtrain's patched loop (``.ci/horovod-patches``: the loop wakes
when a tensor is enqueued): the fusion threshold (0-64 MiB) and the response cache (off, then on),
as in 0.28.1; the cycle time (1-100 ms) no longer paces the rounds, since a round starts when a
tensor arrives, only the retries of rounds that could match nothing, the idle rounds and the
longest burst of gradients one round gathers; hierarchical and torus allreduce are fixed off on
CPU builds.  docs/profiling.md has how to use and read both.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import os
import tempfile
from pathlib import Path
from typing import Any

from ringtrain.errors import UserError
from ringtrain.output.files import atomic_write_bytes

DEFAULT_AUTOTUNE_LOG = "autotune.csv"  # --autotune without a LOG: in the current folder
# The columns of Horovod 0.28.1's autotune log (parameter_manager.cc), in order.
AUTOTUNE_COLUMNS = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce",
                    "cache_enabled", "cycle_time_ms", "tensor_fusion_threshold", "score")
BOOLEAN_COLUMNS = AUTOTUNE_COLUMNS[:4]


def check_flags(args: argparse.Namespace) -> None:
    """``--timeline-out`` and ``--autotune``, before any framework is imported: a file path each (its
    folder is rank 0's to check once the job runs)."""
    for flag, value in (("--timeline-out", args.timeline_out), ("--autotune", args.autotune)):
        if value is None:
            continue
        if args.elastic:
            raise UserError(f"{flag} is not supported with --elastic yet (Horovod starts again in "
                            f"every world); drop one of the two flags")
        if not value.strip() or value.endswith(os.sep) or os.path.isdir(value):
            raise UserError(f"{flag} takes a file to write, got {value!r}"
                            + (" (a folder)" if value.strip() and os.path.isdir(value) else "")
                            + f"; give a file name, e.g. {flag} "
                            + ("timeline.json" if flag == "--timeline-out" else DEFAULT_AUTOTUNE_LOG))
    if args.timeline_out is not None and args.autotune is not None and \
            os.path.abspath(args.timeline_out) == os.path.abspath(args.autotune):
        raise UserError(f"--timeline-out and --autotune name the same file {args.timeline_out}; give each "
                        f"its own")


def output_files(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(flag, path) of every file these tools write on rank 0, for the output folders' check."""
    return [(flag, path) for flag, path in (("--timeline-out", args.timeline_out),
                                            ("--autotune", args.autotune)) if path is not None]


class HorovodTools:
    """One rank's part in ``--timeline-out`` and ``--autotune``: :meth:`before_init` (the environment,
    before ``hvd.init()``), :meth:`start` (the timeline, after the output folders' check),
    :meth:`keep_log` (each epoch's end) and :meth:`finish` (the end)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.timeline: str | None = args.timeline_out
        self.autotune_log: str | None = args.autotune
        self._tune_file: Any = None  # rank 0's unnamed file that Horovod writes the log into
        self._timeline_fd: int | None = None
        self._hvd: Any = None  # the framework's Horovod module, once the timeline started

    @classmethod
    def before_init(cls, args: argparse.Namespace) -> HorovodTools:
        """The tools of ``args``, their environment set: call before ``hvd.init()``."""
        tools = cls(args)
        if tools.timeline is not None:
            # Every rank: Horovod only enables the timeline's bookkeeping where this is set at
            # init; DYNAMIC opens no file (start() names it).
            os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
        if tools.autotune_log is not None:
            os.environ["HOROVOD_AUTOTUNE"] = "1"
            if one_host():
                # Hierarchical and torus allreduce and allgather change nothing on one host, but
                # the autotuner would try each both ways (doubling its search for each one it
                # may tune: hierarchical allgather on CPU builds); fixed off, as Horovod fixes
                # them when told on one host.  A user's setting wins.
                for name in ("HOROVOD_HIERARCHICAL_ALLGATHER", "HOROVOD_HIERARCHICAL_ALLREDUCE",
                             "HOROVOD_TORUS_ALLREDUCE"):
                    os.environ.setdefault(name, "0")
            # Horovod opens this on rank 0 at init (truncating, following links): an unnamed file
            # of this process's, reached through its descriptor.  Other ranks never open it.
            tools._tune_file = tempfile.TemporaryFile(prefix="ringtrain-autotune-")
            os.environ["HOROVOD_AUTOTUNE_LOG"] = _fd_path(tools._tune_file.fileno())
        return tools

    def start(self, rank: int, hvd) -> None:
        """Start the timeline on every rank (Horovod's coordinator, rank 0, writes it); call after
        rank 0 has checked the output folders, before the first collective it should show."""
        if self.timeline is None:
            return
        self._hvd = hvd
        target = self.timeline
        if rank == 0:
            self._timeline_fd = fresh_file(self.timeline)
            target = _fd_path(self._timeline_fd)
        hvd.start_timeline(target)

    def keep_log(self, rank: int) -> dict[str, Any] | None:
        """Rank 0: the autotune log so far copied to ``LOG``; what it says (:func:`read_log`)."""
        if rank != 0 or self._tune_file is None:
            return None
        self._tune_file.seek(0)
        text = self._tune_file.read()
        atomic_write_bytes(self.autotune_log, text)
        return read_log(text.decode(errors="replace"))

    def finish(self, rank: int, say) -> dict[str, Any] | None:
        """The timeline stopped (rank 0's file complete, its JSON closed); rank 0: the autotune
        log kept, the chosen parameters said in one line (``say``) and returned for the summary
        (None elsewhere, and without ``--autotune``)."""
        if self._hvd is not None:
            self._hvd.stop_timeline()
            self._hvd = None
        report = self.keep_log(rank)
        if report is None:
            return None
        report["log"] = os.path.abspath(self.autotune_log)
        say(autotune_line(report))
        return report


def one_host(env: dict[str, str] | None = None) -> bool:
    """Whether the launcher says every rank of the job runs on this host (before ``hvd.init()``:
    mpirun and horovodrun's ``OMPI_COMM_WORLD_SIZE`` and ``_LOCAL_SIZE``, Gloo's ``HOROVOD_SIZE``
    and ``HOROVOD_LOCAL_SIZE``); False when it does not say."""
    env = os.environ if env is None else env
    for size, local in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                        ("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE")):
        if env.get(size, "").isdigit() and env.get(local, "").isdigit():
            return env[size] == env[local]
    return False


def _fd_path(fd: int) -> str:
    path = f"/proc/self/fd/{fd}"
    if not os.path.exists(path):  # not Linux
        raise UserError("--timeline-out and --autotune need Linux's /proc/self/fd here; run without them")
    return path


def fresh_file(path: str) -> int:
    """An empty file of this process's at ``path``, open for writing: made under a new random
    name beside it and renamed over ``path`` (whatever was there, a symlink included, is replaced,
    not followed)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.replace(tmp, target)
    except OSError as err:
        os.close(fd)
        os.unlink(tmp)
        raise UserError(f"cannot write {path} ({err.strerror}); choose another path") from None
    return fd


def read_log(text: str) -> dict[str, Any]:
    """What Horovod's autotune log says: its scored samples, whether tuning finished, and the
    parameters it settled on (finished) or the best so far and the last tried (still tuning).

    Horovod writes one row per scored sample, then, when the search is over, one more row: the
    best sample's parameters and score again.  So the search finished exactly when the last row
    repeats the best earlier row (a fresh sample of equal score to the microsecond is not seen)."""
    rows = []
    for line in csv.reader(io.StringIO(text)):
        fields = [f.strip() for f in line]
        if len(fields) != len(AUTOTUNE_COLUMNS) or fields[0] == AUTOTUNE_COLUMNS[0]:
            continue
        try:
            values = [float(f) for f in fields]
        except ValueError:
            continue
        if not all(math.isfinite(v) for v in values):
            continue
        rows.append({name: (bool(v) if name in BOOLEAN_COLUMNS else v)
                     for name, v in zip(AUTOTUNE_COLUMNS, values, strict=True)})
    finished = False
    if len(rows) >= 2:
        best = max(rows[:-1], key=lambda r: r["score"])
        finished = rows[-1] == best
    samples = rows[:-1] if finished else rows
    best = max(samples, key=lambda r: r["score"]) if samples else None
    return {"samples": len(samples), "finished": finished,
            "chosen": rows[-1] if finished else None, "best_so_far": None if finished else best,
            "last_tried": None if finished or not samples else samples[-1]}


def describe(params: dict[str, Any]) -> str:
    on = {True: "on", False: "off"}
    return (f"fusion threshold {params['tensor_fusion_threshold']:.3g} MiB, cycle time "
            f"{params['cycle_time_ms']:.3g} ms, response cache {on[params['cache_enabled']]}, "
            f"hierarchical allreduce {on[params['hierarchical_allreduce']]}, hierarchical "
            f"allgather {on[params['hierarchical_allgather']]}, torus allreduce "
            f"{on[params['torus_allreduce']]} (score {params['score']:.4g} bytes/us)")


def autotune_line(report: dict[str, Any]) -> str:
    """The one line rank 0 prints at the end."""
    log = report.get("log", "")
    if report["finished"]:
        return (f"autotune: finished after {report['samples']} samples; chosen: "
                f"{describe(report['chosen'])}; log {log}")
    if not report["samples"]:
        return (f"autotune: no sample scored yet (Horovod scores one every 5 x "
                f"HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE (10) allreduces of a tensor, after "
                f"HOROVOD_AUTOTUNE_WARMUP_SAMPLES (3) unscored); Horovod's defaults stayed; log {log}")
    return (f"autotune: still tuning after {report['samples']} samples (a longer run finishes); "
            f"best so far: {describe(report['best_so_far'])}; log {log}")
