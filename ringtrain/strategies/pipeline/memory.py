"""What a pipeline stage will hold, against what its rank may hold: checked before the stage's
weights exist, so that a stage too big for its rank ends the job in one line naming the stage,
what it holds and the limit, instead of failing inside the framework's allocator (PyTorch's
``DefaultCPUAllocator`` traceback; TensorFlow's ``ResourceExhaustedError``, or a segfault, or a
NaN read as divergence: issue 53's measurements).

The per-rank formula (docs/pipeline.md): the stage's weights W, their gradients W, the
optimizer's state (SGD with momentum W, Adam-type 2W, plain SGD 0), and the activations its
schedule keeps (GPipe M micro-batches, 1F1B S - s, each the stage's layer outputs for a
micro-batch's rows).  The limit is the smallest the process meets: ``RLIMIT_DATA`` (what
``bench/workers/memlimit.py`` sets), ``RLIMIT_AS``, or the cgroup's ``memory.max`` shared by the
ranks of this host; each is compared with what the process already uses by the same measure.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from ringtrain.errors import UserError

MB = 1 << 20

@dataclass(frozen=True)
class StageNeeds:
    """The bytes a stage will hold, by the per-rank formula."""

    stage: int
    weights: int
    gradients: int
    optimizer_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.activations

    def parts(self) -> str:
        return (f"weights {self.weights / MB:,.0f} + gradients {self.gradients / MB:,.0f} + "
                f"optimizer state {self.optimizer_state / MB:,.0f} + activations "
                f"{self.activations / MB:,.0f} MB")


def needs(stage: int, weight_bytes: int, state_slots: int, activation_bytes_per_example: int,
          rows_per_microbatch: int, held: int) -> StageNeeds:
    """The formula for one stage: ``state_slots`` tensors of optimizer state per weight
    (:func:`ringtrain.optimizer_spec.state_slots`), ``held`` micro-batches of
    ``rows_per_microbatch`` rows, each keeping ``activation_bytes_per_example`` bytes of the
    stage's layer outputs per row."""
    return StageNeeds(stage, weight_bytes, weight_bytes, state_slots * weight_bytes,
                      held * rows_per_microbatch * activation_bytes_per_example)


@dataclass(frozen=True)
class Limit:
    """How much more this process may allocate, and what says so."""

    left: int
    cap: int
    source: str


def _status_kb(field: str, status: str) -> int | None:
    for line in status.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_max(root: Path = Path("/sys/fs/cgroup")) -> tuple[int, int] | None:
    """(memory.max, memory.current) of this process's cgroup v2, when it has a limit."""
    try:
        own = Path("/proc/self/cgroup").read_text().strip().splitlines()
        rel = next(line.split(":", 2)[2] for line in own if line.startswith("0::"))
        folder = root / rel.lstrip("/")
        cap = (folder / "memory.max").read_text().strip()
        if cap == "max":
            return None
        return int(cap), int((folder / "memory.current").read_text().strip())
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def local_size() -> int:
    """The ranks on this host, as the launcher announced them (they share the host's cgroup)."""
    for name in ("OMPI_COMM_WORLD_LOCAL_SIZE", "HOROVOD_LOCAL_SIZE", "MPI_LOCALNRANKS"):
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def rank_limit(local_size: int = 1, status: str | None = None,
               cgroup: tuple[int, int] | None | bool = False) -> Limit | None:
    """The tightest limit this process meets, or None when there is none to check.  ``status``
    (``/proc/self/status``'s text) and ``cgroup`` (``(max, current)``) are for tests."""
    if status is None:
        try:
            status = Path("/proc/self/status").read_text()
        except OSError:
            return None
    found = []
    for name, rlimit, field in (("RLIMIT_DATA", resource.RLIMIT_DATA, "VmData"),
                                ("RLIMIT_AS", resource.RLIMIT_AS, "VmSize")):
        soft = resource.getrlimit(rlimit)[0]
        used = _status_kb(field, status)
        if soft != resource.RLIM_INFINITY and used is not None:
            found.append(Limit(soft - used, soft, name))
    box = _cgroup_max() if cgroup is False else cgroup
    if box:
        cap, current = box
        # the ranks of this host share the cgroup: each may count on its share of what is left
        found.append(Limit((cap - current) // max(1, local_size), cap, "the cgroup's memory.max"))
    return min(found, key=lambda limit: limit.left) if found else None


def check_fits(stage_needs: StageNeeds, limit: Limit | None, stages: int) -> None:
    """One line when the stage cannot fit its rank, before anything of it is allocated."""
    if limit is None or stage_needs.total <= limit.left:
        return
    raise UserError(
        f"pipeline stage {stage_needs.stage} of {stages} needs {stage_needs.total / MB:,.0f} MB "
        f"({stage_needs.parts()}), but its rank has {max(0, limit.left) / MB:,.0f} MB left under "
        f"{limit.source} of {limit.cap / MB:,.0f} MB: use more --pipeline-stages, fewer "
        f"--microbatches or a smaller --batch-size, or give each rank more memory")


# What the frameworks raise when an allocation fails: Python's MemoryError, PyTorch's
# RuntimeError from its allocators (torch.OutOfMemoryError is one), TensorFlow's
# ResourceExhaustedError: recognised by name and text, so this module imports neither.
_OOM_TEXT = ("DefaultCPUAllocator: can't allocate memory", "out of memory", "OOM when allocating")


def out_of_memory(err: BaseException) -> bool:
    if isinstance(err, MemoryError) or type(err).__name__ in ("OutOfMemoryError",
                                                               "ResourceExhaustedError"):
        return True
    return isinstance(err, RuntimeError) and any(t in str(err) for t in _OOM_TEXT)


def ran_out(stage: int, stages: int, stage_needs: StageNeeds | None, limit: Limit | None,
            during: str) -> UserError:
    """The one line for a stage whose allocation failed ``during`` its work: what the formula
    says it holds, and the limit it met, never "diverged"."""
    holds = (f"it holds {stage_needs.total / MB:,.0f} MB by the per-rank formula "
             f"({stage_needs.parts()})" if stage_needs else "")
    under = (f"its rank's limit is {limit.source} of {limit.cap / MB:,.0f} MB"
             if limit else "no limit of this process says how much it may hold")
    return UserError(f"pipeline stage {stage} of {stages} ran out of memory during {during}: "
                     f"{holds}{'; ' if holds else ''}{under}: use more --pipeline-stages, fewer "
                     f"--microbatches or a smaller --batch-size, or give each rank more memory")
