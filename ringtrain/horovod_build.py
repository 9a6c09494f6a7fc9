"""Horovod's build, checked before a trainer runs: the framework and Horovod's extension for it
import, and the installed Horovod is the one this checkout's patch series builds; each problem is
one clear line.  TensorFlow's C++ start-up lines are held back while it loads
(:mod:`ringtrain.native_logs`).  :func:`ringtrain.strategies.registry.train`, every way into a
trainer, calls :func:`import_entry`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from ringtrain.errors import UserError
from ringtrain.native_logs import min_level, quiet_native_logs

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
            return None  # not installed: import_entry says so
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


def import_entry(framework: str, entry: str) -> Any:
    """What ``entry`` (``module:name``, a framework's run object or job) names, after checking
    that the framework and Horovod's extension for it import and that Horovod is this checkout's
    build; TensorFlow's start-up log lines below ``TF_CPP_MIN_LOG_LEVEL`` held back."""
    if framework not in _PACKAGES:
        raise UserError(f"unknown framework {framework!r}; choose one of {', '.join(_PACKAGES)}")
    quiet = contextlib.nullcontext()
    if framework == "tf":
        # TF's C++ start-up lines (oneDNN, CPU features, absl's pre-init warning) are noise to
        # users unless they ask for them with TF_CPP_MIN_LOG_LEVEL; TF itself ignores that
        # variable for some of them (ringtrain/native_logs.py), so the level is applied here too.
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
        module, name = entry.split(":")
        return getattr(importlib.import_module(module), name)
