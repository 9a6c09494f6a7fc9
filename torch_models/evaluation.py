"""What a run reads from a PyTorch model besides training it: whether its weights are still
numbers, and its state for the checksums.  (Test sums come from the data: :mod:`torch_models.data`.)"""

from __future__ import annotations

import math

import numpy as np
import torch


def weights_finite(params: list[torch.Tensor]) -> bool:
    """Whether every weight of ``params`` is a finite number.  First each tensor's sum in float32:
    all finite means every weight is (a NaN or inf makes its tensor's sum NaN or inf).
    Only where one is not (a weight that is not a number, or finite weights whose sum overflows
    float32) are float64 sums taken, which tell the two apart.  Sums, because on a CPU they are
    cheaper than ``isfinite().all()`` or ``get_total_norm(params, inf)``: for the CNN on one core
    30 us where ``isfinite().all()`` took 600 (Xeon host); on 2 threads (EPYC host) about 80 us
    in float32, about 200 in float64, 490 for ``get_total_norm``."""
    with torch.no_grad():
        if all(map(math.isfinite, torch.stack([p.sum(dtype=torch.float32) for p in params]).tolist())):
            return True
        return math.isfinite(float(torch.stack([p.sum(dtype=torch.float64) for p in params]).sum()))


# The dtypes whose values a float32 holds exactly, all the fused check may see.
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class FiniteWatch:
    """After each optimizer step, ``step(tag)`` returns the tag of the step after which the
    weights stopped being finite numbers, or None; the answer is the same on every rank, since
    the weights are.  With ``lag`` (on a GPU) a step's answer is read at the next step, so the CPU
    never waits for the GPU to finish the step it has just queued; ``flush()`` reads the last
    one (call it before anything uses the weights, e.g. a checkpoint)."""

    def __init__(self, model, lag: bool) -> None:
        self.model, self.lag, self.pending = model, lag, None
        self.params = [p.detach() for p in model.parameters()]
        # One fused call per device and dtype: the kernel takes one device and dtype per list.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self.params:
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.groups = list(groups.values())
        # With lag: one flag per device, which the check sets (and nothing clears) when a weight
        # on it is not a number, and the 1.0 it multiplies the weights by.
        devices = list(dict.fromkeys(d for d, _ in groups)) if lag else []
        self.flags = {d: torch.zeros(1, device=d) for d in devices}
        self.unit = {d: torch.ones(1, device=d) for d in devices}
        # Groups checked through their largest |weight| instead: float64, whose values CUDA's
        # fused kernel tests as float32 (a finite 1e300 read as inf on an H200, torch 2.11), and
        # what the kernel refuses (bfloat16 there).
        self.unfused = {key for key in groups if key[1] not in FUSED_DTYPES}
        # On a GPU: two pinned host buffers and two CUDA events, used in turn (one holds the step
        # being read while the other receives the step just queued).  Made once: a new event and
        # a pinned tensor from PyTorch's host allocator every step cost an event creation, and
        # the allocator's own event record and query, per step.
        self.slots: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None
        self.turn = 0

    def step(self, tag):
        if not self.lag:
            return None if weights_finite(self.params) else tag
        flag, event = self._flag(), None
        if flag.is_cuda:
            if self.slots is None:
                self.slots = [(torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True),
                               torch.cuda.Event()) for _ in range(2)]
            (buffer, event), self.turn = self.slots[self.turn], 1 - self.turn
            buffer.copy_(flag, non_blocking=True)
            event.record()
            flag = buffer
        else:
            flag = flag.clone()  # the flag itself is set in place by the steps after this one
        previous, self.pending = self.pending, (flag, event, tag)
        return self._read(previous)

    def _flag(self) -> torch.Tensor:
        """Every device's flag, on the first device, after checking every weight: PyTorch's own
        fused check of ``GradScaler`` (``_amp_foreach_non_finite_check_and_unscale_``), one
        launch per device and dtype whatever the number of tensors.  It also multiplies each
        weight by its scale, here 1.0, which its kernel skips (the weights are rewritten
        unchanged, bit for bit on an H200 too).  It replaced each tensor's largest |weight|
        (``_foreach_norm``, a result tensor per parameter, a stack), still used for the dtypes
        in ``unfused``: issuing the check for the CNN's 8 tensors cost 14 us of Python and
        dispatch against 47 (CPU, one-element tensors; docs/gpu.md).  The GPU step is bound by
        the CPU that issues it.  (A check read at once, on a CPU: :func:`weights_finite`.)"""
        with torch.no_grad():
            for group in self.groups:
                key = group[0].device, group[0].dtype
                flag = self.flags[key[0]]
                if key in self.unfused:
                    flag.add_(_not_finite(group))
                    continue
                try:
                    torch._amp_foreach_non_finite_check_and_unscale_(group, flag, self.unit[key[0]])
                except NotImplementedError:  # CUDA's kernel in torch 2.11 takes no bfloat16
                    self.unfused.add(key)
                    flag.add_(_not_finite(group))
        flags = list(self.flags.values())
        if len(flags) == 1:
            return flags[0]
        if not flags:
            return torch.zeros(1)
        return torch.cat([f.to(flags[0].device) for f in flags])

    def flush(self):
        previous, self.pending = self.pending, None
        return self._read(previous)

    @staticmethod
    def _read(pending):
        if pending is None:
            return None
        host, event, tag = pending
        if event is not None:
            event.synchronize()
        return tag if any(host.tolist()) else None


def _not_finite(group: list[torch.Tensor]) -> torch.Tensor:
    """1 where a weight of ``group`` is not a finite number, else 0, on its device: each tensor's
    largest |weight| (one ``_foreach_norm`` call), which a NaN or inf makes non-finite."""
    return (~torch.isfinite(torch.stack(torch._foreach_norm(group, float("inf"))))).any().float()


def parameters(model) -> list[np.ndarray]:
    """The model's floating-point state in ``state_dict`` order: the parameters and the buffers
    (BatchNorm's running statistics), which must agree across ranks too."""
    return [t.detach().cpu().numpy() for t in model.state_dict().values() if t.is_floating_point()]
