"""``--strategy ps`` on PyTorch: the framework's half of a parameter-server run, and its job.

:class:`TorchPSRun` opens as every PyTorch run does (:func:`torch_models.startup.open_rank`:
initialise, pin, the data; then the whole model and the checks,
:meth:`~torch_models.run.TorchModelRun.open_model`), without the ring's recipe: no
``DistributedOptimizer``, no broadcast.  MPI is initialised by mpi4py first
(:func:`ringtrain.strategies.ps.transport.start`), Horovod runs the start-up's collectives and is
shut down once the run is open; server 0 (rank 0) keeps the ring's optimizer
(:func:`torch_models.optimizers.build`: ``--optimizer``, ``--weight-decay``) only to write and
read checkpoints in the ring's format.  What the engine asks of PyTorch: the trainable parameters
as one flat float32 vector and back, one step's gradient as one (``--precision bf16``: its
forward under bfloat16 autocast, as the ring's, the weights and the gradient float32), and the
optimizer's state under the servers' names (:data:`STATE_KEYS`: ``momentum_buffer`` is the
``velocity`` of the ``torch`` rule, ``v = mu v + g``; Adam's moments; RMSprop's square average)
with its step count.
"""

from __future__ import annotations

import argparse

import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain import optimizer_spec
from ringtrain.errors import UserError
from ringtrain.strategies.ps import options as ps_options
from ringtrain.strategies.ps.run import ParameterServerRun
from ringtrain.training import startup
from torch_models import optimizers
from torch_models.run import TorchModelRun

# the servers' names of the optimizer's state (ringtrain.strategies.ps.engine.state_names) ->
# torch.optim's keys
STATE_KEYS = {"velocity": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
              "square_avg": "square_avg"}


class TorchPSRun(ParameterServerRun, TorchModelRun):
    """The parameter servers' framework-free half (:class:`ParameterServerRun`) with a PyTorch
    rank that holds the whole model (:class:`~torch_models.run.TorchModelRun`)."""

    momentum_rule = "torch"

    def __init__(self, args: argparse.Namespace) -> None:
        self.open_run(hvd, lambda: self.open_model(args, check_world=ps_options.check_world),
                      self.open_optimizer)

    def open_optimizer(self) -> None:
        """Server 0's optimizer, for checkpoints only (the servers update their slices), and the
        resume on rank 0; no wrapping, no broadcast."""
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        odd = sorted({str(p.dtype) for p in self.trained} - {"torch.float32"})
        if odd:
            raise UserError(f"--strategy ps keeps the parameters as float32, and this model has "
                            f"{', '.join(odd)} ones; use float32 parameters or the ring")
        self.optimizer = None
        if self.world.rank == 0:
            if optimizer_spec.plain_sgd(self.args):  # the optimizer this run always kept
                self.optimizer = torch.optim.SGD(self.trained, lr=self.target_lr,
                                                 momentum=self.args.momentum)
            else:  # the ring's, so that its checkpoints resume either way
                self.optimizer = optimizers.build(self.args, self.model, self.target_lr, None)
        self.start_epoch = startup.resume_epoch(self.world, self.args, self.restore)

    # --- the flat vector ----------------------------------------------------------------------

    def get_flat(self) -> np.ndarray:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1) for p in self.trained]).cpu().numpy().copy()

    def set_flat(self, flat: np.ndarray) -> None:
        source = torch.from_numpy(flat).to(self.device)
        start = 0
        with torch.no_grad():
            for p in self.trained:
                p.copy_(source[start:start + p.numel()].view_as(p))
                start += p.numel()

    def flat_gradient(self, batch) -> tuple[np.ndarray, float, int]:
        """The ring's step (``TorchRun.step``) up to the allreduce: K micro-batches, each loss
        weighted 1/K, their gradients summed by backward."""
        x_all, y_all = batch
        k, model = self.args.backward_passes_per_step, self.model
        model.train()
        for p in self.trained:
            p.grad = None
        total = 0.0
        for micro in range(k):
            x, y = (x_all, y_all) if k == 1 else (x_all[micro * self.micro:][:self.micro],
                                                  y_all[micro * self.micro:][:self.micro])
            if self.args.precision == "bf16":  # bfloat16 compute, float32 weights (the ring's)
                with torch.autocast(self.device.type, dtype=torch.bfloat16):
                    logits = model(x)
                loss = F.cross_entropy(logits.float(), y)
            else:
                loss = F.cross_entropy(model(x), y)
            self.loss_sum.add_(loss.detach(), alpha=len(y))
            total += float(loss.detach()) * len(y)
            (loss / k if k > 1 else loss).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in self.trained]).cpu().numpy()
        return grad, total / len(y_all), len(y_all)

    def get_state(self) -> tuple[dict[str, np.ndarray], int]:
        state = self.optimizer.state
        arrays = {}
        for name in self.state_names():
            key = STATE_KEYS[name]
            arrays[name] = torch.cat([state[p][key].reshape(-1).float().cpu()
                                      if state[p].get(key) is not None else torch.zeros(p.numel())
                                      for p in self.trained]).numpy().copy()
        first = state[self.trained[0]] if self.trained else {}
        return arrays, int(float(first.get("step", 0)))

    def set_state(self, arrays: dict[str, np.ndarray], count: int, steps: int, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        counted = self.args.optimizer != "sgd"  # Adam's and RMSprop's state hold their step
        start = 0
        for p in self.trained:
            entry = self.optimizer.state[p]
            for name, flat in arrays.items():
                entry[STATE_KEYS[name]] = torch.from_numpy(
                    flat[start:start + p.numel()].copy()).view_as(p).to(p.device)
            if counted:
                entry["step"] = torch.tensor(float(count), dtype=torch.float32)
            start += p.numel()

    def buffer_values(self) -> np.ndarray:
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        if not buffers:
            return np.zeros(0)
        return torch.cat([b.detach().reshape(-1).double() for b in buffers]).cpu().numpy()

    def set_buffers(self, flat: np.ndarray) -> None:
        start = 0
        with torch.no_grad():
            for b in (b for b in self.model.buffers() if b.is_floating_point()):
                b.copy_(torch.from_numpy(flat[start:start + b.numel()]).view_as(b))
                start += b.numel()

