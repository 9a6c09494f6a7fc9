"""The per-step divergence check of the PyTorch trainer (torch_models.evaluation.FiniteWatch):
at once on a CPU, one step late on a GPU (``lag``), and never a step missed."""

from __future__ import annotations

import pytest
import torch

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
