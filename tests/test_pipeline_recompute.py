"""A stage that computes its forward pass again in its backward (docs/pipeline.md, "Recomputing
the forward pass"), in one process, no Horovod, no launch: the framework halves' own per
micro-batch methods (``TorchPipelineRun.forward``/``backward``, ``KerasPipelineRun.forward``/
``backward`` with its :class:`~tf_models.pipeline.Traced`) on a small stage holding BatchNorm and
Dropout, run as a pipeline runs them (two forwards, then the two backwards).

* Keras stages always recompute: BatchNorm's moving statistics after a micro-batch's forward and
  backward are those after its forward alone (before the fix the recompute updated them again),
  and the backward's gradients are those of the forward (the same dropout masks).
* PyTorch with ``--checkpoint-activations``: the same gradients, outputs and running statistics as
  without it, the statistics updated once per micro-batch although BatchNorm runs twice, and the
  forward keeps no graph (nothing saved for the backward: the stage keeps the input and the
  random state).
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest

from ringtrain.strategies.pipeline.engine import Boundary
from ringtrain.strategies.pipeline.placement import Placement

ROWS, WIDTH, CLASSES = 6, 8, 4
MIDDLE, LAST = Placement(3, 3, 1), Placement(3, 3, 2)  # a stage that receives and sends; the last


def data(dtype):
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((ROWS, WIDTH)).astype(dtype) for _ in range(2)]
    grads = [rng.standard_normal((ROWS, CLASSES)).astype(dtype) for _ in range(2)]
    labels = [rng.integers(0, CLASSES, ROWS) for _ in range(2)]
    return xs, grads, labels


# --- PyTorch -------------------------------------------------------------------------------------

def torch_stage():
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 6), nn.BatchNorm1d(6, momentum=0.5), nn.ReLU(),
                         nn.Dropout(0.5), nn.Linear(6, CLASSES)).double()


def torch_micro_batches(stage, place: Placement, recompute: bool) -> dict:
    """Two micro-batches through ``TorchPipelineRun``'s forward and backward (forward 0, forward 1,
    backward 0, backward 1): the outputs, the buffers after the forwards and after the backwards,
    the weights' gradients and the inputs'."""
    import torch

    from torch_models.pipeline import TorchPipelineRun

    run = object.__new__(TorchPipelineRun)  # what forward and backward read of a run
    run.args = argparse.Namespace(checkpoint_activations=recompute)
    run.place, run.device, run.stage, run.saved = place, torch.device("cpu"), stage, {}
    xs, grads, labels = data(np.float64)
    run.labels = [torch.from_numpy(y) for y in labels]
    run.rows_total, run.loss_total = 2 * ROWS, torch.zeros((), dtype=torch.float64)
    calls = []
    stage[1].register_forward_hook(lambda *_: calls.append(1))  # BatchNorm's runs
    stage.train()
    torch.manual_seed(7)  # the dropout masks: the same draws in both runs
    packed = []  # what the forwards' graphs save for the backward
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        outs = [run.forward(m, xs[m]) for m in range(2)]
    after_forwards = [b.clone() for b in stage.buffers()]
    inputs = [run.saved[m][0] for m in range(2)]
    backs = [run.backward(m, None if place.last else grads[m]) for m in range(2)]
    return {"outs": outs, "after_forwards": after_forwards,
            "buffers": [b.clone() for b in stage.buffers()],
            "grads": [p.grad.clone() for p in stage.parameters()], "backs": backs,
            "input_grads": [i.grad for i in inputs], "loss": float(run.loss_total),
            "batchnorm_runs": len(calls), "packed": len(packed),
            "random_after": torch.get_rng_state()}


def assert_same_tensors(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
        else:
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("place", [MIDDLE, LAST], ids=["middle", "last"])
def test_torch_checkpointed_stage_equals_the_stage_and_updates_batchnorm_once(place):
    stage = torch_stage()
    plain = torch_micro_batches(copy.deepcopy(stage), place, recompute=False)
    again = torch_micro_batches(copy.deepcopy(stage), place, recompute=True)
    assert (plain["batchnorm_runs"], again["batchnorm_runs"]) == (2, 4)  # it did recompute
    assert plain["packed"] >= 10 and again["packed"] == 0  # it kept no graph, only the inputs
    assert_same_tensors([again["random_after"]], [plain["random_after"]])  # the run's own draws
    # The same gradients of the weights and of the inputs (the same dropout masks), bit for bit.
    assert_same_tensors(again["grads"], plain["grads"])
    assert_same_tensors(again["backs"], plain["backs"])
    if place.last:
        assert again["loss"] == plain["loss"]
    else:
        assert_same_tensors(again["outs"], plain["outs"])
    # BatchNorm's running statistics: the forwards update them, the backward's recompute does not.
    assert_same_tensors(again["buffers"], again["after_forwards"])
    assert_same_tensors(again["buffers"], plain["buffers"])
    *stats, count = again["buffers"]
    assert int(count) == 2  # num_batches_tracked: one update per micro-batch
    assert not np.array_equal(stats[0].numpy(), np.zeros(6))  # updated from their start


# --- Keras ---------------------------------------------------------------------------------------

def keras_stage():
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((WIDTH,)), keras.layers.Dense(6),
                             keras.layers.BatchNormalization(momentum=0.5),
                             keras.layers.Activation("relu"), keras.layers.Dropout(0.5),
                             keras.layers.Dense(CLASSES)])


def test_keras_recompute_leaves_batchnorm_as_the_forward_left_it_with_the_forwards_masks():
    import tensorflow as tf

    from tf_models import checkpoints
    from tf_models.pipeline import KerasPipelineRun, Traced

    stage = keras_stage()
    run = object.__new__(KerasPipelineRun)  # what forward and backward read of a run
    run.place, run.stage, run.saved, run.grads = MIDDLE, stage, {}, None
    run.rng = checkpoints.rng_variables(stage)
    run.traced = Traced(stage, None, Boundary((WIDTH,), np.dtype("float32")),
                        Boundary((CLASSES,), np.dtype("float32")))
    xs, grads, _ = data(np.float32)
    start = [v.numpy() for v in stage.variables]  # weights, moving statistics, the seed state
    initial = [v.numpy() for v in stage.non_trainable_weights]

    outs = [run.forward(m, xs[m]) for m in range(2)]
    after_forwards = [v.numpy() for v in stage.non_trainable_weights]
    assert not np.array_equal(after_forwards[0], initial[0])  # the forwards update them
    back0 = run.backward(0, grads[0])
    grads0 = [g.numpy() for g in run.grads]
    run.backward(1, grads[1])
    assert_same_tensors([v.numpy() for v in stage.non_trainable_weights], after_forwards)

    # The backward's gradients are the forward's: a tape over micro-batch 0's forward, eagerly,
    # from the same variables (the same dropout draws).
    for v, s in zip(stage.variables, start, strict=True):
        v.assign(s)
    x0 = tf.constant(xs[0])
    with tf.GradientTape() as tape:
        tape.watch(x0)
        out = stage(x0, training=True)
    np.testing.assert_allclose(out.numpy(), outs[0], rtol=1e-6, atol=1e-6)
    want = tape.gradient(out, [*stage.trainable_variables, x0], output_gradients=grads[0])
    for got, ref in zip([*grads0, back0], want, strict=True):
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-6)
