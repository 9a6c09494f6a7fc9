"""A pipeline rank builds only its own stage's weights (torch_models/stages.py,
tf_models/stages.py; docs/pipeline.md, "What is built where"), in one process, no launch.

For every stage index the stage built alone must equal, value for value and dtype for dtype,
that stage's layers in the model one process builds whole with the same seed: what the
pipeline's float64 equivalence runs (tests/test_pipeline.py) rely on.  The other stages' layers
must hold no memory (PyTorch: meta tensors; Keras: deferred variables).  A model the replay cannot
reproduce exactly is built whole instead, with the reason in the banner's line, and still equals
the one-process build.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import pytest

from ringtrain.data.dataset import DataInfo
from ringtrain.errors import UserError

MNIST = DataInfo("mnist", "mnist", (28, 28, 1), 10, [str(i) for i in range(10)], 60000, 10000,
                 None, input_dtype="float32", image=True)
TOKENS = DataInfo("tokens", "user_inputs:tokens", (12,), 5, None, 100, 20, None,
                  input_dtype="int64", image=False)
SEED = 11


# --- the models, as --model test_stage_build:NAME names them ----------------------------------------

def torch_bn_dropout(input_shape, num_classes):
    """Conv2d + BatchNorm2d + Dropout + Linear."""
    from torch import nn

    channels, height, width = input_shape
    return nn.Sequential(nn.Conv2d(channels, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Dropout(0.2), nn.Flatten(), nn.Linear(6 * 12 * 12, 32),
                         nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(32, num_classes))


def torch_embedding(input_shape, num_classes):
    """Token ids through an Embedding (a padding row), averaged, two Linears: no LSTM."""
    from torch import nn

    class Mean(nn.Module):
        def forward(self, x):
            return x.mean(dim=1)

    return nn.Sequential(nn.Embedding(50, 16, padding_idx=0), Mean(), nn.Linear(16, 16),
                         nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, num_classes))


def torch_stage_list(input_shape, num_classes):
    """A builder's own stages, three of them."""
    from torch import nn

    return [nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 24), nn.ReLU()),
            nn.Sequential(nn.Linear(24, 24), nn.BatchNorm1d(24), nn.ReLU()),
            nn.Sequential(nn.Dropout(0.1), nn.Linear(24, num_classes))]


def torch_attention(input_shape, num_classes):
    """nn.MultiheadAttention initialises in its own _reset_parameters: no replay."""
    from torch import nn

    class SelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.MultiheadAttention(28, 2, batch_first=True)

        def forward(self, x):
            return self.attention(x, x, x)[0]

    class Rows(nn.Module):
        def forward(self, x):
            return x.flatten(1, 2)

    return nn.Sequential(Rows(), nn.Linear(28, 28), SelfAttention(), nn.Flatten(),
                         nn.Linear(28 * 28, num_classes))


def torch_zeroed_bias(input_shape, num_classes):
    """A builder that initialises a layer again after making it."""
    from torch import nn

    first = nn.Linear(math.prod(input_shape), 16)
    nn.init.zeros_(first.bias)
    return nn.Sequential(nn.Flatten(), first, nn.ReLU(), nn.Linear(16, num_classes))


def torch_made_out_of_order(input_shape, num_classes):
    """Its last layer made first: the replay's order (the chain's) would draw otherwise."""
    from torch import nn

    last = nn.Linear(16, num_classes)
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 16), nn.ReLU(), last)


def torch_own_draw(input_shape, num_classes):
    """A builder that draws from the CPU generator itself (a random width)."""
    import torch
    from torch import nn

    width = 8 + int(torch.randint(0, 8, (1,), device="cpu"))
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                         nn.Linear(width, num_classes))


def torch_lazy(input_shape, num_classes):
    from torch import nn

    return nn.Sequential(nn.Flatten(), nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, num_classes))


def keras_bn_dropout(input_shape, num_classes):
    """Unbuilt (no keras.Input): Conv2D + BatchNormalization + Dropout + Dense."""
    import keras
    from keras import layers

    return keras.Sequential([layers.Conv2D(6, 5), layers.BatchNormalization(), layers.ReLU(),
                             layers.MaxPooling2D(2), layers.Dropout(0.2), layers.Flatten(),
                             layers.Dense(32), layers.BatchNormalization(), layers.ReLU(),
                             layers.Dropout(0.3), layers.Dense(num_classes)])


def keras_embedding(input_shape, num_classes):
    import keras
    from keras import layers

    return keras.Sequential([layers.Embedding(50, 16), layers.GlobalAveragePooling1D(),
                             layers.Dense(16), layers.LayerNormalization(), layers.ReLU(),
                             layers.Dense(num_classes)])


def keras_stage_list(input_shape, num_classes):
    """A builder's own stages, unbuilt."""
    import keras
    from keras import layers

    return [keras.Sequential([layers.Flatten(), layers.Dense(24, activation="relu")]),
            keras.Sequential([layers.Dense(24), layers.BatchNormalization(), layers.ReLU()]),
            keras.Sequential([layers.Dropout(0.1), layers.Dense(num_classes)])]


def keras_built(input_shape, num_classes):
    """Arrives built (a keras.Input)."""
    import keras
    from keras import layers

    return keras.Sequential([keras.Input(tuple(input_shape)), layers.Flatten(),
                             layers.Dense(16, activation="relu"), layers.Dense(num_classes)])


def keras_generator_seeded(input_shape, num_classes):
    """Initializers drawing from one SeedGenerator: their values depend on the order they run."""
    import keras
    from keras import layers

    seeds = keras.random.SeedGenerator(3)
    return keras.Sequential([
        layers.Flatten(),
        layers.Dense(16, kernel_initializer=keras.initializers.RandomNormal(seed=seeds)),
        layers.Dense(num_classes, kernel_initializer=keras.initializers.RandomNormal(seed=seeds))])


# --- PyTorch ------------------------------------------------------------------------------------------

def torch_whole(spec: str, data: DataInfo):
    """The one-process build with the seed: its chain of layers."""
    import torch

    from torch_models import stages
    from torch_models.model import check, instantiate, model_shape

    torch.manual_seed(SEED)
    built = instantiate(spec, data, 0.5, (torch.nn.Module, list, tuple))
    layers = stages._chain(spec, built)[0]
    # its forward pass, as torch_models.model.build's check (it materialises a lazy module)
    check(spec, torch.nn.Sequential(OrderedDict(layers)), model_shape(data), data.num_classes,
          getattr(torch, data.input_dtype))
    return layers


def torch_state(layers) -> dict:
    return {f"{i}.{k}": v for i, (_, m) in enumerate(layers) for k, v in m.state_dict().items()}


def torch_split(spec: str, data: DataInfo, stages_: int, keep):
    import torch

    from torch_models import stages

    torch.manual_seed(SEED)
    return stages.build(spec, data, 0.5, stages_, keep=keep)


@pytest.mark.parametrize("spec,data,count", [
    ("cnn", MNIST, 4), ("mlp", MNIST, 2), ("pipeline_models:torch_cnn64", MNIST, 3),
    ("test_stage_build:torch_bn_dropout", MNIST, 3), ("test_stage_build:torch_embedding", TOKENS, 3),
    ("test_stage_build:torch_stage_list", MNIST, 3)])
def test_torch_each_stage_built_alone_equals_its_layers_of_the_whole_build(spec, data, count):
    from torch_models import stages

    whole = torch_whole(spec, data)
    for keep in range(count):
        split = torch_split(spec, data, count, keep)
        assert split.built == stages.BY_STAGE
        assert [m is None for m in split.modules] == [i != keep for i in range(count)]
        torch_compare(split, whole, keep, spec)


def torch_compare(split, whole, keep: int, spec: str) -> None:
    """Stage ``keep`` of ``split`` holds the whole build's layers at its place, value for value."""
    import torch

    mine = split.modules[keep]
    first = sum(len(s.layers) for s in split.stages[:keep])
    ref = torch_state(whole[first:first + len(mine)])
    got = torch_state(list(mine.named_children()))
    assert [k.split(".", 1)[1] for k in got] == [k.split(".", 1)[1] for k in ref]
    for (name, a), b in zip(got.items(), ref.values(), strict=True):
        assert a.device.type == "cpu" and a.dtype == b.dtype, name
        assert torch.equal(a, b), f"stage {keep} of {spec}: {name} differs"


def test_torch_a_stage_holds_no_later_layer_and_one_earlier_layer_at_a_time(monkeypatch):
    """Stage 2 of 3 of an MLP of equal layers: while the layers before it are replayed, at most
    one of them has memory beside the stage's own, and all of them the same bytes (one scratch
    buffer, allocated once: the first layer is the largest); the layers after it never have
    any."""
    import torch

    from torch_models import stages

    monkeypatch.setenv("BENCH_MLP", "64,6")
    seen, scratches, layers = [], set(), []
    replay = stages._Meta.replay

    def watched(self, layer, device, trace=None, scratch=None):
        replay(self, layer, device, trace, scratch=scratch)
        if scratch is not None:
            at = scratch.untyped_storage().data_ptr()
            scratches.add(at)
            assert all(p.untyped_storage().data_ptr() == at for p in layer.parameters())
        if device == "cpu":
            layers[:] = [self.layers]
            seen.append([sum(p.numel() for p in m.parameters() if p.device.type == "cpu")
                         for _, m in self.layers])

    monkeypatch.setattr(stages._Meta, "replay", watched)
    torch.manual_seed(SEED)
    split = stages.build("bench.parts.model_parallel:mlp", MNIST, 0.5, 3, keep=1)
    assert split.built == stages.BY_STAGE
    layer_of = [i for i, s in enumerate(split.stages) for _ in s.layers]
    mine = [i for i, s in enumerate(layer_of) if s == 1]
    # replayed: the stage's layers and the earlier ones with weights (the others draw nothing)
    weighted = [i for i, (_, m) in enumerate(layers[0]) if next(m.parameters(), None) is not None]
    assert len(seen) == len(mine) + sum(1 for i in weighted if i < mine[0])
    for cpu in seen:
        assert all(n == 0 for n in cpu[mine[-1] + 1:])
        assert sum(1 for i, n in enumerate(cpu[:mine[0]]) if n) <= 1
    assert sum(seen[-1][i] for i in mine) == split.stages[1].params == sum(seen[-1])
    assert len(scratches) == 1


@pytest.mark.parametrize("spec,reason", [
    ("test_stage_build:torch_attention", "MultiheadAttention holds weights but has no reset_parameters()"),
    ("test_stage_build:torch_zeroed_bias", "initialised its weights otherwise than reset_parameters()"),
    ("test_stage_build:torch_made_out_of_order", "initialised its weights otherwise than reset_parameters()"),
    ("test_stage_build:torch_own_draw", "drew from the CPU random generator itself"),
    ("test_stage_build:torch_lazy", "LazyLinear is a lazy module"),
])
def test_torch_what_the_replay_cannot_reproduce_is_built_whole_and_equal(spec, reason):
    import torch

    whole = torch_whole(spec, MNIST)
    split = torch_split(spec, MNIST, 2, 1)
    assert split.built.startswith("built whole on every rank (") and reason in split.built
    ours = torch_state([(n, m) for s in split.modules for n, m in s.named_children()])
    ref = torch_state(whole)
    assert list(ours) == list(ref)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)


def test_torch_the_meta_build_draws_nothing_from_the_cpu_generator():
    import torch

    from torch_models import stages

    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    meta = stages._on_meta("cnn", MNIST, 0.5, (1, 28, 28), torch.float32)
    assert isinstance(meta, stages._Meta)
    assert torch.equal(before, torch.get_rng_state())
    assert all(p.device.type == "meta" for _, m in meta.layers for p in m.parameters())


def test_torch_too_many_stages_is_one_line_before_any_weight_exists(monkeypatch):
    from torch_models import stages

    def refuse(*args):
        raise AssertionError("a layer was materialised before the split was checked")

    monkeypatch.setattr(stages._Meta, "replay", refuse)
    with pytest.raises(UserError, match="--pipeline-stages 5 is more than the 4 layers with weights"):
        torch_split("cnn", MNIST, 5, 0)


# --partition time: rank 0 times each layer alone, on a copy; the weights are the whole build's.

@pytest.mark.parametrize("spec,data,count", [
    ("cnn", MNIST, 3), ("test_stage_build:torch_bn_dropout", MNIST, 3),
    ("test_stage_build:torch_embedding", TOKENS, 3),
    ("test_stage_build:torch_attention", MNIST, 2)])  # built whole, timed all the same
def test_torch_stages_split_by_time_hold_the_whole_builds_weights(spec, data, count):
    import torch

    from ringtrain.strategies.pipeline import timing
    from torch_models import stages

    whole = torch_whole(spec, data)
    for keep in range(count):
        torch.manual_seed(SEED)
        split = stages.build(spec, data, 0.5, count, keep=keep, timing=timing.in_process(4, repeats=1))
        assert (split.built == stages.BY_STAGE) == ("attention" not in spec), split.built
        assert all(s.time_share is not None for s in split.stages)
        torch_compare(split, whole, keep, spec)


def test_torch_timing_leaves_every_random_generator_where_it_was_and_the_model_on_meta():
    """The layers' Dropout draws its masks from the CPU generator while timed: the generator the
    weight replay draws from must be where it was (and NumPy's and Python's), and no layer of the
    model itself gets storage (each timed layer is a copy)."""
    import random

    import torch

    from ringtrain.strategies.pipeline import timing
    from torch_models import stages

    meta = stages._on_meta("test_stage_build:torch_bn_dropout", MNIST, 0.5, (1, 28, 28),
                           torch.float32)
    torch.manual_seed(SEED)
    np.random.seed(SEED)
    random.seed(SEED)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    costs = stages.layer_seconds(meta.layers, meta.sizes, (1, 28, 28), torch.float32,
                                 timing.in_process(4, repeats=2))
    assert len(costs) == len(meta.layers) and all(c >= 0 for c in costs)
    assert torch.equal(before[0], torch.get_rng_state())
    assert np.array_equal(before[1], np.random.get_state()[1]) and before[2] == random.getstate()
    assert all(t.device.type == "meta" for _, m in meta.layers
               for t in [*m.parameters(), *m.buffers()])


# --- Keras --------------------------------------------------------------------------------------------

def keras_whole(spec: str, data: DataInfo) -> list[list[list[np.ndarray]]]:
    """The one-process build with the seed (the ring's: tf_models.model.build, built whole):
    for each element of the chain, each of its layers' weights (layer names differ from build to
    build in one process, so the comparison is by position)."""
    import keras

    from tf_models import model, stages

    keras.utils.set_random_seed(SEED)
    built = model.instantiate(spec, data, 0.5, allowed=(keras.Model, list, tuple))
    items = built if isinstance(built, list) else [built]
    x = np.zeros((2, *data.input_shape), data.input_dtype)
    for item in items:  # a list's stages built one after another, each on the last's output
        x = item(x, training=False)
    chain = stages._chain(spec, built, tuple(data.input_shape), data.input_dtype)[0]
    return [[[w.numpy() for w in layer.weights] for layer in keras_layers(element)]
            for element in chain]


def keras_split(spec: str, data: DataInfo, stages_: int, keep):
    import keras

    from tf_models import stages

    keras.utils.set_random_seed(SEED)
    return stages.build_split(spec, data, 0.5, stages_, keep=keep)


def keras_layers(model) -> list:
    """A model's layers in order, a builder's stage Sequential opened up."""
    if not hasattr(model, "layers"):
        return [model]
    return [leaf for layer in model.layers for leaf in keras_layers(layer)]


def keras_compare(model, whole, first: int, what: str) -> None:
    """``model``'s layers hold the weights of the whole build's chain from element ``first``."""
    ref = [layer for element in whole[first:] for layer in element]
    layers = keras_layers(model)
    assert layers and len(layers) <= len(ref)
    for layer, weights in zip(layers, ref, strict=False):
        assert len(layer.weights) == len(weights), f"{what}: {layer.name}"
        for w, r in zip(layer.weights, weights, strict=True):
            assert w.dtype == r.dtype.name and np.array_equal(w.numpy(), r), f"{what}: {w.path} differs"


@pytest.mark.parametrize("spec,data,count", [
    ("cnn", MNIST, 4), ("mlp", MNIST, 2), ("test_stage_build:keras_bn_dropout", MNIST, 3),
    ("test_stage_build:keras_embedding", TOKENS, 3), ("test_stage_build:keras_stage_list", MNIST, 3)])
def test_keras_each_stage_built_alone_equals_its_layers_of_the_whole_build(spec, data, count):
    from tf_models import stages

    whole = keras_whole(spec, data)
    for keep in range(count):
        split = keras_split(spec, data, count, keep)
        assert split.built == stages.BY_STAGE
        assert [m is None for m in split.models] == [i != keep for i in range(count)]
        layers = keras_layers(split.models[keep])
        assert sum(layer.count_params() for layer in layers) == split.stages[keep].params
        first = sum(len(s.layers) for s in split.stages[:keep])
        keras_compare(split.models[keep], whole, first, f"stage {keep} of {spec}")


def test_keras_the_other_stages_variables_get_no_value(monkeypatch):
    """Stage 1 of the CNN's 4: every variable outside it stays deferred (no value, no memory),
    also after the stage's Sequential is made and called (a closing StatelessScope)."""
    from tf_models import stages

    made = {}
    instantiate = stages.instantiate

    def keep_it(*args, **kwargs):
        made["model"] = instantiate(*args, **kwargs)
        return made["model"]

    monkeypatch.setattr(stages, "instantiate", keep_it)
    split = keras_split("cnn", MNIST, 4, 1)
    split.models[1](np.zeros((2, 12, 12, 32), "float32"), training=False)
    mine = {layer.name for layer in split.models[1].layers}
    for layer in made["model"].layers:
        for v in layer.weights:
            assert (v._value is not None) == (layer.name in mine), v.path


@pytest.mark.parametrize("spec,reason", [
    ("test_stage_build:keras_built", "the model arrived built"),
    ("pipeline_models:tf_cnn64", "the model arrived built"),
    ("test_stage_build:keras_generator_seeded", "is initialised by RandomNormal, whose values may "
                                                "depend on when it runs"),
])
def test_keras_a_model_built_whole_says_why_and_equals_the_whole_build(spec, reason):
    whole = keras_whole(spec, MNIST)
    split = keras_split(spec, MNIST, 2, 0)
    assert split.built.startswith("built whole on every rank (") and reason in split.built
    assert all(m is not None for m in split.models)
    for index, model in enumerate(split.models):
        first = sum(len(s.layers) for s in split.stages[:index])
        keras_compare(model, whole, first, f"stage {index} of {spec}")


def test_keras_too_many_stages_is_one_line_before_any_weight_exists(monkeypatch):
    import keras

    def refuse(self):
        raise AssertionError("a variable got its value before the split was checked")

    monkeypatch.setattr(keras.Variable, "_deferred_initialize", refuse)
    with pytest.raises(UserError, match="--pipeline-stages 5 is more than the 4 layers with weights"):
        keras_split("cnn", MNIST, 5, 0)


@pytest.mark.parametrize("spec,data,count", [
    ("cnn", MNIST, 3), ("test_stage_build:keras_bn_dropout", MNIST, 3),
    ("test_stage_build:keras_embedding", TOKENS, 3),
    ("test_stage_build:keras_built", MNIST, 2)])  # built whole, timed all the same
def test_keras_stages_split_by_time_hold_the_whole_builds_weights(spec, data, count):
    import keras

    from ringtrain.strategies.pipeline import timing
    from tf_models import stages

    whole = keras_whole(spec, data)
    for keep in range(count):
        keras.utils.set_random_seed(SEED)
        split = stages.build_split(spec, data, 0.5, count, keep=keep,
                                   timing=timing.in_process(4, repeats=1))
        assert (split.built == stages.BY_STAGE) == ("built" not in spec), split.built
        assert all(s.time_share is not None for s in split.stages)
        first = sum(len(s.layers) for s in split.stages[:keep])
        keras_compare(split.models[keep], whole, first, f"stage {keep} of {spec} (timed)")


def test_keras_timing_leaves_the_random_state_and_the_models_variables_as_they_were():
    """A timed layer is a copy made from its config: an unseeded Dropout's copy draws a seed from
    Python's generator and a name from Keras' counters, and its built copy has values; after the
    timing every generator (Python's, NumPy's, Keras' global SeedGenerator) and name counter is
    where it was, and the model's own variables are still deferred (no value)."""
    import random

    import keras
    from keras.src.backend.common import global_state

    from ringtrain.strategies.pipeline import timing
    from tf_models import stages

    keras.utils.set_random_seed(SEED)
    built = stages.instantiate("test_stage_build:keras_bn_dropout", MNIST, 0.5,
                               allowed=(keras.Model,), built=False)
    layers = stages._chain("m", built, (28, 28, 1), "float32")[0]
    outputs, variables = stages._deferred("m", MNIST, layers)
    keras.random.randint((1,), 0, 9)  # the global SeedGenerator exists and has moved

    def state():
        gen = global_state.get_global_attribute("global_seed_generator")
        return (random.getstate(), np.random.get_state()[1].copy(), gen.state.numpy().copy(),
                dict(global_state.get_global_attribute("object_name_uids")),
                len(global_state.get_global_attribute("uninitialized_variables", [])))

    before = state()
    costs = stages.layer_seconds(layers, outputs, (28, 28, 1), "float32",
                                 timing.in_process(4, repeats=2))
    after = state()
    assert len(costs) == len(layers) and all(c >= 0 for c in costs)
    assert before[0] == after[0] and np.array_equal(before[1], after[1])
    assert np.array_equal(before[2], after[2]) and before[3:] == after[3:]
    assert all(v._value is None for vs in variables for v in vs)


# --- the memory check comes before the stage's weights exist ---------------------------------------

@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_a_stage_too_big_for_its_rank_is_one_line_before_its_weights_exist(fw):
    """``fits`` gets the kept stage's weight bytes and activation bytes per example (the split's
    own facts) before anything of it is allocated; a limit it cannot fit is one line, and no
    stage's weights were made."""
    from ringtrain.strategies.pipeline import memory

    seen = []

    def fits(stage, weight_bytes, activation_bytes):
        seen.append((stage, weight_bytes, activation_bytes))
        memory.check_fits(memory.needs(stage, weight_bytes, 1, activation_bytes, 16, 2),
                          memory.Limit(64 << 10, 1 << 20, "RLIMIT_DATA"), 2)

    if fw == "torch":
        import torch

        from torch_models import stages

        torch.manual_seed(SEED)
        fact = stages.build("cnn", MNIST, 0.5, 2).stages[1]
        before = torch.get_rng_state()
        with pytest.raises(UserError) as err:
            stages.build("cnn", MNIST, 0.5, 2, keep=1, fits=fits)
        assert torch.equal(torch.get_rng_state(), before)  # no weight was initialised
    else:
        import keras

        from tf_models import stages

        keras.utils.set_random_seed(SEED)
        fact = stages.build_split("cnn", MNIST, 0.5, 2).stages[1]
        with pytest.raises(UserError) as err:
            stages.build_split("cnn", MNIST, 0.5, 2, keep=1, fits=fits)
    assert seen[0][:2] == (1, fact.bytes) and seen[0][2] > 0
    assert str(err.value).startswith("pipeline stage 1 of 2 needs ") and "\n" not in str(err.value)
    assert "under RLIMIT_DATA of 1 MB" in str(err.value)
