"""Keras checkpoint files: one ``.npz`` of plain arrays and JSON metadata, read back with
``allow_pickle=False`` (:mod:`ringtrain.output.checkpoint` does the rest: names, metadata, the
checks that come before any reader, the fall back past a damaged file)."""

from __future__ import annotations

import argparse
import io
import json

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
         args: argparse.Namespace, stage: dict | None = None) -> None:
    """One ``.npz``: ``model_NNNN`` (weights in model order), ``optimizer_NNNN`` (iteration
    counter, momentum slots), ``rng_NNNN`` (rank 0's dropout seed state) and ``meta``, the JSON
    of :func:`ringtrain.output.checkpoint.metadata` plus ``weight_keys``, the names of the weight
    arrays in model order (what tools that compare checkpoints across frameworks read).
    A pipeline stage's file (``stage``: its metadata record) holds that stage's model."""
    arrays = {}
    for prefix, variables in (("model", net.weights), ("optimizer", optimizer.variables),
                              ("rng", rng_variables(net))):
        for i, var in enumerate(variables):
            arrays[f"{prefix}_{i:04d}"] = np.asarray(var.numpy())
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
        var.assign(arrays[key])


def read(path) -> tuple[object, dict]:
    """``(metadata, arrays)`` of one ``.npz``, read with ``allow_pickle=False``: an object array
    (a pickle inside) is refused, never unpickled."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else None
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise checkpoint.refused(path, "holds pickled Python objects") from None
        raise checkpoint.Damaged(type(err).__name__) from None
    except Exception as err:  # zipfile, numpy and json raise many types for damaged files
        raise checkpoint.Damaged(type(err).__name__) from None
    return meta, arrays


def restore(path_dir: str, net: keras.Model, optimizer, identity: RunIdentity) -> int:
    """Restore rank 0's model/optimizer from the newest intact checkpoint; return its epoch (0 if
    there is none)."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity)
    if found is None:
        return 0
    epoch, arrays = found
    load(arrays, checkpoint.path_for(path_dir, epoch, EXT), net, optimizer)
    return epoch


def find(path_dir: str, identity: RunIdentity, stage: tuple[int, int],
         at_most: int | None = None) -> tuple[int, tuple] | None:
    """A pipeline stage's newest intact checkpoint (of epoch ``at_most`` or before): ``(epoch,
    (arrays, path))``, or None."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity, stage, at_most)
    if found is None:
        return None
    epoch, arrays = found
    return epoch, (arrays, checkpoint.path_for(path_dir, epoch, EXT, stage))


def load(arrays: dict, path, net: keras.Model, optimizer) -> None:
    """A checkpoint's arrays into the model, its optimizer and its dropout seed state."""
    _restore(net.weights, arrays, "model", path)
    opt_vars = optimizer.variables
    if len([k for k in arrays if k.startswith("optimizer_")]) == len(opt_vars) - 1:
        # Written while the fixed trainer's LR was a schedule, which the optimizer does not hold
        # as a variable; the LR is set before every step now, so only the others are restored.
        opt_vars = [v for v in opt_vars if v.name != "learning_rate"]
    _restore(opt_vars, arrays, "optimizer", path)
    rng = rng_variables(net)
    if len([k for k in arrays if k.startswith("rng_")]) == len(rng):
        _restore(rng, arrays, "rng", path)
