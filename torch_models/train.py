"""Data-parallel MNIST on PyTorch through ``horovod.torch``.

The Horovod part is the usual handful of lines: init, pin threads/GPU, shard, scale the LR, wrap
the optimizer, broadcast from rank 0.  Everything else (CLI, data, sharding, LR rule, reporting,
checkpoint files) is shared with the TensorFlow trainer in ``launch``.
"""

from __future__ import annotations

import argparse
import io
import time

import horovod
import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from launch import checkpoint, cli, mnist, watchdog
from launch.elastic import check_launcher
from launch.errors import UserError
from launch.lr import lr_at, scaled_lr
from launch.report import EpochRecord, Reporter, Summary
from launch.runtime import before_init, controller, threads_per_rank
from launch.sharding import optimizer_steps, shard_indices
from torch_models.model import MODEL_NAME, MnistCNN

CKPT_EXT = "pt"


def to_tensors(images: np.ndarray, labels: np.ndarray, device: torch.device):
    """Normalised NCHW float tensors, made once: indexing them per batch beats a DataLoader's
    per-image Python work by a wide margin on small CPU machines."""
    x = torch.from_numpy(mnist.normalize(images)).unsqueeze(1).to(device)
    return x, torch.from_numpy(labels).to(device)


def config_of(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("resume", "no_progress")}


def save_checkpoint(path_dir: str, epoch: int, model, optimizer, param_count: int,
                    args: argparse.Namespace) -> None:
    buf = io.BytesIO()
    torch.save({
        "meta": checkpoint.metadata("torch", MODEL_NAME, param_count, epoch, config_of(args)),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }, buf)
    checkpoint.save(path_dir, epoch, CKPT_EXT, buf.getvalue())


def load_checkpoint(path_dir: str, model, optimizer, param_count: int) -> int:
    """Restore rank 0's model/optimizer from the newest checkpoint; return its epoch (0 if none)."""
    path = checkpoint.latest(path_dir, CKPT_EXT)
    if path is None:
        return 0
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # torch raises many types for damaged files
        raise UserError(f"checkpoint {path} is corrupt ({type(err).__name__}); delete it to "
                        f"resume from the one before") from None
    epoch = checkpoint.check_metadata(state.get("meta") if isinstance(state, dict) else None,
                                      path, "torch", MODEL_NAME, param_count)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return epoch


def evaluate(model, x, y, batch_size: int) -> tuple[float, float]:
    """Exact global (loss, accuracy): sums and counts are added across ranks, then divided."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, len(x), batch_size):
            logits = model(x[start:start + batch_size])
            target = y[start:start + batch_size]
            totals[0] += F.cross_entropy(logits, target, reduction="sum").item()
            totals[1] += (logits.argmax(1) == target).sum().item()
            totals[2] += len(target)
    totals = hvd.allreduce(totals, op=hvd.Sum, name="eval_totals")
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    cli.validate_world(args, size)
    watchdog.start(args.stall_timeout, hvd)  # watchdog: a frozen or cut-off rank ends the job
    torch.set_num_threads(threads_per_rank(hvd.local_size()))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        if hvd.local_rank() >= torch.cuda.device_count():  # NCCL refuses two ranks on one GPU
            raise UserError(f"{hvd.local_size()} ranks on this host but only "
                            f"{torch.cuda.device_count()} GPU(s); run at most "
                            f"{torch.cuda.device_count()} processes per host")
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda" if use_cuda else "cpu")
    if args.amp and not use_cuda:
        raise UserError("--amp needs a CUDA GPU; drop the flag on CPU machines")
    report = Reporter(rank == 0, progress=not args.no_progress)
    if args.checkpoint_dir and rank == 0:
        checkpoint.ensure_writable(args.checkpoint_dir)

    data = mnist.load_on_all_ranks(args.data_dir, rank, hvd.broadcast_object)
    train_images, train_labels, test_images, test_labels = mnist.rank_view(
        data, args.train_samples, args.test_samples, rank, size)
    n_train = len(train_labels)
    train_x, train_y = to_tensors(train_images, train_labels, device)
    test_x, test_y = to_tensors(test_images, test_labels, device)

    # Different seeds per rank on purpose: the broadcast below, not luck, makes ranks agree.
    torch.manual_seed(args.seed + rank)
    model = MnistCNN(dropout=args.dropout).to(device)
    param_count = sum(p.numel() for p in model.parameters())
    target_lr = scaled_lr(args.base_lr, size, args.lr_scaling, args.adasum)
    optimizer = torch.optim.SGD(model.parameters(), lr=target_lr, momentum=args.momentum)

    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        backward_passes_per_step=args.backward_passes_per_step,
        op=hvd.Adasum if args.adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )
    # Resume into the wrapped optimizer: DistributedOptimizer builds a new optimizer from the
    # param groups alone, so state loaded before wrapping (the momentum buffers) would be lost.
    start_epoch = 0
    if args.resume and rank == 0:
        start_epoch = load_checkpoint(args.checkpoint_dir, model, optimizer, param_count)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scaler = torch.amp.GradScaler("cuda") if args.amp else None

    k = args.backward_passes_per_step
    steps = optimizer_steps(n_train, size, args.batch_size, k, args.max_steps)

    summary = Summary(
        framework="torch", versions={"torch": torch.__version__, "horovod": horovod.__version__},
        controller=controller(hvd), world_size=size, batch_size_per_rank=args.batch_size,
        global_batch_size=args.batch_size * size * k, base_lr=args.base_lr,
        effective_lr=target_lr, lr_scaling="none (adasum)" if args.adasum else args.lr_scaling,
        param_count=param_count, resumed_from_epoch=start_epoch or None,
    )
    report.info(f"torch {torch.__version__} + horovod {horovod.__version__} ({summary.controller}): "
                f"{size} rank(s), {param_count:,} params, lr {args.base_lr:g} -> {target_lr:g}, "
                f"{steps} steps/epoch of {args.batch_size * size * k} images")

    test_loss = test_acc = float("nan")
    train_seconds = images_seen = 0.0
    for epoch in range(start_epoch + 1, args.epochs + 1):
        model.train()
        idx = torch.from_numpy(shard_indices(n_train, rank, size, args.seed, epoch,
                                             shuffle=not args.no_shuffle))
        loss_sum = torch.zeros(2, dtype=torch.float64)
        t0 = time.perf_counter()
        for step in range(steps):
            lr = lr_at(epoch - 1 + step / steps, args.base_lr, target_lr, args.warmup_epochs,
                       args.epochs, args.lr_decay)
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.zero_grad()
            for micro in range(k):
                b = idx[(step * k + micro) * args.batch_size:][: args.batch_size]
                with torch.autocast("cuda", enabled=scaler is not None):
                    loss = F.cross_entropy(model(train_x[b]), train_y[b])
                loss_sum += torch.tensor([loss.item() * len(b), len(b)], dtype=torch.float64)
                if scaler is not None:
                    scaler.scale(loss / k).backward()
                else:
                    (loss / k).backward()
            if scaler is not None:
                # Horovod's AMP recipe: allreduce first, then unscale, then step without a 2nd sync.
                optimizer.synchronize()
                scaler.unscale_(optimizer)
                with optimizer.skip_synchronize():
                    scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            watchdog.progress()  # watchdog: a step completed
            report.step(epoch, args.epochs, step + 1, steps, loss.item())
        seconds = time.perf_counter() - t0
        loss_sum = hvd.allreduce(loss_sum, op=hvd.Sum, name="train_loss")
        test_loss, test_acc = evaluate(model, test_x, test_y, 1000)
        watchdog.progress()  # watchdog: the epoch's collectives completed
        imgs = loss_sum[1].item()
        train_seconds += seconds
        images_seen += imgs
        rec = EpochRecord(epoch=epoch, train_loss=(loss_sum[0] / loss_sum[1]).item(),
                          test_loss=test_loss, test_accuracy=test_acc, lr=lr, seconds=seconds,
                          images_per_second=imgs / seconds)
        summary.epochs.append(rec)
        report.epoch(rec, args.epochs)
        if args.checkpoint_dir and rank == 0:
            save_checkpoint(args.checkpoint_dir, epoch, model, optimizer, param_count, args)

    if not summary.epochs:  # resumed past the last epoch: still report where the model stands
        test_loss, test_acc = evaluate(model, test_x, test_y, 1000)
    return report.finish(summary, test_loss=test_loss, test_acc=test_acc, train_seconds=train_seconds,
                         images_seen=images_seen, allgather_object=hvd.allgather_object,
                         params=[p.detach().cpu().numpy() for p in model.parameters()],
                         metrics_out=args.metrics_out)


def main_with(args: argparse.Namespace) -> int:
    check_launcher(args.elastic)
    if args.elastic:
        from torch_models.elastic import train_elastic

        train_elastic(args)
    else:
        train(args)
    return 0
