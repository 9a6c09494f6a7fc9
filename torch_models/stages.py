"""``--model`` split into pipeline stages, on the PyTorch side.

What splits: the built-in ``cnn`` and ``mlp`` (their :meth:`layers`, the same modules as a chain),
a user's builder that returns a ``torch.nn.Sequential`` (split between its children, balanced by
parameter count: :func:`ringtrain.strategies.pipeline.partition.balanced_split`), or one that returns a list
of S modules, the stages themselves.  Anything else cannot be split (a module's ``forward`` may
do anything between its children) and is one line.

The whole model is built on every rank, with the same seed on every stage of a replica, and each
rank keeps its own stage: replica 0's stages together are the model a single process builds with
``--seed``, so a pipeline starts from the same weights as a data-parallel run.  The price: the
whole model's weights exist once, briefly, on every rank; what a rank keeps, and trains with
(gradients, optimizer state, activations), is its stage's.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline.engine import Boundary
from ringtrain.strategies.pipeline.partition import Stage, stage_ranges
from torch_models.model import BUILTIN, check, instantiate, model_shape


@dataclass
class Split:
    """The stages (their modules; facts; the cuts between them, one fewer than stages)."""

    modules: list[nn.Module]
    stages: list[Stage]
    cuts: list[Boundary]
    param_count: int


def _label(name: str, module: nn.Module) -> str:
    return f"{name}:{type(module).__name__}" if name.isdigit() else name


def _params(module: nn.Module) -> tuple[int, int]:
    """(parameter count, bytes) of a module's parameters."""
    ps = list(module.parameters())
    return sum(p.numel() for p in ps), sum(p.numel() * p.element_size() for p in ps)


def _chain(spec: str, model) -> tuple[list[tuple[str, nn.Module]], bool]:
    """The model's layers and whether they are already the stages (a builder's list)."""
    if isinstance(model, (list, tuple)):
        if not all(isinstance(m, nn.Module) for m in model):
            raise UserError(f"--model {spec} returned a list holding a "
                            f"{next(type(m).__name__ for m in model if not isinstance(m, nn.Module))}"
                            f"; a list of stages must hold torch.nn.Module objects")
        return [(str(i), m) for i, m in enumerate(model)], True
    if hasattr(model, "layers") and type(model) in BUILTIN.values():
        model = model.layers()
    if isinstance(model, nn.Sequential):
        return list(model.named_children()), False
    what = f"{type(model).__module__}.{type(model).__qualname__}"
    raise UserError(f"--model {spec} returned a {what}, which --pipeline-stages cannot split (its "
                    f"forward may do anything between its layers): return a torch.nn.Sequential, "
                    f"or a list of one module per stage")


def build(spec: str, dataset, dropout: float, stages: int) -> Split:
    """The ``--model spec`` for ``dataset``, checked as a whole (one forward pass) and split."""
    shape = model_shape(dataset)
    built = instantiate(spec, dataset, dropout, (nn.Module, list, tuple),
                        "torch.nn.Module (or a list of stages)")
    layers, given = _chain(spec, built)
    whole = nn.Sequential(OrderedDict(layers))
    check(spec, whole, shape, dataset.num_classes, getattr(torch, dataset.input_dtype))
    sizes = _output_shapes(whole, shape, getattr(torch, dataset.input_dtype))
    counts = [_params(m)[0] for _, m in layers]
    ranges = stage_ranges(counts, [_numel(s) for s in sizes], stages, given, spec)
    modules, facts, cuts = [], [], []
    for index, r in enumerate(ranges):
        module = nn.Sequential(OrderedDict(layers[i] for i in r))
        count, nbytes = _params(module)
        inp = shape if r.start == 0 else sizes[r.start - 1][0]
        out = sizes[r.stop - 1][0]
        modules.append(module)
        facts.append(Stage(index, tuple(_label(*layers[i]) for i in r), count, nbytes,
                           tuple(inp), tuple(out)))
        if index < stages - 1:
            cuts.append(Boundary(tuple(out), sizes[r.stop - 1][1]))
    return Split(modules, facts, cuts, sum(counts))


def _numel(shape_dtype) -> int:
    n = 1
    for d in shape_dtype[0]:
        n *= d
    return n


def _output_shapes(chain: nn.Sequential, shape, dtype) -> list[tuple[tuple[int, ...], object]]:
    """Each layer's output for one example: (shape, NumPy dtype), from a forward pass of two zero
    inputs in eval mode (no dropout draws, the random state untouched)."""
    out = []
    was = chain.training
    chain.eval()
    try:
        with torch.no_grad():
            x = torch.zeros(2, *shape, dtype=dtype)
            for layer in chain:
                x = layer(x)
                out.append((tuple(x.shape[1:]), torch.empty((), dtype=x.dtype).numpy().dtype))
    finally:
        chain.train(was)
    return out
