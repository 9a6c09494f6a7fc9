"""Models for the pipeline tests, as ``--model pipeline_models:NAME`` names them (tests/ on the
path): the built-in CNN's layers in float64 (the equivalence tests compare a pipeline with one
process to float64 rounding), small CNNs with BatchNorm and Dropout in each stage (a stage's
forward recomputed in its backward), and models a pipeline cannot split or splits by the
builder's own list."""

from __future__ import annotations


def torch_cnn64(input_shape, num_classes):
    """The built-in CNN, its layers as an ``nn.Sequential`` in float64 behind a cast."""
    import torch
    from torch import nn

    from torch_models.model import MnistCNN

    class ToFloat64(nn.Module):
        def forward(self, x):
            return x.to(torch.float64)

    layers = MnistCNN(0.0, tuple(input_shape), num_classes).layers()
    return nn.Sequential(ToFloat64(), *layers).double()


def tf_cnn64(input_shape, num_classes):
    """The built-in CNN's layers in float64 (Keras casts the float32 input)."""
    import keras

    from tf_models.model import build_cnn

    model = build_cnn(0.0, "float64", tuple(input_shape), num_classes)
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    twin = {"Conv2D": keras.layers.Conv2D, "MaxPooling2D": keras.layers.MaxPooling2D,
            "Flatten": keras.layers.Flatten, "Dense": keras.layers.Dense,
            "Dropout": keras.layers.Dropout}
    chain = [keras.Input(tuple(input_shape))]
    for layer in layers:  # the same layers, every one in float64 (build_cnn keeps fc2 float32)
        config = {**layer.get_config(), "dtype": "float64"}
        chain.append(twin[type(layer).__name__].from_config(config))
    out = keras.Sequential(chain)
    for mine, theirs in zip(out.layers, layers, strict=True):
        mine.set_weights([w.astype("float64") for w in theirs.get_weights()])
    return out


def torch_bn64(input_shape, num_classes):
    """A small CNN with BatchNorm on both sides of its split and Dropout in each stage, in float64
    (``--checkpoint-activations`` must train it as the run without the flag, bit for bit)."""
    import torch
    from torch import nn

    class ToFloat64(nn.Module):
        def forward(self, x):
            return x.to(torch.float64)

    channels, height, width = input_shape
    flat = 16 * ((height - 4) // 2 - 4) // 2 * ((width - 4) // 2 - 4) // 2
    return nn.Sequential(
        ToFloat64(), nn.Conv2d(channels, 8, 5), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.1), nn.Conv2d(8, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(flat, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.25),
        nn.Linear(64, num_classes)).double()


def tf_bn(input_shape, num_classes):
    """The Keras twin of :func:`torch_bn64` (float32): BatchNorm in both stages, Dropout too."""
    import keras
    from keras import layers

    return keras.Sequential([
        keras.Input(tuple(input_shape)), layers.Conv2D(8, 5), layers.BatchNormalization(),
        layers.ReLU(), layers.MaxPooling2D(2), layers.Dropout(0.1), layers.Conv2D(16, 5),
        layers.BatchNormalization(), layers.ReLU(), layers.MaxPooling2D(2), layers.Flatten(),
        layers.Dense(64), layers.BatchNormalization(), layers.ReLU(), layers.Dropout(0.25),
        layers.Dense(num_classes)])


def torch_unsplittable(input_shape, num_classes):
    """A module whose forward is its own code: nothing says where it could be cut."""
    import math

    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(math.prod(input_shape), 16)
            self.b = nn.Linear(16, num_classes)

        def forward(self, x):
            return self.b(self.a(x.flatten(1)).relu())

    return Net()


def torch_stages(input_shape, num_classes):
    """A builder's own split: a list of two stage modules."""
    import math

    from torch import nn

    return [nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 32), nn.ReLU()),
            nn.Sequential(nn.Linear(32, num_classes))]


def tf_residual(input_shape, num_classes):
    """A functional model with a skip connection: not a chain."""
    import keras

    inputs = keras.Input(tuple(input_shape))
    x = keras.layers.Flatten()(inputs)
    h = keras.layers.Dense(32, activation="relu")(x)
    h = keras.layers.Add()([h, keras.layers.Dense(32)(h)])
    return keras.Model(inputs, keras.layers.Dense(num_classes)(h))


def tf_stages(input_shape, num_classes):
    """A builder's own split: a list of two stage models."""
    import keras

    first = keras.Sequential([keras.Input(tuple(input_shape)), keras.layers.Flatten(),
                              keras.layers.Dense(32, activation="relu")])
    return [first, keras.Sequential([keras.Input((32,)), keras.layers.Dense(num_classes)])]


def torch_bnd64(input_shape, num_classes):
    """:func:`torch_bn64` whose Dropout layers each draw from their own generator (as every Keras
    Dropout layer does from its own seed): layer L's i-th call draws the same mask in one process
    as in the stage that holds it, whatever the other stages draw.  PyTorch's ``nn.Dropout``
    draws from the process's one generator, whose order in one process (stage after stage, per
    micro-batch) no pipeline of S processes can repeat.  BatchNorm in the first, a middle and the
    last stage at S = 3 and 4."""
    import torch
    from torch import nn

    class ToFloat64(nn.Module):
        def forward(self, x):
            return x.to(torch.float64)

    class LayerDropout(nn.Module):
        def __init__(self, p: float, seed: int) -> None:
            super().__init__()
            self.p, self.generator = p, torch.Generator("cpu").manual_seed(seed)

        def forward(self, x):
            if not self.training:
                return x
            keep = torch.rand(x.shape, generator=self.generator, dtype=x.dtype) >= self.p
            return x * keep / (1 - self.p)

    channels, height, width = input_shape
    flat = 16 * ((height - 4) // 2 - 4) // 2 * ((width - 4) // 2 - 4) // 2
    return nn.Sequential(
        ToFloat64(), nn.Conv2d(channels, 8, 5), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        LayerDropout(0.1, 1), nn.Conv2d(8, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(flat, 64), nn.BatchNorm1d(64), nn.ReLU(), LayerDropout(0.25, 2),
        nn.Linear(64, num_classes)).double()


def tf_bnd64(num_classes):
    """The Keras twin of :func:`torch_bnd64` in float64 (Keras' own Dropout: each layer draws
    from its own seed, fixed when the layer is made), unbuilt: a stage builds its own layers."""
    import keras
    from keras import layers

    f64 = {"dtype": "float64"}
    return keras.Sequential([  # unbuilt: no keras.Input
        layers.Conv2D(8, 5, **f64),
        layers.BatchNormalization(**f64), layers.ReLU(**f64), layers.MaxPooling2D(2, **f64),
        layers.Dropout(0.1, **f64), layers.Conv2D(16, 5, **f64), layers.BatchNormalization(**f64),
        layers.ReLU(**f64), layers.MaxPooling2D(2, **f64), layers.Flatten(**f64),
        layers.Dense(64, **f64), layers.BatchNormalization(**f64), layers.ReLU(**f64),
        layers.Dropout(0.25, **f64), layers.Dense(num_classes, **f64)])
