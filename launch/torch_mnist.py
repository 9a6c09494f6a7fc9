"""``horovodrun -np 4 python -m launch.torch_mnist``: the PyTorch reference job."""

from launch.errors import run_cli


def main(argv=None) -> int:
    from launch import cli

    args = cli.parse("torch", argv)  # flags are checked before the framework is imported
    from launch.frameworks import import_trainer

    return import_trainer("torch").main_with(args)


if __name__ == "__main__":
    run_cli(main)
