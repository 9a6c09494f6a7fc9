"""What a run reads from a PyTorch model besides training it: whether its weights are still
numbers, and its state for the checksums.  (Test sums come from the data: :mod:`torch_models.data`.)"""

from __future__ import annotations

import math

import numpy as np
import torch


def weights_total(model) -> torch.Tensor:
    """One float64 sum of every parameter, on the model's device: a single NaN or inf anywhere
    makes it non-finite.  For the CNN on one core: 30 us per step where ``isfinite().all()`` took
    600 us (Xeon host); 83-266 us where ``get_total_norm(params, inf)`` took 490 (2026-11-26, EPYC
    host), so a CPU keeps these sums."""
    with torch.no_grad():
        return torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()]).sum()


def weights_finite(model) -> bool:
    """Whether every parameter is a finite number."""
    return math.isfinite(float(weights_total(model)))


class FiniteWatch:
    """After each optimizer step, ``step(tag)`` returns the tag of the step after which the
    weights stopped being finite numbers, or None; the answer is the same on every rank, since
    the weights are.  With ``lag`` (on a GPU) a step's answer is read at the next step, so the CPU
    never waits for the GPU to finish the step it has just queued; ``flush()`` reads the last
    one (call it before anything uses the weights, e.g. a checkpoint)."""

    def __init__(self, model, lag: bool) -> None:
        self.model, self.lag, self.pending = model, lag, None
        self.params = list(model.parameters())

    def step(self, tag):
        if not self.lag:
            return None if math.isfinite(float(weights_total(self.model))) else tag
        # On a GPU: the largest |weight|, from one fused (foreach) kernel over every tensor, where
        # weights_total launches one per tensor.  A NaN or inf anywhere makes it non-finite, and
        # unlike a sum it cannot overflow.  (On a CPU the sums are cheaper: weights_total.)
        total = torch.nn.utils.get_total_norm(self.params, float("inf"))
        event = None
        host = total.to("cpu", non_blocking=True)  # into pinned memory, when from a GPU
        if total.is_cuda:
            event = torch.cuda.Event()
            event.record()
        previous, self.pending = self.pending, (host, event, tag)
        return self._read(previous)

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
        return None if math.isfinite(float(host)) else tag


def parameters(model) -> list[np.ndarray]:
    """The model's floating-point state in ``state_dict`` order: the parameters and the buffers
    (BatchNorm's running statistics), which must agree across ranks too."""
    return [t.detach().cpu().numpy() for t in model.state_dict().values() if t.is_floating_point()]
