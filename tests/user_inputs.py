"""Data that are not images, and the users' models that read them, as ``--data`` and ``--model``
name them (``--data user_inputs:signals --model user_inputs:torch_signal_model``).  Generated on
the spot, like every test's data.

* :func:`signals`: MNIST-1D's idea (Greydanus 2020, the ``mnist1d`` package): ten templates of
  a 1-D signal, one per class, each example a template shifted, scaled, with a slope and noise
  added, 40 float32 values.  Hard for a linear model, easy for a small MLP.
* :func:`tokens`: sequences of 24 int64 token ids from a vocabulary of 64; the class is which of
  four keyword tokens occurs most often among filler tokens.  Only a model that embeds the
  ids (an embedding and a pooled classifier) can read them.
* :func:`odd_items`: signals of which one item has another shape and one a label out of range,
  for the one-line errors.

Items come as NumPy arrays for TensorFlow, as NumPy arrays (signals) or tensors (tokens) for
PyTorch: both are accepted.
"""

from __future__ import annotations

import numpy as np

SIGNAL, VOCAB, SEQ, KEYWORDS = 40, 64, 24, 4


class Items:
    """A map-style dataset over arrays, with ``classes``."""

    def __init__(self, x: np.ndarray, y: np.ndarray, classes: list[str], as_tensor: bool = False):
        self.x, self.y, self.classes, self.as_tensor = x, y, classes, as_tensor

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        x = self.x[i]
        if self.as_tensor:
            import torch

            x = torch.from_numpy(x)
        return x, int(self.y[i])


def _signals(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.linspace(0, 1, SIGNAL)
    templates = np.stack([np.sin(2 * np.pi * (c + 1) * t / 2 + c) * (1 + 0.3 * (c % 3))
                          for c in range(10)])
    y = rng.integers(0, 10, n)
    shift = rng.integers(-4, 5, n)
    x = np.stack([np.roll(templates[c], s) for c, s in zip(y, shift, strict=True)])
    x = x * rng.uniform(0.8, 1.2, (n, 1)) + rng.normal(0, 0.1, (n, 1)) * t \
        + rng.normal(0, 0.15, (n, SIGNAL))
    return x.astype(np.float32), y


def signals(split: str, framework: str) -> Items:
    x, y = _signals(768 if split == "train" else 256, 0 if split == "train" else 1)
    return Items(x, y, [str(c) for c in range(10)])


def tokens(split: str, framework: str) -> Items:
    rng = np.random.default_rng(2 if split == "train" else 3)
    n = 768 if split == "train" else 256
    y = rng.integers(0, KEYWORDS, n)
    x = rng.integers(KEYWORDS, VOCAB, (n, SEQ))  # filler ids, never a keyword
    for row, label in enumerate(y):
        counts = np.roll([5, 2, 1, 0], label)  # the label's keyword most often
        spots = rng.permutation(SEQ)
        at = 0
        for keyword, count in enumerate(counts):
            x[row, spots[at:at + count]] = keyword
            at += count
    return Items(x.astype(np.int64), y, [f"k{c}" for c in range(KEYWORDS)],
                 as_tensor=framework == "torch")


class OddItems(Items):
    """:func:`signals` with item ``shape_at`` of 41 values and item ``label_at``'s label 10."""

    shape_at, label_at = None, None

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        if i == self.shape_at:
            x = np.zeros(SIGNAL + 1, np.float32)
        if i == self.label_at:
            y = 10
        return x, y


def odd_items(split: str, framework: str, which: str = "shape") -> OddItems:
    x, y = _signals(64 if split == "train" else 32, 0 if split == "train" else 1)
    items = OddItems(x, y, [str(c) for c in range(10)])
    if split == "train":
        items.shape_at, items.label_at = (37, None) if which == "shape" else (None, 37)
    return items


def odd_labels(split: str, framework: str) -> OddItems:
    return odd_items(split, framework, "label")


# --- the users' models ---------------------------------------------------------------------------

def torch_signal_model(input_shape, num_classes):
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 64), nn.ReLU(),
                         nn.Linear(64, num_classes))


def torch_token_model(input_shape, num_classes):
    from torch import nn

    class Bag(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 16)
            self.out = nn.Linear(16, num_classes)

        def forward(self, ids):
            return self.out(self.embed(ids).mean(dim=1))

    return Bag()


def tf_signal_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(64, activation="relu"),
                             keras.layers.Dense(num_classes)])


def tf_token_model(input_shape, num_classes):
    import keras

    return keras.Sequential([keras.Input(input_shape, dtype="int64"),
                             keras.layers.Embedding(VOCAB, 16),
                             keras.layers.GlobalAveragePooling1D(),
                             keras.layers.Dense(num_classes)])
