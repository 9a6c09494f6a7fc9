"""Model parallelism on PyTorch through ``horovod.torch``: a pipeline of S stages x R replicas
(``--pipeline-stages S``), the fixed-size job.

:class:`TorchPipelineRun` opens the run, every Horovod line marked ``# Horovod:``: Horovod is
initialised with one process set per stage (the ranks holding the same layers, one per replica),
the stage's optimizer is Horovod's ``DistributedOptimizer`` restricted to that set (its fusion,
``--fp16-allreduce``, ``--gradient-predivide-factor`` as in a data-parallel run; it allreduces a
gradient once all M x K micro-batches' backward passes have added to it), and the stage's first
replica broadcasts its weights and momentum within the set.  With ``--checkpoint-activations`` a
stage keeps only each micro-batch's input and computes its forward again in the backward
(:func:`recompute`: the same dropout masks, BatchNorm's running statistics updated once).
Activations and their gradients travel between a replica's stages over MPI
(:mod:`ringtrain.strategies.pipeline.transport`, which says why not
``torch.distributed.pipelining``); the schedule, metrics, checkpoints and the rest are the
shared :class:`~ringtrain.strategies.pipeline.run.PipelineRun`'s.  The shared loop
(:class:`~ringtrain.training.fixed_loop.FixedLoop`) trains it.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain import optimizer_spec
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.strategies.pipeline import options as pipeline_options
from ringtrain.strategies.pipeline import run as pipeline
from ringtrain.strategies.pipeline import timing
from ringtrain.strategies.pipeline.engine import BF16
from ringtrain.strategies.pipeline.transport import Link
from ringtrain.training import startup as startup_checks
from ringtrain.training.run import RunIdentity
from torch_models import checkpoints, optimizers, stages, startup
from torch_models.collectives import VERSIONS, average_buffers
from torch_models.evaluation import parameters, weights_finite


class TorchPipelineRun(pipeline.PipelineRun):
    """One rank's stage of one replica."""

    checkpoints = checkpoints
    # --precision fp32's compute, until __init__ reads the flag (a run assembled around a stage,
    # as tests/test_pipeline_recompute.py makes, computes as the default)
    bf16 = False
    autocast = contextlib.nullcontext

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, k = args, args.backward_passes_per_step
        sets = pipeline.before_init(args, hvd)  # MPI up (mpi4py), S divides the world
        # Horovod: initialise with one process set per stage (its replicas' gradient allreduce),
        # pin, open the data (read by the R replicas): the start-up every PyTorch run shares.
        rank = startup.open_rank(args, check_world=pipeline_options.check_world, process_sets=sets,
                                 data_width=lambda world: world.size // args.pipeline_stages)
        self.world, self.device, self.data = rank.world, rank.device, rank.data
        self.locate(hvd, sets)
        self.link = Link.open(self.world.rank, args.stall_timeout)
        self.open_pipeline(args)
        # Seeded per replica: replica 0's stages together are the model one process builds with
        # --seed; other replicas draw other weights on purpose, the broadcast makes them agree.
        # Only this rank's stage gets weights where the model allows (torch_models/stages.py).
        torch.manual_seed(args.seed + self.place.replica)
        # --partition time: rank 0 times the layers, every rank splits on its figures.
        split = startup_checks.every_rank(self.world, lambda: stages.build(
            args.model, self.data.info, args.dropout, self.place.stages, keep=self.place.stage,
            fits=self.fits, timing=timing.for_run(self.world, args, self.micro, self.device.type)))
        self.stage = split.modules[self.keep(split.stages, split.cuts)].to(self.device)
        self.weights_built = split.built
        del split.modules  # the other stages' weights go (when built whole)
        self.identity = RunIdentity.of(args, "torch", VERSIONS, self.data.info, split.param_count,
                                       strategy="pipeline")
        startup_checks.check_output_folders(self.world, args, self.identity.param_count)

        # Horovod: scale the learning rate with the replicas (R, the data-parallel width).
        # --optimizer over the stage's parameters, by the ring's factory (its checks, the same
        # hyperparameters; the default SGD's call unchanged).  PyTorch's default kernels: the
        # fused ones the ring takes on a GPU would make a pipeline on a GPU another arithmetic
        # than its one-process reference.
        optimizer = optimizers.build(args, self.stage, self.target_lr, fused=None)
        self.passes = args.microbatches * k
        # Horovod: wrap the optimizer: step() averages the stage's gradients over its replicas
        # (the stage's process set), each once its M x K micro-batches' backward passes are in.
        self.optimizer = optimizers.wrap(args.optimizer, lambda: hvd.DistributedOptimizer(
            optimizer, named_parameters=self.stage.named_parameters(), process_set=self.stage_set,
            **{**distributed_optimizer_options(args, hvd), "backward_passes_per_step": self.passes}))
        if not optimizer_spec.plain_sgd(args):  # its state exists before the resume, the broadcast
            optimizers.make_state(self.optimizer, args.optimizer in optimizer_spec.BUILTIN)
        self.clip, self.bf16 = args.clip_grad_norm, args.precision == "bf16"
        # --precision bf16: bfloat16 compute, float32 weights and optimizer (as the ring)
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=torch.bfloat16))
                         if self.bf16 else contextlib.nullcontext)
        self.start_epoch = pipeline.resume_epoch(self.world, self.place, args, self.find, self.load)
        self.broadcast()
        self.loss_total = torch.zeros((), dtype=torch.float64, device=self.device)

    def broadcast(self) -> None:
        """The stage's weights and optimizer state from its first replica, within its set.  Plain
        SGD: its momentum (zeros before the first step: SGD's first update is then the same,
        ``0 x momentum + gradient``).  Any other optimizer: every tensor of its state (Adam's
        moments and step count, RMSprop's square average...), which :func:`optimizers.make_state`
        made as a fresh optimizer's, or the stage's checkpoint filled on the first replica.  A
        user's optimizer that keeps Python numbers in its state keeps each replica's own (the same
        on a fresh start)."""
        tensors = dict(self.stage.state_dict())
        if not optimizer_spec.plain_sgd(self.args):
            for name, p in self.stage.named_parameters():
                for key, value in self.optimizer.state[p].items():
                    if torch.is_tensor(value):
                        tensors[f"optimizer.{key}.{name}"] = value
        elif self.args.momentum:
            for name, p in self.stage.named_parameters():
                state = self.optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p)
                tensors[f"momentum.{name}"] = state["momentum_buffer"]
        # Horovod: broadcast the stage's first replica's weights and momentum within its set
        # (root_rank is a global rank, also for a process set, in Horovod 0.28.1).
        handles = [hvd.broadcast_async_(t, root_rank=self.place.stage_root, name=f"stage.{name}",
                                        process_set=self.stage_set) for name, t in tensors.items()]
        for handle in handles:
            hvd.synchronize(handle)  # Horovod: wait for the broadcasts above

    # --- one step ----------------------------------------------------------------------------------

    def stage_batches(self, steps):
        return self.data.epoch(steps)

    def begin_step(self, data, rows: list[int], lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad()
        if len(rows) != self.passes:  # a short last step: fewer micro-batches
            self.passes = len(rows)
            self.optimizer.set_backward_passes_per_step(self.passes)
        self.stage.train()
        x, y = data if data is not None else (None, None)
        self.inputs = torch.split(x, rows) if self.place.first else None
        self.labels = torch.split(y, rows) if self.place.last else None
        self.rows_total = sum(rows)
        self.saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.loss_total.zero_()

    def forward(self, m: int, x):
        if self.place.first:
            inp = self.inputs[m]
        else:
            inp = from_wire(x).to(self.device).requires_grad_()
        again = self.args.checkpoint_activations
        with torch.no_grad() if again else contextlib.nullcontext():  # again: no graph kept
            state = rng_state(self.device) if again else None
            out = self.run_stage(inp)
            total = self.loss_of(m, out) if self.place.last else None
        if self.place.last:
            self.loss_total.add_(total.detach())
        # Kept until the backward: the input, and the graph (the output; the last stage's loss)
        # or, to compute it again, the random state the forward started from.
        self.saved[m] = (inp, state if again else total / self.rows_total if self.place.last
                         else out)
        return None if self.place.last else to_wire(out)

    def run_stage(self, inp: torch.Tensor) -> torch.Tensor:
        """The stage's layers on ``inp``; under ``--precision bf16`` in autocast, and an output
        for the next stage in bfloat16 (the cut's dtype, :meth:`PipelineRun.keep`), whatever dtype
        the stage's last op computes in under autocast (the cast is part of the graph: the
        gradient that comes back in bfloat16 flows through it)."""
        with self.autocast():
            out = self.stage(inp)
        if self.bf16 and not self.place.last and out.dtype == torch.float32:
            out = out.to(torch.bfloat16)
        return out

    def backward(self, m: int, grad):
        inp, kept = self.saved.pop(m)
        grad = None if self.place.last else from_wire(grad).to(self.device)
        if not self.args.checkpoint_activations:
            kept.backward(grad)
        else:
            with buffers_kept(self.stage):  # the forward updated them; the recompute must not
                out = recompute(self.run_stage, inp, kept)
                (self.loss_of(m, out) / self.rows_total if self.place.last else out).backward(grad)
        return None if self.place.first else to_wire(inp.grad)

    def loss_of(self, m: int, logits: torch.Tensor) -> torch.Tensor:
        """The last stage's micro-batch ``m``: its examples' summed loss (divided by the step's
        rows, the M micro-batches' gradients add up to the step's mean gradient; the stage set's
        allreduce then averages the replicas).  bfloat16 logits (8 bits of mantissa) would round
        the loss: it is float32's, as on the ring."""
        return F.cross_entropy(logits.float() if self.bf16 else logits, self.labels[m],
                               reduction="sum")

    def end_step(self) -> bool:
        if self.clip is None:
            self.optimizer.step()
        else:
            # Horovod's recipe for work on averaged gradients: the stage's allreduce first, then
            # the clip by the whole model's norm, then the step without a second allreduce.
            self.optimizer.synchronize()
            grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
            squares = sum(float(torch.linalg.vector_norm(g.detach(), 2.0)) ** 2 for g in grads)
            scale = self.clip_scale(squares)
            if scale < 1.0:
                for g in grads:
                    g.detach().mul_(scale)
            with self.optimizer.skip_synchronize():
                self.optimizer.step()
        self.step_loss = float(self.loss_total)
        return weights_finite(list(self.stage.parameters()))

    def clip_factor(self, norm: float) -> float:
        """``torch.nn.utils.clip_grad_norm_``'s factor, the ring's (its 1e-6 included, so that a
        pipeline clips exactly as one process does)."""
        return min(1.0, self.clip / (norm + 1e-6))

    # --- the epoch's end and the run's -------------------------------------------------------------

    def sync_buffers(self) -> None:
        average_buffers(self.stage, self.stage_set)

    def evaluator(self, relay):
        return _StageEval(self, relay)

    def meta_of(self, state) -> dict:
        return state["meta"]

    def parameters(self) -> list[np.ndarray]:
        return parameters(self.stage)

    def stage_param_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.stage.parameters())


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a forward pass draws its dropout masks from: the CPU's, and the GPU's."""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state(device) if device.type == "cuda" else None)


def recompute(stage: torch.nn.Module, inp: torch.Tensor, state) -> torch.Tensor:
    """``--checkpoint-activations``: a micro-batch's forward pass again, with its graph, in its
    backward, from the random state of the micro-batch's forward (``state``, from
    :func:`rng_state`: the same dropout masks; the run's own random state is left as it was).
    It runs in training mode, as the forward: the caller keeps the buffers
    (:func:`buffers_kept`).

    By hand rather than ``torch.utils.checkpoint``: that one's first call imports
    ``torch._dynamo`` and with it Triton, which ends a process that has loaded TensorFlow
    (a segmentation fault; the test suite runs both frameworks in one process)."""
    cpu, gpu = state
    with torch.random.fork_rng(devices=[inp.device] if gpu is not None else []):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, inp.device)
        return stage(inp)


@contextlib.contextmanager
def buffers_kept(stage: torch.nn.Module) -> Iterator[None]:
    """The stage's buffers put back as they were, after a recompute and its backward: BatchNorm's
    running statistics and batch count, which the micro-batch's forward updated, are not updated
    a second time.  (Not before the backward: BatchNorm's backward checks that the statistics it
    saved have not changed in place.)"""
    buffers = list(stage.buffers())
    kept = [b.detach().clone() for b in buffers]
    yield
    with torch.no_grad():
        for b, k in zip(buffers, kept, strict=True):
            b.copy_(k)


class _StageEval:
    """What the data's evaluation calls as its model (``model.eval()``, then ``model(x)`` per test
    batch): the stage through the relay.  Stages before the last have no logits: they return
    zeros, whose sums :meth:`PipelineRun.eval_sums` drops."""

    def __init__(self, run: TorchPipelineRun, relay) -> None:
        self.run, self.relay = run, relay

    def eval(self) -> None:
        self.run.stage.eval()

    def compute(self, x):
        if isinstance(x, np.ndarray):
            x = from_wire(x).to(self.run.device)
        return self.run.run_stage(x)

    def __call__(self, x):
        logits = self.relay(self.compute, x, len(x), to_wire)
        if logits is None:
            return torch.zeros(len(x), self.run.data.info.num_classes, device=self.run.device)
        return logits.float() if self.run.bf16 else logits


def to_wire(t: torch.Tensor) -> np.ndarray:
    """A tensor for the next (or previous) stage, as NumPy: bfloat16, which NumPy lacks, as
    ``ml_dtypes``' bfloat16 over the same bytes (the cut's dtype; the transport sends its bits)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BF16)
    return t.numpy()


def from_wire(x: np.ndarray) -> torch.Tensor:
    """:func:`to_wire`'s inverse, without a copy."""
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)

