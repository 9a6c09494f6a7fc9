"""The PyTorch trainer under real ``horovodrun -np 2``: the output contract and resume."""

from __future__ import annotations

import sys

import pytest
from conftest import SMALL, SUMMARY_KEYS, metrics, requires_horovod, run, train

pytestmark = requires_horovod
MODULE = "launch.torch_mnist"


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch2")
    proc = train(MODULE, [*SMALL, "--epochs", "3", "--metrics-out", str(out / "m.json"),
                          "--checkpoint-dir", str(out / "ckpt")])
    return proc, metrics(out / "m.json"), out


def test_all_ranks_end_identical(two_epochs):
    _, m, _ = two_epochs
    assert len(m["param_checksums"]) == 2
    assert len(set(m["param_checksums"])) == 1, m["param_checksums"]


def test_loss_falls(two_epochs):
    _, m, _ = two_epochs
    losses = [e["train_loss"] for e in m["epochs"]]
    assert losses[-1] < losses[0] * 0.8, losses
    assert m["final_test_accuracy"] > 0.8


def test_summary_complete(two_epochs):
    _, m, _ = two_epochs
    assert SUMMARY_KEYS <= set(m), SUMMARY_KEYS - set(m)
    assert m["framework"] == "torch" and m["world_size"] == 2 and m["controller"] == "mpi"
    assert m["param_count"] == 184_586 and m["model"] == "cnn" and m["dataset"] == "mnist"
    assert m["effective_lr"] == pytest.approx(0.02)
    assert m["global_batch_size"] == 64
    assert [e["epoch"] for e in m["epochs"]] == [1, 2, 3]
    assert {"torch", "horovod"} <= set(m["versions"])
    assert m["images_per_second"] > 0


def test_rank0_alone_prints_and_writes(two_epochs):
    proc, _, out = two_epochs
    epoch_lines = [ln for ln in proc.stdout.splitlines() if "epoch 1/3:" in ln]
    assert len(epoch_lines) == 1, proc.stdout
    assert epoch_lines[0].startswith("[1,0]") or "[1,1]" not in epoch_lines[0]
    files = sorted(p.name for p in (out / "ckpt").iterdir())
    assert files == ["ckpt-epoch0001.pt", "ckpt-epoch0002.pt", "ckpt-epoch0003.pt"], files


def test_resume_continues_from_saved_epoch(tmp_path):
    ckpt = tmp_path / "ckpt"
    train(MODULE, [*SMALL, "--epochs", "1", "--checkpoint-dir", str(ckpt)])
    train(MODULE, [*SMALL, "--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume",
                   "--metrics-out", str(tmp_path / "m.json")])
    m = metrics(tmp_path / "m.json")
    assert m["resumed_from_epoch"] == 1
    assert [e["epoch"] for e in m["epochs"]] == [2]
    assert len(set(m["param_checksums"])) == 1
    assert (ckpt / "ckpt-epoch0002.pt").exists()


# On a GPU the trainer's SGD is the fused kernel (torch_models.run.fused_sgd) and --amp hands
# GradScaler's non-finite flag to that kernel (keep_fused_amp_step).  CI has no GPU: the same
# code runs here on a CPU (PyTorch has a fused SGD for CPUs too), the trainer's --amp recipe step
# by step, against the foreach SGD the trainer keeps on CPUs.
FUSED_AMP_PROBE = r"""
import torch, horovod.torch as hvd
from torch_models.run import keep_fused_amp_step
hvd.init()
def opened(fused):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    lost = getattr(opt, "_step_supports_amp_scaling", False)
    keep_fused_amp_step(opt)
    return model, opt, torch.amp.GradScaler("cpu", init_scale=1024.0), lost
runs = {f: opened(f) for f in (None, True)}
assert not runs[True][3], "DistributedOptimizer kept the flag: keep_fused_amp_step is not needed"
assert runs[True][1]._step_supports_amp_scaling and not hasattr(runs[None][1], "_step_supports_amp_scaling")
for step in range(5):
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step))
    for model, opt, scaler, _ in runs.values():
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        scaler.scale(model(x).square().mean()).backward()
        if step == 2:  # a non-finite gradient: GradScaler must skip the step and halve its scale
            next(model.parameters()).grad.view(-1)[0] = float("inf")
        opt.synchronize()  # the trainer's --amp recipe (Horovod's)
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        moved = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert moved == (step != 2), (step, moved)
    (ma, _, sa, _), (mb, _, sb, _) = runs.values()
    assert sa.get_scale() == sb.get_scale() == (1024.0 if step < 2 else 512.0)
    for a, b in zip(ma.parameters(), mb.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (step, (a - b).abs().max())
print("fused amp ok")
"""


def test_fused_sgd_amp_step_skips_non_finite_as_foreach():
    proc = run([sys.executable, "-c", FUSED_AMP_PROBE], timeout=120)
    assert proc.returncode == 0 and "fused amp ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
