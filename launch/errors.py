"""One-line user errors instead of traceback soup.

Bad input (missing data, bad flags, impossible world sizes) is the user's to fix, so it is reported
as a single line naming the problem and the fix, and the process exits with status 2.  Only rank 0
prints it: every rank sees the same input and would otherwise repeat the same line N times.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import NoReturn

USAGE_EXIT_CODE = 2

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


def fail(message: str) -> NoReturn:
    """Print ``message`` once (rank 0) as one line and exit with the usage status."""
    if launcher_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def run_cli(main: Callable[[], int | None]) -> None:
    """Run an entry point, turning :class:`UserError` into one line and exit status 2."""
    try:
        code = main()
    except UserError as err:
        fail(str(err))
    except KeyboardInterrupt:  # every rank says so: which rank was hit is the useful part
        print(f"rank {launcher_rank()} interrupted; checkpoints already written are complete",
              file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(code or 0)
