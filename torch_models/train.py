"""Data-parallel training on PyTorch through ``horovod.torch``: the fixed-size trainer.

The Horovod part is the usual handful of lines, each marked ``# Horovod:`` below: initialise, pin
the rank to its GPU and cores, shard the data, scale the LR, wrap the optimizer, broadcast rank 0's
state.  Everything else is shared with the TensorFlow trainer (:mod:`ringtrain`): the flags, the
start-up checks (:mod:`ringtrain.training.startup`), the run's bookkeeping
(:class:`ringtrain.training.fixed.FixedRun`: LR per step, metrics, output, checkpoints), sharding
and the LR rule.
"""

from __future__ import annotations

import argparse
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from ringtrain import model_spec
from ringtrain.data import dataset as datasets
from ringtrain.data.sharding import optimizer_steps, shard_indices
from ringtrain.lr import scaled_lr
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.output.progress import Progress
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init
from ringtrain.training import divergence, startup
from ringtrain.training.fixed import FixedRun
from torch_models import checkpoints, devices
from torch_models.collectives import COLLECTIVES, VERSIONS, average_buffers
from torch_models.data import open_data
from torch_models.evaluation import FiniteWatch, parameters
from torch_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise; from here on every rank knows its rank and the world size.
    hvd.init()
    # Horovod: pin this rank to its share of the host's cores and to GPU local_rank (if any).
    device = devices.pin(hvd.local_rank(), hvd.local_size())
    world = startup.begin(args, hvd, COLLECTIVES, use_gpu=device.type == "cuda")
    rank, size, k = world.rank, world.size, args.backward_passes_per_step

    data = open_data(args, world, device, hvd.local_size())  # --data: MNIST, a folder, your own
    datasets.check_world(args, data.info, size)
    # Different seeds per rank on purpose: the broadcast below, not luck, makes ranks agree.
    torch.manual_seed(args.seed + rank)
    model = build(args.model, data.info, args.dropout).to(device)  # checked on every rank
    param_count = sum(p.numel() for p in model.parameters())
    model_name = model_spec.model_name(args.model, data.info.name)
    startup.check_output_folders(world, args, param_count)
    n_train, b = data.info.train_size, args.batch_size
    steps = optimizer_steps(n_train, size, b, k, args.max_steps)

    # Horovod: scale the learning rate with the number of workers (warm-up and decay per step).
    target_lr = scaled_lr(args.base_lr, size, args.lr_scaling, args.adasum)
    optimizer = torch.optim.SGD(model.parameters(), lr=target_lr, momentum=args.momentum)
    # Horovod: wrap the optimizer: step() averages the gradients over all ranks (ring allreduce).
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         **distributed_optimizer_options(args, hvd))
    # Resume into the wrapped optimizer: DistributedOptimizer builds a new optimizer from the
    # param groups alone, so state loaded before wrapping (the momentum buffers) would be lost.
    start_epoch = startup.resume_epoch(world, args, lambda: checkpoints.restore(
        args.checkpoint_dir, model, optimizer, model_name, param_count, data.info))
    # Horovod: broadcast rank 0's weights and optimizer state (fresh or resumed) to every rank.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None
    # On a GPU, reading the weights' finiteness at once each step would stall the GPU's queue.
    finite = FiniteWatch(model, lag=device.type == "cuda")

    def stop_if(diverged) -> None:  # (epoch, step, local loss) of a diverged step, or None
        if diverged:
            raise divergence.stop(world.gather, *diverged, data.problem)

    run = FixedRun(args, world, Progress(args, rank, n_train), framework="torch", versions=VERSIONS,
                   model_name=model_name, data=data.info, param_count=param_count,
                   target_lr=target_lr, steps=steps, start_epoch=start_epoch)
    for epoch in range(start_epoch + 1, args.epochs + 1):
        model.train()
        # Horovod: shard: rank r takes every N-th sample of the epoch's order, the same on all ranks.
        idx = shard_indices(n_train, rank, size, args.seed, epoch, shuffle=not args.no_shuffle)
        batches = data.epoch([idx[i * b:(i + 1) * b] for i in range(steps * k)])
        loss_sum, images = torch.zeros((), dtype=torch.float64, device=device), 0
        t0 = time.perf_counter()
        for step in range(steps):
            lr = run.lr(epoch, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad()
            step_losses, step_images = [], 0
            for _ in range(k):
                x, y = next(batches)
                with torch.autocast("cuda", enabled=scaler is not None):
                    loss = F.cross_entropy(model(x), y)
                # Sums stay on the device: reading a GPU value every step would stall the GPU.  One
                # kernel per batch: on a GPU the small CNN's step is bound by kernel launches.
                loss_sum.add_(loss.detach(), alpha=len(y))
                step_losses.append((loss.detach(), len(y)))
                step_images += len(y)
                scaled = loss / k if k > 1 else loss
                if scaler is not None:
                    scaler.scale(scaled).backward()
                else:
                    scaled.backward()
            if scaler is not None:
                # Horovod's AMP recipe: allreduce first, then unscale, then step without a 2nd sync.
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            # This rank's mean loss of the step, read (a wait for the GPU) only when shown.
            step_loss = lambda parts=step_losses, n=step_images: sum(float(v) * m for v, m in parts) / n  # noqa: E731
            # Identical on every rank: all stop at the same step (on a GPU, one step later).
            stop_if(finite.step((epoch, step + 1, step_loss)))
            images += step_images
            run.step_done(epoch, step + 1, lr=lr, consumed=images * size, loss=step_loss)
        stop_if(finite.flush())  # the epoch's last step, before a checkpoint can hold it
        average_buffers(model)  # BatchNorm's statistics, the same on every rank from here
        run.end_epoch(epoch, train_sums=[loss_sum.item(), images], seconds=time.perf_counter() - t0,
                      lr=lr, evaluate=lambda: data.eval_sums(model, rank, size),
                      problem=lambda: data.problem,
                      save=lambda e: checkpoints.save(args.checkpoint_dir, e, model, optimizer,
                                                      model_name, param_count, args, data.info))
    return run.finish(lambda: data.eval_sums(model, rank, size), parameters(model))
