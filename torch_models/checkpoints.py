"""PyTorch checkpoint files: ``torch.save`` archives of plain data and tensors, read back with
``weights_only=True`` (:mod:`ringtrain.output.checkpoint` does the rest: names, metadata, the
checks that come before any reader, the fall back past a damaged file)."""

from __future__ import annotations

import argparse
import io
import pickle

import torch

from ringtrain.output import checkpoint
from ringtrain.training.run import RunIdentity

EXT = "pt"


def save(path_dir: str, epoch: int, model, optimizer, identity: RunIdentity,
         args: argparse.Namespace, stage: dict | None = None) -> None:
    """The checkpoint of ``epoch``: the whole model's, or a pipeline stage's (``stage``: its
    :func:`ringtrain.output.checkpoint.metadata` record, ``stage`` and ``stages`` in it)."""
    buf = io.BytesIO()
    torch.save({
        "meta": checkpoint.metadata(identity, epoch, checkpoint.config_of(args), stage),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }, buf)
    checkpoint.save(path_dir, epoch, EXT, buf.getvalue(),
                    (stage["stage"], stage["stages"]) if stage else None)


def read(path) -> tuple[object, dict]:
    """``(metadata, state)`` of one checkpoint archive: tensors and plain data only
    (``weights_only=True``), so nothing in the file runs while it is read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # the archive is intact (its CRCs passed): it holds objects
        raise checkpoint.refused(path, "holds Python objects beyond tensors and plain data") from None
    except Exception as err:  # torch raises many types for damaged files
        raise checkpoint.Damaged(type(err).__name__) from None
    return (state.get("meta") if isinstance(state, dict) else None), state


def restore(path_dir: str, model, optimizer, identity: RunIdentity) -> int:
    """Restore rank 0's model/optimizer from the newest intact checkpoint of a run on the same
    data; return its epoch (0 if there is none)."""
    found = checkpoint.restore_newest(path_dir, EXT, read, identity)
    if found is None:
        return 0
    epoch, state = found
    load(state, model, optimizer)
    return epoch


def find(path_dir: str, identity: RunIdentity, stage: tuple[int, int],
         at_most: int | None = None) -> tuple[int, dict] | None:
    """A pipeline stage's newest intact checkpoint (of epoch ``at_most`` or before): ``(epoch,
    state)``, or None."""
    return checkpoint.restore_newest(path_dir, EXT, read, identity, stage, at_most)


def load(state: dict, model, optimizer) -> None:
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
