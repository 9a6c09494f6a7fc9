"""The per-step divergence check of the PyTorch trainer (torch_models.evaluation.FiniteWatch):
at once on a CPU, one step late on a GPU (``lag``), and never a step missed; and the Keras
trainer's (tf_models.evaluation: the ``WeightsTotal`` metric of its train step, and
``make_weights_finite``), which takes no copy of any weight."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from conftest import run

from torch_models.evaluation import FiniteWatch, weights_finite


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _poison(model):
    with torch.no_grad():
        model[1].bias[0] = float("nan")


def test_without_lag_the_step_that_diverged_is_named_at_once():
    model = _model()
    watch = FiniteWatch(model, lag=False)
    assert watch.step("step 1") is None
    _poison(model)
    assert watch.step("step 2") == "step 2"
    assert watch.flush() is None


def test_with_lag_a_step_is_named_one_step_later():
    model = _model()
    watch = FiniteWatch(model, lag=True)
    assert watch.step("step 1") is None
    assert watch.step("step 2") is None  # step 1 read: finite
    _poison(model)
    assert watch.step("step 3") is None  # step 2 read: finite
    assert watch.step("step 4") == "step 3"  # the first non-finite step, not the latest


@pytest.mark.parametrize("steps", [1, 3])
def test_with_lag_flush_reads_the_last_step(steps):
    model = _model()
    watch = FiniteWatch(model, lag=True)
    for s in range(1, steps):
        assert watch.step(s) is None
    _poison(model)
    assert watch.step(steps) is None
    assert watch.flush() == steps
    assert watch.flush() is None  # nothing pending after a flush


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_with_lag_any_non_finite_weight_of_any_dtype_in_a_mixed_model_is_caught(dtype, value):
    # The lagged check makes one call per dtype (fused; float64 through each tensor's largest
    # |weight|): a model whose layers differ in dtype, poisoned in any one of its tensors.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 3).half(),
                                torch.nn.Linear(3, 3).bfloat16(), torch.nn.Linear(3, 2).double())
    layer = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}[dtype]
    watch = FiniteWatch(model, lag=True)
    assert watch.step(1) is None
    assert watch.step(2) is None
    with torch.no_grad():
        model[layer].weight[1, 2] = value
    assert watch.step(3) is None  # step 2 read: finite
    assert watch.flush() == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_finite_weights_whose_sum_overflows_are_finite_and_nan_or_inf_are_not(dtype):
    """The check's fast sums (float32) may overflow where every weight is finite: it then takes
    float64 sums, which do not, so only a weight that is not a number ends the run."""
    model = torch.nn.Linear(8, 8).to(dtype)
    with torch.no_grad():  # 64 weights each at the dtype's largest (float64: float32's largest)
        model.weight.fill_(torch.finfo(dtype if dtype != torch.float64 else torch.float32).max)
    if dtype != torch.float16:  # float16's largest sums to a finite float32
        assert not torch.isfinite(model.weight.sum(dtype=torch.float32))  # the fast sum overflows
    assert FiniteWatch(model, lag=False).step("step 1") is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        with torch.no_grad():
            model.bias[3] = bad
        assert FiniteWatch(model, lag=False).step("step 2") == "step 2"
        with torch.no_grad():
            model.bias[3] = 0.0
    assert weights_finite([torch.zeros(3), torch.ones(2, dtype=torch.float16)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_lagged_check_leaves_every_weight_bit_for_bit(dtype):
    """The lagged check is the fused kernel that GradScaler unscales gradients with, here with a
    scale of 1.0: it writes the weights back, and must write them unchanged, the smallest
    subnormal and the largest finite value included."""
    info = torch.finfo(dtype)
    model = torch.nn.Linear(4, 4).to(dtype)
    with torch.no_grad():
        model.weight.view(-1)[:4] = torch.tensor([info.smallest_normal / 4, -info.max, info.max,
                                                  -0.0], dtype=torch.float64).to(dtype)
    before = [p.detach().clone() for p in model.parameters()]
    watch = FiniteWatch(model, lag=True)
    for s in (1, 2, 3):
        assert watch.step(s) is None
    assert watch.flush() is None
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old.view(torch.uint8), new.detach().view(torch.uint8))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_dtype_the_fused_check_refuses_is_checked_all_the_same(monkeypatch, value):
    """CUDA's fused kernel (torch 2.11) refuses bfloat16: such a dtype's tensors are then checked
    through their largest |weight|, every step, and the others stay on the fused kernel."""
    fused = torch._amp_foreach_non_finite_check_and_unscale_
    calls = []

    def no_bfloat16(group, found, scale):
        calls.append(group[0].dtype)
        if group[0].dtype == torch.bfloat16:
            raise NotImplementedError("not implemented for 'BFloat16'")
        fused(group, found, scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", no_bfloat16)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).bfloat16())
    watch = FiniteWatch(model, lag=True)
    for s in (1, 2, 3):
        assert watch.step(s) is None
    assert calls.count(torch.bfloat16) == 1 and calls.count(torch.float32) == 3  # refused once
    with torch.no_grad():
        model[1].weight[1, 2] = value
    assert watch.step(4) is None  # step 3 read: finite
    assert watch.flush() == 4


def test_float64_weights_never_reach_the_fused_check(monkeypatch):
    """CUDA's fused kernel tests each value as a float32: a finite float64 weight beyond float32's
    range read as inf there (an H200, torch 2.11).  float64 tensors take the largest-|weight|
    path: finite at float64's largest, not finite with a NaN or inf."""
    fused = torch._amp_foreach_non_finite_check_and_unscale_
    dtypes = []

    def recording(group, found, scale):
        dtypes.append(group[0].dtype)
        fused(group, found, scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", recording)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2).double())
    with torch.no_grad():
        model[1].weight[0] = torch.tensor([torch.finfo(torch.float64).max, 1e300, -1e300],
                                          dtype=torch.float64)
    watch = FiniteWatch(model, lag=True)
    assert watch.step(1) is None and watch.flush() is None
    assert dtypes == [torch.float32]
    with torch.no_grad():
        model[1].weight[1, 1] = float("nan")
    assert watch.step(2) is None and watch.flush() == 2


# --- the Keras side (tf_models.evaluation), in one subprocess: TensorFlow is not imported here --

KERAS_CHECKS = textwrap.dedent("""
    import json
    import keras
    import numpy as np
    import tensorflow as tf
    from tf_models import evaluation
    from tf_models.evaluation import WeightsTotal, make_weights_finite

    def build():
        inputs = keras.Input((32,))
        hidden = keras.layers.Dense(64)(inputs)  # kernel 32x64, bias 64: float32
        wide = keras.layers.Dense(48, dtype="float64")(hidden)  # kernel 64x48, bias 48: float64
        return keras.Model(inputs, keras.layers.Dense(10)(wide))

    net = build()
    weights = net.trainable_weights
    metric = WeightsTotal(net)
    made, real = [], tf.function  # the functions make_weights_finite traces
    evaluation.tf.function = lambda *a, **k: made.append(real(*a, **k)) or made[-1]
    check = make_weights_finite(net)
    evaluation.tf.function = real

    def answers():
        metric.update_state(None, None)
        return [metric.finite(), check()]

    out = {"finite": answers(), "bad": {}}
    saved = [w.numpy() for w in weights]
    for w, value in zip(weights, saved):
        for bad in ("nan", "inf", "-inf"):
            poisoned = value.copy()
            poisoned.flat[value.size // 2] = float(bad)
            w.assign(poisoned)
            out["bad"][f"{w.path} {bad}"] = answers()
            w.assign(value)
    # Finite weights whose sums overflow float32: the float32 kernel at float32's largest, the
    # float64 kernel at 1e300 (beyond float32, as float64 it is finite).
    weights[0].assign(np.full(weights[0].shape, np.finfo(np.float32).max, np.float32))
    weights[2].assign(np.full(weights[2].shape, 1e300))
    out["float32_sum_overflows"] = not np.isfinite(float(tf.reduce_sum(weights[0])))
    out["overflow"] = answers()
    for w, value in zip(weights, saved):
        w.assign(value)
    out["restored"] = answers()

    # What the check's graphs compute: the metric's update (run inside every train step) and
    # what make_weights_finite traced.  A weight-sized tensor is one with a weight's shape.
    sizes = {tuple(w.shape) for w in weights}
    def outputs(graph):
        return [(op.type, t.dtype.name, tuple(t.shape)) for op in graph.get_operations()
                for t in op.outputs if t.shape.rank is not None and tuple(t.shape) in sizes]
    step = tf.function(lambda: metric.update_state(None, None)).get_concrete_function().graph
    out["step_outputs"] = outputs(step)
    out["step_nested"] = len(step.as_graph_def().library.function)
    out["made_outputs"] = [outputs(f.get_concrete_function().graph) for f in made]
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def keras_checks() -> dict:
    proc = run([sys.executable, "-c", KERAS_CHECKS], timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_keras_finite_weights_whose_float32_sum_overflows_are_finite(keras_checks):
    """The per-tensor sums may overflow where every weight is finite: the exact check then says
    finite, so finite weights are never read as divergence."""
    assert keras_checks["finite"] == [True, True]
    assert keras_checks["float32_sum_overflows"]
    assert keras_checks["overflow"] == [True, True]  # [WeightsTotal.finite(), make_weights_finite]
    assert keras_checks["restored"] == [True, True]


def test_keras_a_nan_or_inf_in_any_weight_is_caught(keras_checks):
    bad = keras_checks["bad"]
    assert len(bad) == 6 * 3, bad  # 3 layers' kernels and biases, each with a NaN, an inf, a -inf
    assert all(answer == [False, False] for answer in bad.values()), bad


def test_keras_check_makes_no_copy_of_any_weight(keras_checks):
    """The check inside the train step reads each weight and sums it in its own dtype: no
    tensor of a weight's shape but the variables' reads (a float64 cast of a 4096x4096 kernel,
    128 MB, ended a run under a memory cap with a segfault or, read as NaN, as divergence), and
    no branch in the step (its exact fallback runs outside it, only where a sum is not finite).
    What make_weights_finite traces holds no float64 tensor of a weight's shape either (its exact
    fallback's ``is_finite`` is a boolean one)."""
    step = keras_checks["step_outputs"]
    assert step and {op for op, _, _ in step} == {"ReadVariableOp"}, step
    assert keras_checks["step_nested"] == 0
    made = [t for outputs in keras_checks["made_outputs"] for t in outputs]
    assert made and not [t for t in made if t[1] == "float64" and t[0] != "ReadVariableOp"], made
    assert {dtype for op, dtype, _ in made if op not in ("ReadVariableOp",)} <= {"bool"}, made
