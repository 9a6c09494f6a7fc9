"""Keras checkpoint files: one ``.npz`` of plain arrays and JSON metadata, read back with
``allow_pickle=False`` (:mod:`ringtrain.output.checkpoint` does the rest: names, metadata, the
checks that come before any reader, the fall back past a damaged file)."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import zipfile
from pathlib import Path
from typing import BinaryIO

import keras
import numpy as np

from ringtrain.errors import UserError
from ringtrain.output import checkpoint
from ringtrain.training.run import RunIdentity

EXT = "npz"


def rng_variables(net: keras.Model) -> list:
    """The dropout seed-generator state: in ``net.variables`` but not in ``net.weights``."""
    weights = {id(w) for w in net.weights}
    return [v for v in net.variables if id(v) not in weights]


def save(path_dir: str, epoch: int, net: keras.Model, optimizer, identity: RunIdentity,
         args: argparse.Namespace, stage: dict | None = None,
         optimizer_arrays: list | None = None) -> None:
    """One ``.npz``: ``model_NNNN`` (weights in model order), ``optimizer_NNNN`` (iteration
    counter, momentum slots), ``rng_NNNN`` (rank 0's dropout seed state) and ``meta``, the JSON
    of :func:`ringtrain.output.checkpoint.metadata` plus ``weight_keys``, the names of the weight
    arrays in model order (what tools that compare checkpoints across frameworks read).
    A pipeline stage's file (``stage``: its metadata record) holds that stage's model.
    ``optimizer_arrays``: the optimizer's state already gathered (--shard-optimizer's
    :meth:`~tf_models.sharded.ShardedOptimizer.gathered_state`, in the unsharded optimizer's
    order: a collective that every rank calls, not rank 0 alone here)."""
    arrays = {}
    opt = optimizer_arrays if optimizer_arrays is not None else optimizer.variables
    for prefix, variables in (("model", net.weights), ("optimizer", opt),
                              ("rng", rng_variables(net))):
        for i, var in enumerate(variables):
            arrays[f"{prefix}_{i:04d}"] = np.asarray(var if isinstance(var, np.ndarray)
                                                     else var.numpy())
    meta = checkpoint.metadata(identity, epoch, checkpoint.config_of(args), stage)
    meta["weight_keys"] = [f"model_{i:04d}" for i in range(len(net.weights))]
    arrays["meta"] = np.array(json.dumps(meta))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    checkpoint.save(path_dir, epoch, EXT, buf.getvalue(),
                    (stage["stage"], stage["stages"]) if stage else None)


def _restore(variables: list, arrays: dict, prefix: str, path) -> None:
    saved = sorted(k for k in arrays if k.startswith(prefix + "_"))
    if len(saved) != len(variables):
        raise UserError(f"{path} holds {len(saved)} {prefix} variables, this run has "
                        f"{len(variables)} (saved with different --momentum or --amp?); resume "
                        f"with the original flags or use another --checkpoint-dir")
    for key, var in zip(saved, variables, strict=True):
        if tuple(arrays[key].shape) != tuple(var.shape):
            raise UserError(f"{path}: {prefix} variable {var.path} has shape "
                            f"{tuple(arrays[key].shape)} there, {tuple(var.shape)} here; use "
                            f"another --checkpoint-dir")
        try:
            var.assign(arrays[key])
        except Exception as err:  # Keras and TF raise several types for a value of another dtype
            raise checkpoint.not_ours(path, f"holds {key} of type {arrays[key].dtype}, which "
                                            f"{var.path} cannot take ({type(err).__name__})") from None


# The members :func:`save` writes: the metadata and numbered arrays, nothing else.
_MEMBER = re.compile(r"^(meta|(model|optimizer|rng)_\d{4,})\.npy$")
_KINDS = "biufU"  # what those arrays are: numbers, and the metadata's text


def expected_member(name: str) -> bool:
    return _MEMBER.match(name) is not None


def _array(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> np.ndarray:
    """One ``.npy`` member, read only once its header's shape and type account for exactly the
    bytes that follow (NumPy's reader allocates what the header claims before it reads).  An
    object array (a pickle inside) is refused, never unpickled."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read_header(f)
        if dtype.hasobject:
            raise _ObjectArray
        count = math.prod(shape)
        if dtype.kind not in _KINDS or dtype.itemsize == 0 or dtype.fields is not None:
            raise ValueError(f"array of type {dtype}")
        body = f.read()
    if len(body) != count * dtype.itemsize or min(shape, default=0) < 0:
        raise ValueError("array size unlike its header's")
    return np.frombuffer(body, dtype).reshape(shape, order="F" if fortran else "C")


class _ObjectArray(Exception):
    pass


def read(fh: BinaryIO, path: Path) -> tuple[object, dict]:
    """``(metadata, arrays)`` of one ``.npz`` (``fh``, open on ``path``, its members checked by
    :func:`ringtrain.output.checkpoint.check_archive`), read member by member: an object array
    is refused, never unpickled."""
    try:
        with zipfile.ZipFile(fh) as archive:
            arrays = {member.filename[:-len(".npy")]: _array(archive, member)
                      for member in archive.infolist() if expected_member(member.filename)}
        meta = arrays.get("meta")
        if meta is not None and (meta.dtype.kind != "U" or meta.ndim != 0):
            raise ValueError("metadata is not one text")
        meta = json.loads(str(meta)) if meta is not None else None
    except _ObjectArray:
        raise checkpoint.refused(path, "holds pickled Python objects") from None
    except Exception as err:  # zipfile, numpy and json raise many types for damaged files
        raise checkpoint.Damaged(type(err).__name__) from None
    return meta, arrays


def _check_finite(arrays: dict, path: Path) -> None:
    for key, array in arrays.items():
        if key.startswith(("model_", "optimizer_")) and array.dtype.kind == "f" \
                and not np.isfinite(array).all():
            raise checkpoint.not_finite(path, key)


def restore(path_dir: str, net: keras.Model, optimizer, identity: RunIdentity,
            spec: str | None = None) -> int:
    """Restore rank 0's model/optimizer from the newest intact checkpoint (given ``spec``, of
    that ``--optimizer``); return its epoch (0 if there is none)."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity, expected=expected_member,
                                      optimizer=spec)
    if found is None:
        return 0
    epoch, arrays, path = found
    load(arrays, path, net, optimizer)
    return epoch


def find(path_dir: str, identity: RunIdentity, stage: tuple[int, int],
         at_most: int | None = None) -> tuple[int, tuple] | None:
    """A pipeline stage's newest intact checkpoint (of epoch ``at_most`` or before): ``(epoch,
    (arrays, path))``, or None."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity, expected=expected_member,
                                      stage=stage, at_most=at_most)
    return None if found is None else (found[0], (found[1], found[2]))


def load(arrays: dict, path, net: keras.Model, optimizer) -> None:
    """A checkpoint's arrays into the model, its optimizer and its dropout seed state."""
    _check_finite(arrays, path)
    _restore(net.weights, arrays, "model", path)
    if hasattr(optimizer, "load_state"):  # --shard-optimizer: the whole state, for scatter_state
        _restore_sharded(optimizer, arrays, path)
    else:
        _restore_whole(optimizer, arrays, path)
    rng = rng_variables(net)
    if len([k for k in arrays if k.startswith("rng_")]) == len(rng):
        _restore(rng, arrays, "rng", path)


def _restore_whole(optimizer, arrays: dict, path) -> None:
    opt_vars = optimizer.variables
    if len([k for k in arrays if k.startswith("optimizer_")]) == len(opt_vars) - 1:
        # Written while the fixed trainer's LR was a schedule, which the optimizer does not hold
        # as a variable; the LR is set before every step now, so only the others are restored.
        opt_vars = [v for v in opt_vars if v.name != "learning_rate"]
    _restore(opt_vars, arrays, "optimizer", path)


def _restore_sharded(optimizer, arrays: dict, path) -> None:
    """The unsharded optimizer's arrays, checked against the model, kept by the
    :class:`~tf_models.sharded.ShardedOptimizer` until it scatters them."""
    shapes = optimizer.state_shapes()
    saved = sorted(k for k in arrays if k.startswith("optimizer_"))
    if len(saved) == len(shapes) - 1:  # written without the learning-rate variable (see above)
        saved = saved[:1] + [None] + saved[1:]
    if len(saved) != len(shapes):
        raise UserError(f"{path} holds {len(saved)} optimizer variables, this run has "
                        f"{len(shapes)} (saved with different --momentum or --amp?); resume "
                        f"with the original flags or use another --checkpoint-dir")
    out = []
    for key, shape in zip(saved, shapes, strict=True):
        if key is None:  # the learning rate: set before every step
            out.append(None)
            continue
        if tuple(arrays[key].shape) != tuple(shape):
            raise UserError(f"{path}: optimizer variable {key} has shape "
                            f"{tuple(arrays[key].shape)} there, {tuple(shape)} here; use "
                            f"another --checkpoint-dir")
        if arrays[key].dtype.kind not in "biuf":
            raise checkpoint.not_ours(path, f"holds {key} of type {arrays[key].dtype}")
        out.append(arrays[key])
    optimizer.load_state(out)
