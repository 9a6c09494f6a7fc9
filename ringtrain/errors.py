"""One-line user errors instead of traceback soup.

A :class:`UserError` is bad input (missing data, bad flags, impossible world sizes): the user's to
fix, so its message is one line naming the problem and the fix.  The library raises it; the
commands (:func:`launch.cli.run_cli`) print it once and exit with status 2.
"""

from __future__ import annotations

import os

_RANK_ENV_VARS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")


class UserError(Exception):
    """A problem with the user's input or environment that they can fix without reading code."""


def launcher_rank() -> int:
    """This process's rank as the launcher announced it, readable before ``hvd.init()``."""
    for name in _RANK_ENV_VARS:
        value = os.environ.get(name)
        if value is not None and value.isdigit():
            return int(value)
    return 0
