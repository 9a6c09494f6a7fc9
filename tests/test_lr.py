"""The LR rule: linear / sqrt / none / Adasum scaling and the linear warm-up."""

import math

import pytest

from ringtrain.lr import lr_at, scaled_lr


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_scaling_rules(n):
    assert scaled_lr(0.01, n, "linear") == pytest.approx(0.01 * n)
    assert scaled_lr(0.01, n, "sqrt") == pytest.approx(0.01 * math.sqrt(n))
    assert scaled_lr(0.01, n, "none") == 0.01
    assert scaled_lr(0.01, n, "linear", adasum=True) == 0.01


def test_unknown_rule():
    with pytest.raises(ValueError):
        scaled_lr(0.1, 2, "cubic")


def test_warmup_ramps_linearly_to_target():
    points = [lr_at(e, 0.01, 0.04, warmup_epochs=2) for e in (0, 0.5, 1, 1.5, 2, 5)]
    assert points == pytest.approx([0.01, 0.0175, 0.025, 0.0325, 0.04, 0.04])


def test_no_warmup():
    assert lr_at(0.0, 0.01, 0.04, 0) == 0.04


def test_cosine_decay_after_warmup():
    args = dict(base_lr=0.01, target_lr=0.04, warmup_epochs=1, total_epochs=5, decay="cosine")
    assert lr_at(0.5, **args) == pytest.approx(0.025)  # still warming up
    assert lr_at(1.0, **args) == pytest.approx(0.04)  # peak right after warm-up
    assert lr_at(3.0, **args) == pytest.approx(0.02)  # halfway through the decay
    assert lr_at(5.0, **args) == pytest.approx(0.0, abs=1e-12)
    lrs = [lr_at(1 + i / 10, **args) for i in range(41)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False)), "decay must be monotone"
