"""The elastic pipeline on PyTorch (``--elastic --pipeline-stages S``): a pipeline that keeps
training while workers leave and join, on Horovod's global collectives alone (no process sets, no
MPI: docs/pipeline.md, "Elastic pipeline"; the engine is
:mod:`ringtrain.strategies.pipeline.lockstep`, the loop :mod:`ringtrain.strategies.pipeline.elastic`).

Every rank builds every stage's layers and optimizer (the whole model, seeded with ``--seed``:
the model one process builds), so that after a re-form it can take any stage and can take part in
any stage's broadcast; it trains only its own.  :class:`PipelineState` is Horovod's elastic
``State`` for it: a commit keeps a copy of the rank's stage (weights, optimizer state) and the plain
attributes; a rollback puts them back; every world starts with :meth:`TorchElasticPipeline.reform`,
which hands each stage from its lowest holder at the newest commit to every rank.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain import optimizer_spec
from ringtrain.output.summary import Summary
from ringtrain.runtime import threads_per_rank
from ringtrain.strategies.pipeline import elastic as loop
from ringtrain.strategies.pipeline import lockstep
from ringtrain.training import startup as startup_checks
from ringtrain.training.run import RunIdentity
from ringtrain.training.world import World, state_broadcast
from torch_models import checkpoints, optimizers, stages, startup
from torch_models.collectives import COLLECTIVES, VERSIONS
from torch_models.evaluation import parameters, weights_finite


class TorchComm:
    """:class:`ringtrain.strategies.pipeline.lockstep.Comm` on ``horovod.torch``: the whole
    world's collectives, NumPy in and out (CPU tensors over the arrays' memory)."""

    def alltoall(self, data: np.ndarray, splits, name: str) -> tuple[np.ndarray, list[int]]:
        # Horovod: one alltoall, a split (bytes) per destination rank; with splits given it also
        # returns the bytes received from each rank.
        out = hvd.alltoall(torch.from_numpy(data), splits=torch.tensor(list(splits),
                                                                       dtype=torch.int32),
                           name=name)
        received, got = out if isinstance(out, tuple) else (out, None)
        if got is None:
            raise RuntimeError("this Horovod's alltoall does not return the received splits")
        return received.numpy(), [int(n) for n in got.tolist()]

    def allreduce_sum(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allreduce(torch.from_numpy(array), op=hvd.Sum, name=name).numpy()

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        return hvd.broadcast(torch.from_numpy(array), root_rank=root, name=name).numpy()

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(torch.from_numpy(array), name=name).numpy()


class TorchElasticPipeline:
    """One rank of the elastic pipeline on PyTorch (the loop's
    :class:`ringtrain.strategies.pipeline.elastic.ElasticStages`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # Horovod: initialise (Gloo, under horovodrun's elastic driver; no process sets), pin,
        # open the data: the start-up every PyTorch run shares, without collectives.
        rank = startup.open_rank(args, check_world=lambda a, n: None, elastic=True)
        self.world, self.device, self.data = rank.world, rank.device, rank.data
        self.stage_count = args.pipeline_stages
        self.micro = args.batch_size // args.microbatches
        # Every stage, seeded with --seed (the model one process builds): any rank can take any
        # stage after a re-form, and the broadcasts need every stage's shapes on every rank.
        torch.manual_seed(args.seed)
        split = stages.build(args.model, self.data.info, args.dropout, self.stage_count)
        self.modules = [m.to(self.device) for m in split.modules]
        self.stages, self.cuts = split.stages, split.cuts
        self.identity = RunIdentity.of(args, "torch", VERSIONS, self.data.info, split.param_count,
                                       strategy="pipeline")
        self.n_train = self.identity.data.train_size
        if self.world.rank == 0:
            startup_checks.check_output_folders(None, args, self.identity.param_count)
        # --optimizer per stage, at the base LR (the loop sets each step's LR for this world's R).
        self.optimizers = [optimizers.build(args, m, args.base_lr, fused=None) for m in self.modules]
        for module, opt in zip(self.modules, self.optimizers, strict=True):
            if not optimizer_spec.plain_sgd(args):
                optimizers.make_state(opt, args.optimizer in optimizer_spec.BUILTIN)
            elif args.momentum:  # its momentum exists before any step: broadcast like weights
                for p in module.parameters():
                    opt.state[p]["momentum_buffer"] = torch.zeros_like(p)
        self.sizes = [sum(p.numel() for p in m.parameters()) for m in self.modules]
        self.buffer_sizes = [sum(b.numel() for b in m.buffers() if b.is_floating_point())
                             for m in self.modules]
        self.comm = TorchComm()
        self.layout = lockstep.Layout(self.stage_count, self.world.size, self.world.rank)
        self.loss_total = torch.zeros((), dtype=torch.float64, device=self.device)

    # --- the state a commit keeps, and what a re-form hands over ---------------------------------

    def snapshot(self, s: int) -> dict[str, Any]:
        return {"model": {k: v.detach().clone() for k, v in self.modules[s].state_dict().items()},
                "optimizer": copy.deepcopy(self.optimizers[s].state_dict())}

    def load_snapshot(self, s: int, snap: dict[str, Any]) -> None:
        self.modules[s].load_state_dict(snap["model"])
        self.optimizers[s].load_state_dict(copy.deepcopy(snap["optimizer"]))

    def stage_tensors(self, s: int) -> dict[str, torch.Tensor]:
        """Stage ``s``'s weights, buffers and optimizer tensors, by name (the same on every rank)."""
        module, opt = self.modules[s], self.optimizers[s]
        tensors = dict(module.state_dict())
        for name, p in module.named_parameters():
            for key, value in opt.state[p].items():
                if torch.is_tensor(value):
                    tensors[f"optimizer.{key}.{name}"] = value
        return tensors

    def reform(self, state: loop.PipelineState) -> None:
        """At the start of every world: this rank's new place; the plain state from the lowest
        rank at the newest commit; each stage's weights and optimizer state from its lowest
        holder at that commit, to every rank (all ranks take part in each stage's broadcast,
        non-holders receiving into their own copy of the stage)."""
        self.world = World(hvd, COLLECTIVES)  # Horovod: this world's rank and size
        lockstep.check_world(self.stage_count, self.world.size)
        self.layout = lockstep.Layout(self.stage_count, self.world.size, self.world.rank)
        plain, sources, newest = lockstep.handover(self.comm, self.world.rank, self.stage_count,
                                                   (state.held_stage, state.commits), state.plain())
        state.set_plain(plain)
        state.commits = newest
        for s, src in enumerate(sources):
            # Horovod: broadcast stage s from the rank that held it at the newest commit.
            handles = [hvd.broadcast_async_(t, root_rank=src, name=f"pipeline.elastic.s{s}.{name}")
                       for name, t in self.stage_tensors(s).items()]
            for handle in handles:
                hvd.synchronize(handle)
        state.keep()  # the stage this rank now holds is the newest commit's
        state._plain = state.plain()

    # --- one step ---------------------------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module | None:
        s = self.layout.stage
        return None if s is None else self.modules[s]

    def batches(self, steps):
        if self.layout.first or self.layout.last:
            yield from self.data.epoch(steps)
        else:
            for _ in steps:
                yield None

    def step(self, data, rows: list[int], lr: float) -> tuple[float, bool]:
        layout = self.layout
        s = layout.stage
        if s is None:  # a spare: every collective, nothing computed
            lockstep.spare_step(layout, self.comm, rows, self.sizes)
            return 0.0, True
        module, opt = self.modules[s], self.optimizers[s]
        for group in opt.param_groups:
            group["lr"] = lr
        opt.zero_grad()
        module.train()
        x, y = data if data is not None else (None, None)
        self.inputs = torch.split(x, rows) if layout.first else None
        self.labels = torch.split(y, rows) if layout.last else None
        self.rows_total = sum(rows)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.loss_total.zero_()
        lockstep.train_step(layout, self.comm, self, rows, len(rows),
                            self.cuts[s - 1] if not layout.first else None,
                            self.cuts[s] if not layout.last else None)
        params = list(module.parameters())
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params]).detach().to("cpu", torch.float64).numpy()
        # Horovod: the stage's mean gradient over its replicas (one allreduce over every rank).
        mean = lockstep.average_stage(self.comm, layout, self.sizes, flat, lockstep.GRADS)
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                value = torch.from_numpy(mean[offset:offset + n]).reshape(p.shape)
                p.grad = value.to(p.device, p.dtype)
                offset += n
        opt.step()
        return float(self.loss_total), weights_finite(params)

    def forward(self, m: int, x):
        layout = self.layout
        inp = self.inputs[m] if layout.first else torch.from_numpy(x).to(self.device).requires_grad_()
        out = self.module(inp)
        if layout.last:
            total = F.cross_entropy(out, self.labels[m], reduction="sum")
            self.loss_total.add_(total.detach())
            # each micro-batch's loss over the step's rows: the gradients add up to the step's mean
            self.saved[m] = (inp, total / self.rows_total)
            return None
        self.saved[m] = (inp, out)
        return out.detach().cpu().numpy()

    def backward(self, m: int, grad):
        inp, kept = self.saved.pop(m)
        kept.backward(None if self.layout.last else torch.from_numpy(grad).to(self.device))
        return None if self.layout.first else inp.grad.detach().cpu().numpy()

    # --- the epoch's end ------------------------------------------------------------------------

    def sync_buffers(self) -> None:
        """BatchNorm's running statistics averaged over the stage's replicas (one allreduce of
        every stage's buffers over every rank, as the gradients)."""
        if not any(self.buffer_sizes):
            return
        module = self.module
        mine = None
        if module is not None:
            bufs = [b for b in module.buffers() if b.is_floating_point()]
            mine = (torch.cat([b.reshape(-1) for b in bufs]).to("cpu", torch.float64).numpy()
                    if bufs else np.zeros(0))
        mean = lockstep.average_stage(self.comm, self.layout, self.buffer_sizes, mine,
                                      "pipeline.elastic.buffers")
        if module is not None:
            offset = 0
            with torch.no_grad():
                for b in (b for b in module.buffers() if b.is_floating_point()):
                    b.copy_(torch.from_numpy(mean[offset:offset + b.numel()]).reshape(b.shape))
                    offset += b.numel()

    @property
    def problem(self) -> str | None:
        """The first data problem this rank's data met (a stage that reads the data), or None."""
        return self.data.problem

    def eval_sums(self) -> list[float]:
        """This rank's test sums: the last stage's (loss, correct, count, problems), zeros
        elsewhere.  The first stage reads its replica's test inputs (the data's own evaluation,
        with a recorder for a model), the stages run them forward in lockstep ticks, the last
        stage replays the logits to the data's evaluation, which reads the labels."""
        layout, info = self.layout, self.data.info
        replica, replicas = layout.replica or 0, layout.replicas
        inputs: list[torch.Tensor] = []
        if layout.first:
            self.data.eval_sums(_Recorder(inputs, info.num_classes), replica, replicas)
        counts = self.world.gather([len(x) for x in inputs] if layout.first else None,
                                   "pipeline.elastic.eval_rows")
        rows = counts[layout.rank_of(0, replica)] if not layout.spare else []
        most = max(len(counts[layout.rank_of(0, r)]) for r in range(replicas))
        module = self.module
        if module is not None:
            module.eval()

        def compute(m: int, x):
            with torch.no_grad():
                out = module(inputs[m] if layout.first else torch.from_numpy(x).to(self.device))
            return out if layout.last else out.cpu().numpy()

        s = layout.stage
        logits = lockstep.forward_only(
            layout, self.comm, compute, rows, most,
            self.cuts[s - 1] if s is not None and not layout.first else None,
            self.cuts[s] if s is not None and not layout.last else None, "pipeline.elastic.eval")
        if not layout.last:
            return [0.0, 0.0, 0.0, 0.0]
        return self.data.eval_sums(_Replay(logits), replica, replicas)

    def save(self, epoch: int) -> None:
        s = self.layout.stage
        checkpoints.save(self.args.checkpoint_dir, epoch, self.modules[s], self.optimizers[s],
                         self.identity, self.args,
                         {**self.stages[s].record(), "stages": self.stage_count})

    def parameters(self) -> list[np.ndarray]:
        return [] if self.module is None else parameters(self.module)

    # --- what the run says about itself -----------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        a, layout = self.args, self.layout
        return {"stages": layout.stages, "replicas": layout.replicas, "elastic": True,
                "spares": layout.size - layout.replicas * layout.stages,
                "schedule": "gpipe (lockstep)", "microbatches": a.microbatches,
                "microbatch_size": self.micro, "split": [s.record() for s in self.stages]}

    def describe(self) -> list[str]:
        f = self.facts()
        return [f"elastic pipeline: {f['stages']} stages, rank = replica x {f['stages']} + "
                f"stage, ranks beyond R x S spare; GPipe in lockstep ticks (one alltoall per "
                f"tick over every rank), {f['microbatches']} micro-batches of "
                f"{f['microbatch_size']}; each stage's gradients averaged by one allreduce of "
                f"the whole model's size over every rank",
                *(s.line() for s in self.stages)]


class _Recorder:
    """A stand-in model for the data's evaluation on the first stage: keeps each test batch's
    inputs, returns zero logits (whose sums are dropped)."""

    def __init__(self, inputs: list, classes: int) -> None:
        self.inputs, self.classes = inputs, classes

    def eval(self) -> None:
        pass

    def __call__(self, x):
        self.inputs.append(x)
        return torch.zeros(len(x), self.classes, device=x.device)


class _Replay:
    """A stand-in model for the data's evaluation on the last stage: the logits the pipeline
    computed for the same batches, in the same order."""

    def __init__(self, logits: list) -> None:
        self.logits = iter(logits)

    def eval(self) -> None:
        pass

    def __call__(self, x):
        out = next(self.logits)
        if len(out) != len(x):
            raise RuntimeError(f"evaluation replay: {len(out)} logits for a batch of {len(x)}")
        return out


def train(args: argparse.Namespace) -> Summary:
    run = TorchElasticPipeline(args)
    # Horovod: the elastic state: the rank's stage and the plain attributes, committed and rolled
    # back; its commits check for host updates with a broadcast of plain data.
    state = loop.PipelineState(run, bcast_object=state_broadcast(COLLECTIVES, hvd.rank),
                               get_rank=hvd.rank)
    # Horovod: after a re-form, this host's cores split among its ranks of the new world.
    set_threads = lambda: torch.set_num_threads(threads_per_rank(hvd.local_size()))  # noqa: E731
    state.register_reset_callbacks([set_threads])

    # Horovod: run the loop elastically: re-run it in every re-formed world, from the last commit.
    @hvd.elastic.run
    def train_world(state) -> Summary:
        run.reform(state)  # each world: its layout; every stage from a rank that held it
        return loop.train_world(state, run)

    return train_world(state)
