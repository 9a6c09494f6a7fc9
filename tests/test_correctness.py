"""Proof that data-parallel training computes what one process would (docs/correctness.md).

Every test runs the real trainers under real launchers and compares the parameters they leave in
their checkpoints.  Plain SGD (no momentum unless stated), no dropout, file-order data, so that
the only difference between N ranks x batch B and one process x batch N*B is float32 summation
order.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import metrics, requires_horovod, train

pytestmark = requires_horovod

MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
FRAMEWORKS = list(MODULES)
# Deterministic SGD: what makes "N x B == 1 x N*B" an exact statement up to summation order.
PLAIN = ["--momentum", "0", "--dropout", "0", "--no-shuffle", "--warmup-epochs", "0",
         "--lr-decay", "none", "--lr-scaling", "none", "--base-lr", "0.05", "--test-samples", "200",
         "--no-progress", "--epochs", "1"]
# float32 summation order only: TF's conv kernels pick different reduction orders for batch 24 and
# 48, which after 6 steps moves a few weights by ~1e-5.  A real bug (a missed broadcast, a sum
# instead of an average, a skipped rank) moves them by the size of an update, ~1e-2.
RTOL, ATOL = 1e-3, 5e-5


def load_params(path: Path) -> list[np.ndarray]:
    """Model parameters, in model order, from either framework's checkpoint."""
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            return [z[name] for name in meta["weight_keys"]]
    import torch  # only the test process; the trainers run in their own processes

    state = torch.load(path, map_location="cpu", weights_only=False)["model"]
    return [t.numpy() for t in state.values()]


def ckpt(folder: Path) -> Path:
    files = sorted(folder.glob("ckpt-epoch*.*"))
    assert files, f"no checkpoint in {folder}"
    return files[-1]


def run_params(fw: str, tmp: Path, tag: str, args: list[str], np_: int = 1, how: str = "horovodrun"):
    out = tmp / tag
    train(MODULES[fw], [*args, "--checkpoint-dir", str(out), "--metrics-out", str(out / "m.json")],
          np=np_, how="single" if np_ == 1 else how)
    return load_params(ckpt(out)), metrics(out / "m.json")


def assert_same_params(a: list[np.ndarray], b: list[np.ndarray], rtol=RTOL, atol=ATOL) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def moved(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


# 1 + 2 + 3: identical ranks; N x B equals 1 x N*B; every rank starts from rank 0's weights
# (ranks are seeded differently, so without the broadcast neither equality could hold).
GLOBAL_BATCH, STEPS = 48, 6


@pytest.fixture(scope="module")
def big_batch_baseline(tmp_path_factory):
    """One process, batch 48, per framework: the reference every distributed run must match."""
    cache = {}

    def get(fw: str):
        if fw not in cache:
            cache[fw] = run_params(fw, tmp_path_factory.mktemp(f"single-{fw}"), "single",
                                   [*PLAIN, "--train-samples", str(GLOBAL_BATCH * STEPS),
                                    "--batch-size", str(GLOBAL_BATCH)])[0]
        return cache[fw]

    return get


@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("np_,how", [(2, "horovodrun"), (3, "horovodrun"), (2, "gloo"), (3, "gloo")])
def test_invariant_2_data_parallel_equals_big_batch(fw, np_, how, tmp_path, big_batch_baseline):
    dist, m = run_params(fw, tmp_path, "dist", [*PLAIN, "--train-samples", str(GLOBAL_BATCH * STEPS),
                                               "--batch-size", str(GLOBAL_BATCH // np_)], np_=np_, how=how)
    assert m["world_size"] == np_ and m["controller"] == ("gloo" if how == "gloo" else "mpi")
    assert len(m["epochs"]) == 1 and len(set(m["param_checksums"])) == 1, "invariant 1: ranks differ"
    assert_same_params(dist, big_batch_baseline(fw))


@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_3_resume_broadcasts_rank0_optimizer_state(fw, tmp_path):
    """Resume a momentum run at np=2 from a checkpoint only rank 0 reads: the continuation must
    equal the single-process continuation, which needs rank 0's momentum on every rank."""
    common = [*PLAIN, "--momentum", "0.9", "--train-samples", "128"]
    first = tmp_path / "first"
    train(MODULES[fw], [*common, "--batch-size", "32", "--checkpoint-dir", str(first)], np=1,
          how="single")
    outs = {}
    for np_, b in ((1, 32), (2, 16)):
        d = tmp_path / f"resume{np_}"
        d.mkdir()
        (d / ckpt(first).name).write_bytes(ckpt(first).read_bytes())
        train(MODULES[fw], [*common, "--epochs", "2", "--batch-size", str(b), "--checkpoint-dir",
                            str(d), "--resume", "--metrics-out", str(d / "m.json")],
              np=np_, how="single" if np_ == 1 else "horovodrun")
        m = metrics(d / "m.json")
        assert m["resumed_from_epoch"] == 1 and len(set(m["param_checksums"])) == 1
        outs[np_] = load_params(ckpt(d))
    assert_same_params(outs[2], outs[1])


# 5: exact metrics, with shards of unequal size (1000 test images over 3 ranks: 334/333/333).
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_5_exact_metrics(fw, tmp_path):
    src = tmp_path / "train"
    eval_args = [*PLAIN, "--test-samples", "1000", "--metrics-out"]
    train(MODULES[fw], [*eval_args, str(src / "m.json"), "--train-samples", "256", "--batch-size", "32",
                        "--checkpoint-dir", str(src)], np=1, how="single")
    d = tmp_path / "eval3"
    d.mkdir()
    (d / ckpt(src).name).write_bytes(ckpt(src).read_bytes())
    train(MODULES[fw], [*eval_args, str(d / "m.json"), "--checkpoint-dir", str(d), "--resume"], np=3)
    single, dist = metrics(src / "m.json"), metrics(d / "m.json")
    assert dist["world_size"] == 3 and dist["epochs"] == [], "the np=3 run must only evaluate"
    # Accuracy is a ratio of integer counts: exactly equal.  Loss: float sums in another order.
    assert dist["final_test_accuracy"] == single["final_test_accuracy"]
    assert dist["final_test_loss"] == pytest.approx(single["final_test_loss"], rel=1e-6)


# 6: effective LR and warm-up, as the trainers apply them.
@pytest.mark.parametrize("fw", FRAMEWORKS)
@pytest.mark.parametrize("rule,extra", [("linear", []), ("sqrt", []), ("linear", ["--adasum"])])
def test_invariant_6_lr_rule(fw, rule, extra, tmp_path):
    out = tmp_path / "m.json"
    train(MODULES[fw], ["--train-samples", "256", "--test-samples", "100", "--batch-size", "32",
                        "--epochs", "2", "--warmup-epochs", "2", "--lr-decay", "none", "--base-lr", "0.01",
                        "--lr-scaling", rule, "--no-progress", "--metrics-out", str(out), *extra], np=2)
    m = metrics(out)
    want = {"linear": 0.02, "sqrt": 0.01 * math.sqrt(2)}[rule]
    if extra:
        want = 0.01
    assert m["effective_lr"] == pytest.approx(want)
    # Last step of epoch 1 is halfway through a 2-epoch warm-up (minus one step), epoch 2 ends at
    # the target: the LR ramps linearly from the base to the target.
    steps = 256 // 2 // 32
    lr1 = 0.01 + (want - 0.01) * ((steps - 1) / steps) / 2
    lr2 = 0.01 + (want - 0.01) * (1 + (steps - 1) / steps) / 2
    assert [e["lr"] for e in m["epochs"]] == pytest.approx([lr1, lr2])


# 7: --backward-passes-per-step K equals one step over K x the batch.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_7_gradient_accumulation(fw, tmp_path):
    n = 2 * 4 * 64
    big, _ = run_params(fw, tmp_path, "big", [*PLAIN, "--train-samples", str(n), "--batch-size", "64"],
                        np_=2)
    acc, m = run_params(fw, tmp_path, "acc", [*PLAIN, "--train-samples", str(n), "--batch-size", "16",
                                              "--backward-passes-per-step", "4"], np_=2)
    assert m["global_batch_size"] == 128
    assert_same_params(acc, big)


# 8: fp16 compression perturbs results only at fp16 rounding level.
@pytest.mark.parametrize("fw", FRAMEWORKS)
def test_invariant_8_fp16_compression(fw, tmp_path):
    args = [*PLAIN, "--train-samples", "384", "--batch-size", "32"]
    init, _ = run_params(fw, tmp_path, "init", [*args, "--base-lr", "1e-12"], np_=1)
    full, _ = run_params(fw, tmp_path, "full", args, np_=2)
    half, m = run_params(fw, tmp_path, "half", [*args, "--fp16-allreduce"], np_=2)
    assert len(set(m["param_checksums"])) == 1
    update = moved(full, init)
    diff = moved(half, full)
    assert update > 1e-3, "training must have moved the weights for this test to mean anything"
    # fp16 has an 11-bit significand (relative rounding 2^-11 ~ 4.9e-4 per gradient element); over
    # 6 steps, through ReLU/max-pool switches, that compounds to a few ulps of the update (TF: ~9).
    # Bound: 16 fp16 ulps of the update, i.e. under 1% of how far training moved the weights.
    assert diff <= 2 ** -11 * update * 16, (diff, update)

