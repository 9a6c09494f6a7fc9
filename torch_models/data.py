"""Training and test data as PyTorch tensors."""

from __future__ import annotations

import numpy as np
import torch

from ringtrain.data.dataset import Dataset, model_inputs


def to_tensors(dataset: Dataset, images: np.ndarray, labels: np.ndarray, device: torch.device):
    """Normalised NCHW float tensors, made once: indexing them per batch beats a DataLoader's
    per-image Python work by a wide margin on small CPU machines."""
    x = model_inputs(dataset, images)  # [N, H, W, C]
    n, height, width, channels = x.shape
    if channels > 1:
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    # A reshape, not a permuted view: with one channel the view's strides look channels-last to
    # PyTorch, whose convolutions then take another path and round differently.
    x = torch.from_numpy(x.reshape(n, channels, height, width))
    return x.to(device), torch.from_numpy(labels).to(device)
