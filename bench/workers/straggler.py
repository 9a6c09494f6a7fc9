"""``python -m bench.workers.straggler --slow-rank R [--factor F] TRAINER-ARGS``: the PyTorch trainer
(ring or ``--strategy ps``, as the flags say), with rank R a straggler.

On rank R every forward + backward pass is followed by a sleep of F times its own duration, so
that rank computes at 1 / (1 + F) of its speed (F = 1: half speed) whatever the load, and gives
its core back while it sleeps, as a slower machine would leave the others' cores alone.  The
wrap sits where both strategies compute (the built-in CNN's ``forward`` starts the clock, the
loss's ``backward`` stops it), so the ring's allreduce and the servers' replies are not slowed,
only the computing.  Used by ``bench/parts/param_servers.py``'s straggler table.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import util


def slow_down(factor: float) -> None:
    import torch

    from torch_models import model

    started = {"t": None}
    forward, backward = model.MnistCNN.forward, torch.Tensor.backward

    def timed_forward(self, x):
        started["t"] = time.perf_counter()
        return forward(self, x)

    def slowed_backward(self, *args, **kwargs):
        result = backward(self, *args, **kwargs)
        if started["t"] is not None:
            time.sleep(factor * (time.perf_counter() - started["t"]))
            started["t"] = None
        return result

    model.MnistCNN.forward = timed_forward
    torch.Tensor.backward = slowed_backward


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.workers.straggler", allow_abbrev=False)
    p.add_argument("--slow-rank", type=int, required=True)
    p.add_argument("--factor", type=float, default=1.0)
    ours, rest = p.parse_known_args(argv)
    from launch import cli
    from ringtrain.strategies import registry

    args = cli.parse("torch", rest)
    if util.launcher_rank() == ours.slow_rank:
        slow_down(ours.factor)
    registry.train("torch", args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
