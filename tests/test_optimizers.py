"""``--optimizer``, ``--weight-decay``, ``--clip-grad-norm``, ``--precision`` (docs/training.md,
"Choosing an optimizer"): the flags' checks, each built-in optimizer against PyTorch's update
rule written out in NumPy (PyTorch in this process, Keras in a subprocess: TensorFlow is not
imported here, and both frameworks in one process crash), the optimizer state Horovod's
broadcast and elastic state keep, the clipping of averaged gradients, the checkpoint's record
of the optimizer, and a user's factory.  "N ranks equal one process with N times the batch"
with AdamW, weight decay and clipping is
``tests/test_correctness.py::test_invariant_2_with_adamw_decay_and_clipping``.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import one_error_line, requires_horovod, run

from launch.cli import build_parser
from ringtrain import optimizer_spec
from ringtrain.errors import UserError
from ringtrain.output import checkpoint
from ringtrain.strategies import registry

# --- the flags, before any framework -------------------------------------------------------------


def parse(*argv: str) -> argparse.Namespace:
    return registry.validate(build_parser("torch").parse_args(list(argv)))


@pytest.mark.parametrize("argv,needle", [
    (["--optimizer", "lamb"], "--optimizer must be sgd, adamw, adam, rmsprop or package.module:function"),
    (["--optimizer", "my pkg:fn"], "got 'my pkg:fn'"),
    (["--weight-decay", "-0.01"], "--weight-decay must be a number >= 0, got -0.01"),
    (["--weight-decay", "nan"], "--weight-decay must be a number >= 0"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive number"),
    (["--clip-grad-norm", "-1"], "--clip-grad-norm must be a positive number"),
    (["--precision", "bf16", "--amp"], "--precision bf16 and --amp"),
    (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum is a hyperparameter of sgd and rmsprop"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1)"),
    (["--optimizer", "mypkg.opt:make", "--weight-decay", "0.1"], "your factory sets its own"),
    (["--strategy", "ps", "--optimizer", "mypkg.opt:make"], "element by element, not your factory's"),
])
def test_bad_optimizer_flags_are_one_line_before_any_framework(argv, needle):
    with pytest.raises(UserError, match=None) as err:
        parse(*argv)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_the_pipeline_takes_every_optimizer_flag():
    """The pipeline steps each stage's own optimizer of ``--optimizer`` (tests/test_pipeline.py
    checks its arithmetic): the flags pass the checks there, as on the ring, and with the
    parameter servers too (tests/test_ps.py checks the servers' arithmetic)."""
    args = parse("--pipeline-stages", "2", "--optimizer", "adamw", "--weight-decay", "0.1",
                 "--clip-grad-norm", "1", "--precision", "bf16")
    assert (args.strategy, args.optimizer, args.weight_decay, args.clip_grad_norm,
            args.precision) == ("pipeline", "adamw", 0.1, 1.0, "bf16")
    args = parse("--strategy", "ps", "--optimizer", "adamw", "--weight-decay", "0.1",
                 "--clip-grad-norm", "1", "--precision", "bf16")
    assert (args.strategy, args.optimizer, args.clip_grad_norm, args.precision) == (
        "ps", "adamw", 1.0, "bf16")


def test_momentum_defaults_follow_the_optimizer_and_the_default_is_todays_sgd():
    default = parse()
    assert (default.optimizer, default.momentum, default.weight_decay, default.clip_grad_norm,
            default.precision) == ("sgd", 0.9, 0.0, None, "fp32")
    assert optimizer_spec.plain_sgd(default) and optimizer_spec.describe(default) is None
    assert parse("--optimizer", "rmsprop").momentum == 0.0
    assert parse("--optimizer", "adamw").momentum is None
    assert registry.validate(parse("--optimizer", "rmsprop", "--momentum", "0.5")).momentum == 0.5
    line = optimizer_spec.describe(parse("--optimizer", "adamw", "--weight-decay", "0.01",
                                         "--clip-grad-norm", "1", "--precision", "bf16"), False)
    assert line.startswith("optimizer adamw, weight decay 0.01 (decoupled), gradients clipped to "
                           "global norm 1 after averaging, bfloat16 compute")
    assert "no bfloat16 instructions" in line
    assert "(L2)" in optimizer_spec.describe(parse("--weight-decay", "0.01"))
    # the strategies that refuse the flags still take their defaults
    assert parse("--strategy", "ps").strategy == "ps"
    assert parse("--pipeline-stages", "2", "--momentum", "0.5").strategy == "pipeline"


def test_the_cpu_flags_say_whether_bfloat16_is_native():
    assert optimizer_spec.cpu_has_bf16("flags\t\t: fpu sse2 avx512f avx512_bf16\n") is True
    assert optimizer_spec.cpu_has_bf16("flags\t\t: fpu sse2 avx2 avx512f\n") is False
    assert optimizer_spec.cpu_has_bf16("Features\t: fp asimd bf16 i8mm\n") is True


def test_a_checkpoint_records_its_optimizer_and_resume_with_another_is_one_line(tmp_path):
    class Data:
        def record(self):
            return {"spec": "mnist", "input_shape": [28, 28, 1], "num_classes": 10}

    identity = argparse.Namespace(framework="torch", model_name="m", param_count=3, data=Data())
    meta = checkpoint.metadata(identity, 1, checkpoint.config_of(parse("--optimizer", "adamw")))
    assert meta["optimizer"] == "adamw"
    path = tmp_path / "ckpt-epoch0001.pt"
    assert checkpoint.check_metadata(meta, path, "torch", "m", 3, None, "adamw") == 1
    with pytest.raises(UserError) as err:
        checkpoint.check_metadata(meta, path, "torch", "m", 3, None, "sgd")
    assert str(err.value) == (f"{path} holds the state of --optimizer adamw, this run has "
                              f"--optimizer sgd; resume with --optimizer adamw, or use another "
                              f"--checkpoint-dir to start sgd afresh")
    older = {k: v for k, v in meta.items() if k != "optimizer"}  # before --optimizer: SGD's state
    assert checkpoint.check_metadata(older, path, "torch", "m", 3, None, "sgd") == 1
    with pytest.raises(UserError, match="holds the state of --optimizer sgd"):
        checkpoint.check_metadata(older, path, "torch", "m", 3, None, "adam")


# --- the update rules: PyTorch's, in NumPy ---------------------------------------------------------

CASES = [("sgd", 0.1, 0.9, 1.0), ("adamw", 0.1, None, 1.0), ("adam", 0.1, None, None),
         ("rmsprop", 0.1, 0.5, 2.0), ("sgd", 0.1, 0.0, None)]
W0 = np.array([0.3, -1.2, 2.0, 0.7, -0.4], np.float32)
TARGET = np.array([-0.5, 0.8, -1.0, 1.5, 0.2], np.float32)
LR, STEPS = 0.05, 5


def gradient(w: np.ndarray) -> np.ndarray:
    return 3.0 * (w - TARGET)  # of 1.5 |w - t|^2: norm ~10, so the clips above bite


def reference(name: str, wd: float, momentum: float | None, clip: float | None) -> np.ndarray:
    """PyTorch's update of ``name`` (SGD, AdamW, Adam, RMSprop: their docs' pseudo-code), in
    float64, with ``clip_grad_norm_`` before it."""
    w, b1, b2, eps = W0.astype(np.float64), *optimizer_spec.BETAS, optimizer_spec.EPS
    buf = m = v = None
    for t in range(1, STEPS + 1):
        g = gradient(w)
        if clip is not None:
            g = g * min(1.0, clip / (np.linalg.norm(g) + 1e-6))
        if name == "adamw":
            w = w * (1 - LR * wd)
        else:
            g = g + wd * w
        if name == "sgd":
            buf = g if buf is None else momentum * buf + g
            w = w - LR * buf
        elif name in ("adam", "adamw"):
            m = (1 - b1) * g if m is None else b1 * m + (1 - b1) * g
            v = (1 - b2) * g * g if v is None else b2 * v + (1 - b2) * g * g
            w = w - LR / (1 - b1 ** t) * m / (np.sqrt(v) / np.sqrt(1 - b2 ** t) + eps)
        else:
            a = optimizer_spec.RMSPROP_ALPHA
            v = (1 - a) * g * g if v is None else a * v + (1 - a) * g * g
            step = g / (np.sqrt(v) + eps)
            buf = step if buf is None else momentum * buf + step
            w = w - LR * (buf if momentum else step)
    return w


def flags(name: str, wd: float, momentum: float | None, clip: float | None) -> argparse.Namespace:
    return argparse.Namespace(optimizer=name, weight_decay=wd, momentum=momentum,
                              clip_grad_norm=clip, precision="fp32", amp=False)


@pytest.mark.parametrize("name,wd,momentum,clip", CASES)
def test_torch_optimizers_are_pytorchs_rules_and_their_made_state_is_invisible(name, wd, momentum, clip):
    """Each built-in is the written-out rule; its state made before the first step
    (:func:`torch_models.optimizers.make_state`, what keeps Horovod's broadcast from stepping)
    changes no bit of what follows."""
    import torch

    from torch_models import optimizers

    def train(made: bool) -> torch.Tensor:
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.tensor(W0))
        opt = optimizers.build(flags(name, wd, momentum, clip), model, LR, None)
        if made:
            optimizers.make_state(opt, builtin=True)
            assert torch.equal(model.w.detach(), torch.tensor(W0)) and model.w.grad is None
            assert opt.state  # a state to broadcast: Horovod's broadcast makes none by a step
        for _ in range(STEPS):
            opt.zero_grad()
            (1.5 * ((model.w - torch.tensor(TARGET)) ** 2).sum()).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        return model.w.detach()

    made = train(True)
    assert torch.equal(made, train(False))
    np.testing.assert_allclose(made.numpy(), reference(name, wd, momentum, clip), rtol=2e-5, atol=1e-6)


KERAS_RULES = textwrap.dedent("""
    import argparse, json, sys
    import numpy as np
    import tensorflow as tf
    import keras
    from tf_models import optimizers

    cfg = json.loads(sys.argv[1])
    out = []
    for name, wd, momentum, clip in cfg["cases"]:
        args = argparse.Namespace(optimizer=name, weight_decay=wd, momentum=momentum,
                                  clip_grad_norm=clip, precision="fp32", amp=False)
        opt = optimizers.build(args, cfg["lr"], micro_steps=1)
        w = keras.Variable(np.array(cfg["w0"], "float32"))
        opt.build([w])
        for _ in range(cfg["steps"]):
            opt.apply([tf.constant(3.0 * (w.numpy() - np.array(cfg["target"], "float32")))], [w])
        out.append(w.numpy().tolist())
    print(json.dumps(out))
""")


def test_keras_optimizers_are_pytorchs_rules():
    """The same rules in Keras: decay coupled (L2) for sgd, adam and rmsprop as in PyTorch, not
    Keras' decoupled ``weight_decay``; the same betas, epsilon and RMSprop alpha."""
    cfg = {"cases": CASES, "lr": LR, "steps": STEPS, "w0": W0.tolist(), "target": TARGET.tolist()}
    proc = run([sys.executable, "-c", KERAS_RULES, json.dumps(cfg)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, weights in zip(CASES, got, strict=True):
        # Keras adds Adam's epsilon to sqrt(v) before the bias correction, PyTorch after it (up
        # to 1 / sqrt(1 - beta_2) ~ 32 times more weight in the first steps), and RMSprop's
        # inside the square root: a few 1e-6 here, where a wrong rule moves weights by 1e-3
        np.testing.assert_allclose(weights, reference(*case), rtol=2e-5, atol=5e-6,
                                   err_msg=str(case))


# --- with Horovod, one process each ---------------------------------------------------------------

TORCH_HOROVOD = textwrap.dedent("""
    import argparse, copy, json
    import torch
    import horovod.torch as hvd
    from ringtrain.errors import UserError
    from torch_models import optimizers

    hvd.init()
    torch.manual_seed(0)
    args = argparse.Namespace(optimizer="adamw", weight_decay=0.1, momentum=None,
                              clip_grad_norm=None, precision="fp32", amp=False)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))

    def opened(make: bool):
        model = torch.nn.Linear(4, 3)
        model.load_state_dict(start)
        opt = hvd.DistributedOptimizer(optimizers.build(args, model, 0.01, None),
                                       named_parameters=model.named_parameters())
        if make:
            optimizers.make_state(opt, builtin=True)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        return model, opt

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    start = copy.deepcopy(torch.nn.Linear(4, 3).state_dict())
    plain = torch.nn.Linear(4, 3)
    plain.load_state_dict(start)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01, weight_decay=0.1, eps=1e-8)
    made, made_opt = opened(True)
    horovods, horovods_opt = opened(False)
    out = {"weights_kept": all(torch.equal(a, b) for a, b in zip(made.state_dict().values(),
                                                                 start.values()))}
    for _ in range(3):
        for m, o in ((plain, plain_opt), (made, made_opt), (horovods, horovods_opt)):
            step(m, o)
    same = lambda a, b: all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    out["made_equals_plain"] = same(made, plain)
    out["broadcast_alone_equals_plain"] = same(horovods, plain)

    # Horovod's elastic state keeps AdamW's state: a rollback brings back the commit's moments
    state = hvd.elastic.TorchState(made, made_opt, epoch=1)
    state.save()
    saved = copy.deepcopy(made_opt.state_dict()["state"])
    step(made, made_opt)
    moved = made_opt.state_dict()["state"]
    state.restore()
    state.sync()
    back = made_opt.state_dict()["state"]
    keys = ("step", "exp_avg", "exp_avg_sq")
    out["steps_moved_the_state"] = not torch.equal(moved[0]["exp_avg"], saved[0]["exp_avg"])
    out["rollback_restores_the_state"] = all(torch.equal(back[i][k], saved[i][k])
                                             for i in saved for k in keys)

    class NeedsMore(torch.optim.SGD):
        def __init__(self, params, lr, extra):
            super().__init__(params, lr=lr)

    model = torch.nn.Linear(4, 3)
    try:
        optimizers.wrap("mypkg.opt:make", lambda: hvd.DistributedOptimizer(
            NeedsMore(model.parameters(), 0.1, 1), named_parameters=model.named_parameters()))
    except UserError as err:
        out["wrap_failure"] = str(err)
    print(json.dumps(out))
""")


def test_torch_optimizer_state_survives_horovods_broadcast_and_an_elastic_rollback():
    """Horovod's ``broadcast_optimizer_state`` makes an empty state by a step of zero gradients
    at the LR: AdamW's weights shrink and its step count starts at 1 (the control below shows
    it).  With the state made first, a wrapped, broadcast AdamW trains exactly as a plain one;
    ``TorchState`` commits and rolls back its moments and step; a class Horovod cannot rebuild
    is one line."""
    proc = run([sys.executable, "-c", TORCH_HOROVOD], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["weights_kept"] and out["made_equals_plain"]
    assert not out["broadcast_alone_equals_plain"], "the control: Horovod's own way differs"
    assert out["steps_moved_the_state"] and out["rollback_restores_the_state"]
    assert out["wrap_failure"].startswith("--optimizer mypkg.opt:make: Horovod's DistributedOptimizer "
                                          "rebuilds the optimizer as its class called with the param "
                                          "groups alone, which failed: TypeError")


KERAS_HOROVOD = textwrap.dedent("""
    import argparse, json
    import numpy as np
    import tensorflow as tf
    import keras
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvd_keras
    from tf_models import optimizers
    from tf_models.horovod_keras import ElasticKerasState

    hvd.init()
    out = {}

    def flags(name, clip=None, wd=0.0, momentum=None):
        return argparse.Namespace(optimizer=name, weight_decay=wd, momentum=momentum,
                                  clip_grad_norm=clip, precision="fp32", amp=False)

    # the clip sees the averaged gradients: the allreduce stands in for a sum over 10 ranks
    dist = hvd_keras.DistributedOptimizer(optimizers.build(flags("sgd", 1.0, 0.0, 0.0), 1.0, 1))
    dist._allreduce_grads = lambda grads, variables: [10.0 * g for g in grads]
    w = keras.Variable(np.zeros(4, "float32"))
    dist.build([w])
    dist.apply([tf.constant([3.0, 4.0, 0.0, 0.0])], [w])
    out["update_norm"] = float(np.linalg.norm(w.numpy()))

    # K = 2 micro-batch steps per optimizer step: Adam's bias correction counts optimizer steps
    def adam_after(k):
        opt = hvd_keras.DistributedOptimizer(optimizers.build(flags("adam"), 0.1, k),
                                             backward_passes_per_step=k)
        w = keras.Variable(np.ones(3, "float32"))
        opt.build([w])
        for _ in range(2 * k):
            opt.apply([tf.constant([0.5, -1.0, 2.0]) / k], [w])
        return w.numpy(), int(opt.iterations.numpy()), int(opt._iterations.numpy())

    one, two = adam_after(1), adam_after(2)
    out["accumulated_equals_one_step"] = bool(np.array_equal(one[0], two[0]))
    out["iterations"] = [one[1], two[1], two[2]]

    # the elastic state commits and rolls back AdamW's moments and step count
    net = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = optimizers.build(flags("adamw", wd=0.1), 0.01, 1)
    opt.build(net.trainable_variables)

    def train():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(net(tf.ones((4, 3))) ** 2)
        opt.apply(tape.gradient(loss, net.trainable_variables), net.trainable_variables)

    train()
    state = ElasticKerasState(net, opt, epoch=1)
    state.save()
    saved = [v.numpy().copy() for v in opt.variables]
    train()
    out["steps_moved_the_state"] = any(not np.array_equal(v.numpy(), s)
                                       for v, s in zip(opt.variables, saved))
    state.restore()
    state.sync()
    out["rollback_restores_the_state"] = all(np.array_equal(v.numpy(), s)
                                             for v, s in zip(opt.variables, saved))
    out["slots"] = len(opt.variables)

    # --amp wraps the optimizer in a LossScaleOptimizer, which Horovod rebuilds from its config
    lso = keras.optimizers.LossScaleOptimizer(optimizers.build(flags("adam", wd=0.5), 0.1, 3))
    inner = hvd_keras.DistributedOptimizer(lso).inner_optimizer
    out["loss_scaled"] = [type(inner).__name__, inner.l2, inner.micro_steps]
    print(json.dumps(out))
""")


def test_keras_clips_averaged_gradients_and_keeps_adams_state():
    """Keras clips inside ``apply``, and Horovod's Keras 3 ``DistributedOptimizer`` allreduces
    before it calls the wrapped ``apply``: an allreduce that multiplies by 10 leaves an update of
    norm 1 (a clip before it would leave 10).  Adam's step count is the optimizer's, not the
    micro-batches' (K = 2 equals one step of the summed gradient, bit for bit).  The elastic
    state rolls AdamW's slots back; ``--amp``'s wrapper rebuilds the optimizer with its options."""
    proc = run([sys.executable, "-c", KERAS_HOROVOD], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["update_norm"] == pytest.approx(1.0, rel=1e-6)
    assert out["accumulated_equals_one_step"] and out["iterations"] == [2, 2, 4]
    assert out["steps_moved_the_state"] and out["rollback_restores_the_state"]
    assert out["slots"] == 2 * 2 + 2  # momentums and velocities of kernel and bias, LR, count
    assert out["loss_scaled"] == ["RingAdam", 0.5, 3]


# --- a user's factory ---------------------------------------------------------------------------

FACTORIES = '''
import torch


def raises(params, lr):
    raise RuntimeError("no such optimizer here")


def number(params, lr):
    return 3


def other_params(params, lr):
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=lr)


def holds_an_object(params, lr):
    return torch.optim.SGD([{"params": params, "tag": object()}], lr=lr)


def lbfgs(params, lr):
    return torch.optim.LBFGS(params, lr=lr)


def adam(params, lr=0.5, betas=(0.8, 0.9)):
    return torch.optim.Adam(params, lr=lr, betas=betas)
'''


@pytest.mark.parametrize("factory,needle", [
    ("raises", "calling it as raises(lr=0.01) failed: RuntimeError: no such optimizer here"),
    ("number", "returned a builtins.int, but --framework torch needs a torch.optim.Optimizer"),
    ("other_params", "an optimizer over 1 tensors, the model trains 2"),
    ("holds_an_object", "its param groups hold tag=object"),
    ("lbfgs", "returned an LBFGS, whose step needs a closure"),
    ("gone", "userfactories has no attribute 'gone'"),
])
def test_a_torch_factory_that_fails_is_one_line(factory, needle, tmp_path, monkeypatch):
    import torch

    from torch_models import optimizers

    (tmp_path / "userfactories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UserError) as err:
        optimizers.build(flags(f"userfactories:{factory}", 0.0, None, None), model, 0.01, None)
    assert str(err.value).startswith(f"--optimizer userfactories:{factory}")
    assert needle in str(err.value)


def test_a_torch_factory_gets_the_params_and_the_lr(tmp_path, monkeypatch):
    import torch

    from torch_models import optimizers

    (tmp_path / "userfactories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = torch.nn.Linear(3, 2)
    opt = optimizers.build(flags("userfactories:adam", 0.0, None, None), model, 0.01, None)
    assert isinstance(opt, torch.optim.Adam) and opt.param_groups[0]["lr"] == 0.01
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)


KERAS_FACTORIES = textwrap.dedent('''
    import keras


    def raises(learning_rate):
        raise RuntimeError("no such optimizer here")


    def number(learning_rate):
        return 3


    def scheduled(learning_rate):
        return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(learning_rate, 10, 0.9))


    def clips(learning_rate):
        return keras.optimizers.SGD(learning_rate, clipnorm=1.0)


    def lion(learning_rate=0.5):
        return keras.optimizers.Lion(learning_rate)
''')

KERAS_FACTORY_CHECKS = textwrap.dedent("""
    import json, sys
    from ringtrain.errors import UserError
    from tf_models import optimizers

    out = {}
    for name in ("raises", "number", "scheduled", "clips"):
        try:
            optimizers.from_factory(f"userfactories:{name}", 0.01, 1.0)
        except UserError as err:
            out[name] = str(err)
    good = optimizers.from_factory("userfactories:lion", 0.01, 2.0)
    out["lion"] = [type(good).__name__, float(good.learning_rate.numpy()), good.global_clipnorm]
    print(json.dumps(out))
""")


def test_a_keras_factory_is_checked(tmp_path):
    (tmp_path / "userfactories.py").write_text(KERAS_FACTORIES)
    proc = run([sys.executable, "-c", KERAS_FACTORY_CHECKS], timeout=180,
               env={"PYTHONPATH": f"{Path(__file__).resolve().parents[1]}:{tmp_path}"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "calling it as raises(learning_rate=0.01) failed: RuntimeError" in out["raises"]
    assert "returned a builtins.int, but --framework tf needs a keras.optimizers.Optimizer" in out["number"]
    assert "learning rate is a schedule or a function" in out["scheduled"]
    assert "which clips gradients itself" in out["clips"]
    assert out["lion"] == ["Lion", pytest.approx(0.01), 2.0]


# --- through the command, one process ---------------------------------------------------------

FACTORY = {"launch.torch_mnist": "torch.optim:NAdam", "launch.tf_mnist": "keras.optimizers:Nadam"}
QUICK = ["--train-samples", "256", "--test-samples", "100", "--batch-size", "32", "--max-steps",
         "2", "--no-progress"]


@requires_horovod
@pytest.mark.parametrize("module", list(FACTORY))
def test_a_factory_trains_and_resuming_with_another_optimizer_is_one_line(module, tmp_path):
    """A framework's own optimizer class as the factory trains and records itself in the
    checkpoint; resuming with another ``--optimizer`` is one line naming both; a factory that
    fails after ``hvd.init()`` is one line, exit status 2."""
    ckpt = str(tmp_path / "ckpt")
    spec = FACTORY[module]
    proc = run([sys.executable, "-m", module, *QUICK, "--epochs", "1", "--optimizer", spec,
                "--clip-grad-norm", "1", "--checkpoint-dir", ckpt])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"optimizer {spec}, gradients clipped to global norm 1 after averaging" in proc.stdout
    proc = run([sys.executable, "-m", module, *QUICK, "--epochs", "2", "--optimizer", "adamw",
                "--checkpoint-dir", ckpt, "--resume"])
    one_error_line(proc, f"holds the state of --optimizer {spec}, this run has --optimizer adamw",
                   f"resume with --optimizer {spec}")
    one_error_line(run([sys.executable, "-m", module, *QUICK, "--optimizer", "json:loads"]),
                   "--optimizer json:loads: calling it as loads(")


# --- --shard-optimizer (ZeRO stage 1): the slice's update is the whole's ----------------------


@pytest.mark.parametrize("argv,needle", [
    (["--shard-optimizer", "--strategy", "ps"], "the servers already hold each slice's"),
    (["--shard-optimizer", "--pipeline-stages", "2"], "not supported for now"),
    (["--shard-optimizer", "--elastic"], "--shard-optimizer with --elastic"),
    (["--shard-optimizer", "--adasum"], "--shard-optimizer with --adasum"),
    (["--shard-optimizer", "--amp"], "--shard-optimizer with --amp"),
    (["--shard-optimizer", "--optimizer", "mypkg.opt:make"], "only the built-in optimizers"),
])
def test_shard_optimizer_refusals_are_one_line(argv, needle):
    with pytest.raises(UserError) as err:
        parse(*argv)
    assert needle in str(err.value) and "\n" not in str(err.value)


class OneRank:
    """Horovod's collectives for a world of one: what the sharded optimizer calls, as identities."""
    Average, Sum = "average", "sum"

    class Compression:
        none = fp16 = None

    def size(self): return 1
    def rank(self): return 0
    def reducescatter(self, t, name=None, op=None, compression=None, **scale): return t.clone()
    def allgather(self, t, name=None): return t.clone()
    def allreduce(self, t, name=None, op=None): return t.clone()
    def broadcast(self, t, root_rank, name=None): return t.clone()
    # no broadcast_object: what the state's keys travel in is plain data, never a pickle


SHARD_CASES = [("adamw", 0.1, None, 0.05), ("adam", 0.01, None, None), ("sgd", 0.01, 0.9, 0.05),
               ("rmsprop", 0.0, 0.5, None)]


@pytest.mark.parametrize("name,wd,momentum,clip", SHARD_CASES)
def test_the_flat_shard_steps_as_the_per_tensor_optimizer_and_saves_its_format(name, wd, momentum,
                                                                              clip):
    """One rank's shard is the whole flat model: after 4 steps its weights and its gathered state
    equal the per-tensor optimizer's (with torch's own global-norm clip), in float64, in the same
    state_dict format (a sharded checkpoint resumes unsharded); the state loaded back through
    scatter_state steps on alike."""
    import torch

    from torch_models import optimizers, sharded
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).double()
    shd = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).double()
    shd.load_state_dict(ref.state_dict())
    args = argparse.Namespace(**vars(flags(name, wd, momentum, clip)), fp16_allreduce=False,
                              backward_passes_per_step=1, adasum=False, gradient_predivide_factor=1.0)
    plain = optimizers.build(args, ref, 0.01, None)
    opt = sharded.ShardedOptimizer(args, shd, 0.01, None, OneRank(), clip)
    xs = torch.randn(5, 8, 5, dtype=torch.float64)

    def step(model, o, x, is_ref):
        o.zero_grad()
        model(x).pow(2).mean().backward()
        if is_ref and clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        o.step()

    for x in xs[:4]:
        step(ref, plain, x, True)
        step(shd, opt, x, False)
    for a, b in zip(ref.parameters(), shd.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    want, got = plain.state_dict(), opt.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert want["state"].keys() == got["state"].keys()
    for i, entry in want["state"].items():
        assert entry.keys() == got["state"][i].keys()
        for key, value in entry.items():
            torch.testing.assert_close(got["state"][i][key], value, rtol=1e-12, atol=1e-14)
    # resume: a fresh shard loads the unsharded state (as rank 0 would) and steps on alike
    again = sharded.ShardedOptimizer(args, shd, 0.01, None, OneRank(), clip)
    again.load_state_dict(want)
    again.scatter_state()
    step(ref, plain, xs[4], True)
    step(shd, again, xs[4], False)
    for a, b in zip(ref.parameters(), shd.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", optimizer_spec.BUILTIN)
def test_built_in_optimizers_update_slices_of_a_flat_buffer_as_the_whole(name):
    """Why sharding is exact: each built-in rule is element-wise, so three optimizers over three
    slices of the flat weights (uneven, padded to a multiple of 3 by zeros) step as one over
    the per-tensor weights, weight decay included."""
    import torch

    from torch_models import optimizers, sharded
    torch.manual_seed(1)
    shapes = [(4, 3), (3,), (2, 5)]
    ws = [torch.randn(s, dtype=torch.float64) for s in shapes]
    whole = [torch.nn.Parameter(w.clone()) for w in ws]
    n = sum(w.numel() for w in ws)  # 25: two zeros of padding to 27
    padded, S = sharded.layout(n, 3)
    assert (padded, S) == (27, 9)
    flat = torch.cat([w.reshape(-1) for w in ws] + [torch.zeros(padded - n, dtype=torch.float64)])
    slices = [torch.nn.Parameter(flat[r * S:(r + 1) * S].clone()) for r in range(3)]
    args = flags(name, 0.05, optimizer_spec.TAKES_MOMENTUM.get(name), None)
    ref = optimizers.build(args, torch.nn.ParameterList(whole), 0.01, None)
    parts = [optimizers.build(args, torch.nn.ParameterList([s]), 0.01, None) for s in slices]
    for _ in range(3):
        grads = [torch.randn(s, dtype=torch.float64) for s in shapes]
        for p, g in zip(whole, grads, strict=True):
            p.grad = g
        flat_g = torch.cat([g.reshape(-1) for g in grads]
                           + [torch.zeros(padded - n, dtype=torch.float64)])
        for r, (s, o) in enumerate(zip(slices, parts, strict=True)):
            s.grad = flat_g[r * S:(r + 1) * S].clone()
            o.step()
        ref.step()
    got = torch.cat([s.detach() for s in slices])
    torch.testing.assert_close(got[:n], torch.cat([p.detach().reshape(-1) for p in whole]),
                               rtol=1e-13, atol=1e-15)
    assert not got[n:].any(), "the padding stays zero"


# --- --shard-optimizer in Keras (tf_models/sharded.py): the same, in a subprocess -----------------
# R ranks are threads of that process whose collectives meet by name (Horovod's own matching),
# or a world of one whose collectives are identities, traceable: the step runs in a tf.function
# as in fit's train step.  Chunks of 4 elements: several per slice, padding at R = 2 and 3.
KERAS_SHARDED = r'''
import argparse, json, sys, threading
import numpy as np
import tensorflow as tf
import keras
from tf_models import optimizers, sharded

sharded.CHUNK = 4  # several chunks per slice: the chunked collectives' offsets


class OneRank:
    """Horovod's collectives for a world of one, as identities (traceable)."""
    Average, Sum = "average", "sum"

    def size(self): return 1
    def rank(self): return 0
    def reducescatter(self, t, name=None, op=None, **kw): return tf.identity(t)
    def allgather(self, t, name=None): return tf.identity(t)
    def allreduce(self, t, name=None, op=None): return tf.identity(t)
    def broadcast(self, t, root_rank, name=None): return tf.identity(t)
    # no broadcast_object: the restored state's scalars travel as plain data, never a pickle


class Threads:
    """R ranks as threads of one process: each collective waits for the R calls of its name."""

    def __init__(self, world):
        self.world, self.cond, self.calls = world, threading.Condition(), {}

    def meet(self, name, rank, value, combine):
        with self.cond:
            entry = self.calls.setdefault(name, {"values": {}, "result": None, "taken": 0})
            assert rank not in entry["values"], f"{name} issued twice by rank {rank}"
            entry["values"][rank] = value
            if len(entry["values"]) == self.world:
                entry["result"] = combine([entry["values"][r] for r in range(self.world)])
                self.cond.notify_all()
            while entry["result"] is None:
                self.cond.wait()
            entry["taken"] += 1
            if entry["taken"] == self.world:
                del self.calls[name]
            return entry["result"]


class ThreadRank:
    Average, Sum = "average", "sum"

    def __init__(self, group, rank):
        self.group, self.r = group, rank

    def size(self): return self.group.world
    def rank(self): return self.r

    def reducescatter(self, t, name=None, op=None, **kw):
        parts = self.group.meet(name, self.r, t.numpy(), lambda vs: np.split(
            sum(vs) / (len(vs) if op == self.Average else 1), len(vs)))
        return tf.constant(parts[self.r])

    def allgather(self, t, name=None):
        return tf.constant(self.group.meet(name, self.r, t.numpy(), np.concatenate))

    def allreduce(self, t, name=None, op=None):
        return tf.constant(self.group.meet(name, self.r, t.numpy(), lambda vs: sum(vs)))

    def broadcast(self, t, root_rank, name=None):
        return tf.constant(self.group.meet(name, self.r, t.numpy(), lambda vs: vs[root_rank]))


def flags(name, wd, momentum, clip):
    return argparse.Namespace(optimizer=name, weight_decay=wd, momentum=momentum,
                              clip_grad_norm=clip, precision="fp32", amp=False)


SHAPES = [(4, 3), (3,), (2, 5), (2, 2, 1)]  # 29 elements: padding at R = 2 and 3
ODD = False  # the odd model: variable 1 gets no gradient, variable 2 has a constraint


def weights():
    rng = np.random.default_rng(0)
    ws = [keras.Variable(rng.standard_normal(s), dtype="float64") for s in SHAPES]
    if ODD:
        ws[2].constraint = keras.constraints.NonNeg()
    return ws


def grads(step, micro, rank):
    rng = np.random.default_rng(1000 + 100 * step + 10 * micro + rank)
    out = [tf.constant(rng.standard_normal(s)) for s in SHAPES]
    return [out[0], None, *out[2:]] if ODD else out


def reference(case, world, steps, k=1):
    """Horovod's unsharded way: the K micro-steps' gradients summed, averaged over the ranks,
    the optimizer's iterations counting every micro-step."""
    ws = weights()
    opt = optimizers.build(flags(*case), 0.01, micro_steps=k)
    opt.build(ws)
    for step in range(steps):
        avg = [None if grads(step, 0, 0)[i] is None else
               sum(sum(grads(step, m, r)[i] for m in range(k)) for r in range(world)) / world
               for i in range(len(SHAPES))]
        if k > 1:
            opt._iterations.assign_add(k - 1)
        opt.apply(avg, ws)
    return ws, opt


def sharded_run(case, world, steps, k=1, state=None, first=0, traced=False):
    """Each rank of ``world`` (threads, or OneRank for 1) steps its ShardedOptimizer; returns
    every rank's weights and gathered state.  ``state``: a whole state rank 0 loads first (and
    the weights to start from, the reference's)."""
    out = [None] * world
    group = Threads(world)
    errors = []

    def rank_main(r):
        try:
            hvd = OneRank() if world == 1 else ThreadRank(group, r)
            ws = weights()
            if state is not None:
                for w, v in zip(ws, state[0], strict=True):
                    w.assign(v)
            inner = optimizers.build(flags(*case), 0.01, micro_steps=k)
            opt = sharded.ShardedOptimizer(inner, hvd, clip=case[3], micro_steps=k)
            opt.build(ws)
            if state is not None and r == 0:
                opt.load_state(state[1])
            opt.scatter_state()
            def step_of(g):
                opt.apply(g, ws)
            apply = tf.function(step_of) if traced else step_of  # traced: as in fit's train step
            for step in range(first, first + steps):
                for m in range(k):
                    apply(grads(step, m, r))
            out[r] = ([w.numpy() for w in ws], opt.gathered_state(),
                      [tuple(s) for s in opt.state_shapes()],
                      sum(int(np.prod(v.shape)) for v in opt.variables if len(v.shape)))
        except Exception as err:  # reported, not hung
            errors.append(repr(err))
            raise

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y, "float64"))))
               for x, y in zip(a, b, strict=True))


CASES = [("adamw", 0.1, None, 0.05), ("adam", 0.01, None, None), ("sgd", 0.01, 0.9, 0.05),
         ("rmsprop", 0.0, 0.5, None)]
report = {}
for case in CASES:
    for world, k, traced in ((1, 1, True), (2, 1, False), (3, 2, False), (1, 2, True)):
        ref_w, ref_opt = reference(case, world, 3, k)
        ranks = sharded_run(case, world, 3, k, traced=traced)
        want = [v.numpy() for v in ref_opt.variables]
        key = f"{case[0]}/R{world}/K{k}"
        report[key] = {
            "weights": max(diff(ws, ref_w) for ws, *_ in ranks),
            "state": max(diff(st, want) for _, st, *_ in ranks),
            "moved": diff(ref_w, [w.numpy() for w in weights()]),
            "shapes": all(sh == [tuple(v.shape) for v in want] for *_, sh, _ in ranks),
            "state_elements": [n for *_, n in ranks],
        }
    # a sharded state (R = 2) resumed unsharded, and sharded at R = 3; an unsharded one at R = 2
    ref_w, ref_opt = reference(case, 2, 2)
    two = sharded_run(case, 2, 2)
    ws2, st2 = two[0][0], two[0][1]
    plain = optimizers.build(flags(*case), 0.01, micro_steps=1)
    w_plain = [keras.Variable(w) for w in ws2]
    plain.build(w_plain)
    for v, a in zip(plain.variables, st2, strict=True):
        v.assign(a)
    for step in (2, 3):
        plain.apply([sum(grads(step, 0, r)[i] for r in range(3)) / 3 for i in range(len(SHAPES))],
                    w_plain)
    three = sharded_run(case, 3, 2, state=(ws2, st2), first=2)
    unsharded_state = [v.numpy() for v in ref_opt.variables]
    back = sharded_run(case, 2, 1, state=([w.numpy() for w in ref_w], unsharded_state), first=2)
    ref3_w, ref3_opt = reference(case, 2, 3)
    report[f"{case[0]}/resume"] = {
        "sharded_to_unsharded_at_3": max(diff(ws, [w.numpy() for w in w_plain]) for ws, *_ in three),
        "unsharded_to_sharded": max(diff(ws, ref3_w) for ws, *_ in back),
        "unsharded_to_sharded_state": max(diff(st, [v.numpy() for v in ref3_opt.variables])
                                          for _, st, *_ in back),
    }
# weights of two types: one line (a UserError), before any collective
from ringtrain.errors import UserError
try:
    sharded.ShardedOptimizer(optimizers.build(flags(*CASES[0]), 0.01, 1), OneRank()).build(
        [keras.Variable(np.zeros(2, "float32")), keras.Variable(np.zeros(2, "float64"))])
    report["mixed"] = "no error"
except UserError as err:
    report["mixed"] = str(err)
# the odd model: a variable with no gradient keeps its weights and state, a constraint holds
ODD = True
ref_w, ref_opt = reference(CASES[0], 2, 3)
ranks = sharded_run(CASES[0], 2, 3)
report["odd"] = {"weights": max(diff(ws, ref_w) for ws, *_ in ranks),
                 "state": max(diff(st, [v.numpy() for v in ref_opt.variables]) for _, st, *_ in ranks),
                 "untouched": diff([ref_w[1].numpy()], [weights()[1].numpy()]),
                 "clamped": int((ref_w[2].numpy() == 0).sum())}
print(json.dumps(report))
'''


def test_keras_sharded_optimizer_steps_and_saves_as_the_unsharded_one():
    """Keras' ShardedOptimizer over R = 1, 2, 3 ranks (K = 1 and 2 micro-batch steps) for each
    built-in optimizer, weight decay and the global-norm clip included: every rank's weights and
    its gathered state equal Horovod's unsharded way (the averaged, K-summed gradient into the
    same optimizer over the per-variable weights, its iterations counting micro-steps) in
    float64, in the unsharded ``variables`` order and shapes (a checkpoint's); each rank's state
    is 1/R of it.  A sharded state of R = 2 resumes unsharded and sharded at R = 3 alike, and an
    unsharded state resumes sharded."""
    proc = run([sys.executable, "-c", KERAS_SHARDED], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    whole = {"adamw": 58, "adam": 58, "sgd": 29, "rmsprop": 58}  # 29 weights, slots of each
    for name, total in whole.items():
        for world, k in ((1, 1), (2, 1), (3, 2), (1, 2)):
            got = report[f"{name}/R{world}/K{k}"]
            assert got["moved"] > 1e-4, (name, world, k)  # vs the 1e-12 below
            assert got["weights"] < 1e-12 and got["state"] < 1e-12 and got["shapes"], (name, world, got)
            slots = total // 29
            assert got["state_elements"] == [slots * -(-29 // world)] * world, (name, world, got)
        assert max(report[f"{name}/resume"].values()) < 1e-12, (name, report[f"{name}/resume"])
    odd = report["odd"]  # Keras' apply: no gradient, no step; a constraint after the step
    assert odd["weights"] < 1e-12 and odd["state"] < 1e-12 and odd["untouched"] == 0, odd
    assert odd["clamped"] > 0, odd  # the constraint did something, in both
    assert "float32, float64" in report["mixed"] and "drop --shard-optimizer" in report["mixed"], \
        report["mixed"]
