"""``--model`` on the PyTorch side: the built-in models, and the check every model passes.

``cnn``, the reference CNN: conv 5x5x32 -> ReLU -> maxpool 2 -> conv 5x5x64 -> ReLU -> maxpool 2
-> dense 128 -> ReLU -> dropout -> dense (one logit per class): 184,586 parameters on MNIST, in both
frameworks (``tf_models.model`` builds the same layers in Keras).  Small enough for CPU runs,
large enough to pass 99% test accuracy in a few epochs.

``mlp``: flatten -> dense 128 -> ReLU -> dropout -> dense (logits): 101,770 parameters on MNIST.

A user's ``package.module:function`` is called as ``function(input_shape=..., num_classes=N)``
and must return a ``torch.nn.Module`` mapping ``[B, *input_shape]`` to ``[B, N]`` logits (see
:mod:`ringtrain.model_spec`): ``input_shape`` is an image's ``(C, H, W)``, or the user's data's
own shape (a signal's ``(40,)``, a token sequence's ``(32,)`` of int64 ids).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from ringtrain import model_spec

MNIST_SHAPE = (1, 28, 28)


def channels_first(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """The dataset's (height, width, channels) as PyTorch's (channels, height, width)."""
    height, width, channels = shape
    return channels, height, width


def model_shape(info) -> tuple[int, ...]:
    """One example's shape as PyTorch models read it (``info`` a
    :class:`ringtrain.data.dataset.DataInfo`): an image's channels first, other inputs as they
    arrive."""
    return channels_first(info.input_shape) if info.image else tuple(info.input_shape)


class MnistCNN(nn.Module):
    def __init__(self, dropout: float = 0.5, input_shape: tuple[int, int, int] = MNIST_SHAPE,
                 num_classes: int = 10) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.conv1 = nn.Conv2d(channels, 32, kernel_size=5)
        self.conv2 = nn.Conv2d(32, 64, kernel_size=5)
        self.fc1 = nn.Linear(((height - 4) // 2 - 4) // 2 * ((width - 4) // 2 - 4) // 2 * 64, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)

    def layers(self) -> nn.Sequential:
        """The same modules (the same parameters) as a chain, what a pipeline splits: the same
        maths as :meth:`forward`, op for op."""
        return nn.Sequential(OrderedDict([
            ("conv1", self.conv1), ("relu1", nn.ReLU()), ("pool1", nn.MaxPool2d(2)),
            ("conv2", self.conv2), ("relu2", nn.ReLU()), ("pool2", nn.MaxPool2d(2)),
            ("flatten", nn.Flatten()), ("fc1", self.fc1), ("relu3", nn.ReLU()),
            ("dropout", self.dropout), ("fc2", self.fc2)]))


class MLP(nn.Module):
    def __init__(self, dropout: float = 0.5, input_shape: tuple[int, ...] = MNIST_SHAPE,
                 num_classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(math.prod(input_shape), 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(F.relu(self.fc1(torch.flatten(x, 1)))))

    def layers(self) -> nn.Sequential:
        """The same modules as a chain (see :meth:`MnistCNN.layers`)."""
        return nn.Sequential(OrderedDict([
            ("flatten", nn.Flatten()), ("fc1", self.fc1), ("relu", nn.ReLU()),
            ("dropout", self.dropout), ("fc2", self.fc2)]))


BUILTIN = {"cnn": MnistCNN, "mlp": MLP}


def instantiate(spec: str, dataset, dropout: float, allowed: tuple[type, ...] = (nn.Module,),
                wanted: str = "torch.nn.Module"):
    """A built-in model, or what the user's builder returns if it is one of ``allowed`` (a
    pipeline also takes a list of stages); anything else is one :class:`UserError` line."""
    model_spec.check_builtin_input(spec, dataset)
    shape = model_shape(dataset)
    if spec in BUILTIN:
        return BUILTIN[spec](dropout, shape, dataset.num_classes)
    model = model_spec.call_builder(spec, shape, dataset.num_classes)
    if not isinstance(model, allowed):
        raise model_spec.wrong_type(spec, model, "torch", wanted)
    return model


def build(spec: str, dataset, dropout: float) -> nn.Module:
    """The ``--model spec`` for ``dataset`` (its :class:`ringtrain.data.dataset.DataInfo`), checked: a bad
    spec, a builder that fails or returns the wrong thing is one :class:`UserError` line."""
    model = instantiate(spec, dataset, dropout)
    check(spec, model, model_shape(dataset), dataset.num_classes, getattr(torch, dataset.input_dtype))
    return model


def check(spec: str, model: nn.Module, shape: tuple[int, ...], num_classes: int,
          dtype: torch.dtype = torch.float32) -> None:
    """One forward pass of two zero images in eval mode (no dropout draws, so the random state is
    untouched).  Also materialises lazy modules before the optimizer and the broadcast see the
    parameters."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model_spec.check_forward(spec, shape, num_classes,
                                     lambda: model(torch.zeros(2, *shape, dtype=dtype)))
    finally:
        model.train(was_training)
