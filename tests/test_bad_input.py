"""Bad input gets one clear line naming the problem and the fix, exit status 2, no traceback."""

from __future__ import annotations

import shutil
import sys

import pytest
from conftest import BIN, one_error_line, requires_horovod, run, train
from test_mnist import SHARED

from ringtrain.data import mnist

SMALL = ["--train-samples", "256", "--test-samples", "100", "--epochs", "1", "--no-progress"]


@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
@pytest.mark.parametrize("flags,needle", [
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--epochs", "-1"], "--epochs must be a positive integer"),
    (["--train-samples", "60001"], "--train-samples must be between 1 and 60000"),
    (["--lr-scaling", "cubic"], "invalid choice: 'cubic'"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--epochs", "two"], "invalid int value: 'two'"),
    (["--commit-every", "0"], "--commit-every must be a positive number of steps"),
    (["--elastic", "--adasum"], "--adasum needs a power-of-two world size"),
    (["--elastic", "--amp"], "--amp is not supported with --elastic"),
    (["--strategy", "ps", "--staleness", "-1"],
     "--staleness must be a whole number of steps >= 0 or inf, got '-1'"),
    (["--strategy", "ps", "--staleness", "soon"], "got 'soon'"),
    (["--strategy", "ps", "--elastic"], "--strategy ps cannot run with --elastic: an elastic job"),
    (["--strategy", "ps", "--adasum"], "--strategy ps cannot run with --adasum: Adasum"),
    (["--strategy", "ps", "--timeline-out", "t.json"],
     "--strategy ps cannot run with --timeline-out: Horovod's timeline"),
    (["--strategy", "ps", "--autotune"], "--strategy ps cannot run with --autotune: Horovod's autotuner"),
    (["--strategy", "ps", "--ps-servers", "0"], "--ps-servers must be at least 1"),
    (["--staleness", "4"], "add --strategy ps"),
    (["--optimizer", "lamb"], "--optimizer must be sgd, adamw, adam, rmsprop or package.module:function"),
    (["--weight-decay", "-1"], "--weight-decay must be a number >= 0, got -1"),
    (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive number"),
    (["--precision", "bf16", "--amp"], "--precision bf16 and --amp"),
    (["--optimizer", "adam", "--momentum", "0.9"], "--momentum is a hyperparameter of sgd and rmsprop"),
    (["--strategy", "ps", "--optimizer", "mypkg.opt:make"],
     "--optimizer mypkg.opt:make with --strategy ps: the servers apply a built-in optimizer"),
    (["--strategy", "ps", "--shard-optimizer"], "the servers already hold each slice's optimizer state"),
    (["--shard-optimizer", "--adasum"], "--shard-optimizer with --adasum"),
    (["--shard-optimizer", "--amp"], "--shard-optimizer with --amp"),
])
def test_bad_flags(module, flags, needle):
    one_error_line(run([sys.executable, "-m", module, *flags]), needle)


@pytest.mark.parametrize("flags,needle", [
    (["--framework", "torch", "--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--framework", "jax"], "invalid choice: 'jax'"),
])
def test_console_script_gives_one_line(flags, needle):
    """The installed ``ringtrain`` script (``sys.exit(main())``) takes the same one-line error path
    as ``python -m launch``; it once ended in a UserError traceback with exit status 1.  The
    script imports this checkout: conftest.run puts it first on PYTHONPATH."""
    script = BIN / "ringtrain"
    if not script.exists():
        pytest.skip(f"{script} is not installed (pip install -e . installs it)")
    one_error_line(run([str(script), *flags]), needle)


def test_unknown_framework():
    one_error_line(run([sys.executable, "-m", "launch", "--framework", "jax"]), "invalid choice: 'jax'")


@requires_horovod
@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
def test_missing_data_folder(module, tmp_path):
    # Offline here: the download fails and the message says where the files must go.
    proc = run([sys.executable, "-m", module, *SMALL, "--data-dir", str(tmp_path / "nowhere")],
               env={"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"})
    one_error_line(proc, str(tmp_path / "nowhere"), "--data-dir")


@requires_horovod
@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
@pytest.mark.parametrize("damage", ["wrong_md5", "truncated", "not_mnist"])
def test_damaged_data(module, damage, tmp_path):
    if not (SHARED / mnist.FILES["train_images"][0]).is_file():
        pytest.skip(f"MNIST not present at {SHARED}; set MNIST_DIR")
    d = tmp_path / "mnist"
    d.mkdir()
    for name, _ in mnist.FILES.values():
        shutil.copyfile(SHARED / name, d / name)
    target = d / "train-images-idx3-ubyte.gz"
    if damage == "wrong_md5":
        raw = bytearray(target.read_bytes())
        raw[100] ^= 1
        target.write_bytes(bytes(raw))
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[: 1 << 20])
    else:
        target.write_bytes(b"<html>404 not found</html>")
    proc = run([sys.executable, "-m", module, *SMALL, "--data-dir", str(d)])
    one_error_line(proc, "train-images-idx3-ubyte.gz has MD5", "delete it to re-download")


@requires_horovod
@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
def test_fewer_samples_than_ranks(module):
    proc = train(module, ["--train-samples", "1", *SMALL[2:]], np=2, expect_ok=False)
    assert proc.returncode != 0
    assert "--train-samples 1 is smaller than the world size 2" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


@requires_horovod
@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
def test_unwritable_checkpoint_folder(module, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    proc = run([sys.executable, "-m", module, *SMALL, "--checkpoint-dir", str(blocker / "ckpt")])
    one_error_line(proc, "is not writable", "--checkpoint-dir")


@requires_horovod
@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
def test_missing_data_under_horovodrun_fails_fast(module, tmp_path):
    """Rank 0's data problem reaches every rank: the job exits 2 at once instead of hanging the
    others in their next collective (a broadcast whose name differed by payload type once did)."""
    proc = train(module, [*SMALL, "--data-dir", str(tmp_path / "nowhere"), "--stall-timeout", "0"],
                 np=2, expect_ok=False, timeout=120,
                 env={"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"})
    assert proc.returncode != 0
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and str(tmp_path / "nowhere") in errors[0], proc.stderr[-2000:]


@requires_horovod
@pytest.mark.parametrize("module", ["launch.torch_mnist", "launch.tf_mnist"])
def test_elastic_flag_without_an_elastic_launcher(module):
    one_error_line(run([sys.executable, "-m", module, *SMALL, "--elastic"]),
                   "--elastic needs horovodrun's elastic mode", "--host-discovery-script")


@requires_horovod
def test_elastic_launcher_without_the_flag():
    """A fixed-size trainer under an elastic driver would die with its first lost worker."""
    proc = run([sys.executable, "-m", "launch.torch_mnist", *SMALL], env={"HOROVOD_ELASTIC": "1"})
    one_error_line(proc, "add --elastic")


# --- --strategy ps (docs/parameter-servers.md) ----------------------------------------------------

def test_parameter_servers_refuse_pipeline_stages():
    """Refused before any process starts, whichever of the two flags came first (--pipeline-stages
    is another strategy's flag: the check reads it where it exists)."""
    import argparse

    from launch.cli import build_parser
    from ringtrain.errors import UserError
    from ringtrain.strategies.ps import options

    args = build_parser("torch").parse_args(["--strategy", "ps"])
    with pytest.raises(UserError, match="cannot run with --pipeline-stages: pipeline stages split"):
        options.validate(argparse.Namespace(**{**vars(args), "pipeline_stages": 2}))
    options.validate(argparse.Namespace(**{**vars(args), "pipeline_stages": 1}))


@requires_horovod
def test_parameter_servers_need_a_worker_on_every_rank():
    """--ps-servers 2 of 2 processes: every rank stops after hvd.init(), with one line."""
    proc = train("launch.torch_mnist", [*SMALL, "--strategy", "ps", "--ps-servers", "2"], np=2,
                 expect_ok=False, timeout=180)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "--ps-servers 2 leaves no worker among 2 processes" in errors[0]


@requires_horovod
def test_parameter_servers_refuse_gloo():
    """What horovodrun --gloo (and Ray) start: no MPI for the point-to-point transfers."""
    proc = run([sys.executable, "-m", "launch.tf_mnist", *SMALL, "--strategy", "ps"],
               env={"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"})
    one_error_line(proc, "--strategy ps moves the parameters point to point with MPI",
                   "horovodrun --gloo", "run it under horovodrun without --gloo, or mpirun")
    proc = run([sys.executable, "-m", "launch.ray", "--framework", "torch", "--num-workers", "2",
                "--strategy", "ps"])
    one_error_line(proc, "--strategy ps moves the parameters point to point with MPI", "Ray")
