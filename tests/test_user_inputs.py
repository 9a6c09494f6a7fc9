"""Your own data need not be images: 1-D signals (float features) and token sequences (int64 ids
read by an embedding) train with the user's model in both frameworks, every rank identical; the
summary and the checkpoints record the input's shape and dtype; an item unlike the others, or a
label out of range, is one line naming it.

The data and models are ``tests/user_inputs.py``.  One launch per framework runs both datasets
(``tests/correctness_probe.py``): starting a job costs more than its few steps.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import REPO, launch_cmd, metrics, one_error_line, requires_horovod, run

pytestmark = requires_horovod

TESTS = str(REPO / "tests")
PROBE = str(REPO / "tests" / "correctness_probe.py")
ENV = {"PYTHONPATH": f"{TESTS}:{REPO}"}
JOB = ["--epochs", "2", "--batch-size", "32", "--base-lr", "0.05", "--no-progress", "--workers", "1"]
CASES = {"signals": ([40], "float32", 10), "tokens": ([24], "int64", 4)}


@pytest.fixture(scope="module", params=["torch", "tf"])
def trained(request, tmp_path_factory):
    """Both datasets trained by one ``horovodrun -np 2`` launch of the framework."""
    fw, out = request.param, tmp_path_factory.mktemp(f"inputs-{request.param}")
    plan = [{"args": ["--data", f"user_inputs:{name}", "--model",
                      f"user_inputs:{fw}_{'signal' if name == 'signals' else 'token'}_model", *JOB,
                      "--checkpoint-dir", str(out / name), "--metrics-out", str(out / f"{name}.json")]}
            for name in CASES]
    (out / "plan.json").write_text(json.dumps(plan))
    proc = run(launch_cmd(PROBE, [fw, str(out / "plan.json")], np=2), timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return fw, out


@pytest.mark.parametrize("name", list(CASES))
def test_non_image_inputs_train_with_identical_ranks(trained, name):
    fw, out = trained
    m = metrics(out / f"{name}.json")
    shape, dtype, classes = CASES[name]
    assert len(m["param_checksums"]) == 2 and len(set(m["param_checksums"])) == 1
    losses = [e["train_loss"] for e in m["epochs"]]
    assert losses[-1] < losses[0], losses
    assert m["final_test_accuracy"] > 2.0 / classes, m["final_test_accuracy"]  # well above chance
    assert (m["data"]["input_shape"], m["data"]["input_dtype"], m["data"]["image"]) == (shape, dtype,
                                                                                      False)
    # The checkpoint records the same (the resume check compares it).
    ckpt = sorted((out / name).glob("ckpt-epoch*"))[-1]
    if ckpt.suffix == ".npz":
        with np.load(ckpt, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
    else:
        import torch

        meta = torch.load(ckpt, map_location="cpu", weights_only=True)["meta"]
    assert (meta["data"]["input_shape"], meta["data"]["input_dtype"]) == (shape, dtype)


@pytest.mark.parametrize("fw,spec,needle", [
    ("torch", "user_inputs:odd_items", "item 37 of --data user_inputs:odd_items's train split has a "
                                       "float32 input of shape (41,), item 0 a float32 one of shape (40,)"),
    ("tf", "user_inputs:odd_labels", "item 37 of --data user_inputs:odd_labels's train split has "
                                     "label 10, outside range(10)"),
])
def test_an_item_unlike_the_others_is_one_line(fw, spec, needle):
    """Met while training (item 37, in file order at step 5 of batch 8): every rank stops at that
    step, the line names the item."""
    proc = run([sys.executable, "-m", "launch", "--framework", fw, "--data", spec, "--model", "mlp",
                "--epochs", "1", "--batch-size", "8", "--no-shuffle", "--workers", "0", "--no-progress"],
               env=ENV)
    one_error_line(proc, needle, "met by rank 0 at epoch 1, step 5")


@pytest.mark.parametrize("fw,data,model,needle", [
    ("torch", "signals", "cnn", "--model cnn reads images; --data user_inputs:signals gives float32 "
                                "inputs of shape (40,)"),
    ("tf", "tokens", "mlp", "--model mlp reads float features; --data user_inputs:tokens gives int64 "
                            "token ids of shape (24,)"),
])
def test_a_built_in_model_refuses_inputs_it_cannot_read(fw, data, model, needle):
    proc = run([sys.executable, "-m", "launch", "--framework", fw, "--data", f"user_inputs:{data}",
                "--model", model, "--epochs", "1", "--no-progress"], env=ENV)
    one_error_line(proc, needle)
