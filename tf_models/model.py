"""The reference CNN (Keras 3 side); ``torch_models.model`` builds the same layers in PyTorch.

conv 5x5x32 -> ReLU -> maxpool 2 -> conv 5x5x64 -> ReLU -> maxpool 2 -> dense 128 -> ReLU
-> dropout -> dense 10 (logits): 184,586 parameters in both frameworks.  Keras is channels-last,
so images are ``[N, 28, 28, 1]`` here and ``[N, 1, 28, 28]`` in PyTorch; the parameter count,
the order of the weights (kernel then bias, layer by layer) and the maths are the same.

The weights are also *initialised* the PyTorch way (kernels and biases uniform in
+-1/sqrt(fan_in)), not with Keras' Glorot-uniform kernels and zero biases: same distribution,
different draws, so both trainers start from statistically identical networks and their training
curves under the shared LR rule are comparable.  (Glorot's dense-layer weights are about twice as
large, which makes the first steps at the scaled LR noticeably rougher.)
"""

from __future__ import annotations

import keras

MODEL_NAME = "mnist-cnn-v1"
PARAM_COUNT = 184_586


def _torch_init(fan_in: int) -> dict:
    """PyTorch's default for ``nn.Conv2d``/``nn.Linear``: ``kaiming_uniform_(a=sqrt(5))`` for the
    kernel, which is uniform in +-1/sqrt(fan_in), and the same bound for the bias."""
    bound = fan_in ** -0.5
    return {
        "kernel_initializer": keras.initializers.VarianceScaling(
            scale=1.0 / 3.0, mode="fan_in", distribution="uniform"),
        "bias_initializer": keras.initializers.RandomUniform(-bound, bound),
    }


def build_model(dropout: float = 0.5, dtype_policy: str | None = None) -> keras.Model:
    """The CNN, built (its variables exist) and returning logits.

    ``dtype_policy`` (e.g. ``"mixed_float16"``) is for ``--amp``; the last layer always returns
    float32 logits so the loss and the softmax never run in half precision.
    """
    policy = dtype_policy or keras.config.dtype_policy().name
    layers = keras.layers
    inputs = keras.Input(shape=(28, 28, 1), name="image")
    x = layers.Conv2D(32, 5, activation="relu", name="conv1", dtype=policy,
                      **_torch_init(5 * 5 * 1))(inputs)
    x = layers.MaxPooling2D(2, name="pool1", dtype=policy)(x)
    x = layers.Conv2D(64, 5, activation="relu", name="conv2", dtype=policy,
                      **_torch_init(5 * 5 * 32))(x)
    x = layers.MaxPooling2D(2, name="pool2", dtype=policy)(x)
    x = layers.Flatten(name="flatten", dtype=policy)(x)
    x = layers.Dense(128, activation="relu", name="fc1", dtype=policy,
                     **_torch_init(4 * 4 * 64))(x)
    x = layers.Dropout(dropout, name="dropout", dtype=policy)(x)
    logits = layers.Dense(10, name="fc2", dtype="float32", **_torch_init(128))(x)
    return keras.Model(inputs, logits, name=MODEL_NAME)
