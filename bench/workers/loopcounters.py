"""Horovod's background-loop counters (ringtrain's patch: ``horovod_loop_counters`` in
``horovod/common/operations.cc``): rounds of the loop, rounds that performed an operation, the
allreduce operations with the tensors and bytes each carried (one operation is one MPI/Gloo call
on the fused buffer), other operations, and the rounds that a thread waiting for its own
collective ran itself.  Read through the framework library Horovod already loaded."""

from __future__ import annotations

import ctypes

NAMES = ("rounds", "rounds_with_work", "allreduce_calls", "allreduce_tensors", "allreduce_bytes",
         "other_calls", "caller_rounds")


def read(basics) -> dict[str, int]:
    """This rank's counters so far; ``basics`` is the framework module's ``_basics``
    (``horovod.torch.mpi_ops._basics``), whose ``MPI_LIB_CTYPES`` is the loaded library."""
    lib = basics.MPI_LIB_CTYPES
    if not hasattr(lib, "horovod_loop_counters"):
        raise RuntimeError("this Horovod has no loop counters: build it with the project's patch "
                           "(bash .ci/setup)")
    out = (ctypes.c_longlong * len(NAMES))()
    lib.horovod_loop_counters(out, len(NAMES))
    return dict(zip(NAMES, (int(v) for v in out), strict=True))


def delta(before: dict[str, int], after: dict[str, int], steps: int) -> dict[str, float | None]:
    """Per step between two :func:`read` results, and what fusion did: tensors and bytes per
    allreduce call (None when no allreduce ran)."""
    d = {k: after[k] - before[k] for k in NAMES}
    calls = d["allreduce_calls"]
    return {"steps": steps, **{f"{k}_per_step": d[k] / steps for k in NAMES},
            "tensors_per_call": d["allreduce_tensors"] / calls if calls else None,
            "bytes_per_call": d["allreduce_bytes"] / calls if calls else None}
