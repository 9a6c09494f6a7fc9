"""Bench-local PyTorch training loop; ``--wrapper none|horovod|ddp`` is the only difference.

``none``: plain ``python``.  ``horovod``: under ``horovodrun``, ``hvd.DistributedOptimizer`` plus
the initial broadcast, as in :mod:`torch_models.run`.  ``ddp``: under ``torchrun``,
``DistributedDataParallel`` over gloo.  No per-step ``.item()``, no LR schedule, no metrics: just
forward, backward, gradient exchange, step.  ``--data folder:DIR`` reads the batches through the
trainers' own input pipeline (:func:`torch_models.data.open_data`: the DataLoader, its shard
sampler and its workers) and also reports the workers' cores busy.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from bench.workers.loopcommon import (
    StepClock,
    folder_batches,
    image_data,
    mnist_shard,
    parser,
    slowest_torch,
    synthetic_batch,
    trainer_args,
    write_result,
)
from ringtrain.runtime import configure_mpi_progress, threads_per_rank
from torch_models.model import build


def main() -> None:
    p = parser(("none", "horovod", "ddp"))
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the model, and with --data mnist the whole training set, on the GPU")
    p.add_argument("--amp", action="store_true",
                   help="mixed precision, as the trainer's --amp (--device cuda, --wrapper none)")
    p.add_argument("--fused", action="store_true",
                   help="SGD's fused kernel, as the trainer's optimizer on a GPU (--device cuda)")
    args = p.parse_args()
    if args.amp and (args.device != "cuda" or args.wrapper != "none"):
        p.error("--amp needs --device cuda and --wrapper none")
    if args.fused and args.device != "cuda":
        p.error("--fused needs --device cuda (the trainer uses it on a GPU only)")
    device = torch.device(args.device)
    rank, size, local_size, hvd, dist = 0, 1, 1, None, None
    if args.wrapper == "horovod":
        import horovod.torch as hvd

        configure_mpi_progress()  # as the trainers do (ringtrain.runtime.before_init)
        hvd.init()
        rank, size, local_size = hvd.rank(), hvd.size(), hvd.local_size()
    elif args.wrapper == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, size = dist.get_rank(), dist.get_world_size()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    threads = args.threads or threads_per_rank(local_size)
    torch.set_num_threads(threads)

    folder = args.data.startswith("folder:")
    if folder:
        from torch_models.data import open_data, workers

        trainer = trainer_args(args)
        data = open_data(trainer, None, device, local_size)
        shape, classes = data.info.input_shape, data.info.num_classes
        index_batches = folder_batches(data.info.train_size, rank, size, args.batch_size,
                                       args.warmup_steps + args.steps)
        stream = data.epoch(index_batches)
    else:
        shape, classes = args.input_shape, args.classes
    torch.manual_seed(rank)
    model = build(args.model, image_data(shape, classes), 0.5).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * size, momentum=0.9,
                                fused=args.fused or None)
    if hvd is not None:
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    if dist is not None:
        model = torch.nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's weights

    if args.data == "synthetic":
        x, y = synthetic_batch(args.batch_size, rank, shape, classes)
        fixed = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2))).to(device),
                 torch.from_numpy(y).to(device))
    elif args.data == "mnist":
        images, labels, idx = mnist_shard(rank, size)
        all_x, all_y = torch.from_numpy(images).unsqueeze(1).to(device), torch.from_numpy(labels).to(device)
        idx = torch.from_numpy(idx).to(device)
    # As the trainer's --amp: autocast forward, scaled backward and step.
    scaler = torch.amp.GradScaler("cuda") if args.amp else None

    clock = StepClock(args.warmup_steps, workers=folder,
                      sync=torch.cuda.synchronize if device.type == "cuda" else None)
    model.train()
    for step in range(args.warmup_steps + args.steps):
        if args.data == "synthetic":
            bx, by = fixed
        elif folder:
            bx, by = next(stream)
        else:
            start = (step * args.batch_size) % (len(idx) - args.batch_size)
            b = idx[start:start + args.batch_size]
            bx, by = all_x[b], all_y[b]
        optimizer.zero_grad()
        with torch.autocast("cuda", enabled=scaler is not None):
            loss = F.cross_entropy(model(bx), by)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        clock.tick()
    clock.stop()
    # every rank's clock, the slowest one counts (they finish together up to one step anyway)
    seconds = slowest_torch(clock.seconds, hvd, dist)
    if rank == 0:
        extra = {"torch": torch.__version__, "model": args.model, "device": args.device, "amp": args.amp,
                 "fused": args.fused, "input_shape": list(shape), "classes": classes,
                 "rank0_cores_busy": clock.cpu_seconds / clock.seconds}
        if folder:
            extra.update(workers=workers(trainer, local_size),
                         rank0_workers_cores_busy=clock.workers_cpu_seconds / clock.seconds)
        write_result(args.out, framework="torch", wrapper=args.wrapper, data=args.data, size=size,
                     batch=args.batch_size, steps=args.steps, seconds=seconds,
                     threads=threads, extra=extra)
    if dist is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
