"""One rank of the fusion check: ``horovodrun -np N python -m bench.workers.fusion_worker --out F``.

A model of many small layers (``--layers`` Linear layers of ``--width`` units: 2 x layers
gradient tensors, 20 by default, 64 KiB and 512 B each at width 128) trained with
``hvd.DistributedOptimizer`` on one fixed batch, so gradients are enqueued one by one as the
backward pass produces them, as in any PyTorch training step.  Around the timed steps each rank
reads Horovod's loop counters (:mod:`bench.workers.loopcounters`): allreduce calls per step and tensors and
bytes per call say how much tensor fusion fused; rounds per step say how often the background
loop turned.  Rank 0 writes every rank's figures and the step time.
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.common import util
from bench.workers import loopcounters


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import horovod.torch as hvd
    import torch
    from horovod.torch.mpi_ops import _basics

    from ringtrain.runtime import configure_mpi_progress, threads_per_rank

    configure_mpi_progress()  # as the trainers do
    hvd.init()
    torch.set_num_threads(threads_per_rank(hvd.local_size()))
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                         named_parameters=model.named_parameters())
    x = torch.randn(args.batch_size, args.width, generator=torch.Generator().manual_seed(hvd.rank()))

    def step() -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    try:
        before = loopcounters.read(_basics)
    except RuntimeError as e:  # a Horovod without the project's patch
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    for _ in range(args.warmup_steps):
        step()
    hvd.barrier()
    before, t0 = loopcounters.read(_basics), time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - t0
    per_rank = loopcounters.delta(before, loopcounters.read(_basics), args.steps)
    per_rank["step_seconds"] = seconds / args.steps
    gathered = hvd.allgather_object(per_rank, name="fusion_gather")
    if hvd.rank() == 0:
        grads = [p.numel() * p.element_size() for p in model.parameters()]
        util.write_json(args.out, {
            "world_size": hvd.size(), "gradients": len(grads), "gradient_bytes": sum(grads),
            "layers": args.layers, "width": args.width, "batch_size_per_rank": args.batch_size,
            "per_rank": gathered})


if __name__ == "__main__":
    main()
