"""Elastic data-parallel training on PyTorch: keeps training while workers leave and join.

Horovod elastic re-runs the wrapped function after every membership change, with the committed
state (model, optimizer, position in the epoch) restored on the survivors and broadcast to
newcomers by ``hvd.elastic.TorchState``.  The epoch loop itself is shared with TensorFlow
(:func:`ringtrain.training.elastic.run_epochs`), and each world's bookkeeping with the fixed-size trainer
(:class:`ringtrain.training.job.Job`); this module is the PyTorch glue.  Nothing here may issue a collective
outside the wrapped function: a worker that joins later would wait in it while the others sync.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain.data.sharding import eval_indices
from ringtrain.faults import watchdog
from ringtrain.output.summary import Summary
from ringtrain.runtime import before_init, threads_per_rank
from ringtrain.training import elastic
from ringtrain.training.job import Job
from torch_models import common
from torch_models.model import build


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    # Horovod: initialise (again after every membership change, inside hvd.elastic.run).
    hvd.init()
    # Horovod: pin this rank to its GPU, once: a process keeps its device for life.
    device = common.pin(hvd.local_rank(), hvd.local_size())
    first = Job(args, framework="torch", versions=common.VERSIONS, hvd=hvd,
                collectives=common.COLLECTIVES, use_gpu=device.type == "cuda", elastic=True)
    watchdog.start(args.stall_timeout, hvd, elastic=True)  # watchdog: a frozen worker is lost
    torch.manual_seed(args.seed + first.rank)  # rank 0's weights win at the first sync
    model = build(args.model, first.dataset, args.dropout).to(device)  # checked on every rank
    param_count = sum(p.numel() for p in model.parameters())
    first.check_folders(param_count)
    train_images, train_labels, test_images, test_labels = elastic.local_data(args)
    n_train, n_test = len(train_labels), len(test_labels)
    train_x, train_y = common.to_tensors(first.dataset, train_images, train_labels, device)
    test_x, test_y = common.to_tensors(first.dataset, test_images, test_labels, device)

    # Horovod: wrap the optimizer (the LR is set per step for the current world size).
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.backward_passes_per_step,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )
    start_epoch = 0
    if args.resume and first.rank == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = common.load_checkpoint(args.checkpoint_dir, model, optimizer,
                                             first.model_name, param_count)
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
        # Each world has its own ranks, so its own Job; the shard and the LR scale are derived
        # from the world size inside run_epochs.
        job = Job(args, framework="torch", versions=common.VERSIONS, hvd=hvd,
                  collectives=common.COLLECTIVES, use_gpu=device.type == "cuda", elastic=True)
        eval_idx = torch.from_numpy(eval_indices(n_test, job.rank, job.size)).to(device)
        return job.elastic_world(
            state, n_train=n_train, step=step, param_count=param_count,
            eval_sums=lambda: common.eval_sums(model, test_x[eval_idx], test_y[eval_idx]),
            save=lambda epoch: common.save_checkpoint(args.checkpoint_dir, epoch, model, optimizer,
                                                      job.model_name, param_count, args),
            params=lambda: common.parameters(model),
            weights_finite=lambda: common.weights_finite(model))

    return run(state)
