"""``--model`` split into pipeline stages, on the Keras side (the twin of
:mod:`torch_models.stages`).

What splits: a ``keras.Sequential`` or a functional model that is a chain (each layer reads the
one before: the built-in ``cnn`` and ``mlp``, and a user's), split between its layers, balanced by
parameter count (:func:`ringtrain.strategies.pipeline.partition.balanced_split`); or a builder's list of S
models or layers, the stages themselves.  Whether a functional model is a chain is tested, not
guessed: its layers re-assembled as a ``Sequential`` must compute what the model computes (a
residual connection, two inputs or a shared layer would not).  A stage is a ``Sequential`` of the
model's own layer objects, so its weights are the model's.

**Built stage by stage** when the model arrives unbuilt (a ``keras.Sequential`` without a
``keras.Input``, or a list of such stages; the built-ins are built so for a pipeline): each
layer is called on a symbolic ``KerasTensor`` inside a ``keras.StatelessScope``, which builds it
with its variables *deferred* (shape, dtype and initializer, no value: Keras' own mechanism), so
the split's output shapes and parameter counts come without a single weight.  A rank then
initialises the deferred variables of its own stage's layers only, and the stage is
``keras.Sequential([keras.Input(stage input shape, dtype), *its layers])``; the other layers'
variables never get a value (they are taken off Keras' list of variables to initialise, which
the next ``StatelessScope`` to close would otherwise fill).  The values equal a whole build's with
the same ``keras.utils.set_random_seed``: Keras draws each initializer's seed (an int) when the
layer object is made, and an int-seeded initializer is stateless, so it gives the same values
whenever and in whatever order the variables are initialised.  That is checked for each
variable, not assumed: its initializer must be one of Keras' own with an int seed or a
deterministic one (zeros, ones, constant, ...); any other (a ``SeedGenerator`` seed, whose draws
depend on the order; a function of the user's) builds the model whole.

**Built whole** (as before) when the model arrives built (a ``keras.Input``, a functional model)
or a variable fails that check: the whole model is built on every rank with the same seed on the
stages of a replica, and each rank keeps its stage's layers.  The banner says which and why
(:attr:`Split.built`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from keras.src.initializers.random_initializers import RandomInitializer
from keras.src.random import seed_generator

from ringtrain import model_spec
from ringtrain.errors import UserError
from ringtrain.strategies.pipeline.engine import Boundary
from ringtrain.strategies.pipeline.partition import Stage, stage_ranges, timed_stages
from ringtrain.strategies.pipeline.timing import SLACK, Timing, clock, median_seconds
from tf_models.model import check, instantiate

BY_STAGE = "built stage by stage"


def built_whole(reason: str) -> str:
    """The banner's words for a model built whole on every rank."""
    return f"built whole on every rank ({reason})"


@dataclass
class Split:
    """The stages (their models, None for a stage not built here; facts; the cuts between them,
    one fewer than stages) and how the weights were built (the banner's line)."""

    models: list[keras.Model | None]
    stages: list[Stage]
    cuts: list[Boundary]
    param_count: int
    built: str


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


def build_split(spec: str, dataset, dropout: float, stages: int, keep: int | None = None,
                fits: Callable[[int, int, int], None] | None = None,
                timing: Timing | None = None) -> Split:
    """The ``--model spec`` for ``dataset``, checked as a whole (one call) and split; the
    weights of stage ``keep`` only (None: every stage's, as the tests compare them), built stage
    by stage where the model arrives unbuilt, else the whole model.  ``fits(stage, weight bytes,
    activation bytes per example)`` is called before stage ``keep``'s weights get values (it
    raises when they cannot fit the rank: :mod:`ringtrain.strategies.pipeline.memory`).  With
    ``timing`` (``--partition time``) the split balances the layers' timed seconds
    (:func:`layer_seconds`, agreed between the ranks by ``timing.agree``) instead of their
    parameter counts."""
    shape, dtype = tuple(dataset.input_shape), dataset.input_dtype
    before = _RandomState.take()
    built = instantiate(spec, dataset, dropout, allowed=(keras.Model, list, tuple),
                        wanted="keras.Model (or a list of stages)", built=False)
    layers, given = _chain(spec, built, shape, dtype)
    if any(layer.built and layer.weights for layer in layers):  # weights exist already
        return _whole(spec, dataset, layers, given, stages, "the model arrived built", timing)
    deferred = _deferred(spec, dataset, layers)
    if isinstance(deferred, str):
        before.restore()  # the same layers again, with the same seeds, built whole
        built = instantiate(spec, dataset, dropout, allowed=(keras.Model, list, tuple),
                            wanted="keras.Model (or a list of stages)")
        return _whole(spec, dataset, _chain(spec, built, shape, dtype)[0], given, stages,
                      deferred, timing)
    outputs, variables = deferred
    counts = [layer.count_params() for layer in layers]
    costs = None if timing is None or given else timing.agree(
        lambda: layer_seconds(layers, outputs, shape, dtype, timing))
    # The split before any weight exists: more stages than layers with weights is one line here.
    ranges = stage_ranges(counts, [math.prod(s) for s, _ in outputs], stages, given, spec, costs,
                          SLACK if costs else 0.0)
    wanted = range(stages) if keep is None else [keep]
    if fits is not None and keep is not None:
        mine = ranges[keep]
        fits(keep, sum(math.prod(v.shape) * np.dtype(v.dtype).itemsize for i in mine
                       for v in variables[i]),
             sum(math.prod(outputs[i][0]) * np.dtype(outputs[i][1]).itemsize for i in mine))
    for index in wanted:
        for i in ranges[index]:
            for v in variables[i]:
                v._deferred_initialize()  # Keras' own first use of a deferred variable
    return _assemble(layers, ranges, outputs, shape, dtype, wanted, BY_STAGE, costs)


def _whole(spec: str, dataset, layers, given: bool, stages: int, reason: str,
           timing: Timing | None = None) -> Split:
    """Every layer built whole, by one call of the chain; each stage a Sequential of them."""
    shape, dtype = tuple(dataset.input_shape), dataset.input_dtype
    whole = keras.Sequential([keras.Input(shape, dtype=dtype), *layers])
    check(spec, whole, shape, dataset.num_classes, dtype)
    outputs = _output_shapes(layers, shape, dtype)
    counts = [layer.count_params() for layer in layers]
    costs = None if timing is None or given else timing.agree(
        lambda: layer_seconds(layers, outputs, shape, dtype, timing))
    ranges = stage_ranges(counts, [math.prod(s) for s, _ in outputs], stages, given, spec, costs,
                          SLACK if costs else 0.0)
    return _assemble(layers, ranges, outputs, shape, dtype, range(stages), built_whole(reason),
                     costs)


def _assemble(layers, ranges, outputs, shape, dtype, wanted, built: str, costs=None) -> Split:
    models, facts, cuts = [], [], []
    for index, r in enumerate(ranges):
        inp, in_dtype = (shape, dtype) if r.start == 0 else outputs[r.start - 1]
        out = outputs[r.stop - 1][0]
        models.append(keras.Sequential([keras.Input(inp, dtype=in_dtype),
                                        *(layers[i] for i in r)], name=f"stage{index}")
                      if index in wanted else None)
        weights = [w for i in r for w in layers[i].weights]  # a deferred one has shape and dtype
        facts.append(Stage(index, tuple(layers[i].name for i in r),
                           sum(layers[i].count_params() for i in r),
                           sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize for w in weights),
                           tuple(inp), tuple(out)))
        if index < len(ranges) - 1:
            cuts.append(Boundary(tuple(out), np.dtype(outputs[r.stop - 1][1])))
    return Split(models, timed_stages(facts, costs), cuts,
                 sum(layer.count_params() for layer in layers), built)


def _output_shapes(layers, shape, dtype: str) -> list[tuple[tuple[int, ...], str]]:
    """Each layer's output for one example: (shape, dtype), from a call on two zero inputs in
    inference mode."""
    x = np.zeros((2, *shape), dtype)
    out = []
    for layer in layers:
        x = layer(x, training=False)
        out.append((tuple(x.shape[1:]), x.dtype.name if hasattr(x.dtype, "name") else str(x.dtype)))
    return out


# --- --partition time ---------------------------------------------------------------------------

def layer_seconds(layers, outputs, shape, dtype: str, timing: Timing) -> list[float]:
    """Each layer's forward pass and its backward pass (a Keras stage's backward runs the forward
    again under a tape: :class:`tf_models.pipeline.Traced`), each a traced function, on
    ``timing.rows`` rows, timed alone.  The timed layer is a throwaway copy made from the layer's
    config (``from_config(get_config())``) and built with values of its own, so the model's own
    variables stay deferred (no value: no rank holds the whole model for this), and at most one
    layer's copy exists at a time.  Making a copy draws seeds (an unseeded initializer or
    Dropout draws from Python's generator) and layer names: the random state and name counters
    the build depends on are put back afterwards (:class:`_RandomState`)."""
    state = _RandomState.take()
    rng = np.random.default_rng(0)  # private: the probe inputs
    try:
        costs = []
        for i, layer in enumerate(layers):
            inp = (tuple(shape), dtype) if i == 0 else outputs[i - 1]
            costs.append(_time_layer(layer, inp, i > 0, timing, rng))
        return costs
    finally:
        state.restore()


def _time_layer(layer, inp, input_grad: bool, timing: Timing, rng) -> float:
    """One layer's median forward + (forward + backward) seconds, on a copy of it."""
    in_shape, in_dtype = inp
    floating = np.dtype(in_dtype).kind == "f"
    x = tf.constant(rng.standard_normal((timing.rows, *in_shape)).astype(in_dtype) if floating
                    else np.zeros((timing.rows, *in_shape), in_dtype))  # token ids: row 0
    alone = type(layer).from_config(layer.get_config())
    alone(x, training=False)  # built eagerly: its variables made outside the traced functions
    forward = tf.function(lambda v: alone(v, training=True))
    watch = input_grad and floating
    weights = alone.trainable_variables

    @tf.function
    def backward(v):
        with tf.GradientTape() as tape:
            if watch:
                tape.watch(v)
            out = alone(v, training=True)
        return tape.gradient(out, [*([v] if watch else []), *weights],
                             output_gradients=tf.ones_like(out))

    trains = (watch or weights) and keras.backend.standardize_dtype(forward(x).dtype).startswith("float")

    def once() -> float:
        t0 = clock()
        forward(x)
        if trains:
            backward(x)
        return clock() - t0

    return median_seconds(once, timing.repeats)


# --- stage by stage ---------------------------------------------------------------------------------

class _RandomState:
    """What a builder's layers draw their seeds from (Python's generator, NumPy's, Keras' global
    SeedGenerator) and the layer-name counters, so that building the model again after a failed
    attempt makes the same layers, with the same seeds and names."""

    def __init__(self, python, numpy, generator, names) -> None:
        self.python, self.numpy, self.generator, self.names = python, numpy, generator, names

    @classmethod
    def take(cls) -> _RandomState:
        gen = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
        names = global_state.get_global_attribute("object_name_uids")
        return cls(random.getstate(), np.random.get_state(),
                   (gen, None if gen is None else gen.state.numpy()),
                   None if names is None else dict(names))

    def restore(self) -> None:
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        gen, state = self.generator
        global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, gen)
        if gen is not None:
            gen.state.assign(state)
        if self.names is None:  # no name given yet: Keras starts the counters afresh
            global_state.set_global_attribute("object_name_uids", None)
        else:
            global_state.get_global_attribute("object_name_uids").clear()
            global_state.get_global_attribute("object_name_uids").update(self.names)


def _deferred(spec: str, dataset, layers):
    """The unbuilt chain built symbolically, its variables deferred: (each layer's output shape
    and dtype, each layer's deferred variables), or why the stages cannot be built alone."""
    shape, dtype = tuple(dataset.input_shape), dataset.input_dtype
    x, outputs = keras.KerasTensor((2, *shape), dtype=dtype), []
    pending = global_state.get_global_attribute("uninitialized_variables", [], set_to_default=True)
    already = {id(v) for v in pending}
    try:
        # initialize_variables=False: closing the scope must not give every variable its value.
        with keras.StatelessScope(initialize_variables=False):
            for layer in layers:
                x = layer(x, training=False)
                outputs.append((tuple(x.shape[1:]), keras.backend.standardize_dtype(x.dtype)))
    except Exception as err:
        why = f"building it symbolically failed: {type(err).__name__}"
    else:
        why = None
    ours = [v for v in global_state.get_global_attribute("uninitialized_variables")
            if id(v) not in already]
    # Off Keras' list of variables to initialise: only this rank's stage gets values, by hand;
    # the next StatelessScope to close (a symbolic call inside Keras) would give all of them one.
    global_state.set_global_attribute(
        "uninitialized_variables",
        [v for v in global_state.get_global_attribute("uninitialized_variables")
         if id(v) in already])
    if why:
        return why
    model_spec.check_output(spec, shape, (2, *outputs[-1][0]), dataset.num_classes)
    mine = {id(v) for v in ours}
    variables = []
    for layer in layers:
        variables.append([v for v in layer.weights if id(v) in mine])
        for v in variables[-1]:
            if not _same_whenever(v._initializer):
                return (f"{layer.name}'s {v.name} is initialised by "
                        f"{type(v._initializer).__name__}, whose values may depend on when it "
                        f"runs")
    return outputs, variables


def _same_whenever(initializer) -> bool:
    """Whether ``initializer`` gives the same values whenever, in whatever order, it is called:
    Keras' own, stateless (an int seed, drawn when the layer was made), or a Keras layer's own
    seed generator's starting state."""
    if isinstance(initializer, RandomInitializer):
        return isinstance(initializer.seed, int)
    if isinstance(initializer, keras.initializers.Initializer):
        return type(initializer).__module__.startswith("keras.")
    # SeedGenerator's state starts at [its seed, 0]: its seed was drawn when it was made.
    return getattr(initializer, "__qualname__", "") == "SeedGenerator.__init__.<locals>.seed_initializer"
