"""``python -m launch --framework {torch,tf} [trainer flags]``: one launcher for both frameworks.

Only the chosen framework is imported, so a machine with just one of them installed works, and the
process never loads two copies of Horovod's native library.
"""

from __future__ import annotations

import argparse

from launch import cli
from launch.cli import run_cli
from ringtrain import flags
from ringtrain.strategies import registry


def build_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    parser.add_argument("--framework", required=True, choices=flags.FRAMEWORKS,
                        help="torch (PyTorch, horovod.torch) or tf (TensorFlow/Keras 3, "
                             "horovod.tensorflow)")
    return parser


def run(argv=None) -> int:
    """The job; bad input raises :class:`ringtrain.errors.UserError`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    framework = args.__dict__.pop("framework")
    registry.validate(args)
    registry.train(framework, args)
    return 0


def main(argv=None) -> None:
    """Entry point of ``python -m launch`` and of the ``ringtrain`` console script (setup.cfg).

    The console script calls ``sys.exit(main())``, so the one-line error path must live here, not
    only under ``__main__``: it once ended in a ``UserError`` traceback with exit status 1.
    """
    run_cli(lambda: run(argv))


if __name__ == "__main__":
    main()
