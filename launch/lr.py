"""The learning-rate rule both trainers follow.

Data-parallel training with N ranks sees N times the batch per step, so the LR is scaled with N
(Goyal et al. 2017, "Accurate, Large Minibatch SGD"): linearly by default, by sqrt(N) for the more
cautious, and not at all with Adasum, which adapts the combination itself (Horovod's Adasum guide).
A linear warm-up from the single-worker LR avoids the early divergence large LRs cause.
"""

from __future__ import annotations

import math

SCALING_RULES = ("linear", "sqrt", "none")


def scaled_lr(base_lr: float, world_size: int, rule: str = "linear", adasum: bool = False) -> float:
    """The effective LR once warm-up is over."""
    if rule not in SCALING_RULES:
        raise ValueError(f"unknown LR scaling rule {rule!r}; choose one of {SCALING_RULES}")
    if adasum or rule == "none":
        return base_lr
    if rule == "sqrt":
        return base_lr * math.sqrt(world_size)
    return base_lr * world_size


def lr_at(progress_epochs: float, base_lr: float, target_lr: float, warmup_epochs: float) -> float:
    """LR after ``progress_epochs`` (fractional) epochs: base -> target linearly over warm-up."""
    if warmup_epochs <= 0 or progress_epochs >= warmup_epochs:
        return target_lr
    return base_lr + (target_lr - base_lr) * (progress_epochs / warmup_epochs)
