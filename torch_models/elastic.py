"""Elastic data-parallel training on PyTorch: keeps training while workers leave and join.

Horovod elastic re-runs the wrapped function after every membership change, with the committed
state (model, optimizer, position in the epoch) restored on the survivors and broadcast to
newcomers by ``hvd.elastic.TorchState``.  The epoch loop itself is shared with TensorFlow
(:func:`ringtrain.training.elastic.train_world`); this module is the PyTorch glue.  Nothing here
may issue a collective outside the wrapped function: a worker that joins later would wait in it
while the others sync.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F

from ringtrain import model_spec
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init, threads_per_rank
from ringtrain.training import elastic, startup
from ringtrain.training.world import World, state_broadcast
from torch_models import checkpoints, devices
from torch_models.collectives import COLLECTIVES, VERSIONS, average_buffers
from torch_models.data import open_data
from torch_models.evaluation import parameters, weights_finite
from torch_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise (again after every membership change, inside hvd.elastic.run).
    hvd.init()
    # Horovod: pin this rank to its GPU, once: a process keeps its device for life.
    device = devices.pin(hvd.local_rank(), hvd.local_size())
    first = startup.begin(args, hvd, COLLECTIVES, use_gpu=device.type == "cuda", elastic=True)
    # Opened by this worker alone: a collective here would be outside the elastic loop, which a
    # worker joining mid-run would never be matched with.  Sharded per world below.
    data = open_data(args, None, device, hvd.local_size())
    torch.manual_seed(args.seed + first.rank)  # rank 0's weights win at the first sync
    model = build(args.model, data.info, args.dropout).to(device)  # checked on every rank
    param_count = sum(p.numel() for p in model.parameters())
    model_name = model_spec.model_name(args.model, data.info.name)
    if first.rank == 0:
        startup.check_output_folders(None, args, param_count)

    # Horovod: wrap the optimizer (the LR is set per step for the current world size).
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum),
        named_parameters=model.named_parameters(), **distributed_optimizer_options(args, hvd))
    start_epoch = 0
    if args.resume and first.rank == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = checkpoints.restore(args.checkpoint_dir, model, optimizer, model_name,
                                          param_count, data.info)
    # Horovod: the elastic state broadcasts rank 0's weights and optimizer at every (re)start.
    state = hvd.elastic.TorchState(model, optimizer, **elastic.initial_state(start_epoch))
    # Its plain attributes as JSON, not cloudpickle (TorchState takes no bcast_object; 0.28.1's
    # State and ObjectState both call this attribute).  The optimizer's own sync still pickles
    # its scalar options: docs/security.md.
    state._bcast_object = state_broadcast(COLLECTIVES, hvd.rank)
    set_threads = lambda: torch.set_num_threads(threads_per_rank(hvd.local_size()))  # noqa: E731
    state.register_reset_callbacks([set_threads])

    def step(batch, lr: float) -> tuple[float, int]:
        """One optimizer step on this rank's rows of it: K micro-batches, one update."""
        x_all, y_all = batch
        model.train()  # evaluation in between switched it off
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        k, b, total = args.backward_passes_per_step, args.batch_size, 0.0
        for micro in range(k):
            x, y = x_all[micro * b:][:b], y_all[micro * b:][:b]
            loss = F.cross_entropy(model(x), y)
            (loss / k).backward()
            total += loss.item() * len(y)
        optimizer.step()
        return total, len(y_all)

    @hvd.elastic.run
    def run(state) -> Summary:
        # Each world has its own ranks, so its own World; the shard and the LR scale are derived
        # from the world size inside train_world.
        world = World(hvd, COLLECTIVES)
        ops = elastic.FrameworkOps(
            batches=data.epoch, step=step,
            eval_sums=lambda: data.eval_sums(model, world.rank, world.size),
            problem=lambda: data.problem, sync_buffers=lambda: average_buffers(model),
            save_checkpoint=lambda epoch: checkpoints.save(args.checkpoint_dir, epoch, model,
                                                           optimizer, model_name, param_count, args,
                                                           data.info),
            weights_finite=lambda: weights_finite(model), parameters=lambda: parameters(model))
        return elastic.train_world(state, args, world, ops, data=data.info, framework="torch",
                                   versions=VERSIONS, param_count=param_count)

    return run(state)
