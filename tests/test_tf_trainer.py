"""The TensorFlow/Keras 3 trainer: the output contract under real ``horovodrun -np 2``, resume,
rank-0-only output, and the Keras 3 Horovod pieces in :mod:`tf_models.horovod_keras`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import SMALL, SUMMARY_KEYS, metrics, requires_horovod, train

MODULE = "launch.tf_mnist"

# Runs the trainer like ``python -m launch.tf_mnist``, except that on every rank but 0 the
# functions that write files raise: a rank other than 0 writing anything fails the job.
GUARDED_MAIN = textwrap.dedent("""
    import os, sys
    from launch.cli import run_cli
    from ringtrain.errors import launcher_rank
    rank = launcher_rank()
    if rank != 0:
        import ringtrain.output.checkpoint, ringtrain.output.summary
        def refuse(path, *args, **kwargs):
            raise AssertionError(f"rank {rank} tried to write {path}")
        ringtrain.output.summary.atomic_write_bytes = refuse
        ringtrain.output.checkpoint.atomic_write_bytes = refuse
        ringtrain.output.checkpoint.ensure_writable = refuse
    from launch.tf_mnist import main
    run_cli(lambda: main(sys.argv[1:]))
""")


def guarded_train(tmp: Path, args: list[str]):
    script = tmp / "guarded_main.py"
    script.write_text(GUARDED_MAIN)
    return train(str(script), [*SMALL, *args])


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    out = tmp_path_factory.mktemp("tf2")
    proc = guarded_train(out, ["--test-samples", "500", "--epochs", "2", "--metrics-out",
                               str(out / "m.json"), "--checkpoint-dir", str(out / "ckpt")])
    return proc, metrics(out / "m.json"), out


# --- in-process --------------------------------------------------------------------------------

def test_model_matches_the_torch_reference():
    from tf_models.model import build_cnn

    model = build_cnn(dropout=0.5)
    assert model.count_params() == 184_586
    assert [tuple(w.shape) for w in model.weights] == [
        (5, 5, 1, 32), (32,), (5, 5, 32, 64), (64,), (1024, 128), (128,), (128, 10), (10,)]
    assert tuple(model.output.shape) == (None, 10)
    # PyTorch's default initialisation: everything uniform in +-1/sqrt(fan_in), biases included
    layers = zip(model.weights[::2], model.weights[1::2], (25, 800, 1024, 128), strict=True)
    for kernel, bias, fan_in in layers:
        bound = fan_in ** -0.5
        for w in (kernel.numpy(), bias.numpy()):
            assert np.abs(w).max() <= bound and np.abs(w).max() > 0.5 * bound
        assert kernel.numpy().std() == pytest.approx(bound / 3 ** 0.5, rel=0.1)


@requires_horovod
def test_checkpoint_round_trip_and_corrupt_file(tmp_path, capsys):
    import argparse
    import dataclasses

    import keras

    from ringtrain.data.dataset import mnist_info
    from ringtrain.errors import UserError
    from ringtrain.output import checkpoint
    from ringtrain.training.run import RunIdentity
    from tf_models import checkpoints
    from tf_models.model import build_cnn

    MNIST = RunIdentity("tf", {}, "cnn", "mnist-cnn-v1", 184_586, mnist_info())

    def fresh(seed, lr=0.1):
        keras.utils.set_random_seed(seed)
        net = build_cnn(0.5)
        opt = keras.optimizers.SGD(learning_rate=lr, momentum=0.9)
        opt.build(net.trainable_variables)
        return net, opt

    net, opt = fresh(1)
    opt.iterations.assign(7)
    for m in opt.variables[2:]:  # after the step counter and the LR: the momentum slots
        m.assign(np.full(m.shape, 0.5, np.float32))
    args = argparse.Namespace(epochs=3, seed=1, resume=False, no_progress=True, model="cnn")
    checkpoints.save(str(tmp_path), 2, net, opt, MNIST, args)

    other, other_opt = fresh(2)
    epoch = checkpoints.restore(str(tmp_path), other, other_opt, MNIST)
    assert epoch == 2
    for a, b in zip(net.weights, other.weights, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for a, b in zip(opt.variables, other_opt.variables, strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(other_opt.iterations.numpy()) == 7

    # A damaged newest checkpoint: resume falls back to the previous one and says so; with no
    # intact one left, it is one line.
    checkpoint.path_for(tmp_path, 3, "npz").write_bytes(b"PK\x03\x04 definitely not a zip")
    assert checkpoints.restore(str(tmp_path), other, other_opt, MNIST) == 2
    assert "ckpt-epoch0003.npz is damaged" in capsys.readouterr().err
    checkpoint.path_for(tmp_path, 2, "npz").write_bytes(b"PK\x03\x04 not one either")
    with pytest.raises(UserError, match="corrupt") as err:
        checkpoints.restore(str(tmp_path), other, other_opt, MNIST)
    assert "\n" not in str(err.value)

    wrong = tmp_path / "wrong"
    wrong.mkdir()
    checkpoints.save(str(wrong), 1, net, opt, MNIST, args)
    with pytest.raises(UserError, match="belongs to param_count"):
        checkpoints.restore(str(wrong), other, other_opt, dataclasses.replace(MNIST, param_count=123))
    with pytest.raises(UserError, match="belongs to model 'mnist-cnn-v1', not 'mnist-mlp-v1'; "
                                        "resume with --model cnn or use another --checkpoint-dir"):
        checkpoints.restore(str(wrong), other, other_opt,
                            dataclasses.replace(MNIST, model_name="mnist-mlp-v1"))

    # Checkpoints from before the LR was set per step: the optimizer ran a schedule, which is not
    # a variable, so they hold one optimizer variable fewer.  They still resume.
    old = tmp_path / "old"
    old.mkdir()
    net, opt = fresh(3, lr=lambda: 0.1)
    for m in opt.variables[1:]:
        m.assign(np.full(m.shape, 0.25, np.float32))
    checkpoints.save(str(old), 4, net, opt, MNIST, args)
    assert checkpoints.restore(str(old), other, other_opt, MNIST) == 4
    for a, b in zip(opt.variables[1:], other_opt.variables[2:], strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# --- one process -------------------------------------------------------------------------------

@requires_horovod
def test_amp_on_cpu_is_one_line_error():
    proc = train(MODULE, ["--amp", "--train-samples", "64", "--epochs", "1", "--no-progress"],
                 np=1, how="single", expect_ok=False, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: --amp needs a CUDA GPU")


# --- horovodrun -np 2 --------------------------------------------------------------------------

@requires_horovod
def test_all_ranks_end_identical(two_epochs):
    _, m, _ = two_epochs
    assert len(m["param_checksums"]) == 2
    assert len(set(m["param_checksums"])) == 1, m["param_checksums"]


@requires_horovod
def test_loss_falls(two_epochs):
    _, m, _ = two_epochs
    losses = [e["train_loss"] for e in m["epochs"]]
    assert losses[1] < losses[0] * 0.8, losses
    # 32 steps, half of them warm-up and the rest cosine-decayed: far from converged (the PyTorch
    # trainer lands at 75% here), but well above chance
    assert m["final_test_accuracy"] > 0.5


@requires_horovod
def test_summary_complete(two_epochs):
    _, m, _ = two_epochs
    assert SUMMARY_KEYS <= set(m), SUMMARY_KEYS - set(m)
    assert m["framework"] == "tf" and m["world_size"] == 2 and m["controller"] == "mpi"
    assert m["param_count"] == 184_586
    assert m["effective_lr"] == pytest.approx(0.02)
    assert m["global_batch_size"] == 64 and m["batch_size_per_rank"] == 32
    assert [e["epoch"] for e in m["epochs"]] == [1, 2]
    assert {"tensorflow", "keras", "horovod"} <= set(m["versions"])
    assert m["resumed_from_epoch"] is None
    assert m["images_per_second"] > 0 and m["total_seconds"] > 0
    # 1024 images over 2 ranks: every image of both shards is trained on once per epoch
    assert all(e["images_per_second"] * e["seconds"] == pytest.approx(1024) for e in m["epochs"])


@requires_horovod
def test_rank0_alone_prints_and_writes(two_epochs):
    # GUARDED_MAIN makes any write from rank 1 fail the job, so getting here proves rank 1 wrote
    # nothing; what rank 0 wrote is exactly one checkpoint per epoch (no temporary leftovers).
    proc, _, out = two_epochs
    epoch_lines = [ln for ln in proc.stdout.splitlines() if "epoch 1/2:" in ln]
    assert len(epoch_lines) == 1, proc.stdout
    files = sorted(p.name for p in (out / "ckpt").iterdir())
    assert files == ["ckpt-epoch0001.npz", "ckpt-epoch0002.npz"], files


@requires_horovod
def test_resume_continues_from_saved_epoch(tmp_path):
    ckpt = tmp_path / "ckpt"
    guarded_train(tmp_path, ["--epochs", "1", "--checkpoint-dir", str(ckpt)])
    guarded_train(tmp_path, ["--epochs", "2", "--checkpoint-dir", str(ckpt), "--resume",
                             "--metrics-out", str(tmp_path / "m.json")])
    m = metrics(tmp_path / "m.json")
    assert m["resumed_from_epoch"] == 1
    assert [e["epoch"] for e in m["epochs"]] == [2]
    assert len(set(m["param_checksums"])) == 1
    assert (ckpt / "ckpt-epoch0002.npz").exists()


# What tf_models/horovod_keras.py still adds to Horovod's Keras API (the fixed trainer uses
# Horovod's own DistributedOptimizer and callbacks; the elastic loop uses these pieces).
HOROVOD_KERAS_CHECKS = textwrap.dedent("""
    import horovod.tensorflow as hvd
    hvd.init()
    import keras
    import numpy as np
    import tensorflow as tf
    from ringtrain.output.summary import param_checksum
    from tf_models.horovod_keras import DistributedModel, broadcast_variables, loss_sums
    from tf_models.model import build_cnn

    rank = hvd.rank()
    tf.config.threading.set_intra_op_parallelism_threads(1)

    def checksums(variables, name):
        return hvd.allgather_object(param_checksum(v.numpy() for v in variables), name=name)

    # 1. broadcast_variables on Keras 3 variables (the elastic state's sync).
    keras.utils.set_random_seed(100 + rank)
    net = build_cnn(0.0)
    before = checksums(net.weights, "before")
    assert before[0] != before[1], "ranks must start different for this check to mean anything"
    broadcast_variables(net.weights, root_rank=0)
    after = checksums(net.weights, "after")
    assert after == [before[0]] * 2, (before, after)

    # 2. DistributedModel (the elastic train step): K micro-batches of B == one batch of K x B;
    #    pre-division and fp16 change only rounding.
    rng = np.random.default_rng(10 + rank)
    x = rng.normal(size=(32, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=32)
    def one_step(**kwargs):
        keras.utils.set_random_seed(400 + rank)
        net = build_cnn(0.0)
        model = DistributedModel(net, **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5))
        model.optimizer.build(net.trainable_variables)
        broadcast_variables(net.weights, root_rank=0)
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
        return [w.numpy() for w in net.weights]
    ref = one_step()
    assert len(set(checksums([tf.constant(w) for w in ref], "ref"))) == 1
    for kwargs in ({"backward_passes_per_step": 2, "micro_batch_size": 16},
                   {"backward_passes_per_step": 4, "micro_batch_size": 8},
                   {"gradient_predivide_factor": 2.0}):
        for a, b in zip(one_step(**kwargs), ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=str(kwargs))
    half = one_step(fp16_allreduce=True)
    for a, b in zip(half, ref):
        np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-3)

    # 3. loss_sums (the fixed trainer's train loss): this rank's float64 sum of per-example
    #    losses and its example count, through a compiled fit, unequal rows per rank.
    keras.utils.set_random_seed(500)
    net = build_cnn(0.0)
    sums = loss_sums()
    net.compile(optimizer=keras.optimizers.SGD(learning_rate=0.0),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=[sums])
    rows = 12 if rank == 0 else 5
    net.fit(x[:rows], y[:rows], batch_size=8, epochs=1, verbose=0, shuffle=False)
    want = keras.losses.sparse_categorical_crossentropy(y[:rows], net(x[:rows]), from_logits=True)
    assert sums.total.dtype == "float64" and float(sums.count.numpy()) == rows
    np.testing.assert_allclose(float(sums.total.numpy()), float(np.sum(want, dtype=np.float64)),
                               rtol=1e-6)
    print(f"rank {rank}: horovod_keras checks passed")
""")


@requires_horovod
def test_horovod_keras_pieces_under_horovodrun(tmp_path):
    script = tmp_path / "checks.py"
    script.write_text(HOROVOD_KERAS_CHECKS)
    proc = train(str(script), [])
    assert proc.stdout.count("horovod_keras checks passed") == 2, proc.stdout
