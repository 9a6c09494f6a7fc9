"""One-line user errors instead of traceback soup.

A :class:`UserError` is bad input (missing data, bad flags, impossible world sizes): the user's to
fix, so its message is one line naming the problem and the fix.  The library raises it; the
commands (:func:`launch.cli.run_cli`) print it once and exit with status 2.
"""

from __future__ import annotations

import os
import unicodedata

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


def printable(text: str, limit: int = 160) -> str:
    """``text`` fit for one line of a terminal: whitespace runs (newlines too) as one space,
    other control and format characters (escape codes, bidi overrides) as ``?``, at most
    ``limit`` characters.  For anything that came from a file or a peer."""
    text = "".join("?" if unicodedata.category(c)[0] == "C" else c for c in " ".join(str(text).split()))
    return text if len(text) <= limit else text[:limit - 3] + "..."
