"""One job, any launcher: plain python, horovodrun (MPI), horovodrun --gloo, raw mpirun; and the
``python -m launch --framework`` front door with its one-line errors."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import BIN, REPO, SMALL, metrics, requires_horovod, run, train

from ringtrain.horovod_build import CHECKOUT_SERIES, series_sha256

MODULES = {"torch": "launch.torch_mnist", "tf": "launch.tf_mnist"}
QUICK = [*SMALL, "--epochs", "1"]


@requires_horovod
@pytest.mark.parametrize("fw", ["torch", "tf"])
@pytest.mark.parametrize("how,np_,controller", [
    ("single", 1, "mpi"), ("horovodrun", 2, "mpi"), ("gloo", 2, "gloo"), ("mpirun", 2, "mpi")])
def test_same_job_under_every_launcher(fw, how, np_, controller, tmp_path):
    out = tmp_path / "m.json"
    # The framework flag and the direct module are the same job: use both across the matrix.
    module, flags = ("launch", ["--framework", fw]) if how in ("gloo", "single") else (MODULES[fw], [])
    train(module, [*flags, *QUICK, "--metrics-out", str(out)], np=np_, how=how)
    m = metrics(out)
    assert m["framework"] == fw and m["world_size"] == np_ and m["controller"] == controller
    assert len(m["param_checksums"]) == np_ and len(set(m["param_checksums"])) == 1


@requires_horovod
def test_oversubscribed_without_extra_flags(tmp_path):
    """-np 3 on a 2-core machine: horovodrun's default host list, no -H, no --oversubscribe."""
    out = tmp_path / "m.json"
    proc = run([str(BIN / "horovodrun"), "-np", "3", sys.executable, "-m", "launch.torch_mnist",
                *QUICK, "--metrics-out", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(out)["world_size"] == 3


BTL_PROBE = "import os; print('btl=' + os.environ.get('OMPI_MCA_btl', ''))"


def btl_seen_by_ranks(env: dict | None = None) -> list[str]:
    proc = run([str(BIN / "horovodrun"), "-np", "2", sys.executable, "-c", BTL_PROBE], timeout=120,
               env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return re.findall(r"btl=([\w^,]*)", proc.stdout)


@requires_horovod
def test_btl_selection_adds_openib_to_the_configured_one():
    from horovod.runner.mpi_run import _btl_selection

    assert _btl_selection("^uct,openib,ofi") == "^uct,openib,ofi"  # Debian 12's file
    assert _btl_selection('"^ofi"') == "^ofi,openib"
    assert _btl_selection("self,vader,tcp") == "self,vader,tcp"  # an inclusion list stays
    assert _btl_selection("self,vader,openib") == "^openib"      # ... unless it names openib
    assert _btl_selection("") == _btl_selection(None) == "^openib"  # upstream's flag


@requires_horovod
@pytest.mark.skipif(shutil.which("ompi_info") is None, reason="no Open MPI (ompi_info) here")
def test_horovodrun_keeps_open_mpis_own_btl_exclusions():
    """Upstream horovodrun passed `-mca btl ^openib`, which replaces Open MPI's configured btl
    selection: Debian's `^uct,openib,ofi` lost its libfabric exclusion, and every small MPI call
    got 3x slower (issue 23; horovod/runner/mpi_run.py in the patch).  The ranks see openib added
    to what Open MPI is configured with (here: a user's OMPI_MCA_btl, then the machine's files)."""
    assert btl_seen_by_ranks({"OMPI_MCA_btl": "^ofi,uct"}) == ["^ofi,uct,openib"] * 2
    configured = subprocess.run(["ompi_info", "--parsable", "--param", "btl", "all", "--level", "9"],
                                capture_output=True, text=True, timeout=60).stdout
    value = re.search(r"^mca:btl:base:param:btl:value:(.*)$", configured, re.M)
    value = value.group(1).strip('"') if value else ""
    for seen in btl_seen_by_ranks():
        if value.startswith("^") or not value:
            assert seen.startswith("^"), seen
            assert set(seen[1:].split(",")) == set(filter(None, value[1:].split(","))) | {"openib"}
        else:
            assert seen == value


def test_help_lists_frameworks_and_trainer_flags():
    proc = run([sys.executable, "-m", "launch", "--help"])
    assert proc.returncode == 0
    for needle in ("--framework {torch,tf}", "--batch-size", "--fp16-allreduce", "--metrics-out"):
        assert needle in proc.stdout


def fake_package(root, name: str, body: str) -> None:
    pkg = root.joinpath(*name.split("."))
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body)


# What TensorFlow 2.21's C++ writes to fd 2 while it loads, one write() per record, on a CPU with
# AVX512-VNNI (this machine), and the lowest TF_CPP_MIN_LOG_LEVEL at which TF itself still
# prints it: only cpu_feature_guard's record obeys the variable.
TF_START_UP_NOISE = [
    ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n", 3),
    ("I0000 00:00:1795447680.872803    9914 port.cc:153] oneDNN custom operations are on. You may see "
     "slightly different numerical results due to floating-point round-off errors from different "
     "computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.\n", 3),
    ("I0000 00:00:1795447681.240148    9914 cpu_feature_guard.cc:227] This TensorFlow binary is "
     "optimized to use available CPU instructions in performance-critical operations.\nTo enable the "
     "following instructions: AVX2 AVX512F AVX512_VNNI FMA, in other operations, rebuild TensorFlow "
     "with the appropriate compiler flags.\n", 0),
]
NOISY = f"""import os
level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL") or 0)
for record, up_to in {TF_START_UP_NOISE!r}:
    if level <= up_to:
        os.write(2, record.encode())
"""
MISSING = 'raise ImportError("No module named {name}")\n'


def run_as_a_user(cmd: list[str], tmp_path, fakes: dict[str, str], env: dict | None = None):
    """``cmd`` with the environment a user has: TF_CPP_MIN_LOG_LEVEL unset (the suite's default
    sets it), the packages in ``fakes`` shadowing real ones, TensorFlow's oneDNN start-up line
    forced on whatever the CPU (TF_ENABLE_ONEDNN_OPTS=1)."""
    for name, body in fakes.items():
        fake_package(tmp_path, name, body.format(name=name))
    if "horovod" in fakes:  # this checkout's patch series (ringtrain/horovod_build.py checks it) ...
        sha = series_sha256(CHECKOUT_SERIES)
        (tmp_path / "horovod" / "_ringtrain_patch.py").write_text(f'PATCH_SHA256 = "{sha}"\n')
    full = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    full.update(PYTHONPATH=f"{tmp_path}:{REPO}", TF_ENABLE_ONEDNN_OPTS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=full, cwd=REPO)


def real_tensorflow(reason: str):
    return pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason=reason)


@pytest.mark.parametrize("fw,fakes,needle", [
    ("tf", {"tensorflow": NOISY + MISSING}, "tensorflow is not installed"),
    ("torch", {"torch": MISSING}, "torch is not installed"),
    ("tf", {"tensorflow": NOISY, "horovod": ""}, "Horovod was not built with tensorflow support"),
    pytest.param("tf", {"horovod": ""}, "Horovod was not built with tensorflow support",
                 marks=real_tensorflow("needs the real tensorflow"), id="tf-real-tensorflow"),
], ids=["tf-missing-noisy", "torch-missing", "tf-noisy-no-horovod-ext", None])
def test_missing_framework_is_one_line(fw, fakes, needle, tmp_path):
    """A missing framework, or a Horovod without it, is named in one line with the fix, and
    nothing TensorFlow's C++ prints while it loads comes before it.  CPU-proof: the fakes print
    TF's start-up records whatever the CPU, and the real TensorFlow is made to print its oneDNN
    line (test_forced_onednn_line_is_printed shows it does); an empty ``horovod`` package is a
    Horovod built without the tensorflow extension."""
    proc = run_as_a_user([sys.executable, "-m", "launch", "--framework", fw, *QUICK], tmp_path, fakes)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and "make setup" in lines[0], proc.stderr


@real_tensorflow("needs the real tensorflow")
def test_forced_onednn_line_is_printed(tmp_path):
    """The control for the real-TensorFlow case above: unfiltered, with TF_ENABLE_ONEDNN_OPTS=1,
    TensorFlow prints its oneDNN line on this CPU, so that case would fail without the filter."""
    proc = run_as_a_user([sys.executable, "-c", "import tensorflow"], tmp_path, {})
    assert proc.returncode == 0, proc.stderr
    assert "oneDNN custom operations are on" in proc.stderr, proc.stderr


NOISE_THEN_REAL_MESSAGES = NOISY + """
os.write(2, b"E0000 00:00:1795447681.240149    9914 cuda_dnn.cc:8579] Unable to register cuDNN factory\\n")
os.write(2, b"a native library's own line\\n")
import warnings
warnings.warn("a Python warning from the framework")
"""


def test_tf_start_up_errors_still_reach_the_user(tmp_path):
    """The filter holds back only TF's log records below the level: an ERROR record, a native
    line that is no log record, and Python's warnings all come through, before our one line."""
    proc = run_as_a_user([sys.executable, "-m", "launch", "--framework", "tf", *QUICK], tmp_path,
                         {"tensorflow": NOISE_THEN_REAL_MESSAGES, "horovod": ""})
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    for shown in ("cuda_dnn.cc:8579] Unable to register cuDNN factory", "a native library's own line",
                  "UserWarning: a Python warning from the framework"):
        assert shown in err, err
    for hidden in ("absl::InitializeLog", "oneDNN", "cpu_feature_guard", "To enable the following"):
        assert hidden not in err, err
    assert "Horovod was not built with tensorflow support" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize("level,shown", [("0", ["absl::InitializeLog", "oneDNN", "To enable the"]),
                                         ("1", ["absl::InitializeLog"])])
def test_tf_start_up_lines_shown_when_the_user_asks(level, shown, tmp_path):
    """TF_CPP_MIN_LOG_LEVEL set by the user is obeyed, also for the records TF itself lets
    through: 0 shows everything, 1 the warnings but not the INFO records."""
    proc = run_as_a_user([sys.executable, "-m", "launch", "--framework", "tf", *QUICK], tmp_path,
                         {"tensorflow": NOISY, "horovod": ""}, env={"TF_CPP_MIN_LOG_LEVEL": level})
    assert proc.returncode == 2, proc.stderr
    for needle in shown:
        assert needle in proc.stderr, proc.stderr
    if level == "1":
        assert "oneDNN" not in proc.stderr and "cpu_feature_guard" not in proc.stderr, proc.stderr
