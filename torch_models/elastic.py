"""Elastic data-parallel MNIST on PyTorch: keeps training while workers leave and join.

Horovod elastic re-runs the wrapped function after every membership change, with the committed
state (model, optimizer, position in the epoch) restored on the survivors and broadcast to
newcomers by ``hvd.elastic.TorchState``.  The epoch loop itself is shared with TensorFlow
(:func:`launch.elastic.run_epochs`); this module is the PyTorch glue.  Nothing here may issue a
collective outside the wrapped function: a worker that joins later would wait in it while the
others sync.
"""

from __future__ import annotations

import argparse

import horovod
import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from launch import checkpoint, elastic, watchdog
from launch.report import Reporter, Summary
from launch.runtime import before_init, controller, threads_per_rank
from launch.sharding import eval_indices
from torch_models.model import MnistCNN
from torch_models.train import evaluate, load_checkpoint, save_checkpoint, to_tensors


def train_elastic(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    hvd.init()
    watchdog.start(args.stall_timeout, hvd, elastic=True)  # watchdog: a frozen worker is lost
    if args.checkpoint_dir and hvd.rank() == 0:
        checkpoint.ensure_writable(args.checkpoint_dir)
    train_images, train_labels, test_images, test_labels = elastic.local_data(args)
    n_train, n_test = len(train_labels), len(test_labels)
    device = torch.device("cpu")
    if torch.cuda.is_available():  # the GPU is picked once: a process keeps its device for life
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda")
    train_x, train_y = to_tensors(train_images, train_labels, device)
    test_x, test_y = to_tensors(test_images, test_labels, device)

    torch.manual_seed(args.seed + hvd.rank())  # rank 0's weights win at the first sync
    model = MnistCNN(dropout=args.dropout).to(device)
    param_count = sum(p.numel() for p in model.parameters())
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.base_lr, momentum=args.momentum),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.backward_passes_per_step,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )
    start_epoch = 0
    if args.resume and hvd.rank() == 0:  # the first sync hands rank 0's restored state to all
        start_epoch = load_checkpoint(args.checkpoint_dir, model, optimizer, param_count)
    state = hvd.elastic.TorchState(model, optimizer, **elastic.initial_state(start_epoch))
    set_threads = lambda: torch.set_num_threads(threads_per_rank(hvd.local_size()))  # noqa: E731
    state.register_reset_callbacks([set_threads])
    set_threads()

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

    def sum_across_ranks(values: list[float]) -> list[float]:
        return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum,
                             name="elastic_sums").tolist()

    @hvd.elastic.run
    def run(state) -> Summary:
        rank, size = hvd.rank(), hvd.size()
        eval_idx = torch.from_numpy(eval_indices(n_test, rank, size)).to(device)
        glue = elastic.Glue(
            rank=rank, size=size, step=step, sum_across_ranks=sum_across_ranks,
            evaluate=lambda: evaluate(model, test_x[eval_idx], test_y[eval_idx], 1000),
            save_checkpoint=lambda epoch: args.checkpoint_dir and save_checkpoint(
                args.checkpoint_dir, epoch, model, optimizer, param_count, args))
        report = Reporter(rank == 0, progress=not args.no_progress)
        test_loss, test_acc = elastic.run_epochs(state, args, n_train, glue, report)
        summary = Summary(framework="torch", controller=controller(hvd), param_count=param_count,
                          versions={"torch": torch.__version__, "horovod": horovod.__version__},
                          **elastic.summary_fields(state, args, glue))
        return report.finish(summary, test_loss=test_loss, test_acc=test_acc,
                             train_seconds=state.train_seconds, images_seen=state.images_seen,
                             allgather_object=hvd.allgather_object,
                             params=[p.detach().cpu().numpy() for p in model.parameters()],
                             metrics_out=args.metrics_out)

    return run(state)

