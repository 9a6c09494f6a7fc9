"""PyTorch checkpoint files: ``torch.save`` archives of plain data and tensors, read back with
``weights_only=True`` (:mod:`ringtrain.output.checkpoint` does the rest: names, metadata, the
checks that come before any reader, the fall back past a damaged file)."""

from __future__ import annotations

import argparse
import io
import pickle
import re
from pathlib import Path
from typing import BinaryIO

import torch

from ringtrain.errors import printable
from ringtrain.output import checkpoint
from ringtrain.training.run import RunIdentity

EXT = "pt"


def save(path_dir: str, epoch: int, model, optimizer, identity: RunIdentity,
         args: argparse.Namespace, stage: dict | None = None,
         optimizer_state: dict | None = None) -> None:
    """The checkpoint of ``epoch``: the whole model's, or a pipeline stage's (``stage``: its
    :func:`ringtrain.output.checkpoint.metadata` record, ``stage`` and ``stages`` in it).
    ``optimizer_state``: the optimizer's state already gathered (--shard-optimizer's, whose
    ``state_dict`` is a collective that every rank must call, not rank 0 alone here)."""
    buf = io.BytesIO()
    torch.save({
        "meta": checkpoint.metadata(identity, epoch, checkpoint.config_of(args), stage),
        "model": model.state_dict(),
        "optimizer": optimizer_state if optimizer_state is not None else optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }, buf)
    checkpoint.save(path_dir, epoch, EXT, buf.getvalue(),
                    (stage["stage"], stage["stages"]) if stage else None)


# What torch.save writes into its archive, under one folder named after the file (or "archive"
# for a buffer, as :func:`save` writes): the pickle, its tensors' storages and a few records.
_MEMBER = re.compile(r"^[^/]+/(data\.pkl|\.format_version|\.storage_alignment|byteorder|version|"
                     r"\.data/(version|serialization_id)|data/\d+)$")


def expected_member(name: str) -> bool:
    return _MEMBER.match(name) is not None


def read(fh: BinaryIO, path: Path) -> tuple[object, dict]:
    """``(metadata, state)`` of one checkpoint archive (``fh``, open on ``path``): tensors and
    plain data only (``weights_only=True``), so nothing in the file runs while it is read."""
    try:
        state = torch.load(fh, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # the archive is intact (its CRCs passed): it holds objects
        raise checkpoint.refused(path, "holds Python objects beyond tensors and plain data") from None
    except Exception as err:  # torch raises many types for damaged files
        raise checkpoint.Damaged(type(err).__name__) from None
    return (state.get("meta") if isinstance(state, dict) else None), state


def _tensors(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and torch.is_tensor(v)
                                           for k, v in value.items())


def _check_state(state: dict, path: Path) -> None:
    """What :func:`save` writes besides the metadata, each of its type, and finite weights."""
    optimizer = state.get("optimizer")
    rng = state.get("torch_rng")
    if not _tensors(state.get("model")):
        raise checkpoint.not_ours(path, "has no model weights (a mapping of names to tensors)")
    if not (isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
            and isinstance(optimizer.get("param_groups"), list)):
        raise checkpoint.not_ours(path, "has no optimizer state")
    if not (torch.is_tensor(rng) and rng.dtype == torch.uint8 and rng.dim() == 1):
        raise checkpoint.not_ours(path, "has no random number generator state")
    slots = [(f"optimizer slot {k}.{name}", v) for k, per in optimizer["state"].items()
             if isinstance(per, dict) for name, v in per.items() if torch.is_tensor(v)]
    for name, tensor in [*((f"model weight {k}", v) for k, v in state["model"].items()), *slots]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise checkpoint.not_finite(path, name)


def restore(path_dir: str, model, optimizer, identity: RunIdentity, spec: str | None = None) -> int:
    """Restore rank 0's model/optimizer from the newest intact checkpoint of a run on the same
    data (and, given ``spec``, of that ``--optimizer``); return its epoch (0 if there is none)."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity, expected=expected_member,
                                      optimizer=spec)
    if found is None:
        return 0
    epoch, state, path = found
    load(state, path, model, optimizer)
    return epoch


def find(path_dir: str, identity: RunIdentity, stage: tuple[int, int],
         at_most: int | None = None) -> tuple[int, tuple[dict, Path]] | None:
    """A pipeline stage's newest intact checkpoint (of epoch ``at_most`` or before): ``(epoch,
    (state, path))``, or None."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity, expected=expected_member,
                                      stage=stage, at_most=at_most)
    return None if found is None else (found[0], (found[1], found[2]))


def load(state: dict, path: Path, model, optimizer) -> None:
    """A checkpoint's state (from ``path``) into the model, its optimizer and the RNG."""
    _check_state(state, path)
    try:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as err:
        raise checkpoint.not_ours(path, f"does not fit this model and optimizer "
                                        f"({printable(str(err), 120)})") from None
