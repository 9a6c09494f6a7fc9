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
