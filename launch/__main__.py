"""``python -m launch --framework {torch,tf} [trainer flags]``: one launcher for both frameworks.

Only the chosen framework is imported, so a machine with just one of them installed works, and the
process never loads two copies of Horovod's native library.
"""

from __future__ import annotations

import argparse

from launch import cli
from launch.errors import run_cli


def build_parser() -> argparse.ArgumentParser:
    parser = cli.build_parser()
    parser.add_argument("--framework", required=True, choices=cli.FRAMEWORKS,
                        help="torch (PyTorch, horovod.torch) or tf (TensorFlow/Keras 3, "
                             "horovod.tensorflow)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    framework = args.__dict__.pop("framework")
    cli.validate(args)
    from launch.job import main_with

    return main_with(framework, args)


if __name__ == "__main__":
    run_cli(main)
