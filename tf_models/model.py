"""``--model`` on the Keras 3 side: the built-in models, and the check every model passes.

The built-ins are the same networks as :mod:`torch_models.model`: ``cnn``, the reference CNN
(conv 5x5x32 -> ReLU -> maxpool 2 -> conv 5x5x64 -> ReLU -> maxpool 2 -> dense 128 -> ReLU ->
dropout -> dense logits, 184,586 parameters on MNIST) and ``mlp`` (flatten -> dense 128 -> ReLU ->
dropout -> dense logits, 101,770).  Keras is channels-last, so images are ``[N, 28, 28, 1]`` here
and ``[N, 1, 28, 28]`` in PyTorch; the parameter count, the order of the weights (kernel then
bias, layer by layer) and the maths are the same.

The weights are also *initialised* the PyTorch way (kernels and biases uniform in
+-1/sqrt(fan_in)), not with Keras' Glorot-uniform kernels and zero biases: same distribution,
different draws, so both trainers start from statistically identical networks and their training
curves under the shared LR rule are comparable.  (Glorot's dense-layer weights are about twice as
large, which makes the first steps at the scaled LR noticeably rougher.)

A user's ``package.module:function`` is called as ``function(input_shape=..., num_classes=N)``
and must return a ``keras.Model`` mapping ``[B, *input_shape]`` to ``[B, N]`` logits (see
:mod:`ringtrain.model_spec`): ``input_shape`` is an image's ``(H, W, C)``, or the user's data's own
shape (a signal's ``(40,)``, a token sequence's ``(32,)`` of int64 ids).
"""

from __future__ import annotations

import math

import keras
import numpy as np

from ringtrain import model_spec

MNIST_SHAPE = (28, 28, 1)


def _torch_init(fan_in: int) -> dict:
    """PyTorch's default for ``nn.Conv2d``/``nn.Linear``: ``kaiming_uniform_(a=sqrt(5))`` for the
    kernel, which is uniform in +-1/sqrt(fan_in), and the same bound for the bias."""
    bound = fan_in ** -0.5
    return {
        "kernel_initializer": keras.initializers.VarianceScaling(
            scale=1.0 / 3.0, mode="fan_in", distribution="uniform"),
        "bias_initializer": keras.initializers.RandomUniform(-bound, bound),
    }


def cnn_layers(dropout: float = 0.5, dtype_policy: str | None = None,
               input_shape: tuple[int, int, int] = MNIST_SHAPE,
               num_classes: int = 10) -> list[keras.layers.Layer]:
    """The CNN's layers, made (their initializers' seeds drawn, in this order) but not built."""
    policy = dtype_policy or keras.config.dtype_policy().name
    layers = keras.layers
    height, width, channels = input_shape
    flat = ((height - 4) // 2 - 4) // 2 * ((width - 4) // 2 - 4) // 2 * 64
    return [
        layers.Conv2D(32, 5, activation="relu", name="conv1", dtype=policy,
                      **_torch_init(5 * 5 * channels)),
        layers.MaxPooling2D(2, name="pool1", dtype=policy),
        layers.Conv2D(64, 5, activation="relu", name="conv2", dtype=policy,
                      **_torch_init(5 * 5 * 32)),
        layers.MaxPooling2D(2, name="pool2", dtype=policy),
        layers.Flatten(name="flatten", dtype=policy),
        layers.Dense(128, activation="relu", name="fc1", dtype=policy, **_torch_init(flat)),
        layers.Dropout(dropout, name="dropout", dtype=policy),
        layers.Dense(num_classes, name="fc2", dtype="float32", **_torch_init(128))]


def mlp_layers(dropout: float = 0.5, dtype_policy: str | None = None,
               input_shape: tuple[int, ...] = MNIST_SHAPE,
               num_classes: int = 10) -> list[keras.layers.Layer]:
    """The MLP's layers, made but not built (as :func:`cnn_layers`)."""
    policy = dtype_policy or keras.config.dtype_policy().name
    layers = keras.layers
    return [
        layers.Flatten(name="flatten", dtype=policy),
        layers.Dense(128, activation="relu", name="fc1", dtype=policy,
                     **_torch_init(math.prod(input_shape))),
        layers.Dropout(dropout, name="dropout", dtype=policy),
        layers.Dense(num_classes, name="fc2", dtype="float32", **_torch_init(128))]


def _assembled(layers: list[keras.layers.Layer], input_shape, name: str,
               built: bool) -> keras.Model:
    """The layers as a functional model, built (what every strategy but a pipeline trains), or as
    an unbuilt ``Sequential`` (a pipeline builds only its rank's stage: tf_models/stages.py).
    Building draws no seed (each initializer drew its own when made), so both hold the same
    weights once built."""
    if not built:
        return keras.Sequential(layers, name=name)
    x = inputs = keras.Input(shape=input_shape, name="image")
    for layer in layers:
        x = layer(x)
    return keras.Model(inputs, x, name=name)


def build_cnn(dropout: float = 0.5, dtype_policy: str | None = None,
              input_shape: tuple[int, int, int] = MNIST_SHAPE, num_classes: int = 10,
              name: str = "cnn", built: bool = True) -> keras.Model:
    """The CNN, built (its variables exist; ``built=False``: not yet) and returning logits.

    ``dtype_policy`` (e.g. ``"mixed_float16"``) is for ``--amp``; the last layer always returns
    float32 logits so the loss and the softmax never run in half precision.
    """
    return _assembled(cnn_layers(dropout, dtype_policy, input_shape, num_classes), input_shape,
                      name, built)


def build_mlp(dropout: float = 0.5, dtype_policy: str | None = None,
              input_shape: tuple[int, ...] = MNIST_SHAPE, num_classes: int = 10,
              built: bool = True) -> keras.Model:
    """The MLP, built (``built=False``: not yet) and returning logits (float32, as
    :func:`build_cnn`)."""
    return _assembled(mlp_layers(dropout, dtype_policy, input_shape, num_classes), input_shape,
                      "mlp", built)


def instantiate(spec: str, dataset, dropout: float, dtype_policy: str | None = None,
                allowed: tuple[type, ...] = (keras.Model,), wanted: str = "keras.Model",
                built: bool = True):
    """A built-in model (``built=False``: its layers not yet built, for a pipeline), or what the
    user's builder returns if it is one of ``allowed`` (a pipeline also takes a list of stages);
    anything else is one :class:`UserError` line."""
    model_spec.check_builtin_input(spec, dataset)
    shape, classes = tuple(dataset.input_shape), dataset.num_classes
    if spec == "cnn":
        return build_cnn(dropout, dtype_policy, shape, classes, built=built)
    if spec == "mlp":
        return build_mlp(dropout, dtype_policy, shape, classes, built=built)
    model = model_spec.call_builder(spec, shape, classes)
    if not isinstance(model, allowed):
        raise model_spec.wrong_type(spec, model, "tf", wanted)
    return model


def build(spec: str, dataset, dropout: float, dtype_policy: str | None = None) -> keras.Model:
    """The ``--model spec`` for ``dataset`` (its :class:`ringtrain.data.dataset.DataInfo`), checked: a bad
    spec, a builder that fails or returns the wrong thing is one :class:`UserError` line."""
    model = instantiate(spec, dataset, dropout, dtype_policy)
    check(spec, model, tuple(dataset.input_shape), dataset.num_classes, dataset.input_dtype)
    return model


def check(spec: str, model: keras.Model, shape: tuple[int, ...], num_classes: int,
          dtype: str = "float32") -> None:
    """One inference call on two zero inputs (no dropout draws).  Also builds a subclassed
    model's variables before the optimizer and the broadcast need them."""
    model_spec.check_forward(spec, shape, num_classes,
                             lambda: model(np.zeros((2, *shape), dtype), training=False))
