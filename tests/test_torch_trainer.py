"""The PyTorch trainer under real ``horovodrun -np 2``: the output contract and resume."""

from __future__ import annotations

import pytest
from conftest import SMALL, SUMMARY_KEYS, metrics, requires_horovod, train

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
