"""The dispatcher: a checked command line to the framework's fixed or elastic trainer.

Only one framework's Horovod module may be loaded per process (two copies of Horovod's native
library otherwise), so the trainer is imported lazily, by name, after checking that the framework,
Horovod's extension for it, and Horovod's build (the patch series it was built from) are what this
checkout needs; each problem is one clear line.  The library (``ringtrain``) never imports this
module: commands call the library, not the other way round.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
from pathlib import Path
from types import ModuleType

from launch.native_logs import min_level, quiet_native_logs
from ringtrain.errors import UserError
from ringtrain.faults import termination
from ringtrain.training.elastic import check_launcher

# framework -> (fixed-size trainer, elastic trainer); each module's ``train(args)`` runs a job.
TRAINERS = {"torch": ("torch_models.train", "torch_models.elastic"),
            "tf": ("tf_models.train", "tf_models.elastic")}
# --strategy ps (issue 39): each framework's parameter-server trainer (fixed-size jobs only).
PS_TRAINERS = {"torch": "torch_models.ps", "tf": "tf_models.ps"}
# --pipeline-stages > 1 (model parallelism, a fixed-size job): the framework's pipeline trainer.
PIPELINE_TRAINERS = {"torch": "torch_models.pipeline", "tf": "tf_models.pipeline"}
_PACKAGES = {"torch": ("torch", "horovod.torch"), "tf": ("tensorflow", "horovod.tensorflow")}
_INSTALL_HINT = "run 'make setup' (or bash .ci/setup) to install the pinned stack and build Horovod"
# The patch series this checkout builds Horovod with; absent where ringtrain is installed without it.
CHECKOUT_SERIES = Path(__file__).resolve().parents[1] / ".ci" / "horovod-patches"
ANY_HOROVOD = "RINGTRAIN_ANY_HOROVOD"  # =1: run on whatever Horovod is installed


def series_sha256(series: Path) -> str:
    """The patch series' hash, as .ci/horovod-build.sh's ``series_sha256`` computes it: the SHA-256
    of one line ``<sha256 of the patch>  <name>`` per patch, in the order of ``series/series``
    (comments and blank lines aside).  A patch the series names but lacks: FileNotFoundError."""
    lines = []
    for line in (series / "series").read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if name:
            lines.append(f"{hashlib.sha256((series / name).read_bytes()).hexdigest()}  {name}\n")
    return hashlib.sha256("".join(lines).encode()).hexdigest()


def horovod_build_problem(series: Path = CHECKOUT_SERIES, package_dir: Path | None = None) -> str | None:
    """Why the installed Horovod is not the one this checkout builds, or None.

    ``make setup`` records the patch series' hash inside the Horovod it builds
    (``horovod/_ringtrain_patch.py``, .ci/horovod-build.sh).  Another build (PyPI's, a container's,
    one of an older checkout) runs, but without fixes the trainers rely on: upstream 0.28.1's
    Keras optimizer skipped the allreduce on Keras 3 and ranks trained apart without an error.
    Read as text, without importing Horovod.  Where ringtrain is installed without its
    checkout (``pip install .``: no patch beside the package), the patch's version cannot be
    compared, but a Horovod that records none is still refused.
    """
    if os.environ.get(ANY_HOROVOD) == "1":
        return None
    if package_dir is None:
        spec = importlib.util.find_spec("horovod")
        if spec is None or not spec.submodule_search_locations:
            return None  # not installed: import_trainer says so
        package_dir = Path(next(iter(spec.submodule_search_locations)))
    record = package_dir / "_ringtrain_patch.py"
    found = re.search(r'PATCH_SHA256 = "([0-9a-f]+)"', record.read_text()) if record.is_file() else None
    if not (series / "series").is_file():
        if found:
            return None  # built by ringtrain's setup; which series, only a checkout can tell
        want = ""
    else:
        try:
            want = series_sha256(series)
        except FileNotFoundError as err:
            return (f"this checkout's Horovod patch series is incomplete ({err.filename} is "
                    "missing): restore it with git")
    if found and found.group(1) == want:
        return None
    what = (f"was built from another version of the patch series ({found.group(1)[:10]}, this "
            f"checkout's is {want[:10]})" if found else
            "was not built by ringtrain's setup (it records no patch series)")
    return (f"the Horovod in {package_dir.parent} {what}, so it lacks fixes the trainers rely on; "
            f"run 'make setup' to rebuild it (or set {ANY_HOROVOD}=1 to use it anyway)")


def import_trainer(framework: str, elastic: bool = False, strategy: str = "ring",
                   pipeline: bool = False) -> ModuleType:
    """The framework's trainer module (its elastic one under ``elastic``, its parameter-server
    one for ``strategy`` ps, its pipeline one under ``pipeline``), after checking that the
    framework and Horovod's extension for it import."""
    if framework not in TRAINERS:
        raise UserError(f"unknown framework {framework!r}; choose one of {', '.join(TRAINERS)}")
    quiet = contextlib.nullcontext()
    if framework == "tf":
        # TF's C++ start-up lines (oneDNN, CPU features, absl's pre-init warning) are noise to
        # users unless they ask for them with TF_CPP_MIN_LOG_LEVEL; TF itself ignores that
        # variable for some of them (launch/native_logs.py), so the level is applied here too.
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        quiet = quiet_native_logs(min_level(os.environ["TF_CPP_MIN_LOG_LEVEL"]))
    problem = horovod_build_problem()
    if problem:
        raise UserError(problem)
    framework_pkg, horovod_pkg = _PACKAGES[framework]
    with quiet:
        try:
            importlib.import_module(framework_pkg)
        except ImportError:
            raise UserError(f"{framework_pkg} is not installed; {_INSTALL_HINT}") from None
        try:
            importlib.import_module(horovod_pkg)
        except ImportError as err:
            raise UserError(f"{horovod_pkg} cannot be imported ({err}); Horovod was not built with "
                            f"{framework_pkg} support: {_INSTALL_HINT}") from None
        if strategy == "ps":
            return importlib.import_module(PS_TRAINERS[framework])
        if pipeline:
            return importlib.import_module(PIPELINE_TRAINERS[framework])
        return importlib.import_module(TRAINERS[framework][1 if elastic else 0])


def run(framework: str, args: argparse.Namespace, own_signals: bool = True) -> int:
    """Run a validated command line: the framework's elastic trainer under ``--elastic``, else
    its fixed-size one.  ``own_signals``: this process is the trainer's (not a Ray actor's)."""
    check_launcher(args.elastic)
    if own_signals:
        termination.install()  # SIGTERM: finish a save under way, then exit 143 with one line
    import_trainer(framework, elastic=args.elastic, strategy=args.strategy,
                   pipeline=args.pipeline_stages > 1).train(args)
    return 0
