"""``--model`` split into pipeline stages, on the Keras side (the twin of
:mod:`torch_models.stages`).

What splits: a ``keras.Sequential`` or a functional model that is a chain (each layer reads the
one before: the built-in ``cnn`` and ``mlp``, and a user's), split between its layers, balanced by
parameter count (:func:`ringtrain.strategies.pipeline.partition.balanced_split`); or a builder's list of S
models or layers, the stages themselves.  Whether a functional model is a chain is tested, not
guessed: its layers re-assembled as a ``Sequential`` must compute what the model computes (a
residual connection, two inputs or a shared layer would not).  A stage is a ``Sequential`` of the
model's own layer objects, so its weights are the model's.

As in PyTorch the whole model is built on every rank, with the same seed on the stages of a
replica, and each rank keeps its stage's layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import keras
import numpy as np

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline.engine import Boundary
from ringtrain.strategies.pipeline.partition import Stage, stage_ranges
from tf_models.model import check, instantiate


@dataclass
class Split:
    """The stages (their models; facts; the cuts between them, one fewer than stages)."""

    models: list[keras.Model]
    stages: list[Stage]
    cuts: list[Boundary]
    param_count: int


def _chain(spec: str, model, shape, dtype: str) -> tuple[list[keras.layers.Layer], bool]:
    """The model's layers in order and whether they are already the stages (a builder's list)."""
    if isinstance(model, (list, tuple)):
        if not all(isinstance(m, keras.layers.Layer) for m in model):
            raise UserError(f"--model {spec} returned a list holding something other than Keras "
                            f"models or layers; a list of stages must hold keras.Model objects")
        return list(model), True
    layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
    if not isinstance(model, keras.Sequential):
        probe = np.random.default_rng(0).standard_normal((2, *shape)).astype(dtype) \
            if dtype.startswith("float") else np.zeros((2, *shape), dtype)
        try:
            chain = keras.Sequential([keras.Input(shape, dtype=dtype), *layers])
            same = np.allclose(chain(probe, training=False), model(probe, training=False))
        except Exception:
            same = False
        if not layers or not same:
            raise UserError(f"--model {spec} is not a chain of layers (each reading the one "
                            f"before), so --pipeline-stages cannot split it: return a "
                            f"keras.Sequential or a chain, or a list of one model per stage")
    return layers, False


def build_split(spec: str, dataset, dropout: float, stages: int) -> Split:
    """The ``--model spec`` for ``dataset``, checked as a whole (one call) and split."""
    shape, dtype = tuple(dataset.input_shape), dataset.input_dtype
    built = instantiate(spec, dataset, dropout, allowed=(keras.Model, list, tuple),
                        wanted="keras.Model (or a list of stages)")
    layers, given = _chain(spec, built, shape, dtype)
    whole = keras.Sequential([keras.Input(shape, dtype=dtype), *layers])
    check(spec, whole, shape, dataset.num_classes, dtype)
    outputs = _output_shapes(layers, shape, dtype)
    counts = [layer.count_params() for layer in layers]
    ranges = stage_ranges(counts, [math.prod(s) for s, _ in outputs], stages, given, spec)
    models, facts, cuts = [], [], []
    for index, r in enumerate(ranges):
        inp, in_dtype = (shape, dtype) if r.start == 0 else outputs[r.start - 1]
        stage = keras.Sequential([keras.Input(inp, dtype=in_dtype), *(layers[i] for i in r)],
                                 name=f"stage{index}")
        out = outputs[r.stop - 1][0]
        models.append(stage)
        facts.append(Stage(index, tuple(layers[i].name for i in r), stage.count_params(),
                           sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize
                               for w in stage.weights),
                           tuple(inp), tuple(out)))
        if index < stages - 1:
            cuts.append(Boundary(tuple(out), np.dtype(outputs[r.stop - 1][1])))
    return Split(models, facts, cuts, sum(counts))


def _output_shapes(layers, shape, dtype: str) -> list[tuple[tuple[int, ...], str]]:
    """Each layer's output for one example: (shape, dtype), from a call on two zero inputs in
    inference mode."""
    x = np.zeros((2, *shape), dtype)
    out = []
    for layer in layers:
        x = layer(x, training=False)
        out.append((tuple(x.shape[1:]), x.dtype.name if hasattr(x.dtype, "name") else str(x.dtype)))
    return out
