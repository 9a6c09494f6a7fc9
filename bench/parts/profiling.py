"""Where the time goes: summaries of a py-spy profile and of a Horovod timeline.

``python -m bench --profile RUN`` records rank 0 of the named run with ``py-spy record --format
raw`` (collapsed stacks; add ``--profile-native`` for C/C++ frames) and, for Horovod runs with
``--timeline``, Horovod's own timeline (``horovodrun --timeline-filename``).  These functions
turn both into the short tables that land in BENCHMARKS.md; the raw files stay in
``<out>/profile/`` for a flame graph viewer (speedscope.app reads py-spy's raw format;
chrome://tracing or Perfetto reads the timeline).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path

_LINE_NO = re.compile(r":\d+\)$")


def frame_name(frame: str) -> str:
    """``step (torch/optim/sgd.py:123)`` -> ``step (torch/optim/sgd.py)``: functions, not lines."""
    return _LINE_NO.sub(")", frame.strip())


# Coarse buckets for a sample, first match wins (checked against the whole stack, outermost
# first for imports and exit, innermost first otherwise): enough to tell compute from waiting
# from start-up without reading a flame graph.
CATEGORIES = (
    ("start-up (imports)", ("_find_and_load (",)),
    ("exit (shutdown, gc)", ("shutdown (", "_exitfunc (", "gc_collect_main")),
    ("Horovod / collectives", ("horovod/", "horovod::", "torch/distributed/", "gloo::",
                               "tensorflow/python/distribute/", "mpi4py", "PMPI_", "ompi_")),
    ("backward", ("backward (torch/", "run_backward", "gradient (tensorflow/", "GradientTape")),
    ("optimizer update", ("torch/optim/", "apply_gradients (")),
    ("forward", ("forward (", "_call_impl (", "__call__ (keras/", "__call__ (tensorflow/")),
    ("input pipeline", ("tensorflow/python/data/", "normalize (", "shard_indices (")),
)


def categorize(frames: list[str]) -> str:
    for name, needles in CATEGORIES:
        if any(n in f for f in frames for n in needles):
            return name
    return "other"


def summarize_pyspy(path: Path, top: int = 12) -> dict:
    """Self time (leaf frames), inclusive time per function and coarse categories from py-spy's
    raw output (collapsed stacks, one ``frame;frame;... count`` per line)."""
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    buckets: Counter[str] = Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = [frame_name(f) for f in stack.split(";") if f]
        total += n
        if frames:
            self_time[frames[-1]] += n
        buckets[categorize(frames)] += n
        for f in set(frames):
            inclusive[f] += n
    def rows(counter: Counter) -> list[dict]:
        return [{"function": f, "share": c / total} for f, c in counter.most_common(top)] if total else []
    return {"samples": total, "self": rows(self_time), "inclusive": rows(inclusive),
            "categories": [{"category": c, "share": n / total} for c, n in buckets.most_common()]
            if total else []}


def load_timeline(path: Path) -> list[dict]:
    """Horovod writes its timeline as a JSON array it may never close; accept both."""
    text = Path(path).read_text().strip()
    if not text.endswith("]"):
        text = text.rstrip(",\n ") + "]"
    return json.loads(text)


def summarize_timeline(path: Path, top: int = 10) -> dict:
    """Total time and count per Horovod activity (NEGOTIATE_ALLREDUCE, MPI_ALLREDUCE, ...)."""
    events = load_timeline(path)
    open_at: dict[tuple, list[float]] = defaultdict(list)
    total: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for ev in events:
        ph, name = ev.get("ph"), ev.get("name")
        key = (ev.get("pid"), ev.get("tid"))
        if ph == "B" and name:
            open_at[key].append((name, ev["ts"]))
        elif ph == "E" and open_at[key]:
            name, ts = open_at[key].pop()
            total[name] += ev["ts"] - ts
            count[name] += 1
        elif ph == "X" and name:
            total[name] += ev.get("dur", 0)
            count[name] += 1
    return {"activities": [{"activity": n, "total_ms": t / 1e3, "count": count[n],
                            "mean_us": t / max(count[n], 1)}
                           for n, t in total.most_common(top) if t > 0]}


def collect(out: Path) -> dict | None:
    """The summaries of whatever profile files ``out/profile`` holds (None if it has none)."""
    folder = out / "profile"
    found: dict = {}
    if (folder / "pyspy.txt").exists():
        found["pyspy"] = summarize_pyspy(folder / "pyspy.txt")
    if (folder / "timeline.json").exists():
        try:
            found["timeline"] = summarize_timeline(folder / "timeline.json")
        except (json.JSONDecodeError, KeyError) as err:
            found["timeline"] = {"error": f"unreadable timeline: {err}"}
    return found or None
