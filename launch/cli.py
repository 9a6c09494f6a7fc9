"""What every trainer command shares: its parser, and the wrapper that turns bad input into one
line and exit status 2.

The flags themselves, and their checks, are the library's (:mod:`ringtrain.flags` and each
strategy's, put together by :mod:`ringtrain.strategies.registry`).  Bad input
(missing data, bad flags, impossible world sizes) is the user's to fix, so it is reported as a
single line naming the problem and the fix.  Only rank 0 prints it: every rank sees the same input
and would otherwise repeat the same line N times.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from ringtrain.errors import UserError, launcher_rank, printable
from ringtrain.strategies import registry

USAGE_EXIT_CODE = 2
# Set by python -m launch.horovodrun where mpirun runs with --enable-recovery, whose exit status
# is 0 whatever the ranks': rank 0 then writes its own on a line keyed by this variable's value
# (STATUS_LINE and a random token), which the wrapper reads and keeps out of the output.
STATUS_ENV = "RINGTRAIN_JOB_STATUS_LINE"
STATUS_LINE = "ringtrain-job-status"


def tell_launcher(code: int) -> None:
    """Rank 0, under the wrapper's recovery: its exit status, for the wrapper to return."""
    token = os.environ.get(STATUS_ENV, "")
    if token.startswith(STATUS_LINE) and launcher_rank() == 0:
        try:
            print(f"{token} {code}", file=sys.stderr, flush=True)
        except OSError:  # no stderr left: the wrapper falls back on the lines it saw
            pass


def fail(message: str) -> NoReturn:
    """Print ``message`` once (rank 0) as one line and exit with the usage status.  One line
    whatever it quotes: a newline or an escape code in a flag's value or a file's name is shown
    as ``?`` (:func:`ringtrain.errors.printable`)."""
    if launcher_rank() == 0:
        print(f"error: {printable(message, 4000)}", file=sys.stderr, flush=True)
    sys.exit(USAGE_EXIT_CODE)


def run_cli(main: Callable[[], int | None]) -> None:
    """Run an entry point, turning :class:`UserError` into one line and exit status 2."""
    try:
        code = main()
    except UserError as err:
        tell_launcher(USAGE_EXIT_CODE)
        fail(str(err))
    except KeyboardInterrupt:  # every rank says so: which rank was hit is the useful part
        print(f"rank {launcher_rank()} interrupted; checkpoints already written are complete",
              file=sys.stderr, flush=True)
        tell_launcher(130)
        sys.exit(130)
    except SystemExit as done:
        tell_launcher(done.code if isinstance(done.code, int) else 0 if done.code is None else 1)
        raise
    except BaseException:
        tell_launcher(1)  # Python's own traceback follows, with its exit status 1
        raise
    tell_launcher(code or 0)
    sys.exit(code or 0)


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming the problem and where to look, not a usage dump."""

    def error(self, message: str):
        fail(f"{message} (see {self.prog} --help)")


def build_parser(framework: str | None = None) -> argparse.ArgumentParser:
    what = {"torch": "PyTorch", "tf": "TensorFlow/Keras 3"}.get(framework or "", "PyTorch or TensorFlow")
    parser = OneLineParser(
        prog=f"python -m launch.{framework}_mnist" if framework else "python -m launch",
        description=f"Data-parallel training on {what} through Horovod (MNIST, an image folder or "
                    f"your own data: --data). Run one process per worker: horovodrun -np 4 <this "
                    f"command>, mpirun -np 4 ..., or plain python.",
        # No abbreviations: --data would otherwise be taken for --data-dir when misspelt, and a
        # new flag could silently change what an old abbreviation meant.
        allow_abbrev=False,
    )
    return registry.add_trainer_args(parser)


def parse(framework: str, argv: Sequence[str] | None = None) -> argparse.Namespace:
    return registry.validate(build_parser(framework).parse_args(argv))
