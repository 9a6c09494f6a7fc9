"""How each framework's models split into stages (torch_models/stages.py, tf_models/stages.py),
in one process, no Horovod: which models split and where, the stage facts the summary prints,
and the one-line refusals (a model that cannot be split, more stages than layers with weights,
a stage list of the wrong length)."""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain.data.dataset import DataInfo
from ringtrain.errors import UserError

MNIST = DataInfo("mnist", "mnist", (28, 28, 1), 10, [str(i) for i in range(10)], 60000, 10000,
                 None, input_dtype="float32", image=True)


@pytest.fixture(params=["torch", "tf"])
def fw(request):
    return request.param


def split(fw: str, spec: str, stages: int):
    if fw == "torch":
        import torch

        from torch_models import stages as torch_stages

        torch.manual_seed(0)
        return torch_stages.build(spec, MNIST, 0.5, stages)
    import keras

    from tf_models import stages as tf_stages

    keras.utils.set_random_seed(0)
    return tf_stages.build_split(spec, MNIST, 0.5, stages)


def test_the_cnn_splits_into_convolutions_and_dense_layers(fw):
    got = split(fw, "cnn", 2)
    first, second = got.stages
    assert (first.params, second.params) == (52096, 132490) and got.param_count == 184586
    assert first.bytes == 4 * first.params and second.bytes == 4 * second.params
    assert first.layers[0] == "conv1" and second.layers[-1] == "fc2"
    assert np.prod(first.output_shape) == 1024 and first.output_shape == second.input_shape
    assert got.cuts[0].shape == first.output_shape and np.dtype(got.cuts[0].dtype) == np.float32


def test_the_mlp_splits_at_its_hidden_layer(fw):
    got = split(fw, "mlp", 2)
    assert [s.params for s in got.stages] == [100480, 1290]
    assert np.prod(got.stages[0].output_shape) == 128


def test_a_builders_own_stage_list_is_taken_as_it_is(fw):
    got = split(fw, f"pipeline_models:{fw}_stages", 2)
    assert [s.params for s in got.stages] == [784 * 32 + 32, 32 * 10 + 10]


@pytest.mark.parametrize("case,stages,needle", [
    ("cnn", 5, "--pipeline-stages 5 is more than the 4 layers with weights of --model cnn"),
    ("mlp", 3, "--pipeline-stages 3 is more than the 2 layers with weights of --model mlp"),
    ("stages", 3, "returned 2 stages but --pipeline-stages is 3"),
    ("unsplittable", 2, "cannot split"),
])
def test_what_cannot_be_split_is_one_line(fw, case, stages, needle):
    spec = {"stages": f"pipeline_models:{fw}_stages",
            "unsplittable": "pipeline_models:torch_unsplittable" if fw == "torch"
            else "pipeline_models:tf_residual"}.get(case, case)
    if case == "unsplittable" and fw == "tf":
        needle = "is not a chain of layers"
    with pytest.raises(UserError, match=needle):
        split(fw, spec, stages)


# --- --partition time: the split balances timed compute ---------------------------------------------

CONVS = 5  # of 64 -> 64 channels on 32 x 32, after one of 2 -> 64


def torch_wide_then_convs(input_shape, num_classes):
    """A wide Linear (1.6M of the model's 1.8M weights, 3.2 MFLOP per example forward), then
    convolutions with few weights and most of the work (36,928 weights and 75.5 MFLOP each).
    Measured on 8 rows, one thread: the Linear's forward and backward took 2-3 ms (it reads its
    6.4 MB of weights: bound by memory), a convolution about 4x that; with the Linear at
    784 x 8192 instead, 10-17 ms against 3 ms for a 32-channel convolution: weights cost time
    too, so the test's margin is the convolutions' work, not the Linear's lightness."""
    from torch import nn

    layers = [nn.Flatten(), nn.Linear(784, 2048), nn.ReLU(), nn.Unflatten(1, (2, 32, 32)),
              nn.Conv2d(2, 64, 3, padding=1), nn.ReLU()]
    for _ in range(CONVS):
        layers += [nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))


def tf_wide_then_convs(input_shape, num_classes):
    """The same layers in Keras (channels last; each activation inside its layer)."""
    import keras

    layers = keras.layers
    return keras.Sequential([layers.Flatten(), layers.Dense(2048, activation="relu"),
                             layers.Reshape((32, 32, 2)),
                             layers.Conv2D(64, 3, padding="same", activation="relu"),
                             *(layers.Conv2D(64, 3, padding="same", activation="relu")
                               for _ in range(CONVS)),
                             layers.GlobalAveragePooling2D(), layers.Dense(num_classes)])


def timed_split(fw: str, spec: str, stages: int, rows: int = 8):
    from ringtrain.strategies.pipeline import timing

    if fw == "torch":
        import torch

        from torch_models import stages as torch_stages

        torch.manual_seed(0)
        return torch_stages.build(spec, MNIST, 0.5, stages, timing=timing.in_process(rows))
    import keras

    from tf_models import stages as tf_stages

    keras.utils.set_random_seed(0)
    return tf_stages.build_split(spec, MNIST, 0.5, stages, timing=timing.in_process(rows))


@pytest.fixture
def one_thread():
    """PyTorch's intra-op threads at 1 while timing: on the shared 2-core machine a 2-thread op
    waits for its second thread to be scheduled (a ReLU's median read 7 ms with 2 threads, 0.06
    ms with 1), and the test compares layers, not the scheduler."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_model_whose_work_is_not_its_weights_splits_by_time_otherwise(fw, one_thread):
    """By parameters the wide Linear is a stage of its own (1.6M of 1.8M weights); by time the
    convolutions (5 x 75.5 MFLOP per example against the Linear's 3.2) are spread over both
    stages, so stage 0 takes the Linear and at least one of them."""
    spec = f"test_pipeline_split:{fw}_wide_then_convs"
    by_params, by_time = split(fw, spec, 2), timed_split(fw, spec, 2)
    conv = "Conv2d" if fw == "torch" else "conv2d"

    def convs(stage):
        return sum(conv in name for name in stage.layers)

    assert convs(by_params.stages[0]) == 0 and by_params.stages[0].params > 1_600_000
    assert convs(by_time.stages[0]) >= 1 and convs(by_time.stages[1]) >= 1
    assert all(s.time_share is None and "seconds" not in s.record() for s in by_params.stages)
    shares = [s.time_share for s in by_time.stages]
    assert sum(shares) == pytest.approx(1) and all(0 < s < 1 for s in shares)
    # The same layers, the same weights in total: only the cut moved (Keras names the layers of
    # a second build in one process afresh, so they are counted).
    assert by_time.param_count == by_params.param_count
    assert sum(len(s.layers) for s in by_time.stages) == sum(len(s.layers) for s in by_params.stages)


def test_timed_costs_follow_the_work(fw, one_thread):
    """Each layer's timed seconds, one at a time, on 8 rows, come out in the order of their
    work: every convolution of 64 channels (75.5 MFLOP per example forward, over 1000x any
    layer without weights) timed slower than every layer without weights (a ratio of work, never
    a time threshold)."""
    from ringtrain.strategies.pipeline import timing

    if fw == "torch":
        import torch

        from torch_models import stages as torch_stages

        meta = torch_stages._on_meta(f"test_pipeline_split:{fw}_wide_then_convs", MNIST, 0.5,
                                     (1, 28, 28), torch.float32)
        names = [type(m).__name__ for _, m in meta.layers]
        counts = meta.counts
        costs = torch_stages.layer_seconds(meta.layers, meta.sizes, (1, 28, 28), torch.float32,
                                           timing.in_process(8))
        heavy = [i for i, m in enumerate(meta.layers) if type(m[1]).__name__ == "Conv2d"
                 and m[1].in_channels == 64]
    else:
        import keras

        from tf_models import stages as tf_stages

        built = tf_stages.instantiate(f"test_pipeline_split:{fw}_wide_then_convs", MNIST, 0.5,
                                      allowed=(keras.Model,), built=False)
        layers = tf_stages._chain("m", built, (28, 28, 1), "float32")[0]
        outputs, _ = tf_stages._deferred("m", MNIST, layers)
        names = [type(layer).__name__ for layer in layers]
        counts = [layer.count_params() for layer in layers]
        costs = tf_stages.layer_seconds(layers, outputs, (28, 28, 1), "float32",
                                        timing.in_process(8))
        heavy = [i for i, layer in enumerate(layers) if type(layer).__name__ == "Conv2D"
                 and i > 3]
    light = [i for i, n in enumerate(counts) if n == 0]
    assert len(costs) == len(names) and len(heavy) == CONVS and light
    assert all(c >= 0 for c in costs)
    slowest_light = max(costs[i] for i in light)
    assert all(costs[i] > slowest_light for i in heavy), \
        {f"{i}:{names[i]}": f"{1e3 * c:.2f} ms" for i, c in enumerate(costs)}
