"""When, and on which Horovod build, each part of the results was measured; the line under each
section of BENCHMARKS.md that says so (issue 41).

Parts run alone (``python -m bench --only PART``), days apart, and the patched Horovod is rebuilt
between them, so one report holds figures from several builds.  Each part records its build in
``machine.versions.horovod``: ``0.28.1+ringtrain.<hash>`` names the patch series the wheel was
built from; parts measured before the version named it say ``0.28.1``.  The *current* build is
that of the latest measurement in the results; a section measured on another one says so, so that
a reader does not take its figures for the current build's.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.reports.report_cluster import CELL_NAMES


@dataclass(frozen=True)
class Measured:
    part: str
    started: str  # as the driver writes it: "2026-11-23 06:04 UTC"
    build: str | None  # None: the part ran before parts kept their machine record
    cells: tuple[str, ...] = ()  # a rerun of some of the part's cells (--cells); () the part's own run

    @property
    def date(self) -> str:
        return self.started.split()[0]


def _build(machine: dict | None) -> str | None:
    return ((machine or {}).get("versions") or {}).get("horovod")


def records(res: dict, part: str) -> list[Measured]:
    """The part's run, then each later rerun of some of its cells (the cluster part's)."""
    rec = res.get(part) or {}
    if "started" not in rec or "skipped" in rec:  # a skipped part (no root) measured nothing
        return []
    return [Measured(part, rec["started"], _build(rec.get("machine")))] + [
        Measured(part, r["started"], _build(r.get("machine")), tuple(r.get("cells", ())))
        for r in rec.get("reruns", []) if r.get("started")]


def holding(res: dict, part: str, cell: str | None = None) -> Measured | None:
    """The measurement a figure comes from: the latest rerun of ``cell``, else the part's run."""
    recs = records(res, part)
    reruns = [m for m in recs[1:] if cell in m.cells]
    return max(reruns, key=_when) if reruns else (recs[0] if recs else None)


def _when(m: Measured) -> str:
    # "%Y-%m-%d %H:%M UTC" sorts as it reads: every part is stamped in the driver's UTC clock
    return m.started


def current(res: dict, parts: tuple[str, ...]) -> Measured | None:
    """The latest measurement that recorded its build: that build is the current one."""
    recs = [m for part in parts for m in records(res, part) if m.build]
    return max(recs, key=_when) if recs else None


def _said(m: Measured) -> str:
    build = f"Horovod `{m.build}`" if m.build else "Horovod build not recorded"
    if not m.cells:
        return f"{m.started}, {build}"
    names = " and ".join(CELL_NAMES.get(c, c) for c in m.cells)
    return f"the {names} cells again {m.started}, {build}"


def line(res: dict, part: str, now: Measured | None) -> str | None:
    """One sentence: when and on which build the part was measured, and whether that build is
    the current one (None where the part measured nothing)."""
    recs = records(res, part)
    if not recs:
        return None
    said = _said(recs[0]) + (f" ({'; '.join(_said(m) for m in recs[1:])})" if recs[1:] else "")
    older = [m for m in recs if m.build and now and m.build != now.build]
    if older:
        head, which = ("**Measured on an older build:**", "not rerun") if len(older) == len(recs) else \
            ("**Measured partly on an older build:**", "what was measured on an older build not rerun")
        return f"{head} {said}; {which} on the current build, `{now.build}`."
    if any(m.build is None for m in recs):
        return f"Measured {said}."
    return f"Measured on the current build: {said}."


def stamp(lines: list[str], res: dict, part: str, now: Measured | None) -> list[str]:
    """A section's lines with :func:`line` under its heading (the sections' first two lines are
    the heading and a blank line)."""
    said = line(res, part, now)
    if not lines or said is None:
        return lines
    return lines[:2] + [said, ""] + lines[2:]
