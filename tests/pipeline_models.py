"""Models for the pipeline tests, as ``--model pipeline_models:NAME`` names them (tests/ on the
path): the built-in CNN's layers in float64 (the equivalence tests compare a pipeline with one
process to float64 rounding), and models a pipeline cannot split or splits by the builder's own
list."""

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
