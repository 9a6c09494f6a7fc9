"""Lookups and number formatting shared by the report and the plots."""

from __future__ import annotations

FW_NAMES = {"torch": "PyTorch", "tf": "TensorFlow/Keras 3"}


def find(runs: list[dict], fw: str, kind: str, wrapper: str, data: str, np: int,
         threads: int | None = None) -> dict | None:
    for r in runs:
        if (r["framework"], r["kind"], r["wrapper"], r["data"], r["np"]) == (fw, kind, wrapper, data, np) \
                and r.get("threads") == threads:
            return r
    return None


def ips(runs: list[dict], fw: str, kind: str, wrapper: str, data: str, np: int,
        threads: int | None = None) -> float | None:
    r = find(runs, fw, kind, wrapper, data, np, threads)
    return r["images_per_second"] if r and r.get("ok") else None


def memory_limit(machine: dict) -> float | None:
    """The memory system's copy rate: the better of one core and all cores together."""
    vals = [machine.get("copy_bandwidth_1core"), machine.get("copy_bandwidth_all_cores")]
    vals = [v for v in vals if v]
    return max(vals) if vals else None


def num(v: float | None, fmt: str = "{:.0f}") -> str:
    return "n/a" if v is None else fmt.format(v)


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{100 * v:.0f}%"


def x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def size(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def gbs(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e9:.2f}"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def load_text(values: list[float] | None) -> str:
    """A recorded load average (1, 5, 15 min) as the report prints it."""
    return ", ".join(f"{v:.2f}" for v in values) if values else "n/a"


def load_note(load_at_start: list[float] | None, cores: int | None) -> str:
    """How a part's own-run comparisons should be read, from the 1-minute load average when it
    started.  Above the core count, other work held cores then or in the minute before (the
    average decays over about a minute, so a part that just ended still counts)."""
    if not load_at_start or not cores:
        return "the load is not recorded"
    if load_at_start[0] > cores:
        return f"load above the {cores} cores at the start: other work ran beside it or just before"
    return f"no other job was running on the {cores} cores"
