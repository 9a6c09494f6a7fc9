"""Bandwidth-bound PyTorch training step (see :mod:`bench.workers.bigmodel`): a torchvision ResNet on one
fixed synthetic batch, ``--wrapper none|alone|horovod|ddp``.

``horovod`` is what Horovod's synthetic benchmark and our trainer do: ``hvd.DistributedOptimizer``
(allreduces start from backward hooks as gradients become ready, ``step()`` waits for them), the
initial broadcast, ``--fp16`` = ``hvd.Compression.fp16``; fusion threshold, cycle time and
hierarchical allreduce come from ``horovodrun``'s flags.  ``ddp``: ``DistributedDataParallel`` over
gloo with its default 25 MB buckets (``--fp16``: its ``fp16_compress_hook``).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import torchvision

from bench.workers.bigmodel import env_rank, parser, summary, tcp_barrier, write
from bench.workers.loopcommon import StepClock, slowest_torch

MODELS = ("resnet18", "resnet50", "resnet101", "vgg16")


def main() -> None:
    args = parser(MODELS, "resnet18").parse_args()
    torch.set_num_threads(args.threads)
    rank, size, hvd, dist = 0, 1, None, None
    if args.wrapper == "horovod":
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif args.wrapper == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
    elif args.wrapper == "alone":
        rank, size = env_rank()

    torch.manual_seed(rank)
    model = getattr(torchvision.models, args.model)(num_classes=1000)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * size, momentum=0.9)
    if hvd is not None:
        compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             compression=compression)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if dist is not None:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if args.fp16:
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)

    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=gen)
    y = torch.randint(0, 1000, (args.batch_size,), generator=gen)

    if args.wrapper == "alone":
        tcp_barrier(rank, size, 0)
    clock = StepClock(args.warmup_steps)
    steps = []
    model.train()
    for _ in range(args.warmup_steps + args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps.append(time.perf_counter() - t0)
        clock.tick()
    clock.stop()
    seconds = slowest_torch(clock.seconds, hvd, dist)
    if args.wrapper == "alone":
        tcp_barrier(rank, size, 1)  # rank 0's window ends after everyone's started
    weight_sum = float(sum(p.detach().double().sum() for p in model.parameters()))
    if hvd is not None:
        weight_sums = hvd.allgather_object(weight_sum, name="bench_weight_sums")
    elif dist is not None:
        weight_sums = [None] * size
        dist.all_gather_object(weight_sums, weight_sum)
    else:
        weight_sums = [weight_sum]
    if rank == 0:
        write(args.out, summary(args, framework="torch", size=size, grad_bytes=grad_bytes,
                                step_seconds=steps[args.warmup_steps:], timed_seconds=seconds,
                                cpu_seconds=clock.cpu_seconds, weight_sums=weight_sums,
                                extra={"torch": torch.__version__}))
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
