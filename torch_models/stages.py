"""``--model`` split into pipeline stages, on the PyTorch side.

What splits: the built-in ``cnn`` and ``mlp`` (their :meth:`layers`, the same modules as a chain),
a user's builder that returns a ``torch.nn.Sequential`` (split between its children, balanced by
parameter count: :func:`ringtrain.strategies.pipeline.partition.balanced_split`), or one that returns a list
of S modules, the stages themselves.  Anything else cannot be split (a module's ``forward`` may
do anything between its children) and is one line.

**Built stage by stage.**  The builder runs under ``torch.device("meta")``: every module, no
weight (a meta tensor has a shape and a dtype, no storage, and its random initialisation draws
nothing from the CPU generator).  The split comes from that: parameter counts, and each layer's
output shape from a forward pass of meta tensors.  Then a rank materialises its own stage's
layers only, and initialises them to exactly what a one-process build with the same
``torch.manual_seed`` gives: the chain's layers are walked in order, each one's modules that
hold weights re-initialised by their ``reset_parameters()`` (in ``modules()`` order) from the
generator, so every layer draws what it drew when the builder made it.  The layers before the
stage must draw too (the generator's position is theirs to move), so each is materialised,
drawn and dropped in turn: the peak is the stage plus the largest earlier layer, during start-up.
The layers after the stage never exist on this rank.  (The generator is then where the stage's
last layer left it, not past the whole model: only the dropout masks drawn later differ from a
whole build's, which no comparison relies on: ranks draw their own masks anyway.)

**Exact, or whole.**  Re-initialising equals the builder's initialisation only if the builder's
own random (and other in-place) writes into the weights are exactly what the replay writes.
That is checked, not assumed (:class:`_Trace`): the builder's every in-place operator and every
random draw, recorded under the meta device (operator, target weight, its dtype, shape and
strides, the other arguments), must equal the replay's, recorded the same way, in the same
order; every weight must be written whole by the replay; the builder must not have moved the
CPU generator, made a weight off the meta device, kept a plain tensor attribute or a lazy
module, and the meta forward pass must run.  So a module with weights and no
``reset_parameters`` (``nn.MultiheadAttention``), a builder that re-initialises a layer after
making it (``nn.init.zeros_(layer.bias)``), builds layers in another order than they run, shares
a layer between two places, or draws random numbers itself, falls back to the whole build: the
model built on every rank as before, each rank keeping its stage, and the banner says which and
why (:attr:`Split.built`).  A model converted after it was made (``.double()``) is initialised in
the dtype it was made in and then converted, as the builder did.

Replica 0's stages together are then the model a single process builds with ``--seed``, so a
pipeline starts from the same weights as a data-parallel run, either way.
"""

from __future__ import annotations

import copy
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ringtrain import model_spec
from ringtrain.errors import UserError
from ringtrain.strategies.pipeline.engine import Boundary
from ringtrain.strategies.pipeline.partition import Stage, stage_ranges, timed_stages
from ringtrain.strategies.pipeline.timing import SLACK, Timing, clock, median_seconds
from torch_models.model import BUILTIN, check, instantiate, model_shape

BY_STAGE = "built stage by stage"


def built_whole(reason: str) -> str:
    """The banner's words for a model built whole on every rank."""
    return f"built whole on every rank ({reason})"


Fits = Callable[[int, int, int], None]  # (stage, weight bytes, activation bytes per example)


@dataclass
class Split:
    """The stages (their modules, None for a stage not built here; facts; the cuts between them,
    one fewer than stages) and how the weights were built (the banner's line)."""

    modules: list[nn.Module | None]
    stages: list[Stage]
    cuts: list[Boundary]
    param_count: int
    built: str


def _label(name: str, module: nn.Module) -> str:
    return f"{name}:{type(module).__name__}" if name.isdigit() else name


def _params(module: nn.Module) -> tuple[int, int]:
    """(parameter count, bytes) of a module's parameters (meta tensors have both)."""
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


def build(spec: str, dataset, dropout: float, stages: int, keep: int | None = None,
          fits: Fits | None = None, timing: Timing | None = None) -> Split:
    """The ``--model spec`` for ``dataset``, checked as a whole (one forward pass) and split;
    the weights of stage ``keep`` only (None: every stage's, as the tests compare them), built
    stage by stage where that is exact, else the whole model.  ``fits(stage, weight bytes,
    activation bytes per example)`` is called before stage ``keep``'s weights exist (it raises
    when they cannot fit the rank: :mod:`ringtrain.strategies.pipeline.memory`).  With
    ``timing`` (``--partition time``) the split balances the layers' timed seconds
    (:func:`layer_seconds`, agreed between the ranks by ``timing.agree``) instead of their
    parameter counts."""
    shape, dtype = model_shape(dataset), getattr(torch, dataset.input_dtype)
    before = _Generators.take()
    meta = _on_meta(spec, dataset, dropout, shape, dtype)
    if isinstance(meta, str):
        before.restore()  # the whole build draws from where the meta attempt started
        return _whole(spec, dataset, dropout, stages, shape, dtype, meta, timing)
    costs = None if timing is None or meta.given else timing.agree(
        lambda: layer_seconds(meta.layers, meta.sizes, shape, dtype, timing))
    # The split before any weight exists: more stages than layers with weights is one line here.
    ranges = stage_ranges(meta.counts, [_numel(s) for s in meta.sizes], stages, meta.given, spec,
                          costs, SLACK if costs else 0.0)
    wanted = range(stages) if keep is None else [keep]
    if fits is not None and keep is not None:
        mine = ranges[keep]
        fits(keep, sum(p.numel() * p.element_size() for i in mine
                       for p in meta.layers[i][1].parameters()),
             sum(_numel(meta.sizes[i]) * np.dtype(meta.sizes[i][1]).itemsize for i in mine))
    meta.materialise({i for s in wanted for i in ranges[s]})
    modules = [nn.Sequential(OrderedDict(meta.layers[i] for i in r)) if index in wanted else None
               for index, r in enumerate(ranges)]
    return _assemble(meta.layers, ranges, modules, meta.sizes, shape, BY_STAGE, costs)


def _whole(spec: str, dataset, dropout: float, stages: int, shape, dtype, reason: str,
           timing: Timing | None = None) -> Split:
    """Every layer built and initialised by the builder itself, on every rank; each stage a
    Sequential of the model's own modules."""
    built = instantiate(spec, dataset, dropout, (nn.Module, list, tuple),
                        "torch.nn.Module (or a list of stages)")
    layers, given = _chain(spec, built)
    whole = nn.Sequential(OrderedDict(layers))
    check(spec, whole, shape, dataset.num_classes, dtype)
    sizes = _output_shapes(whole, shape, dtype)
    counts = [_params(m)[0] for _, m in layers]
    costs = None if timing is None or given else timing.agree(
        lambda: layer_seconds(layers, sizes, shape, dtype, timing))
    ranges = stage_ranges(counts, [_numel(s) for s in sizes], stages, given, spec, costs,
                          SLACK if costs else 0.0)
    modules = [nn.Sequential(OrderedDict(layers[i] for i in r)) for r in ranges]
    return _assemble(layers, ranges, modules, sizes, shape, built_whole(reason), costs)


def _assemble(layers, ranges, modules, sizes, shape, built: str, costs=None) -> Split:
    facts, cuts = [], []
    for index, r in enumerate(ranges):
        count, nbytes = _params(nn.Sequential(OrderedDict(layers[i] for i in r)))
        inp = shape if r.start == 0 else sizes[r.start - 1][0]
        out = sizes[r.stop - 1][0]
        facts.append(Stage(index, tuple(_label(*layers[i]) for i in r), count, nbytes,
                           tuple(inp), tuple(out)))
        if index < len(ranges) - 1:
            cuts.append(Boundary(tuple(out), sizes[r.stop - 1][1]))
    return Split(modules, timed_stages(facts, costs), cuts, sum(_params(m)[0] for _, m in layers),
                 built)


def _numel(shape_dtype) -> int:
    n = 1
    for d in shape_dtype[0]:
        n *= d
    return n


def _output_shapes(chain: nn.Sequential, shape, dtype,
                   device: str = "cpu") -> list[tuple[tuple[int, ...], object]]:
    """Each layer's output for one example: (shape, NumPy dtype), from a forward pass of two zero
    inputs in eval mode (no dropout draws, the random state untouched)."""
    out = []
    was = chain.training
    chain.eval()
    try:
        with torch.no_grad():
            x = torch.zeros(2, *shape, dtype=dtype, device=device)
            for layer in chain:
                x = layer(x)
                out.append((tuple(x.shape[1:]), torch.empty((), dtype=x.dtype).numpy().dtype))
    finally:
        chain.train(was)
    return out


# --- --partition time ---------------------------------------------------------------------------

def layer_seconds(layers: list[tuple[str, nn.Module]], sizes, shape, dtype,
                  timing: Timing) -> list[float]:
    """Each layer's forward and backward pass on ``timing.rows`` rows on ``timing.device``, timed
    alone: a copy of the layer (of the meta layer: given storage and small values from a private
    generator; of a built one: its own values) is made, timed and dropped before the next, so at
    most one layer is ever materialised for it.  Under ``torch.random.fork_rng`` (a Dropout's
    mask draws from the device's generator), so the CPU generator the weight replay draws from
    is where it was (checked)."""
    rng = torch.Generator().manual_seed(0)  # private: the inputs and a meta layer's values
    before = torch.get_rng_state()
    device = torch.device(timing.device)
    costs = []
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):
        for i, (_, layer) in enumerate(layers):
            inp = (tuple(shape), dtype) if i == 0 else (sizes[i - 1][0], _torch_dtype(sizes[i - 1][1]))
            costs.append(_time_layer(layer, inp, i > 0, timing, rng, device))
    if not torch.equal(before, torch.get_rng_state()):
        raise RuntimeError("timing the layers moved the CPU random generator")
    return costs


def _torch_dtype(numpy_dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, numpy_dtype)).dtype


def _time_layer(layer: nn.Module, inp, input_grad: bool, timing: Timing,
                rng: torch.Generator, device: torch.device) -> float:
    """One layer's median forward (twice if recomputed) + backward seconds, on its own copy."""
    alone = copy.deepcopy(layer)
    if any(t.device.type == "meta" for t in [*alone.parameters(), *alone.buffers()]):
        alone.to_empty(device=device)
        with torch.no_grad():
            for t in [*alone.parameters(), *alone.buffers()]:
                if t.is_floating_point():
                    # small values, a variance buffer positive: U(0.01, 0.05)
                    t.copy_(torch.rand(t.shape, generator=rng, dtype=t.dtype) * 0.04 + 0.01)
                else:
                    t.zero_()
    alone.to(device).train()
    shape, dtype = inp
    if dtype.is_floating_point:
        x = torch.randn((timing.rows, *shape), generator=rng, dtype=dtype).to(device)
    else:  # token ids: 0 is every table's row
        x = torch.zeros((timing.rows, *shape), dtype=dtype, device=device)
    grad_in = input_grad and dtype.is_floating_point
    forwards = 2 if timing.recompute else 1
    # A GPU runs operators asynchronously: the clock is read once the device is done.
    done = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def once() -> float:
        for p in alone.parameters():
            p.grad = None
        xi = x.detach().requires_grad_(grad_in)
        done()
        t0 = clock()
        for _ in range(forwards - 1):
            with torch.no_grad():
                alone(xi)
        out = alone(xi)
        if out.requires_grad:
            out.backward(torch.ones_like(out))
        done()
        return clock() - t0

    return median_seconds(once, timing.repeats)  # the copy goes with this frame


# --- stage by stage ---------------------------------------------------------------------------------

class _Generators:
    """The random generators a builder may draw from (PyTorch's CPU one, NumPy's, Python's), so
    that a whole build after a failed meta attempt starts where the attempt started."""

    def __init__(self, states) -> None:
        self.states = states

    @classmethod
    def take(cls) -> _Generators:
        return cls((torch.get_rng_state(), np.random.get_state(), random.getstate()))

    def restore(self) -> None:
        torch.set_rng_state(self.states[0])
        np.random.set_state(self.states[1])
        random.setstate(self.states[2])


def _direct(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and buffers a module holds itself (not its children's)."""
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


def _owners(layer: nn.Module) -> list[nn.Module]:
    """The layer's modules that hold weights themselves, in ``modules()`` (pre-)order: what the
    replay re-initialises, in the order it does."""
    return [m for m in layer.modules() if next(_direct(m), None) is not None]


class _Trace(TorchDispatchMode):
    """Records every in-place (or ``out=``) operator and every random draw run under it, with
    what they write to, for comparison; and, while it records a builder, every parameter and
    buffer registered, with the dtype it was made in.

    A dispatch mode sees the operators themselves (``aten.uniform_``), below ``nn.init``'s
    functions, so a layer's ``reset_parameters`` and a builder's own ``nn.init`` call look alike.
    Every tensor written to is kept alive until the trace is compared: a recorded identity is
    then never reused by another tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.made: dict[int, tuple[torch.Tensor, nn.Module, str]] = {}  # id -> (tensor, where)
        self.dtypes: dict[tuple[int, str], torch.dtype] = {}  # (id(module), name) -> made in
        self.hooks: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.is_mutable or torch.Tag.nondeterministic_seeded in func.tags:
            # Each tensor as it is now (a conversion later changes a Parameter's dtype in place).
            self.ops.append((func, _snap(args), _snap(kwargs)))
        return func(*args, **kwargs)

    def own(self, module: nn.Module, name: str, tensor: torch.Tensor) -> None:
        """``tensor`` is ``module``'s weight ``name`` (from registration, or the replay's)."""
        self.made[id(tensor)] = (tensor, module, name)

    def registrations(self) -> _Trace:
        """Also record the parameters and buffers made from now on (until :meth:`close`)."""
        def made(module, name, tensor):
            if tensor is not None:
                self.own(module, name, tensor)
                self.dtypes[(id(module), name)] = tensor.dtype

        hooks = torch.nn.modules.module
        self.hooks = [hooks.register_module_parameter_registration_hook(made),
                      hooks.register_module_buffer_registration_hook(made)]
        return self

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks = []

    def resolve(self, layers: list[tuple[str, nn.Module]]) -> list[tuple]:
        """The recorded operators with each tensor named by what it is: a weight by its layer's
        index and its path in the layer (the same in the builder's run and the replay's), any
        other tensor by its shape and dtype."""
        where = {id(m): (i, path) for i, (_, layer) in enumerate(layers)
                 for path, m in layer.named_modules(remove_duplicate=False)}
        owner = {key: (module, name) for key, (_, module, name) in self.made.items()}
        for _, layer in layers:  # the weights as they are now (one converted after it was made)
            for m in layer.modules():
                owner.update({id(t): (m, name) for name, t in _direct(m)})

        def value(v):
            if isinstance(v, _Tensor):
                found = owner.get(id(v.base))
                what = (("weight", where.get(id(found[0]), ("outside", type(found[0]).__name__)),
                         found[1]) if found else ("tensor",))
                return what, *v.facts
            if isinstance(v, tuple):
                return tuple(value(x) for x in v)
            return v

        return [(str(func), value(args), value(kwargs)) for func, args, kwargs in self.ops]


class _Tensor:
    """A tensor an operator wrote or read, as it was then: it (kept alive), the tensor it is a
    view of (or itself), and its view offset, dtype, shape and strides."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.base = t._base if t._base is not None else t
        self.facts = (None if self.base is t else t.storage_offset(), str(t.dtype),
                      tuple(t.shape), tuple(t.stride()))


def _snap(v):
    """An operator's arguments as comparable values (tensors as :class:`_Tensor`)."""
    if isinstance(v, torch.Tensor):
        return _Tensor(v)
    if isinstance(v, dict):
        return tuple(sorted((k, _snap(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_snap(x) for x in v)
    if isinstance(v, torch.Generator):
        # A generator of the builder's own: never equal, so such a model is built whole (the
        # replay would draw from wherever that generator then is).
        return ("generator", object())
    return v if isinstance(v, (int, float, bool, str, type(None))) else repr(v)


class _Meta:
    """A model built on the meta device whose weights can be replayed layer by layer."""

    def __init__(self, layers, given: bool, sizes, dtypes) -> None:
        self.layers, self.given, self.sizes = layers, given, sizes
        self.counts = [_params(m)[0] for _, m in layers]
        self.dtypes = dtypes  # (id(module), name) -> the dtype the builder made it in

    def replay(self, layer: nn.Module, device: str, trace: _Trace | None = None,
               scratch: torch.Tensor | None = None) -> None:
        """The layer's weights on ``device``, initialised as the builder initialised them: in
        the dtype it made them in (then converted, as it converted them), each module that holds
        weights re-initialised by its ``reset_parameters()`` in ``modules()`` order.  With
        ``scratch`` (CPU bytes, at least :func:`_scratch_bytes` of the layer) the weights are
        views of it: a layer replayed only to move the generator allocates nothing."""
        if scratch is None:
            layer.to_empty(device=device)
        else:
            offset = 0

            def view(t: torch.Tensor) -> torch.Tensor:  # as to_empty's empty_like, in scratch
                nonlocal offset
                n = t.numel() * t.element_size()
                out = scratch[offset:offset + n].view(t.dtype).view(t.shape)
                offset += _aligned(n)
                return out

            layer._apply(view)  # what to_empty does (Parameters re-made off the meta device)
        converted = []
        for m in _owners(layer):
            for name, t in list(_direct(m)):
                made = self.dtypes.get((id(m), name), t.dtype)
                if made != t.dtype:
                    converted.append((m, name, t.dtype))
                    _replace(m, name, torch.empty_like(t, dtype=made))
        if trace is not None:
            for m in _owners(layer):
                for name, t in _direct(m):
                    trace.own(m, name, t)
        for m in _owners(layer):
            m.reset_parameters()
        for m, name, dtype in converted:
            _replace(m, name, getattr(m, name).to(dtype))

    def materialise(self, keep: set[int]) -> None:
        """The layers in ``keep`` on the CPU, initialised; every layer before the last of them is
        replayed too, one at a time, and dropped at once unless kept (it moves the generator as
        the builder's did); the layers after it never hold memory."""
        # The layers not kept are replayed into one scratch buffer, reused: a fresh allocation
        # and free per layer let glibc's heap grow by most of them (its dynamic mmap threshold
        # moves 4 MB weights onto the heap, where freed chunks were not reused): building stage
        # 3 of 4 of a 240-layer MLP of 1024 then grew the rank by 957 MB for 242 MB kept.
        scratch = None
        for i in range(max(keep) + 1):
            layer = self.layers[i][1]
            if i in keep:
                self.replay(layer, "cpu")
                continue
            need = _scratch_bytes(layer)
            if not need:
                continue  # no weights: nothing to initialise, nothing drawn
            if scratch is None or scratch.numel() < need:
                scratch = None  # the smaller one goes first
                scratch = torch.empty(need, dtype=torch.uint8)
            self.replay(layer, "cpu", scratch=scratch)
            layer.to_empty(device="meta")  # its weights go now: one earlier layer at a time


def _aligned(nbytes: int) -> int:
    return -(-nbytes // 64) * 64  # each view starts 64-byte aligned, as the allocator's tensors


def _scratch_bytes(layer: nn.Module) -> int:
    """The bytes of a layer's parameters and buffers, each rounded up to 64."""
    return sum(_aligned(t.numel() * t.element_size())
               for m in layer.modules() for _, t in _direct(m))


def _replace(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """A parameter's data (the Parameter object stays: an RNN's flat weights hold it) or a
    buffer swapped for ``tensor``."""
    if name in module._parameters:
        module._parameters[name].data = tensor
    else:
        module._buffers[name] = tensor


def _on_meta(spec: str, dataset, dropout: float, shape, dtype) -> _Meta | str:
    """The model built on the meta device and checked replayable, or why not (the reason the
    banner gives for building it whole)."""
    rng = torch.get_rng_state()
    trace = _Trace().registrations()
    try:
        with torch.device("meta"), trace:
            built = instantiate(spec, dataset, dropout, (nn.Module, list, tuple),
                                "torch.nn.Module (or a list of stages)")
    except Exception as err:  # a builder's UserError too: the whole build says it, if it is one
        return f"the builder failed on the meta device: {type(err).__name__}"
    finally:
        trace.close()
    if not torch.equal(rng, torch.get_rng_state()):
        return "the builder drew from the CPU random generator itself"
    layers, given = _chain(spec, built)  # what cannot be split is one line, on any device
    why = _not_replayable(layers)
    if why:
        return why
    whole = nn.Sequential(OrderedDict(layers))
    try:
        sizes = _output_shapes(whole, shape, dtype, device="meta")
    except Exception as err:
        return f"a forward pass on the meta device failed: {type(err).__name__}"
    model_spec.check_output(spec, shape, (2, *sizes[-1][0]), dataset.num_classes)
    meta = _Meta(layers, given, sizes, trace.dtypes)
    return _same_draws(meta, trace) or meta


def _not_replayable(layers: list[tuple[str, nn.Module]]) -> str | None:
    """What in the meta-built chain rules the replay out, before it is tried."""
    seen: set[int] = set()
    for _, layer in layers:
        for m in layer.modules():
            kind = type(m).__name__
            if isinstance(m, nn.modules.lazy.LazyModuleMixin):
                return f"{kind} is a lazy module"
            if id(m) in seen:
                return f"a {kind} appears twice in the model"
            seen.add(id(m))
            tensors = dict(_direct(m))
            if any(t.device.type != "meta" for t in tensors.values()):
                return f"{kind} made its weights off the meta device"
            if tensors and not callable(getattr(m, "reset_parameters", None)):
                return f"{kind} holds weights but has no reset_parameters()"
            if any(isinstance(v, torch.Tensor) and not any(v is t for t in tensors.values())
                   for v in vars(m).values()):
                return f"{kind} keeps a tensor that is neither a parameter nor a buffer"
    return None


def _same_draws(meta: _Meta, built: _Trace) -> str | None:
    """Whether replaying every layer writes into the weights exactly what the builder wrote, in
    the same order (its random draws among them); run on the meta device, so nothing is held."""
    replayed = _Trace()
    for _, layer in meta.layers:
        layer.to_empty(device="meta")  # the replay's own tensors, as on the CPU later
    try:
        for _, layer in meta.layers:
            with replayed:
                meta.replay(layer, "meta", replayed)
    except Exception as err:
        return f"reset_parameters() failed on the meta device: {type(err).__name__}"
    ours, theirs = replayed.resolve(meta.layers), built.resolve(meta.layers)
    if ours != theirs:
        return "the builder initialised its weights otherwise than reset_parameters() does"
    written = {args[0][0] for _, args, _ in ours  # (what, view offset, ...): whole, not a view
               if args and isinstance(args[0], tuple) and args[0][0][0] == "weight"
               and args[0][1] is None}
    for i, (_, layer) in enumerate(meta.layers):
        for path, m in layer.named_modules(remove_duplicate=False):
            for name, _ in _direct(m):
                if ("weight", (i, path), name) not in written:
                    return (f"reset_parameters() of {type(m).__name__} does not initialise its "
                            f"{name}")
    return None
