"""``--data``: an image folder and the user's own dataset, streamed, in both frameworks.

Real jobs under ``horovodrun`` on folders written here (tests/image_folders.py): identical ranks,
falling loss, a sensible accuracy, exact shard coverage per epoch on the streamed path, no hang at
an uneven count, BatchNorm models with identical buffers, and MNIST read as a PNG folder landing
where ``--data mnist`` does.  The bad inputs are in tests/test_data_bad_input.py.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import MNIST, REPO, SUMMARY_KEYS, metrics, requires_horovod, run, train
from image_folders import mnist_folder, shapes_folder

from ringtrain.data import folder
from ringtrain.data.sharding import epoch_permutation

pytestmark = requires_horovod
FW = ["torch", "tf"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """Three classes of drawn shapes, 32x32 RGB JPEGs, mixed with some 40x40 ones (resized)."""
    return shapes_folder(tmp_path_factory.mktemp("shapes"), 900, 150, size=32, sizes=(32, 32, 40))


def test_folder_classes_and_labels_match_torchvision_imagefolder(shapes):
    from torchvision.datasets import ImageFolder

    index = folder.scan(str(shapes))
    reference = ImageFolder(str(shapes / "train"))
    assert list(index.classes) == reference.classes == ["circle", "square", "triangle"]
    ours = [(index.train.path(i), int(index.train.labels[i])) for i in range(len(index.train.labels))]
    assert ours == [(p, t) for p, t in reference.samples]
    assert index.shape == (32, 32, 3)  # the first image's size; the 40x40 ones are resized


@pytest.fixture(scope="module", params=FW)
def folder_run(request, shapes, tmp_path_factory):
    fw = request.param
    out = tmp_path_factory.mktemp(f"folder-{fw}")
    train("launch", ["--framework", fw, "--data", f"folder:{shapes}", "--epochs", "3",
                     "--batch-size", "32", "--base-lr", "0.04", "--no-progress",
                     "--metrics-out", str(out / "m.json"),
                     "--checkpoint-dir", str(out / "ckpt")], np=2, timeout=600)
    return fw, metrics(out / "m.json"), out


def test_a_folder_trains_with_identical_ranks(folder_run, shapes):
    fw, m, _ = folder_run
    assert SUMMARY_KEYS <= set(m) and m["dataset"] == "folder"
    assert len(m["param_checksums"]) == 2 and len(set(m["param_checksums"])) == 1
    losses = [e["train_loss"] for e in m["epochs"]]
    assert losses[-1] < losses[0], losses
    # 3 balanced classes, chance is 1/3; here 99% (torch) and 97% (tf) were seen.
    assert m["final_test_accuracy"] >= 0.85, m["epochs"]
    data = m["data"]
    assert data["spec"] == f"folder:{shapes}" and data["classes"] == ["circle", "square", "triangle"]
    assert data["input_shape"] == [32, 32, 3] and data["train_size"] == 900
    norm = data["normalization"]
    assert norm["source"] == "computed from 900 training images" and len(norm["mean"]) == 3
    assert all(0 < s < 1 for s in norm["std"])


def test_the_checkpoint_records_the_data_and_resume_refuses_other_data(folder_run, tmp_path):
    """--resume on a folder with other classes: one line, before any training."""
    fw, m, out = folder_run
    if fw == "torch":
        import torch

        meta = torch.load(sorted((out / "ckpt").iterdir())[-1], weights_only=True)["meta"]
    else:
        with np.load(sorted((out / "ckpt").iterdir())[-1], allow_pickle=False) as npz:
            meta = json.loads(str(npz["meta"]))
    assert meta["data"] == m["data"]
    other = shapes_folder(tmp_path / "two", 60, 30, classes=("circle", "square"))
    proc = run([sys.executable, "-m", "launch", "--framework", fw, "--data", f"folder:{other}",
                "--epochs", "4", "--no-progress", "--checkpoint-dir", str(out / "ckpt"), "--resume"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "3 classes there, 2 here" in errors[0], proc.stderr[-2000:]


@pytest.mark.parametrize("fw", FW)
def test_n_ranks_on_a_folder_equal_one_process_with_n_times_the_batch(fw, shapes, tmp_path):
    """The correctness suite's invariant 2 (docs/correctness.md) on the streamed path: 2 ranks x
    batch 12 end with the weights of one process x batch 24, up to float32 summation order."""
    from test_correctness import PLAIN, assert_same_params, ckpt, load_params

    runs = {}
    for np_, batch in ((2, 12), (1, 24)):
        folder_ = tmp_path / f"np{np_}"
        train("launch", ["--framework", fw, "--data", f"folder:{shapes}", *PLAIN,
                         "--train-samples", "240", "--batch-size", str(batch),
                         "--checkpoint-dir", str(folder_)], np=np_, timeout=400)
        runs[np_] = load_params(ckpt(folder_))
    assert_same_params(runs[2], runs[1])


@pytest.mark.parametrize("fw", ["torch"])
def test_an_uneven_folder_at_three_ranks_does_not_hang(fw, tmp_path):
    """301 images over 3 ranks: equal steps everywhere, the remainder trimmed."""
    data = shapes_folder(tmp_path / "odd", 301, 31, size=24)
    out = tmp_path / "m.json"
    train("launch", ["--framework", fw, "--data", f"folder:{data}", "--epochs", "2", "--batch-size",
                     "16", "--no-progress", "--metrics-out", str(out), "--stall-timeout", "60"],
          np=3, timeout=400)
    m = metrics(out)
    assert m["world_size"] == 3 and len(set(m["param_checksums"])) == 1


# A user's dataset that records which items each rank reads (its DataLoader workers or tf.data
# threads included), one line per item, in a file per rank.
RECORDING = textwrap.dedent('''
    import os
    import numpy as np

    LOG = os.environ["RECORD_DIR"]


    class Recording:
        classes = ["even", "odd"]

        def __init__(self, split, framework):
            self.split, self.framework = split, framework
            self.n = int(os.environ["RECORD_N"]) if split == "train" else 40

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if self.split == "train":
                rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
                with open(os.path.join(LOG, f"rank{rank}.txt"), "a") as fh:
                    fh.write(f"{i}\\n")
            x = np.full((8, 8, 1), (i % 2) - 0.5, np.float32)
            if self.framework == "torch":
                import torch
                return torch.from_numpy(x.transpose(2, 0, 1).copy()), i % 2
            return x, i % 2


    def build(split, framework):
        return Recording(split, framework)
''')


@pytest.mark.parametrize("fw", FW)
def test_streamed_shards_cover_every_item_once_per_epoch(fw, tmp_path):
    """103 items, 3 ranks, 2 epochs: each epoch the ranks together read exactly the first
    3 x 34 items of that epoch's permutation of (seed, epoch), none twice, and the trimmed
    remainder not at all."""
    (tmp_path / "recording.py").write_text(RECORDING)
    logs = tmp_path / "logs"
    logs.mkdir()
    n, ranks, epochs, seed = 103, 3, 2, 7
    train("launch", ["--framework", fw, "--data", "recording:build", "--model", "mlp",
                     "--epochs", str(epochs), "--batch-size", "8", "--seed", str(seed),
                     "--no-progress", "--workers", "2"],
          np=ranks, timeout=400,
          env={"PYTHONPATH": f"{tmp_path}:{REPO}", "RECORD_DIR": str(logs), "RECORD_N": str(n)})
    per_rank = n // ranks
    reads = {r: [int(v) for v in (logs / f"rank{r}.txt").read_text().split()] for r in range(ranks)}
    # The start-up check reads item 0 once per rank; the epochs read their shards after it.
    reads = {r: v[1:] for r, v in reads.items()}
    for r in range(ranks):
        assert len(reads[r]) == epochs * per_rank, (r, len(reads[r]))
    for e in range(epochs):
        seen = [i for r in range(ranks) for i in reads[r][e * per_rank:(e + 1) * per_rank]]
        assert len(seen) == len(set(seen)), "an item was read twice in one epoch"
        expected = epoch_permutation(n, seed, e + 1)[:ranks * per_rank]
        assert sorted(seen) == sorted(expected.tolist())


@pytest.mark.parametrize("fw", ["torch"])
def test_mnist_as_a_png_folder_lands_where_mnist_does(fw, tmp_path):
    """The same 6,000 training images, once from MNIST's files and once as PNG files in class
    folders (their own normalisation, another order): the same accuracy band after an epoch."""
    data = mnist_folder(tmp_path / "mnist-png", 6000, 1000, str(MNIST))
    results = {}
    for name, flags in (("mnist", ["--train-samples", "6000", "--test-samples", "1000"]),
                        ("folder", ["--data", f"folder:{data}"])):
        out = tmp_path / f"{name}.json"
        train("launch", ["--framework", fw, *flags, "--epochs", "1", "--no-progress",
                         "--metrics-out", str(out)], np=2, timeout=600)
        results[name] = metrics(out)
    acc = {k: v["final_test_accuracy"] for k, v in results.items()}
    assert acc["mnist"] > 0.85 and abs(acc["folder"] - acc["mnist"]) <= 0.02, acc  # seen: 0.889, 0.885
    assert results["folder"]["data"]["input_shape"] == [28, 28, 1]
    mean = results["folder"]["data"]["normalization"]["mean"][0]
    assert abs(mean - 0.1307) < 0.01, mean  # MNIST's usual constant, computed from the PNGs


def test_resnet18_trains_on_an_rgb_folder_with_identical_buffers(tmp_path):
    """``--model torchvision.models:resnet18`` (it takes num_classes, not input_shape) on 64x64
    colour images: both ranks end with the same weights and BatchNorm statistics, which Horovod
    alone would leave apart (the checksum covers the buffers)."""
    data = shapes_folder(tmp_path / "rgb", 192, 48, size=64)
    out = tmp_path / "m.json"
    train("launch", ["--framework", "torch", "--data", f"folder:{data}", "--model",
                     "torchvision.models:resnet18", "--epochs", "1", "--batch-size", "16",
                     "--no-progress", "--metrics-out", str(out)], np=2, timeout=600)
    m = metrics(out)
    assert m["param_count"] == 11_178_051  # resnet18 with 3 classes
    assert len(set(m["param_checksums"])) == 1, m["param_checksums"]


def test_a_folder_in_an_elastic_job(shapes, tmp_path):
    """The elastic trainer reads the same streamed data (no worker changes here: the elastic
    tests cover those)."""
    from test_elastic import ElasticJob

    job = ElasticJob(tmp_path, "launch", ["localhost:2"], np=2, max_np=2, epochs=2,
                     extra=["--framework", "torch", "--data", f"folder:{shapes}",
                            "--train-samples", "300", "--test-samples", "60"])
    summary = job.finish()
    assert summary["dataset"] == "folder" and len(set(summary["param_checksums"])) == 1
    assert [e["epoch"] for e in summary["epochs"]] == [1, 2]
