"""The reference CNN (PyTorch side); ``tf_models.model`` builds the same layers in Keras.

conv 5x5x32 -> ReLU -> maxpool 2 -> conv 5x5x64 -> ReLU -> maxpool 2 -> dense 128 -> ReLU
-> dropout -> dense 10: 184,586 parameters in both frameworks.  Small enough for CPU runs, large
enough to pass 99% test accuracy in a few epochs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

MODEL_NAME = "mnist-cnn-v1"


class MnistCNN(nn.Module):
    def __init__(self, dropout: float = 0.5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, kernel_size=5)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.fc1 = nn.Linear(4 * 4 * 64, 128)
        self.fc2 = nn.Linear(128, 10)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)
