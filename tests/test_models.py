"""``--model``: a user's own model through the same launcher, in both frameworks, and each bad
spec as one line; ``--tensorboard`` from the same runs (``python -m launch`` under real
``horovodrun -np 2``)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import BIN, REPO, SMALL, metrics, one_error_line, requires_horovod, run, train
from test_tensorboard import read_events, scalars

from ringtrain.errors import UserError
from ringtrain.output.tensorboard import EPOCH_TAGS, STEP_LOSS, STEP_LR

# A user's package, as README shows it: builders import their framework themselves, so the module
# imports in a process of either framework.
USER_PACKAGE = textwrap.dedent('''
    """mypkg.net: models of my own."""


    def build(input_shape, num_classes):
        """PyTorch: input_shape is (channels, height, width)."""
        from torch import nn

        channels, height, width = input_shape
        return nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, 32), nn.ReLU(),
                             nn.Linear(32, num_classes))


    def build_keras(input_shape, num_classes):
        """Keras, subclassed (its weights exist only after a first call): (height, width, channels)."""
        import keras

        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.hidden = keras.layers.Dense(32, activation="relu")
                self.logits = keras.layers.Dense(num_classes)

            def call(self, x, training=False):
                return self.logits(self.hidden(keras.ops.reshape(x, (keras.ops.shape(x)[0], -1))))

        return Net()


    def wrong_shape(input_shape, num_classes):
        from torch import nn

        return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes - 5))


    def needs_other_arguments(shape):
        raise AssertionError("never called: the arguments do not fit")


    not_callable = 42
''')
USER_PARAMS = 28 * 28 * 32 + 32 + 32 * 10 + 10  # the same network in both frameworks: 25,450
JOB = [*SMALL, "--train-samples", "2048", "--epochs", "2", "--base-lr", "0.05"]
MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
SPECS = {"torch": "mypkg.net:build", "tf": "mypkg.net:build_keras"}


@pytest.fixture(scope="module")
def user_path(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user")
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "net.py").write_text(USER_PACKAGE)
    return root


def env_for(user_path: Path) -> dict:
    return {"PYTHONPATH": f"{user_path}:{REPO}"}


@pytest.fixture(scope="module", params=["torch", "tf"])
def user_run(request, user_path, tmp_path_factory):
    """The user's model, trained for 2 epochs by ``python -m launch`` under horovodrun -np 2,
    with checkpoints and TensorBoard scalars (per epoch and per step)."""
    fw = request.param
    out = tmp_path_factory.mktemp(f"user-{fw}")
    train("launch", ["--framework", fw, "--model", SPECS[fw], *JOB, "--metrics-out",
                     str(out / "m.json"), "--checkpoint-dir", str(out / "ckpt"), "--tensorboard",
                     str(out / "tb"), "--tensorboard-steps"], env=env_for(user_path))
    return fw, metrics(out / "m.json"), out


@requires_horovod
def test_user_model_trains_with_identical_ranks(user_run):
    fw, m, out = user_run
    assert m["framework"] == fw and m["world_size"] == 2 and m["model"] == SPECS[fw]
    assert m["param_count"] == USER_PARAMS
    assert len(m["param_checksums"]) == 2 and len(set(m["param_checksums"])) == 1, m["param_checksums"]
    losses = [e["train_loss"] for e in m["epochs"]]
    assert losses[1] < losses[0] and m["final_test_accuracy"] > 0.8, m["epochs"]


@requires_horovod
def test_checkpoint_records_the_model_and_resume_refuses_another(user_run, user_path):
    fw, _, out = user_run
    newest = sorted((out / "ckpt").iterdir())[-1]
    if fw == "torch":
        import torch

        meta = torch.load(newest, map_location="cpu", weights_only=True)["meta"]
    else:
        with np.load(newest, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
    assert meta["model"] == SPECS[fw] and meta["config"]["model"] == SPECS[fw]
    proc = run([sys.executable, "-m", MODULES[fw], *JOB, "--epochs", "3", "--model", "cnn",
                "--checkpoint-dir", str(out / "ckpt"), "--resume"], env=env_for(user_path))
    one_error_line(proc, f"belongs to model '{SPECS[fw]}', not 'mnist-cnn-v1'",
                   f"resume with --model {SPECS[fw]}")


@requires_horovod
def test_user_model_resumes(user_run, user_path, tmp_path):
    fw, m, out = user_run
    train(MODULES[fw], ["--model", SPECS[fw], *JOB, "--epochs", "3", "--checkpoint-dir",
                        str(out / "ckpt"), "--resume", "--metrics-out", str(tmp_path / "m.json")],
          env=env_for(user_path))
    resumed = metrics(tmp_path / "m.json")
    assert resumed["resumed_from_epoch"] == 2 and [e["epoch"] for e in resumed["epochs"]] == [3]
    assert len(set(resumed["param_checksums"])) == 1


@requires_horovod
def test_tensorboard_rank0_writes_every_epoch_and_step(user_run):
    """The same tags in both frameworks, rank 0's file only, values equal to the JSON summary."""
    fw, m, out = user_run
    files = list((out / "tb").iterdir())
    assert len(files) == 1, files  # rank 0 alone
    tags = scalars(read_events(files[0]))
    assert set(tags) == {*EPOCH_TAGS.values(), STEP_LOSS, STEP_LR}
    for key, tag in EPOCH_TAGS.items():
        assert [step for step, _ in tags[tag]] == [1, 2]
        assert [v for _, v in tags[tag]] == pytest.approx([e[key] for e in m["epochs"]], rel=1e-6)
    steps_per_epoch = 2048 // 2 // 32
    x = [step for step, _ in tags[STEP_LR]]
    # step = samples both ranks have trained on: 64 more per step, the same axis in both epochs
    assert x == [64 * s + 2048 * e for e in range(2) for s in range(1, steps_per_epoch + 1)]
    assert all(np.isfinite(v) and v > 0 for _, v in tags[STEP_LOSS])
    assert tags[STEP_LR][-1][1] == pytest.approx(m["epochs"][-1]["lr"])


# --- bad specs: one line, exit status 2, no traceback --------------------------------------------

@pytest.mark.parametrize("module", MODULES.values())
@pytest.mark.parametrize("spec", ["resnet", "mypkg.net", "mypkg/net:build", "mypkg.net:"])
def test_bad_spec_syntax_before_any_framework_import(module, spec):
    one_error_line(run([sys.executable, "-m", module, "--model", spec]),
                   "--model must be cnn, mlp or package.module:function", repr(spec))


@requires_horovod
@pytest.mark.parametrize("fw,spec,needle", [
    ("torch", "nosuchpkg.net:build", "cannot import nosuchpkg.net (No module named 'nosuchpkg')"),
    ("tf", "mypkg.net:not_callable", "mypkg.net.not_callable is a int, not a function"),
])
def test_bad_spec_one_process(fw, spec, needle, user_path):
    proc = run([sys.executable, "-m", MODULES[fw], *SMALL, "--epochs", "1", "--model", spec],
               env=env_for(user_path))
    one_error_line(proc, f"--model {spec}", needle)


@requires_horovod
def test_wrong_output_shape_ends_every_rank_in_one_line(user_path):
    """Checked right after the model is built, on every rank, before any collective: both ranks
    stop, rank 0 says why, nobody waits for a peer that is gone."""
    proc = train("launch.torch_mnist", [*SMALL, "--epochs", "1", "--model", "mypkg.net:wrong_shape",
                                        "--stall-timeout", "0"],
                 expect_ok=False, timeout=120, env=env_for(user_path))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1, proc.stderr[-2000:]
    assert "maps inputs of shape (1, 28, 28) to outputs of shape (5,), expected (10,)" in errors[0]


# --- in-process: every spec error is one line, in both frameworks -------------------------------

class FakeDataset:
    name, spec, input_shape, num_classes, input_dtype, image = "mnist", "mnist", (28, 28, 1), 10, \
        "float32", True


@pytest.mark.parametrize("fw", ["torch", "tf"])
@pytest.mark.parametrize("spec,needle", [
    ("nosuchpkg.net:build", "cannot import nosuchpkg.net"),
    ("mypkg.net:nothing", "mypkg.net has no attribute 'nothing'"),
    ("mypkg.net:not_callable", "is a int, not a function that builds a model"),
    ("mypkg.net:needs_other_arguments", "calling it as needs_other_arguments(input_shape="),
    ("mypkg.net:wrong_shape", "to outputs of shape (5,), expected (10,)"),
])
def test_each_bad_spec_is_one_line(fw, spec, needle, user_path, monkeypatch):
    monkeypatch.syspath_prepend(str(user_path))
    build = framework_build(fw)
    if fw == "tf" and spec.endswith("wrong_shape"):
        spec = "mypkg.net:build"  # a torch module: wrong for tf before its shape matters
        needle = "returned a torch.nn.modules.container.Sequential, but --framework tf needs a keras.Model"
    with pytest.raises(UserError) as err:
        build(spec, FakeDataset(), 0.5)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_torch_refuses_a_keras_model(user_path, monkeypatch):
    monkeypatch.syspath_prepend(str(user_path))
    with pytest.raises(UserError, match="returned a .*Net, but --framework torch needs a "
                                        "torch.nn.Module"):
        framework_build("torch")("mypkg.net:build_keras", FakeDataset(), 0.5)


@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_builtin_models_match_across_frameworks(fw):
    build = framework_build(fw)
    counts = {}
    for spec in ("cnn", "mlp"):
        model = build(spec, FakeDataset(), 0.5)
        counts[spec] = (sum(p.numel() for p in model.parameters()) if fw == "torch"
                        else model.count_params())
    assert counts == {"cnn": 184_586, "mlp": 101_770}


def framework_build(fw: str):
    if fw == "torch":
        from torch_models.model import build
    else:
        from tf_models.model import build
    return build


@requires_horovod
def test_user_model_in_an_elastic_job(user_path, tmp_path):
    """The elastic trainer builds and checks the same --model (no worker changes here: the
    elastic tests cover those with the built-in model)."""
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("localhost:2\n")
    out = tmp_path / "m.json"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(REPO / "launch" / "discover_hosts.sh"),
           "--network-interface", "lo", sys.executable, "-m", "launch", "--framework", "torch",
           "--elastic", "--model", SPECS["torch"], *JOB, "--epochs", "1", "--metrics-out", str(out)]
    proc = run(cmd, timeout=240, env={**env_for(user_path), "RINGTRAIN_HOSTS": str(hosts),
                                      "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = metrics(out)
    assert m["model"] == SPECS["torch"] and m["param_count"] == USER_PARAMS
    assert m["world_size"] == 2 and len(set(m["param_checksums"])) == 1
