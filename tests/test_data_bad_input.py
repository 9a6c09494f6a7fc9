"""``--data``'s bad inputs: each one line naming the problem and the fix, exit status 2, no
traceback, nothing left behind, and under horovodrun every rank ends, also when only one rank
meets the problem (a corrupt image read by rank 1 alone)."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import REPO, one_error_line, requires_horovod, run, train
from image_folders import corrupt, shapes_folder

from ringtrain.data import folder
from ringtrain.data.sharding import epoch_permutation

pytestmark = requires_horovod
QUICK = ["--epochs", "1", "--batch-size", "8", "--no-progress"]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return shapes_folder(tmp_path_factory.mktemp("good"), 60, 12, size=16)


def copy_of(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "data"))


def data_run(spec: str, fw: str = "torch", *extra: str, env: dict | None = None):
    return run([sys.executable, "-m", "launch", "--framework", fw, "--data", spec, *QUICK, *extra],
               env=env)


# --- the folder's layout: found at start-up, before any training -------------------------------

def test_a_missing_folder(tmp_path):
    one_error_line(data_run(f"folder:{tmp_path / 'nowhere'}"), "nowhere: no such folder",
                   "train/ and test/")


@pytest.mark.parametrize("missing,needle", [("train", "has no train/ folder"),
                                            ("test", "has no test/ (or val/) folder")])
def test_a_missing_split(missing, needle, good, tmp_path):
    data = copy_of(good, tmp_path)
    shutil.rmtree(data / missing)
    one_error_line(data_run(f"folder:{data}"), needle)


def test_val_stands_for_test(good, tmp_path):
    data = copy_of(good, tmp_path)
    (data / "test").rename(data / "val")
    index = folder.scan(str(data))
    assert index.test.root.endswith("val") and len(index.test.labels) == 12


@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_a_class_folder_without_images(fw, good, tmp_path):
    data = copy_of(good, tmp_path)
    for f in (data / "train" / "square").iterdir():
        f.unlink()
    one_error_line(data_run(f"folder:{data}", fw), f"class folder {data / 'train' / 'square'} has no images")


def test_different_classes_in_train_and_test(good, tmp_path):
    data = copy_of(good, tmp_path)
    (data / "test" / "triangle").rename(data / "test" / "hexagon")
    one_error_line(data_run(f"folder:{data}"), "train/ and test/ have different classes",
                   "only in train/: triangle", "only in test/: hexagon")


def test_a_file_that_is_not_an_image(good, tmp_path):
    data = copy_of(good, tmp_path)
    (data / "train" / "circle" / "notes.txt").write_text("not a picture")
    one_error_line(data_run(f"folder:{data}"), "notes.txt is not a JPEG or PNG image", "remove it")


def test_hidden_files_are_left_alone(good, tmp_path):
    data = copy_of(good, tmp_path)
    (data / "train" / "circle" / ".DS_Store").write_bytes(b"\0\0")
    assert len(folder.scan(str(data)).train.labels) == 60


def test_one_class_only(good, tmp_path):
    data = copy_of(good, tmp_path)
    for split in ("train", "test"):
        for name in ("square", "triangle"):
            shutil.rmtree(data / split / name)
    one_error_line(data_run(f"folder:{data}"), "has one class folder (circle)", "at least two")


def test_the_first_image_is_corrupt(good, tmp_path):
    data = copy_of(good, tmp_path)
    first = sorted((data / "train" / "circle").iterdir())[0]
    corrupt(first)
    one_error_line(data_run(f"folder:{data}"), f"{first} is not a readable image")


@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_images_too_small_for_the_built_in_cnn(fw, good):
    one_error_line(data_run(f"folder:{good}", fw, "--image-size", "12"),
                   "--model cnn needs images of at least 16x16 pixels", "the data's are 12x12",
                   "--model mlp")


def test_more_ranks_than_images(tmp_path):
    data = shapes_folder(tmp_path / "tiny", 2, 2, size=8, classes=("a", "b"))
    proc = train("launch", ["--framework", "torch", "--data", f"folder:{data}", *QUICK,
                            "--stall-timeout", "0"], np=3, expect_ok=False, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "has 2 training image(s), fewer than the world size 3" in errors[0], errors[0]


# --- a corrupt image met while training, by one rank ----------------------------------------------

@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_a_corrupt_image_met_by_one_rank_ends_every_rank_naming_it(fw, good, tmp_path):
    """A file in the middle of the list, in rank 1's shard of epoch 1 (the permutation of
    (seed 42, epoch 1)), cut to its header: both ranks stop at the step that reads it, rank 0
    says which file and which rank, and no checkpoint of that epoch is written.  (ImageNet's
    normalisation: the computed one reads every image of a small folder at start-up, which
    would find the file there, as it should.)"""
    data = copy_of(good, tmp_path)
    index = folder.scan(str(data))
    shard_of_rank1 = epoch_permutation(60, 42, 1)[1::2][: 60 // 2]
    victim = index.train.path(int(shard_of_rank1[10]))
    corrupt(victim)
    ckpt = tmp_path / "ckpt"
    proc = train("launch", ["--framework", fw, "--data", f"folder:{data}", *QUICK,
                            "--normalize", "imagenet", "--checkpoint-dir", str(ckpt),
                            "--stall-timeout", "60"],
                 np=2, expect_ok=False, timeout=240)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert f"{victim} is not a readable image" in errors[0] and "met by rank 1" in errors[0], errors[0]
    assert not list(ckpt.glob("ckpt-*")), "a checkpoint was written after the bad step"


# --- the user's own data -------------------------------------------------------------------------

USER = textwrap.dedent('''
    import numpy as np


    def fails(split):
        raise ValueError("the bucket is empty")


    def not_a_dataset(split):
        return 42


    def pil_images(split):
        from PIL import Image

        class Items:
            classes = ["a", "b"]
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return Image.new("L", (8, 8)), i % 2
        return Items()


    def no_classes(split, framework):
        class Items:
            def __len__(self):
                return 4
            def __getitem__(self, i):
                x = np.zeros((8, 8, 1), np.float32)
                if framework == "torch":
                    import torch
                    return torch.zeros(1, 8, 8), i % 2
                return x, i % 2
        return Items()
''')


@pytest.fixture(scope="module")
def user_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("userdata")
    (root / "baddata.py").write_text(USER)
    return root


@pytest.mark.parametrize("spec,needle", [
    ("nosuchpkg.data:make", "--data nosuchpkg.data:make: cannot import nosuchpkg.data"),
    ("baddata:fails", "calling it as fails(split='train') failed: ValueError: the bucket is empty"),
    ("baddata:not_a_dataset", "returned a builtins.int for split='train', not a map-style dataset"),
    ("baddata:pil_images", "is a PIL.Image.Image; --framework torch needs a tensor or array of numbers"),
    ("baddata:no_classes", "give the training split a 'classes' attribute"),
])
def test_a_bad_data_function(spec, needle, user_path):
    one_error_line(data_run(spec, env={"PYTHONPATH": f"{user_path}:{REPO}"}), needle)


def test_a_bad_data_function_under_horovodrun_ends_every_rank(user_path):
    proc = train("launch", ["--framework", "tf", "--data", "baddata:fails", *QUICK,
                            "--stall-timeout", "0"], np=2, expect_ok=False, timeout=120,
                 env={"PYTHONPATH": f"{user_path}:{REPO}"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "the bucket is empty" in errors[0], proc.stderr[-2000:]


# --- flags ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,needle", [
    (["--data", "pictures"], "--data must be mnist, folder:DIR"),
    (["--data", "folder:"], "--data must be mnist, folder:DIR"),
    (["--data", "folder:/x", "--data-dir", "/y"], "--data-dir is MNIST's folder"),
    (["--image-size", "64"], "--image-size works with --data folder:DIR only"),
    (["--data", "folder:/x", "--image-size", "64x"], "--image-size must be N or HxW"),
    (["--workers", "-1"], "--workers must be 0"),
    # No abbreviations: once, --data folder:x was silently taken for --data-dir folder:x.
    (["--data-d", "/y"], "unrecognized arguments: --data-d"),
    (["--dat", "mnist"], "unrecognized arguments: --dat"),
])
def test_bad_data_flags_before_any_framework_import(flags, needle):
    one_error_line(run([sys.executable, "-m", "launch.torch_mnist", *flags]), needle)


def test_resuming_mnist_checkpoints_on_a_folder_is_refused(good, tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run([sys.executable, "-m", "launch.torch_mnist", "--train-samples", "64", "--test-samples",
                "16", *QUICK, "--checkpoint-dir", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = data_run(f"folder:{good}", "torch", "--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume")
    one_error_line(proc, "was trained on --data mnist", "10 classes there, 3 here")


def test_resuming_with_another_normalisation_is_refused(good, tmp_path):
    ckpt = tmp_path / "ckpt"
    assert data_run(f"folder:{good}", "torch", "--checkpoint-dir", str(ckpt)).returncode == 0
    one_error_line(data_run(f"folder:{good}", "torch", "--epochs", "2", "--normalize", "imagenet",
                            "--checkpoint-dir", str(ckpt), "--resume"),
                   "normalisation mean", "(--normalize, --image-size, --train-samples as then)")
