"""What a run reads from a PyTorch model besides training it: whether its weights are still
numbers, and its state for the checksums.  (Test sums come from the data: :mod:`torch_models.data`.)"""

from __future__ import annotations

import math

import numpy as np
import torch


def weights_finite(model) -> bool:
    """Whether every parameter is a finite number: one float64 sum per tensor, which a single NaN
    or inf anywhere makes non-finite (30 us per step for the CNN on one core, where
    ``isfinite().all()`` took 600 us)."""
    with torch.no_grad():
        total = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()]).sum()
    return math.isfinite(float(total))


def parameters(model) -> list[np.ndarray]:
    """The model's floating-point state in ``state_dict`` order: the parameters and the buffers
    (BatchNorm's running statistics), which must agree across ranks too."""
    return [t.detach().cpu().numpy() for t in model.state_dict().values() if t.is_floating_point()]
