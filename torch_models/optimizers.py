"""The ring's PyTorch optimizer (``--optimizer``, ``--weight-decay``): built, a user's factory
checked, and its state made before the first step.

:func:`build` makes the built-in optimizers with the hyperparameters both frameworks share
(:mod:`ringtrain.optimizer_spec`), or calls the user's ``package.module:function`` as
``function(params, lr=...)`` and checks what it returns, on every rank right after
``hvd.init()``: every failure is one :class:`~ringtrain.errors.UserError` line, as for
``--model``.  :func:`wrap` turns Horovod's failure to rebuild an optimizer class into one line
too.  :func:`make_state` gives the optimizer its state before Horovod's broadcast would make it
by a step (see there).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

import torch

from ringtrain import optimizer_spec, user_code
from ringtrain.errors import UserError

_PLAIN = (str, int, float, bool, type(None))


def build(args: argparse.Namespace, model: torch.nn.Module, lr: float,
          fused: bool | None) -> torch.optim.Optimizer:
    """``--optimizer`` over ``model``'s parameters at ``lr``; ``fused``: the fused kernel (a GPU,
    see ``torch_models.run.fused_sgd``) for SGD, Adam and AdamW, else PyTorch's default."""
    spec, wd = args.optimizer, args.weight_decay
    eps, betas = optimizer_spec.EPS, optimizer_spec.BETAS
    if spec == "sgd":  # the trainers' optimizer since the first: its call unchanged
        if not wd:
            return torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum, fused=fused)
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum,
                               weight_decay=wd, fused=fused)
    if spec == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                 fused=fused)
    if spec == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                fused=fused)
    if spec == "rmsprop":  # no fused kernel
        return torch.optim.RMSprop(model.parameters(), lr=lr, alpha=optimizer_spec.RMSPROP_ALPHA,
                                   eps=eps, weight_decay=wd, momentum=args.momentum)
    return from_factory(spec, model, lr)


def from_factory(spec: str, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    """The user's ``function(params, lr=...)``: a ``torch.optim.Optimizer`` over exactly the
    model's trained parameters, whose param groups hold plain values (a checkpoint keeps them and
    is read back without running code), and that steps without a closure."""
    params = [p for p in model.parameters() if p.requires_grad]
    factory = user_code.import_function("--optimizer", spec, "returns an optimizer")
    # params positional (any name), lr among the keywords it accepts
    optimizer = user_code.call("--optimizer", spec, functools.partial(factory, params), {"lr": lr})
    if not isinstance(optimizer, torch.optim.Optimizer):
        got = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
        raise UserError(f"--optimizer {spec} returned a {got}, but --framework torch needs a "
                        f"torch.optim.Optimizer over the parameters it is given")
    if isinstance(optimizer, torch.optim.LBFGS):
        raise UserError(f"--optimizer {spec} returned an LBFGS, whose step needs a closure that "
                        f"re-evaluates the loss; the ring's step has one forward and backward")
    theirs = [p for group in optimizer.param_groups for p in group["params"]]
    if {id(p) for p in theirs} != {id(p) for p in params} or len(theirs) != len(params):
        raise UserError(f"--optimizer {spec} returned an optimizer over {len(theirs)} tensors, the "
                        f"model trains {len(params)}: build it on the params it is given, each once")
    for group in optimizer.param_groups:
        for key, value in group.items():
            if key != "params" and not _plain(value):
                raise UserError(f"--optimizer {spec}: its param groups hold {key}="
                                f"{type(value).__name__}, which a checkpoint cannot keep as plain "
                                f"data; use numbers, text, or tuples of them")
    return optimizer


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN) or (torch.is_tensor(value) and value.numel() == 1)


def wrap(spec: str, wrapper: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """``wrapper()``, Horovod's ``DistributedOptimizer``: it rebuilds the optimizer as
    ``type(optimizer)(param_groups)``, which a class needing more constructor arguments fails;
    that is one line naming ``--optimizer``."""
    try:
        return wrapper()
    except (TypeError, ValueError) as err:
        raise UserError(f"--optimizer {spec}: Horovod's DistributedOptimizer rebuilds the optimizer "
                        f"as its class called with the param groups alone, which failed: "
                        f"{type(err).__name__}: {user_code.one_line(err)}; give every other "
                        f"argument of its constructor a default") from None


def make_state(optimizer: torch.optim.Optimizer, builtin: bool) -> None:
    """Make the optimizer's state, as its first step would, without changing a weight or a count.

    Horovod's ``broadcast_optimizer_state`` (the fixed job's broadcast, and ``TorchState``'s sync
    in every world of an elastic job) makes an empty state by one step of zero gradients at the
    current LR: harmless for plain SGD, but Adam's step count then starts at 1 (its bias
    correction one step off), AdamW shrinks every weight by lr x W, and an L2 term fills the
    momentum.  Here: that step at LR 0 (so no decoupled decay, no update), the weights put back
    all the same, and the gradients cleared; a built-in optimizer's state is then zeroed, which is
    its state before the first step (PyTorch makes zeros and a count of 0 at the first step; a
    zero momentum buffer gives SGD's first update exactly), so a non-empty state is broadcast as
    it is and the first step is that of a fresh optimizer.  A user's optimizer keeps the state of
    its step at LR 0 (its own initial values may not be zeros); SGD without momentum, which keeps
    no state, gets an empty momentum buffer, so that Horovod finds a state and steps none."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_lr = [group["lr"] for group in optimizer.param_groups]
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        if hasattr(optimizer, "skip_synchronize"):  # Horovod's wrapper: its optimizer's own
            super(type(optimizer), optimizer).step()  # step, no allreduce (Horovod's way too)
        else:
            optimizer.step()
        for p, value in zip(params, kept, strict=True):
            p.copy_(value)
            p.grad = None
        for group, lr in zip(optimizer.param_groups, saved_lr, strict=True):
            group["lr"] = lr
        if builtin and not optimizer.state:  # SGD without momentum keeps none: mark it made
            for p in params:  # (what SGD's step reads, and ignores at momentum 0)
                optimizer.state[p]["momentum_buffer"] = None
        if builtin:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        value.zero_()
                    elif isinstance(value, (int, float)) and not isinstance(value, bool):
                        state[key] = type(value)(0)
