"""``horovodrun -np 4 python -m launch.torch_mnist``: the PyTorch reference job."""

from launch.cli import run_cli


def main(argv=None) -> int:
    from launch import cli

    args = cli.parse("torch", argv)  # flags are checked before the framework is imported
    from ringtrain.strategies import registry

    registry.train("torch", args)
    return 0


if __name__ == "__main__":
    run_cli(main)
