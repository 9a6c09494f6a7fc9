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


class FiniteWatch:
    """After each optimizer step, ``step(tag)`` returns the tag of the step after which the
    weights stopped being finite numbers, or None; the answer is the same on every rank, since
    the weights are.  With ``lag`` (on a GPU) a step's answer is read at the next step, so the CPU
    never waits for the GPU to finish the step it has just queued; ``flush()`` reads the last
    one (call it before anything uses the weights, e.g. a checkpoint)."""

    def __init__(self, model, lag: bool) -> None:
        self.model, self.lag, self.pending = model, lag, None
        self.params = [p.detach() for p in model.parameters()]
        # One foreach call per device and dtype: a mixed list takes foreach's per-tensor path.
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in model.parameters():
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.groups = list(groups.values())
        self.device = self.groups[0][0].device if len({d for d, _ in groups}) > 1 else None
        # On a GPU: two pinned host buffers and two CUDA events, used in turn (one holds the step
        # being read while the other receives the step just queued).  Made once: a new event and
        # a pinned tensor from PyTorch's host allocator every step cost an event creation, and
        # the allocator's own event record and query, per step.
        self.slots: list[tuple[torch.Tensor, torch.cuda.Event]] | None = None
        self.turn = 0

    def step(self, tag):
        if not self.lag:
            return None if weights_finite(self.params) else tag
        largest, event = self._largest(), None
        if largest.is_cuda:
            if self.slots is None:
                self.slots = [(torch.empty(largest.shape, dtype=largest.dtype, pin_memory=True),
                               torch.cuda.Event()) for _ in range(2)]
            (buffer, event), self.turn = self.slots[self.turn], 1 - self.turn
            buffer.copy_(largest, non_blocking=True)
            event.record()
            largest = buffer
        previous, self.pending = self.pending, (largest, event, tag)
        return self._read(previous)

    def _largest(self) -> torch.Tensor:
        """Each parameter tensor's largest |weight|, on the device: a NaN or inf in a tensor
        makes its entry non-finite, and unlike a sum it cannot overflow.  ``_foreach_norm``
        itself, because ``get_total_norm(params, inf)`` takes torch's per-tensor path for
        parameters (its foreach check admits plain Tensors, not ``nn.Parameter``): one norm
        kernel per tensor plus one.  Here: three launches per dtype whatever the number of
        tensors, one stack, and the host checks every entry (no reduction kernel).  On two H100
        hosts the CNN's check took 313-367 us of CPU per step that way, with a new event and
        pinned tensor per step, and 189-236 us as now, of a 2.0-2.5 ms step (2026-11-26,
        docs/gpu.md).  (On a CPU sums are cheaper: :func:`weights_finite`.)"""
        with torch.no_grad():
            if not self.groups:
                return torch.zeros(1)
            norms = [n for group in self.groups for n in torch._foreach_norm(group, float("inf"))]
            return torch.stack(norms if self.device is None else [n.to(self.device) for n in norms])

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
        return None if all(map(math.isfinite, host.tolist())) else tag


def parameters(model) -> list[np.ndarray]:
    """The model's floating-point state in ``state_dict`` order: the parameters and the buffers
    (BatchNorm's running statistics), which must agree across ranks too."""
    return [t.detach().cpu().numpy() for t in model.state_dict().values() if t.is_floating_point()]
