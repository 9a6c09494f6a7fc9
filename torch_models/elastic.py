"""Elastic data-parallel MNIST on PyTorch: keeps training while workers leave and join.

Horovod elastic re-runs :func:`_train_loop` after every membership change.  Before it does, the
state committed last (model, optimizer, and where in the epoch the job is) is restored on the
survivors and broadcast to newcomers, so the loop only has to re-derive what depends on the world
size: this rank's share of the rest of the epoch and the scaled LR.  Nothing here may issue a
collective outside the loop: a worker that joins later would wait in it while the others sync.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import horovod
import horovod.torch as hvd
import torch
import torch.nn.functional as F

from launch import checkpoint, mnist
from launch.elastic import epoch_progress
from launch.errors import UserError
from launch.lr import lr_at, scaled_lr
from launch.report import EpochRecord, Reporter, Summary
from launch.runtime import configure_stall_check, controller, threads_per_rank
from launch.sharding import eval_indices, remaining_shard
from torch_models.model import MnistCNN
from torch_models.train import evaluate, load_checkpoint, save_checkpoint, to_tensors


def train_elastic(args: argparse.Namespace) -> Summary:
    if args.amp:
        raise UserError("--amp is not supported with --elastic yet; drop one of the two flags")
    configure_stall_check(args.stall_timeout)
    hvd.init()
    if args.checkpoint_dir and hvd.rank() == 0:
        checkpoint.ensure_writable(args.checkpoint_dir)
    # Every worker reads the files itself: a broadcast here would be a collective outside the
    # elastic loop, which a worker joining mid-run would never be matched with.
    data = mnist.load(args.data_dir)
    n_train = args.train_samples or len(data.train_labels)
    n_test = min(args.test_samples or len(data.test_labels), len(data.test_labels))
    device = torch.device("cpu")
    if torch.cuda.is_available():  # the GPU is picked once: a process keeps its device for life
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda")
    train_x, train_y = to_tensors(data.train_images[:n_train], data.train_labels[:n_train], device)
    test_x, test_y = to_tensors(data.test_images[:n_test], data.test_labels[:n_test], device)

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
    state = hvd.elastic.TorchState(
        model, optimizer, epoch=start_epoch + 1, consumed=0, epoch_steps=0, loss_sum=[0.0, 0.0],
        epoch_started=time.time(), train_seconds=0.0, images_seen=0.0, records=[], resizes=[])
    state.register_reset_callbacks([lambda: torch.set_num_threads(threads_per_rank(hvd.local_size()))])
    torch.set_num_threads(threads_per_rank(hvd.local_size()))

    @hvd.elastic.run
    def run(state) -> Summary:
        return _train_loop(state, args, train_x, train_y, test_x, test_y, param_count)

    return run(state)


def _train_loop(state, args, train_x, train_y, test_x, test_y, param_count: int) -> Summary:
    rank, size = hvd.rank(), hvd.size()
    n_train, n_test = len(train_y), len(test_y)
    k, batch = args.backward_passes_per_step, args.batch_size
    report = Reporter(rank == 0, progress=not args.no_progress)
    target_lr = scaled_lr(args.base_lr, size, args.lr_scaling)
    if not state.resizes or state.resizes[-1]["world_size"] != size:
        state.resizes.append({"epoch": state.epoch, "consumed": state.consumed, "world_size": size,
                              "target_lr": target_lr})
        report.info(f"elastic: {size} worker(s) from epoch {state.epoch}, sample {state.consumed}"
                    f"/{n_train}: lr {args.base_lr:g} -> {target_lr:g}, global batch {batch * size * k}")
    eval_idx = torch.from_numpy(eval_indices(n_test, rank, size)).to(train_x.device)
    model, optimizer = state.model, state.optimizer

    lr = target_lr
    while state.epoch <= args.epochs:
        epoch = state.epoch
        shard = torch.from_numpy(remaining_shard(n_train, state.consumed, rank, size, args.seed, epoch,
                                                 shuffle=not args.no_shuffle)).to(train_x.device)
        steps = len(shard) // (batch * k) + (1 if k == 1 and len(shard) % batch else 0)
        if args.max_steps:
            steps = max(0, min(steps, args.max_steps - state.epoch_steps))
        model.train()
        done_before = state.epoch_steps
        pending = torch.zeros(2, dtype=torch.float64)  # this rank's loss sum since the last commit
        for step in range(steps):
            lr = lr_at(epoch_progress(epoch, state.consumed, n_train), args.base_lr, target_lr,
                       args.warmup_epochs, args.epochs, args.lr_decay)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad()
            used = 0
            for micro in range(k):
                b = shard[(step * k + micro) * batch:][:batch]
                loss = F.cross_entropy(model(train_x[b]), train_y[b])
                (loss / k).backward()
                pending += torch.tensor([loss.item() * len(b), len(b)], dtype=torch.float64)
                used += len(b)
            optimizer.step()
            state.consumed += used * size  # a strided prefix per rank is a prefix of the order
            state.epoch_steps += 1
            report.step(epoch, args.epochs, state.epoch_steps, done_before + steps, loss.item())
            if (step + 1) % args.commit_every == 0 and step + 1 < steps:
                _fold_loss(state, pending)
                state.commit()

        _fold_loss(state, pending)
        test_loss, test_acc = evaluate(model, test_x[eval_idx], test_y[eval_idx], 1000)
        seconds = time.time() - state.epoch_started
        rec = EpochRecord(epoch=epoch, train_loss=state.loss_sum[0] / max(state.loss_sum[1], 1),
                          test_loss=test_loss, test_accuracy=test_acc, lr=lr, seconds=seconds,
                          images_per_second=state.loss_sum[1] / seconds)
        report.epoch(rec, args.epochs)
        if args.checkpoint_dir and rank == 0:
            save_checkpoint(args.checkpoint_dir, epoch, model, optimizer, param_count, args)
        state.records.append(asdict(rec))
        state.train_seconds += seconds
        state.images_seen += state.loss_sum[1]
        state.epoch, state.consumed, state.epoch_steps = epoch + 1, 0, 0
        state.loss_sum, state.epoch_started = [0.0, 0.0], time.time()
        state.commit()

    summary = Summary(
        framework="torch", versions={"torch": torch.__version__, "horovod": horovod.__version__},
        controller=controller(hvd), world_size=size, batch_size_per_rank=batch,
        global_batch_size=batch * size * k, base_lr=args.base_lr, effective_lr=target_lr,
        lr_scaling=args.lr_scaling, param_count=param_count,
        epochs=[EpochRecord(**r) for r in state.records], elastic_resizes=list(state.resizes),
    )
    last = state.records[-1] if state.records else None
    test_loss, test_acc = ((last["test_loss"], last["test_accuracy"]) if last else
                           evaluate(model, test_x[eval_idx], test_y[eval_idx], 1000))
    return report.finish(summary, test_loss=test_loss, test_acc=test_acc,
                         train_seconds=state.train_seconds, images_seen=state.images_seen,
                         allgather_object=hvd.allgather_object,
                         params=[p.detach().cpu().numpy() for p in model.parameters()],
                         metrics_out=args.metrics_out)


def _fold_loss(state, pending: torch.Tensor) -> None:
    """Add every rank's loss since the last commit to the committed epoch total (a collective, so
    the epoch's train loss survives ranks that leave)."""
    total = hvd.allreduce(pending, op=hvd.Sum, name="elastic_loss")
    state.loss_sum = [state.loss_sum[0] + total[0].item(), state.loss_sum[1] + total[1].item()]
    pending.zero_()
