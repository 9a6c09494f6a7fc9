"""Model parallelism on PyTorch through ``horovod.torch``: a pipeline of S stages x R replicas
(``--pipeline-stages S``), the fixed-size job.

:class:`TorchPipelineRun` opens the run, every Horovod line marked ``# Horovod:``: Horovod is
initialised with one process set per stage (the ranks holding the same layers, one per replica),
the stage's optimizer is Horovod's ``DistributedOptimizer`` restricted to that set (its fusion,
``--fp16-allreduce``, ``--gradient-predivide-factor`` as in a data-parallel run; it allreduces a
gradient once all M x K micro-batches' backward passes have added to it), and the stage's first
replica broadcasts its weights and momentum within the set.  Activations and their gradients
travel between a replica's stages over MPI (:mod:`ringtrain.strategies.pipeline.transport`, which says why
not ``torch.distributed.pipelining``); the schedule, metrics, checkpoints and the rest are the
shared :class:`~ringtrain.strategies.pipeline.run.PipelineRun`'s.  The shared loop
(:class:`~ringtrain.training.fixed_loop.FixedLoop`) trains it.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.strategies.pipeline import options as pipeline_options
from ringtrain.strategies.pipeline import run as pipeline
from ringtrain.strategies.pipeline.transport import Link
from ringtrain.training import startup as startup_checks
from ringtrain.training.run import RunIdentity
from torch_models import checkpoints, stages, startup
from torch_models.collectives import VERSIONS, average_buffers
from torch_models.evaluation import parameters, weights_finite


class TorchPipelineRun(pipeline.PipelineRun):
    """One rank's stage of one replica."""

    checkpoints = checkpoints

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
        torch.manual_seed(args.seed + self.place.replica)
        split = startup_checks.every_rank(self.world, lambda: stages.build(
            args.model, self.data.info, args.dropout, self.place.stages))
        self.stage = split.modules[self.keep(split.stages, split.cuts)].to(self.device)
        del split.modules  # the other stages' weights go
        self.identity = RunIdentity.of(args, "torch", VERSIONS, self.data.info, split.param_count,
                                       strategy="pipeline")
        startup_checks.check_output_folders(self.world, args, self.identity.param_count)

        # Horovod: scale the learning rate with the replicas (R, the data-parallel width).
        optimizer = torch.optim.SGD(self.stage.parameters(), lr=self.target_lr,
                                    momentum=args.momentum)
        self.passes = args.microbatches * k
        # Horovod: wrap the optimizer: step() averages the stage's gradients over its replicas
        # (the stage's process set), each once its M x K micro-batches' backward passes are in.
        self.optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=self.stage.named_parameters(), process_set=self.stage_set,
            **{**distributed_optimizer_options(args, hvd), "backward_passes_per_step": self.passes})
        self.start_epoch = pipeline.resume_epoch(self.world, self.place, args, self.find, self.load)
        self.broadcast()
        self.loss_total = torch.zeros((), dtype=torch.float64, device=self.device)

    def broadcast(self) -> None:
        """The stage's weights and momentum (zeros before the first step: SGD's first update is
        then the same, ``0 x momentum + gradient``) from its first replica, within its set."""
        tensors = dict(self.stage.state_dict())
        if self.args.momentum:
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
            inp = torch.from_numpy(x).to(self.device).requires_grad_()
        out = self.stage(inp)
        if self.place.last:
            # The examples' summed loss over the step's rows: the M micro-batches' gradients add
            # up to the step's mean gradient (the stage set's allreduce then averages replicas).
            total = F.cross_entropy(out, self.labels[m], reduction="sum")
            self.loss_total.add_(total.detach())
            self.saved[m] = (inp, total / self.rows_total)
            return None
        self.saved[m] = (inp, out)
        return out.detach().cpu().numpy()

    def backward(self, m: int, grad):
        inp, out = self.saved.pop(m)
        if self.place.last:
            out.backward()
        else:
            out.backward(torch.from_numpy(grad).to(self.device))
        return None if self.place.first else inp.grad.cpu().numpy()

    def end_step(self) -> bool:
        self.optimizer.step()
        self.step_loss = float(self.loss_total)
        return weights_finite(list(self.stage.parameters()))

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
            x = torch.from_numpy(x).to(self.run.device)
        return self.run.stage(x)

    def __call__(self, x):
        logits = self.relay(self.compute, x, len(x), lambda t: t.cpu().numpy())
        if logits is None:
            return torch.zeros(len(x), self.run.data.info.num_classes, device=self.run.device)
        return logits

