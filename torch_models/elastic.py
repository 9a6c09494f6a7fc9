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
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain import model_spec
from ringtrain.data import dataset as datasets
from ringtrain.data.sharding import eval_indices
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init, threads_per_rank
from ringtrain.training import elastic, startup
from ringtrain.training.world import World
from torch_models import checkpoints, devices
from torch_models.collectives import COLLECTIVES, VERSIONS
from torch_models.data import to_tensors
from torch_models.evaluation import eval_sums, parameters, weights_finite
from torch_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise (again after every membership change, inside hvd.elastic.run).
    hvd.init()
    # Horovod: pin this rank to its GPU, once: a process keeps its device for life.
    device = devices.pin(hvd.local_rank(), hvd.local_size())
    first = startup.begin(args, hvd, COLLECTIVES, use_gpu=device.type == "cuda", elastic=True)
    torch.manual_seed(args.seed + first.rank)  # rank 0's weights win at the first sync
    dataset = datasets.get()
    model = build(args.model, dataset, args.dropout).to(device)  # checked on every rank
    param_count = sum(p.numel() for p in model.parameters())
    model_name = model_spec.model_name(args.model, dataset.name)
    if first.rank == 0:
        startup.check_output_folders(args, param_count)
    # Read by this worker alone: a broadcast here would be a collective outside the elastic loop,
    # which a worker joining mid-run would never be matched with.  Sharded per world below.
    data = datasets.subset(dataset.load(args.data_dir), args)
    n_train, n_test = len(data.train_labels), len(data.test_labels)
    train_x, train_y = to_tensors(dataset, data.train_images, data.train_labels, device)
    test_x, test_y = to_tensors(dataset, data.test_images, data.test_labels, device)

    # Horovod: wrap the optimizer (the LR is set per step for the current world size).
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum),
        named_parameters=model.named_parameters(), **distributed_optimizer_options(args, hvd))
    start_epoch = 0
    if args.resume and first.rank == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = checkpoints.restore(args.checkpoint_dir, model, optimizer, model_name,
                                          param_count)
    # Horovod: the elastic state broadcasts rank 0's weights and optimizer at every (re)start.
    state = hvd.elastic.TorchState(model, optimizer, **elastic.initial_state(start_epoch))
    set_threads = lambda: torch.set_num_threads(threads_per_rank(hvd.local_size()))  # noqa: E731
    state.register_reset_callbacks([set_threads])

    def step(idx: np.ndarray, lr: float) -> tuple[float, int]:
        model.train()  # evaluation in between switched it off
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        k, total = args.backward_passes_per_step, 0.0
        b_all = torch.from_numpy(idx).to(device)
        for micro in range(k):
            b = b_all[micro * args.batch_size:][:args.batch_size]
            loss = F.cross_entropy(model(train_x[b]), train_y[b])
            (loss / k).backward()
            total += loss.item() * len(b)
        optimizer.step()
        return total, len(idx)

    @hvd.elastic.run
    def run(state) -> Summary:
        # Each world has its own ranks, so its own World; the shard and the LR scale are derived
        # from the world size inside train_world.
        world = World(hvd, COLLECTIVES)
        eval_idx = torch.from_numpy(eval_indices(n_test, world.rank, world.size)).to(device)
        ops = elastic.FrameworkOps(
            step=step, eval_sums=lambda: eval_sums(model, test_x[eval_idx], test_y[eval_idx]),
            save_checkpoint=lambda epoch: checkpoints.save(args.checkpoint_dir, epoch, model,
                                                           optimizer, model_name, param_count, args),
            weights_finite=lambda: weights_finite(model), parameters=lambda: parameters(model))
        return elastic.train_world(state, args, world, ops, n_train=n_train, framework="torch",
                                   versions=VERSIONS, dataset=dataset.name, param_count=param_count)

    return run(state)
