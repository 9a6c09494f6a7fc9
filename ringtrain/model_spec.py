"""``--model``: the built-in models by name, or a user's builder as ``package.module:function``.

Framework-free: the spec's syntax is checked with the other flags before any framework is imported;
the builder is imported and called, and what it returns checked, by the framework's model module
(:mod:`torch_models.model`, :mod:`tf_models.model`) right after ``hvd.init()``, on every rank
and before any collective, so a bad spec ends every rank with the same line instead of leaving
some of them waiting for the others.

A builder is called with the keyword arguments it accepts of ``input_shape`` and ``num_classes``
(:func:`ringtrain.user_code.call`): ``input_shape`` is one example's shape in the framework's
layout (PyTorch ``(channels, height, width)``, Keras ``(height, width, channels)``), and the model
it returns maps a batch of them to ``num_classes`` logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ringtrain import user_code
from ringtrain.errors import UserError

BUILTIN = ("cnn", "mlp")


def check_spec(spec: str) -> str:
    """The syntax check, before any framework import."""
    if spec not in BUILTIN and not user_code.SPEC.match(spec):
        raise UserError(f"--model must be {', '.join(BUILTIN)} or package.module:function (a "
                        f"function that builds your model), got {spec!r}")
    return spec


CNN_MIN_SIDE = 16  # two 5x5 convolutions, each followed by a 2x2 pool, leave 1 pixel of 16


def check_builtin_input(spec: str, data) -> None:
    """The built-in CNN needs images of at least 16 x 16 pixels, the built-in MLP float inputs
    (``data`` a :class:`ringtrain.data.dataset.DataInfo`); said before the framework tries, whose
    errors differ (Keras raises while building)."""
    if spec == "mlp" and data.input_dtype != "float32":
        raise UserError(f"--model mlp reads float features; --data {data.spec} gives "
                        f"{data.input_dtype} token ids of shape {tuple(data.input_shape)}: bring a "
                        f"model that embeds them (--model package.module:function)")
    if spec != "cnn":
        return
    if not data.image:
        raise UserError(f"--model cnn reads images; --data {data.spec} gives {data.input_dtype} "
                        f"inputs of shape {tuple(data.input_shape)}: use --model mlp (float "
                        f"features) or your own --model")
    height, width, _ = data.input_shape
    if spec == "cnn" and min(height, width) < CNN_MIN_SIDE:
        raise UserError(f"--model cnn needs images of at least {CNN_MIN_SIDE}x{CNN_MIN_SIDE} pixels "
                        f"(two 5x5 convolutions and 2x2 pools), the data's are {height}x{width}; "
                        f"use --image-size, --model mlp or your own --model")


def model_name(spec: str, dataset_name: str) -> str:
    """What checkpoints and summaries record: ``mnist-cnn-v1`` for the built-in CNN on MNIST
    (the name checkpoints have always carried), the spec itself for a user's builder."""
    return f"{dataset_name}-{spec}-v1" if spec in BUILTIN else spec


def call_builder(spec: str, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The user's builder called with the keyword arguments it accepts of ``input_shape`` and
    ``num_classes`` (``torchvision.models.resnet18`` takes ``num_classes`` only)."""
    builder = user_code.import_function("--model", spec, "builds a model")
    return user_code.call("--model", spec, builder,
                          {"input_shape": input_shape, "num_classes": num_classes})


def wrong_type(spec: str, model: Any, framework: str, wanted: str) -> UserError:
    got = f"{type(model).__module__}.{type(model).__qualname__}"
    return UserError(f"--model {spec} returned a {got}, but --framework {framework} needs a "
                     f"{wanted}")


def check_output(spec: str, input_shape: tuple[int, ...], output_shape: tuple[int, ...],
                 num_classes: int) -> None:
    """The model must map a batch ``[B, *input_shape]`` to logits ``[B, num_classes]``."""
    if tuple(output_shape[1:]) != (num_classes,):
        raise UserError(f"--model {spec} maps inputs of shape {tuple(input_shape)} to outputs of "
                        f"shape {tuple(output_shape[1:])}, expected ({num_classes},): one logit per "
                        f"class")


def check_forward(spec: str, shape: tuple[int, ...], num_classes: int,
                  forward: Callable[[], Any]) -> None:
    """Run the framework's ``forward`` (the model on two zero images, in inference mode): it must
    map ``[2, *shape]`` to logits ``[2, num_classes]``; anything else is one line."""
    try:
        out = forward()
    except Exception as err:
        raise UserError(f"--model {spec}: a forward pass on a batch of shape {(2, *shape)} failed: "
                        f"{type(err).__name__}: {user_code.one_line(err)}") from None
    if not hasattr(out, "shape"):
        raise UserError(f"--model {spec} returns a {type(out).__name__}, not a tensor of logits")
    check_output(spec, shape, tuple(out.shape), num_classes)
