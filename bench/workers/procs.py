"""A process's descendants as Linux's ``/proc`` shows them: their peak memory and CPU seconds.

Why: a rank's ``ru_maxrss`` (:mod:`bench.workers.rankexec`) does not include its DataLoader workers.
PyTorch starts them from a fork server, a child of the rank, so they are the rank's
grandchildren, and ``RUSAGE_CHILDREN`` only counts children that their parent waited for (the
fork server outlives the rank's last wait).  Their own kernel counters do: ``VmHWM`` (a process's
peak resident set, what ``ru_maxrss`` reports for itself) and ``utime + stime``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> list[str] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (field 3 onwards), or None."""
    try:
        text = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process visible now."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of ``pid`` -> its depth (1: a child, 2: a grandchild, ...)."""
    kids, out, todo = children_map(), {}, [(pid, 0)]
    while todo:
        parent, depth = todo.pop()
        for child in kids.get(parent, []):
            out[child] = depth + 1
            todo.append((child, depth + 1))
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of ``pid`` so far (all its threads), or None if it is gone."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_mib(pid: int) -> float | None:
    """``VmHWM`` of ``pid``: its peak resident set so far, in MiB."""
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def memory_shares_mib(pid: int) -> tuple[float, float] | None:
    """(PSS, USS) of ``pid`` now, in MiB, from ``smaps_rollup``: its resident pages with each
    shared page divided among the processes sharing it, and its private pages alone.  A forked
    worker's RSS counts every library page it maps (PyTorch's are hundreds of MiB), which the
    rank and the other workers share; PSS and USS say what it adds."""
    pss = private = 0
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith(("Private_Clean:", "Private_Dirty:")):
                private += int(line.split()[1])
    except OSError:
        return None
    return pss / 1024, private / 1024


def rss_parts_mib(pid: int) -> dict[str, float] | None:
    """``pid``'s resident set now by kind, in MiB (``/proc/<pid>/status``): ``anon`` (its heap
    and stacks: what grows with what it holds), ``file`` (pages of files it maps: libraries, and
    a memory-mapped cache's pages it has touched, which the kernel shares with every process
    mapping them and may drop when clean), ``shmem`` (shared memory)."""
    keys = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    out = {}
    try:
        for line in open(f"/proc/{pid}/status"):
            key = line.split(":", 1)[0] + ":"
            if key in keys:
                out[keys[key]] = int(line.split()[1]) / 1024
    except OSError:
        return None
    return out if len(out) == len(keys) else None


class PeakParts(threading.Thread):
    """The largest :func:`rss_parts_mib` of one process seen every ``interval`` seconds (each
    kind's own peak; ``VmHWM`` is their sum's)."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        super().__init__(daemon=True, name="bench-rss-parts")
        self.pid, self.interval, self.halt = pid, interval, threading.Event()
        self.peak: dict[str, float] = {}

    def sample(self) -> None:
        parts = rss_parts_mib(self.pid)
        for key, value in (parts or {}).items():
            self.peak[key] = max(value, self.peak.get(key, 0.0))

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.interval)

    def stop(self) -> dict[str, float]:
        self.halt.set()
        self.sample()
        return dict(self.peak)


def command(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def role(cmd: str, depth: int) -> str:
    """``forkserver`` (multiprocessing's fork server), ``worker`` (a process it forked: a
    DataLoader worker), or ``other``."""
    if "multiprocessing.forkserver" in cmd:
        return "forkserver" if depth == 1 else "worker"
    return "other"


@dataclass
class Seen:
    pid: int
    role: str
    peak_rss_mib: float  # VmHWM: exact
    cpu_seconds: float
    max_pss_mib: float  # the largest of the samples
    max_uss_mib: float


class Watcher(threading.Thread):
    """Samples the descendants of this process every ``interval`` seconds, keeping each one's
    latest ``VmHWM`` and CPU seconds and its largest PSS and USS (a process that exits keeps its
    last sample: its peak up to then, its CPU up to ``interval`` short)."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True, name="bench-procs")
        self.interval, self.seen, self.lock = interval, {}, threading.Lock()
        self.halt = threading.Event()

    def sample(self) -> None:
        for pid, depth in descendants(os.getpid()).items():
            rss, cpu, shares = peak_rss_mib(pid), cpu_seconds(pid), memory_shares_mib(pid)
            if rss is None or cpu is None or shares is None:
                continue
            with self.lock:
                old = self.seen.get(pid) or Seen(pid, role(command(pid), depth), 0.0, 0.0, 0.0, 0.0)
                self.seen[pid] = Seen(pid, old.role, max(rss, old.peak_rss_mib), cpu,
                                      max(shares[0], old.max_pss_mib), max(shares[1], old.max_uss_mib))

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.interval)

    def stop(self) -> list[dict]:
        self.halt.set()
        self.sample()
        with self.lock:
            return [asdict(s) for s in sorted(self.seen.values(), key=lambda s: s.pid)]


def workers_cpu(pid: int | None = None) -> dict[int, float]:
    """CPU seconds so far of every DataLoader worker (a fork server's child) below ``pid``."""
    out = {}
    for child, depth in descendants(pid or os.getpid()).items():
        if role(command(child), depth) == "worker":
            cpu = cpu_seconds(child)
            if cpu is not None:
                out[child] = cpu
    return out


def since(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two :func:`workers_cpu` readings (a worker born in between counts
    from 0)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
