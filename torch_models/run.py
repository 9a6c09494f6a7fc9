"""A PyTorch run through ``horovod.torch``: the run object the shared loops drive.

:class:`TorchRun` opens the run once, in the order it happens, every Horovod line marked
``# Horovod:`` (Horovod's own ``examples/pytorch/pytorch_mnist.py`` has the same handful):
initialise, pin the rank to its cores and GPU, scale the LR, wrap the optimizer, broadcast rank
0's state.  The shard is the library's (:meth:`ringtrain.training.fixed_loop.FixedLoop.index_batches`).
After that it owns what needs PyTorch: the step, the loss sums, the finiteness check,
BatchNorm's buffers, evaluation, checkpoints, the checksums.
"""

from __future__ import annotations

import argparse
import contextlib

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain import optimizer_spec
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.output.progress import Loss
from ringtrain.strategies.ring import options as ring_options
from ringtrain.training import startup as startup_checks
from ringtrain.training.run import FrameworkRun, RunIdentity, StepTag
from ringtrain.training.world import World
from torch_models import checkpoints, optimizers, sharded, startup
from torch_models.collectives import COLLECTIVES, VERSIONS, average_buffers
from torch_models.evaluation import FiniteWatch, parameters
from torch_models.model import build


def fused_sgd(model: torch.nn.Module, device: torch.device) -> bool:
    """SGD's (and Adam's, AdamW's) fused kernel (one launch per step) where it applies: a GPU,
    floating-point weights and no sparse gradients.  PyTorch's default there, the foreach path,
    launches several kernels and costs more Python per step, and the CNN's GPU step is bound by
    the CPU that issues it (docs/gpu.md).  On a CPU the default stays: the CPU tests compare
    numbers to the last digit."""
    if device.type != "cuda":
        return False
    sparse = any(getattr(m, "sparse", False) is True for m in model.modules())
    return not sparse and all(p.is_cuda and p.is_floating_point() for p in model.parameters())


def keep_fused_amp_step(optimizer: torch.optim.Optimizer) -> None:
    """After ``hvd.DistributedOptimizer``: SGD(fused=True) tells GradScaler (--amp) that its kernel
    skips a step whose gradients are not finite by itself, with no wait for the GPU (the foreach
    path reads GradScaler's flag on the host every step).  DistributedOptimizer rebuilds the
    optimizer from its param groups alone and loses that; say it again."""
    if any(group.get("fused") for group in optimizer.param_groups):
        optimizer._step_supports_amp_scaling = True


class TorchModelRun(FrameworkRun):
    """A PyTorch rank that holds the whole model: what the ring (:class:`TorchRun`) and the
    parameter servers (:class:`torch_models.ps.TorchPSRun`) share once the run is open: the
    batches, the loss sums, the finiteness check, BatchNorm's buffers, evaluation, checkpoints,
    the checksums.  The strategy's constructor calls :meth:`open_model`, then adds its optimizer."""

    fused: bool | None = None  # SGD's fused kernel (a GPU; see fused_sgd), else PyTorch's default
    optimizer: torch.optim.Optimizer | None = None

    def open_model(self, args: argparse.Namespace, *, check_world, elastic: bool = False) -> None:
        """The framework's start-up (:func:`torch_models.startup.open_rank`), then the model,
        seeded per rank, the run's identity and the output folders' check.  ``elastic``: a worker
        of an elastic job, which issues no collective while it opens: rank 0 alone checks the
        folders."""
        self.args, k = args, args.backward_passes_per_step
        rank = startup.open_rank(args, check_world=check_world, elastic=elastic)
        self.world, self.device, self.data, self.tools = rank.world, rank.device, rank.data, rank.tools
        # Different seeds per rank on purpose: the broadcast, not luck, makes ranks agree.
        torch.manual_seed(args.seed + self.world.rank)
        self.model = build(args.model, self.data.info, args.dropout).to(self.device)  # checked
        self.identity = RunIdentity.of(args, "torch", VERSIONS, self.data.info,
                                       sum(p.numel() for p in self.model.parameters()))
        if not elastic or self.world.rank == 0:
            startup_checks.check_output_folders(None if elastic else self.world, args,
                                                self.identity.param_count)
        # On a GPU, reading the weights' finiteness at once each step would stall the GPU's queue
        # (an elastic job reads it at once: a commit between two steps must hold finite weights).
        self.finite = FiniteWatch(self.model, lag=self.device.type == "cuda" and not elastic)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        self.micro = args.batch_size if k > 1 else None

    def batches(self, steps):
        # Once per epoch, not per step (19 us of the CNN's GPU step, bound by the CPU): only the
        # evaluation between epochs switches the model to eval mode.
        self.model.train()
        return self.data.epoch(steps)

    def take_loss_sum(self) -> float:
        total = float(self.loss_sum)
        self.loss_sum.zero_()
        return total

    def diverged(self, tag: StepTag) -> StepTag | None:
        return self.finite.step(tag)

    def flush_diverged(self) -> StepTag | None:
        return self.finite.flush()

    @property
    def problem(self) -> str | None:
        return self.data.problem

    def sync_buffers(self) -> None:
        average_buffers(self.model)

    def eval_sums(self) -> list[float]:
        return self.data.eval_sums(self.model, self.world.rank, self.world.size)

    def save(self, epoch: int) -> None:
        checkpoints.save(self.args.checkpoint_dir, epoch, self.model, self.optimizer,
                         self.identity, self.args)

    def restore(self) -> int:
        epoch = checkpoints.restore(self.args.checkpoint_dir, self.model, self.optimizer,
                                    self.identity, self.args.optimizer)
        for group in self.optimizer.param_groups:  # the checkpoint's groups say where it was written
            if "fused" in group:  # (an optimizer without a fused kernel has no such option)
                group["fused"] = self.fused
        return epoch

    def parameters(self) -> list[np.ndarray]:
        return parameters(self.model)


class TorchRun(TorchModelRun):
    """One rank's PyTorch run on the ring.  ``elastic``: a worker of an elastic job (no collective
    while it opens; Horovod's elastic state, not a broadcast here, hands rank 0's weights to
    everyone)."""

    def __init__(self, args: argparse.Namespace, *, elastic: bool = False) -> None:
        self.open_model(args, check_world=ring_options.check_world, elastic=elastic)
        # Horovod: its timeline (--timeline-out) records from here on, written by rank 0.
        self.tools.start(self.world.rank, hvd)
        # Horovod: scale the learning rate with the number of workers (warm-up and decay per step).
        lr = self.target_lr if not elastic else args.base_lr  # elastic: set per step, per world
        self.fused = fused_sgd(self.model, self.device) or None
        self.sharded = args.shard_optimizer  # ZeRO stage 1: state for this rank's slice only
        if self.sharded:
            self.optimizer = sharded.ShardedOptimizer(args, self.model, lr, self.fused, hvd,
                                                      args.clip_grad_norm)
            # The weights now live in the flat buffer: the finiteness watch held detached
            # tensors of their old storage (kept alive, and no longer the trained weights).
            self.finite = FiniteWatch(self.model, lag=self.device.type == "cuda")
            self.start_epoch = startup_checks.resume_epoch(self.world, args, self.restore)
            # Horovod: broadcast rank 0's weights (views of the flat buffer, written in place),
            # then hand out rank 0's restored optimizer state, each rank keeping its slice.
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            self.optimizer.scatter_state()
        else:
            self._unsharded_optimizer(args, lr, elastic)
        self.scaler = torch.amp.GradScaler("cuda") if args.amp else None
        self.clip, self.bf16 = args.clip_grad_norm, args.precision == "bf16"
        # (autocast's context, even disabled, costs 12 us of Python a step: only when asked for)
        self.autocast = (lambda: torch.autocast("cuda")) if args.amp else (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if self.bf16
            else contextlib.nullcontext)

    def _unsharded_optimizer(self, args: argparse.Namespace, lr: float, elastic: bool) -> None:
        """Horovod's DistributedOptimizer over the chosen optimizer, resumed and broadcast."""
        optimizer = optimizers.build(args, self.model, lr, self.fused)  # --optimizer, checked
        # Horovod: wrap the optimizer: step() averages the gradients over all ranks (ring allreduce).
        self.optimizer = optimizers.wrap(args.optimizer, lambda: hvd.DistributedOptimizer(
            optimizer, named_parameters=self.model.named_parameters(),
            **distributed_optimizer_options(args, hvd)))
        keep_fused_amp_step(self.optimizer)
        if not optimizer_spec.plain_sgd(args):  # its state, before the broadcast would step for it
            optimizers.make_state(self.optimizer, args.optimizer in optimizer_spec.BUILTIN)
        # Resume into the wrapped optimizer: DistributedOptimizer builds a new optimizer from the
        # param groups alone, so state loaded before wrapping (the momentum buffers) would be lost.
        if elastic:  # the first sync hands rank 0's restored state to all
            self.start_epoch = self.restore() if args.resume and self.world.rank == 0 else 0
        else:
            self.start_epoch = startup_checks.resume_epoch(self.world, args, self.restore)
            # Horovod: broadcast rank 0's weights and optimizer state (fresh or resumed) to every rank.
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(self.optimizer, root_rank=0)

    @property
    def writes_checkpoints(self) -> bool:
        """--shard-optimizer: every rank, each gathering its slice of the state for rank 0's file
        (which alone writes it, :meth:`save`); else rank 0."""
        return self.sharded or self.world.rank == 0

    def save(self, epoch: int) -> None:
        if not self.sharded:
            super().save(epoch)
            return
        whole = self.optimizer.state_dict()  # a collective: the unsharded file's format
        if self.world.rank == 0:
            checkpoints.save(self.args.checkpoint_dir, epoch, self.model, self.optimizer,
                             self.identity, self.args, optimizer_state=whole)

    def describe(self) -> list[str]:
        """Under the banner: the update, when it is not the default SGD's."""
        line = optimizer_spec.describe(
            self.args, optimizer_spec.cpu_has_bf16() if self.device.type == "cpu" else None)
        return [line] if line else []

    def new_world(self) -> World:
        """After an elastic re-form: this rank's new :class:`World`."""
        self.world = World(hvd, COLLECTIVES)
        return self.world

    # --- one optimizer step ---------------------------------------------------------------------

    def step(self, batch, lr: float) -> tuple[Loss, int]:
        x_all, y_all = batch
        model, optimizer, scaler = self.model, self.optimizer, self.scaler
        k = self.args.backward_passes_per_step
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        losses = []
        for micro in range(k):
            x, y = (x_all, y_all) if k == 1 else (x_all[micro * self.micro:][:self.micro],
                                                  y_all[micro * self.micro:][:self.micro])
            with self.autocast():  # --amp: float16; --precision bf16: bfloat16; else nothing
                logits = model(x)
                # bfloat16 logits, 8 bits of mantissa, would round the loss: it is float32's
                loss = F.cross_entropy(logits.float() if self.bf16 else logits, y)
            # Sums stay on the device: reading a GPU value every step would stall the GPU.  One
            # kernel per batch: on a GPU the small CNN's step is bound by kernel launches.
            value = loss.detach()
            self.loss_sum.add_(value, alpha=len(y))
            losses.append((value, len(y)))
            scaled = loss / k if k > 1 else loss
            if scaler is not None:
                scaler.scale(scaled).backward()
            else:
                scaled.backward()
        if self.sharded:  # reduce-scatter, clip, this rank's slice, allgather
            optimizer.step()
        elif scaler is not None or self.clip is not None:
            # Horovod's recipe for work on the averaged gradients (its AMP example): allreduce
            # first, then unscale (--amp) and clip the global norm, then step without a 2nd sync.
            optimizer.synchronize()
            if scaler is not None:
                scaler.unscale_(optimizer)
            if self.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), self.clip)
            with optimizer.skip_synchronize():
                if scaler is not None:
                    scaler.step(optimizer)
                else:
                    optimizer.step()
            if scaler is not None:
                scaler.update()
        else:
            optimizer.step()
        n = len(y_all)
        # This rank's mean loss of the step, read (a wait for the GPU) only when shown.
        return (lambda: sum(float(v) * m for v, m in losses) / n), n
