"""Importing exactly one framework's trainer, with one clear line when that is impossible.

Only one framework's Horovod module may be loaded per process (two copies of Horovod's native
library otherwise), so the launcher imports lazily, by name.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from types import ModuleType

from launch.errors import UserError
from launch.native_logs import min_level, quiet_native_logs

# framework -> (fixed-size trainer, elastic trainer); each module's ``train(args)`` runs a job.
TRAINERS = {"torch": ("torch_models.train", "torch_models.elastic"),
            "tf": ("tf_models.train", "tf_models.elastic")}
_PACKAGES = {"torch": ("torch", "horovod.torch"), "tf": ("tensorflow", "horovod.tensorflow")}
_INSTALL_HINT = "run 'make setup' (or bash .ci/setup) to install the pinned stack and build Horovod"


def import_trainer(framework: str, elastic: bool = False) -> ModuleType:
    """The framework's trainer module (its elastic one under ``elastic``), after checking that the
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
        return importlib.import_module(TRAINERS[framework][1 if elastic else 0])
