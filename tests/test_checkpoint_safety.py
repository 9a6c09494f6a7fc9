"""Checkpoint folders are shared (NFS, object stores): nothing in a checkpoint may run code, and
what users meet on clusters (a damaged file, a newer format, a read-only or full disk, a missing
folder) is one line, or a fall back that says so.

The malicious files are real exploits: unpickling them would create a marker file.  Each test
asserts the marker never appears.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import metrics, mounted_tmpfs, one_error_line, requires_horovod, run

from ringtrain.data.dataset import mnist_info
from ringtrain.output import checkpoint
from ringtrain.training.run import RunIdentity

pytestmark = requires_horovod
MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
EXT = {"torch": "pt", "tf": "npz"}
SMALL = ["--train-samples", "256", "--test-samples", "100", "--batch-size", "32", "--no-progress"]


class Exploit:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def trained(framework: str, folder: Path, epochs: int) -> Path:
    """A folder with ``epochs`` real checkpoints of the MNIST CNN."""
    proc = run([sys.executable, "-m", MODULES[framework], *SMALL, "--epochs", str(epochs),
                "--checkpoint-dir", str(folder)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """Two epochs of checkpoints per framework, copied by each test that changes them."""
    root = tmp_path_factory.mktemp("saved")
    return {fw: trained(fw, root / fw, 2) for fw in MODULES}


def resume(framework: str, folder: Path, *extra: str, epochs: int = 3):
    return run([sys.executable, "-m", MODULES[framework], *SMALL, "--epochs", str(epochs),
                "--checkpoint-dir", str(folder), "--resume", *extra])


# --- nothing runs --------------------------------------------------------------------------------

def evil_torch_archive(marker: Path) -> bytes:
    """A real torch.save archive whose metadata is the exploit."""
    import torch

    buf = io.BytesIO()
    torch.save({"meta": Exploit(marker), "model": {}}, buf)
    return buf.getvalue()


def mnist_cnn(framework: str) -> RunIdentity:
    """The identity of a run of the built-in CNN on MNIST, as checkpoints record it."""
    return RunIdentity(framework, {}, "cnn", "mnist-cnn-v1", 184_586, mnist_info())


def evil_npz(marker: Path) -> bytes:
    """A real .npz with our metadata, plus an object array holding the exploit, under the name
    of the model's first weight (a member of another name is refused for its name alone)."""
    buf = io.BytesIO()
    meta = checkpoint.metadata(mnist_cnn("tf"), 9, {})
    np.savez(buf, meta=np.array(json.dumps(meta)), model_0000=np.array([Exploit(marker)], dtype=object))
    return buf.getvalue()


@pytest.mark.parametrize("framework,kind", [("torch", "archive"), ("torch", "bare-pickle"),
                                            ("tf", "object-array"), ("tf", "bare-pickle")])
def test_a_malicious_checkpoint_runs_nothing_and_is_refused(framework, kind, saved, tmp_path):
    """The newest checkpoint of a real run replaced by an exploit: refused in one line before
    anything in it is unpickled, and no fallback to the older ones (someone wrote into the folder)."""
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[framework], folder)
    marker = tmp_path / "pwned"
    if kind == "bare-pickle":
        evil = pickle.dumps({"meta": Exploit(marker)})
    else:
        evil = evil_torch_archive(marker) if framework == "torch" else evil_npz(marker)
    (folder / f"ckpt-epoch0003.{EXT[framework]}").write_bytes(evil)
    line = one_error_line(resume(framework, folder), "ckpt-epoch0003", "refused without loading it")
    assert not marker.exists(), "the checkpoint's code ran"
    assert ("bare Python pickle" if kind == "bare-pickle" else "Python objects") in line, line


def test_the_exploits_are_real(tmp_path):
    """What the test above feeds the trainers does run code when unpickled the unsafe way."""
    import torch

    marker = tmp_path / "pwned-archive"
    (tmp_path / "evil.pt").write_bytes(evil_torch_archive(marker))
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()
    marker = tmp_path / "pwned-pickle"
    pickle.loads(pickle.dumps({"meta": Exploit(marker)}))
    assert marker.exists()
    marker = tmp_path / "pwned-npz"
    (tmp_path / "evil.npz").write_bytes(evil_npz(marker))
    with np.load(tmp_path / "evil.npz", allow_pickle=True) as npz:
        npz["model_0000"]
    assert marker.exists()


# --- damaged files, formats, folders ------------------------------------------------------------

@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_a_truncated_checkpoint_falls_back_to_the_previous_one(framework, saved, tmp_path):
    """Epoch 2's file cut in half (a copy that stopped, a full disk elsewhere): the run resumes
    from epoch 1, says so in one warning line, and trains on to the end."""
    folder = tmp_path / "ckpt"
    shutil.copytree(saved[framework], folder)
    newest = folder / f"ckpt-epoch0002.{EXT[framework]}"
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc = resume(framework, folder, "--metrics-out", str(tmp_path / "m.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [ln for ln in proc.stderr.splitlines() if "warning:" in ln]
    assert len(warnings) == 1 and "ckpt-epoch0002" in warnings[0] and "damaged" in warnings[0], \
        proc.stderr
    assert f"resuming from ckpt-epoch0001.{EXT[framework]}" in warnings[0], warnings[0]
    assert metrics(tmp_path / "m.json")["resumed_from_epoch"] == 1


def test_only_damaged_checkpoints_are_one_line(saved, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(saved["torch"], folder)
    for path in folder.iterdir():
        path.write_bytes(path.read_bytes()[:1000])
    one_error_line(resume("torch", folder), "ckpt-epoch0002.pt is corrupt",
                   "no earlier checkpoint", "is intact")


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_a_checkpoint_from_a_newer_format_is_one_line(framework, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    meta = checkpoint.metadata(mnist_cnn(framework), 1, {})
    meta["format_version"] = checkpoint.FORMAT_VERSION + 1
    if framework == "torch":
        import torch

        torch.save({"meta": meta}, folder / "ckpt-epoch0001.pt")
    else:
        np.savez(folder / "ckpt-epoch0001.npz", meta=np.array(json.dumps(meta)))
    one_error_line(resume(framework, folder), "written by a newer ringtrain",
                   f"checkpoint format {checkpoint.FORMAT_VERSION + 1}", "upgrade ringtrain")


def test_resume_from_a_folder_that_does_not_exist_is_one_line(tmp_path):
    folder = tmp_path / "no-such-folder"
    one_error_line(resume("torch", folder), f"the checkpoint folder {folder} does not exist",
                   "drop --resume")
    assert not folder.exists(), "the missing folder was created"


def test_resume_from_an_empty_folder_starts_afresh_and_says_so(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    proc = resume("torch", folder, epochs=1)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"no checkpoint in {folder} yet; starting from epoch 1" in proc.stdout


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_a_read_only_checkpoint_folder_is_one_line_at_start(framework, tmp_path):
    with mounted_tmpfs(tmp_path / "ckpt", "4m", read_only=True) as folder:
        proc = run([sys.executable, "-m", MODULES[framework], *SMALL, "--epochs", "1",
                    "--checkpoint-dir", str(folder)])
    one_error_line(proc, f"checkpoint folder {folder} is not writable", "Read-only file system",
                   "--checkpoint-dir")
    assert "epoch 1/1" not in proc.stdout, "training started"


@pytest.mark.parametrize("framework", ["torch", "tf"])
def test_a_full_checkpoint_disk_is_one_line_at_start(framework, tmp_path):
    """256 KiB free, and one checkpoint of the CNN (weights and momentum) needs ~1.5 MB."""
    with mounted_tmpfs(tmp_path / "ckpt", "256k") as folder:
        proc = run([sys.executable, "-m", MODULES[framework], *SMALL, "--epochs", "1",
                    "--checkpoint-dir", str(folder)])
        left = list(folder.iterdir())
    one_error_line(proc, f"checkpoint folder {folder} has 0.3 MB free",
                   "needs about 1.5 MB", "choose another --checkpoint-dir")
    assert not left, f"files left behind: {left}"
