"""``horovodrun -np 4 python -m launch.torch_mnist``: the PyTorch reference job."""

from launch.cli import run_cli


def main(argv=None) -> int:
    from launch import cli

    args = cli.parse("torch", argv)  # flags are checked before the framework is imported
    from launch import dispatch

    return dispatch.run("torch", args)


if __name__ == "__main__":
    run_cli(main)
