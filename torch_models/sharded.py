"""``--shard-optimizer`` in PyTorch: ZeRO stage 1 over Horovod on the ring.

The model's parameters become views of one flat buffer (padded to a multiple of the world size
R), and their gradients views of another, so that backward accumulates straight into the flat
gradient and the update writes straight into the flat weights: no per-step copy of the whole
model.  Each step the flat gradient is reduce-scattered (``hvd.reducescatter``, averaged: Horovod
splits a tensor's first dimension evenly among the ranks when it divides), each rank updates its
1/R slice with the chosen optimizer, which holds state for that slice only (one flat shard
parameter, a view of the flat weights, whose ``.grad`` is the averaged slice), and the slices are
allgathered back.  The built-in optimizers are element-wise, so the slice's update is the
unsharded one's; ``--clip-grad-norm``'s global norm is the square root of every slice's squared
norm summed, one allreduce of a scalar.

Both collectives go in chunks of :data:`CHUNK` elements: a whole-model reduce-scatter output or
allgather result would cost a transient copy of the model, the size of the state saved.

Checkpoints hold the whole, unsharded state (:meth:`ShardedOptimizer.state_dict` gathers it on
every rank, in the format of the same optimizer over the model's parameters), so a sharded run
resumes unsharded, and at another R; :meth:`ShardedOptimizer.scatter_state` hands rank 0's
restored state out, each rank keeping its slice.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.training.world import Collectives, broadcast_plain
from torch_models import optimizers

# Elements per collective call: 16 MiB of float32, the transient buffer of a reduce-scatter or
# allgather (and R times that for the reduce-scatter's input), small beside a model worth sharding.
CHUNK = 1 << 22


def _plain(value: Any) -> Any:
    """A state or hyperparameter value as plain data: a tensor (Adam's step) as a NumPy array."""
    return value.detach().cpu().numpy() if torch.is_tensor(value) else value


def _unplain(value: Any) -> Any:
    return torch.from_numpy(value.copy()) if isinstance(value, np.ndarray) else value


def layout(numel: int, world: int) -> tuple[int, int]:
    """``(padded, shard)``: the flat length, ``numel`` rounded up to a multiple of ``world``, and
    each rank's slice of it."""
    shard = -(-numel // world)
    return shard * world, shard


class ShardedOptimizer:
    """The chosen ``--optimizer`` over this rank's slice of the model's flat weights, with the
    interface the ring's step uses (``param_groups``, ``zero_grad``, ``step``)."""

    def __init__(self, args: argparse.Namespace, model: torch.nn.Module, lr: float,
                 fused: bool | None, hvd, clip: float | None) -> None:
        self.hvd, self.clip = hvd, clip
        self.world, self.rank = hvd.size(), hvd.rank()
        # In model order, as an unsharded optimizer numbers them in its state_dict.
        self.params = list(model.parameters())
        first = self.params[0]
        self.numels = [p.numel() for p in self.params]
        self.padded, self.shard_len = layout(sum(self.numels), self.world)
        self.lo = self.rank * self.shard_len
        self.flat = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.flat_grad = torch.zeros_like(self.flat)
        offset = 0
        with torch.no_grad():
            for p, n in zip(self.params, self.numels, strict=True):
                self.flat[offset:offset + n].copy_(p.detach().reshape(-1))
                p.data = self.flat[offset:offset + n].view_as(p)  # the old storage is freed
                offset += n
        self.zero_grad()
        # A leaf over this rank's slice of the flat weights (same storage): the update lands there.
        self.shard = torch.nn.Parameter(self.flat[self.lo:self.lo + self.shard_len])
        self.shard.grad = self.flat_grad[self.lo:self.lo + self.shard_len]
        self.optimizer = optimizers.build(args, torch.nn.ParameterList([self.shard]), lr, fused)
        opts = distributed_optimizer_options(args, hvd)  # --fp16-allreduce, predivide (no Adasum)
        self.compression, f = opts["compression"], opts["gradient_predivide_factor"]
        # Horovod's own split of an average around a predivide factor (its DistributedOptimizer)
        self.scale = {"prescale_factor": 1.0 / f, "postscale_factor": f} if f != 1.0 else {}
        self.pending: dict | None = None  # rank 0's restored whole state, until scatter_state

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Zero the flat gradient in place, every parameter's ``.grad`` a view of it again (code
        that set one to None would otherwise get a fresh tensor from backward)."""
        self.flat_grad.zero_()
        offset = 0
        for p, n in zip(self.params, self.numels, strict=True):
            p.grad = self.flat_grad[offset:offset + n].view_as(p)
            offset += n

    def _chunks(self):
        for start in range(0, self.shard_len, CHUNK):
            yield start, min(CHUNK, self.shard_len - start)

    @torch.no_grad()
    def step(self) -> None:
        """Reduce-scatter the averaged gradient, clip its global norm, update this rank's slice,
        allgather the slices into every rank's flat weights."""
        hvd, S, grad = self.hvd, self.shard_len, self.flat_grad
        for start, n in self._chunks():
            # Each rank's piece [start, start+n) of its slice, in rank order: the first dimension
            # that reducescatter splits evenly, rank r receiving the average of piece r.
            pieces = torch.cat([grad[r * S + start:r * S + start + n] for r in range(self.world)])
            out = hvd.reducescatter(pieces, name=f"shard.grad.{start}", op=hvd.Average,
                                    compression=self.compression, **self.scale)
            grad[self.lo + start:self.lo + start + n].copy_(out)  # its input was copied already
        mine = self.shard.grad
        if self.clip is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient, from the sum of every slice's squares
            sq = hvd.allreduce(mine.double().pow(2).sum(), name="shard.grad_norm", op=hvd.Sum)
            coef = torch.clamp(self.clip / (sq.sqrt().to(mine.dtype) + 1e-6), max=1.0)
            mine.mul_(coef.to(mine.device))
        self.optimizer.step()
        for start, n in self._chunks():
            gathered = hvd.allgather(self.flat[self.lo + start:self.lo + start + n],
                                     name=f"shard.weights.{start}")
            for r in range(self.world):
                if r != self.rank:
                    self.flat[r * S + start:r * S + start + n].copy_(gathered[r * n:(r + 1) * n])

    # --- checkpoints: the whole state, in the unsharded optimizer's format ----------------------

    def _per_param(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out, offset = [], 0
        for p, n in zip(self.params, self.numels, strict=True):
            out.append(flat[offset:offset + n].view_as(p).clone())
            offset += n
        return out

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, gathered on every rank (a collective: every rank calls it),
        as the same optimizer over the model's parameters would give it."""
        mine = self.optimizer.state_dict()
        slot = mine["state"].get(0, {})
        per_param: list[dict[str, Any]] = [{} for _ in self.params]
        for key, value in slot.items():
            if torch.is_tensor(value) and value.numel() == self.shard_len and value.dim() == 1:
                whole = self.hvd.allgather(value.detach(), name=f"shard.state.{key}")
                for entry, t in zip(per_param, self._per_param(whole), strict=True):
                    entry[key] = t
            else:  # the step count (one per tensor unsharded) and other scalars
                for entry in per_param:
                    entry[key] = value.clone() if torch.is_tensor(value) else value
        groups = [{**g, "params": list(range(len(self.params)))} for g in mine["param_groups"]]
        return {"state": dict(enumerate(per_param)) if slot else {}, "param_groups": groups}

    def load_state_dict(self, whole: dict[str, Any]) -> None:
        """Rank 0 (which alone reads the checkpoint): keep the whole state for
        :meth:`scatter_state`, after checking that it fits this model."""
        groups, state = whole["param_groups"], whole["state"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(f"the optimizer state is of {sum(len(g['params']) for g in groups)} "
                             f"tensors in {len(groups)} groups, the model has {len(self.params)}")
        for i, entry in state.items():
            for key, value in entry.items():
                if torch.is_tensor(value) and value.dim() and value.shape != self.params[i].shape:
                    raise ValueError(f"state {i}.{key} has shape {tuple(value.shape)}, its "
                                     f"parameter {tuple(self.params[i].shape)}")
        self.pending = whole

    def _plain_comm(self) -> Collectives:
        """The broadcast of NumPy arrays that :func:`broadcast_plain` sends its JSON in, from
        this optimizer's Horovod (a fake in the tests)."""
        hvd = self.hvd

        def broadcast(array: np.ndarray, name: str) -> np.ndarray:
            return hvd.broadcast(torch.from_numpy(array), root_rank=0, name=name).numpy()

        return Collectives(sum=None, broadcast=broadcast, allgather=None)

    def scatter_state(self) -> None:
        """On every rank, after the weights' broadcast: rank 0's restored state (if any), each
        rank keeping its slice; every rank starts fresh alike when nothing was restored."""
        hvd, whole = self.hvd, self.pending
        keys = None
        if whole is not None:
            groups, state = whole["param_groups"], whole["state"]
            tensors = sorted({k for e in state.values() for k, v in e.items()
                              if torch.is_tensor(v) and v.dim()})
            first = state[min(state)] if state else {}
            scalars = {k: v for k, v in first.items() if k not in tensors}
            hyper = {k: v for k, v in groups[0].items() if k != "params"}
            keys = (tensors, scalars, hyper)
        # Plain data (ringtrain.training.wire's JSON, never a pickle): the step counts as arrays.
        if keys is not None:
            keys = (keys[0], {k: _plain(v) for k, v in keys[1].items()},
                    {k: _plain(v) for k, v in keys[2].items()})
        keys = broadcast_plain(self._plain_comm(), self.rank == 0, keys, "shard.state.keys")
        self.pending = None
        if keys is None:
            return
        tensors, scalars, hyper = keys
        slot: dict[str, Any] = {k: _unplain(v) for k, v in scalars.items()}
        hyper = {k: tuple(v) if isinstance(v, list) else _unplain(v) for k, v in hyper.items()}
        for key in tensors:
            flat = torch.zeros(self.padded, dtype=self.flat.dtype)
            if whole is not None:
                offset = 0
                for i, n in enumerate(self.numels):
                    value = whole["state"].get(i, {}).get(key)
                    if torch.is_tensor(value):
                        flat[offset:offset + n].copy_(value.reshape(-1))
                    offset += n
            flat = hvd.broadcast(flat, root_rank=0, name=f"shard.state.{key}")
            slot[key] = flat[self.lo:self.lo + self.shard_len].clone()
        self.optimizer.load_state_dict({"state": {0: slot} if slot else {},
                                        "param_groups": [{**hyper, "params": [0]}]})
