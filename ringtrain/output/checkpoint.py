"""Checkpoint files: where they live, how they are named, and what makes one usable.

The payload is framework-specific (the trainers serialise it), but every checkpoint carries the
same metadata, so a checkpoint from another model, framework or format version is refused with one
line rather than loaded into the wrong tensors.  Files are written atomically (see
:func:`ringtrain.output.files.atomic_write_bytes`), so a kill mid-save leaves the previous one intact.

Nothing in a checkpoint runs.  Checkpoint folders are shared (NFS, object stores), so whoever can
write one could otherwise run code as the training user on rank 0: PyTorch's files are read with
``torch.load(weights_only=True)``, NumPy's with ``allow_pickle=False``, and both frameworks write zip
archives, so :func:`check_archive` sorts out everything else before a reader sees it: a file that
is not a complete archive is *damaged* (resume falls back to the previous checkpoint and says so),
one that is a pickle, or an archive holding more than tensors and plain data, is *refused*.
"""

from __future__ import annotations

import errno
import io
import os
import pickletools
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ringtrain.errors import UserError
from ringtrain.faults import termination
from ringtrain.output.files import atomic_write_bytes

FORMAT_VERSION = 1


class Identity(Protocol):
    """What a checkpoint says it holds (:class:`ringtrain.training.run.RunIdentity` is one)."""

    framework: str
    model_name: str
    param_count: int
    data: Any  # a DataInfo
_NAME = re.compile(r"^ckpt-epoch(\d{4,})\.(\w+)$")
# A pipeline's checkpoint is one file per stage: ckpt-epoch0003-stage1of2.pt, which _NAME does not
# match (a data-parallel run never mistakes one stage for the whole model).
_STAGE_NAME = re.compile(r"^ckpt-epoch(\d{4,})-stage(\d+)of(\d+)\.(\w+)$")
Stage = tuple[int, int]  # (stage, stages) of a pipeline's checkpoint file; None: the whole model


def estimated_bytes(param_count: int, momentum: float) -> int:
    """About one checkpoint's size: float32 weights, and as many momentum slots with momentum."""
    return param_count * 4 * (2 if momentum else 1)


def check_resume_folder(directory: str | os.PathLike) -> None:
    """``--resume`` continues a run: its folder must exist (an empty one starts afresh)."""
    if not Path(directory).is_dir():
        raise UserError(f"--resume: the checkpoint folder {directory} does not exist; fix "
                        f"--checkpoint-dir, or drop --resume to start a new run there")


def path_for(directory: str | os.PathLike, epoch: int, ext: str, stage: Stage | None = None) -> Path:
    part = f"-stage{stage[0]}of{stage[1]}" if stage else ""
    return Path(directory) / f"ckpt-epoch{epoch:04d}{part}.{ext}"


def newest_first(directory: str | os.PathLike, ext: str, stage: Stage | None = None) -> list[Path]:
    """The folder's checkpoints (of one pipeline stage), newest epoch first (temporary files from
    interrupted saves never match)."""
    found = []
    for entry in Path(directory).glob(f"ckpt-epoch*.{ext}"):
        m = _NAME.match(entry.name)
        s = _STAGE_NAME.match(entry.name)
        if (m and stage is None) or (s and stage and (int(s[2]), int(s[3])) == tuple(stage)):
            found.append((int((m or s).group(1)), entry))
    return [path for _, path in sorted(found, reverse=True)]


def stage_counts(directory: str | os.PathLike, ext: str) -> set[int]:
    """The numbers of pipeline stages the folder's checkpoints were written with (1: the whole
    model in one file)."""
    counts = set()
    for entry in Path(directory).glob(f"ckpt-epoch*.{ext}"):
        if _NAME.match(entry.name):
            counts.add(1)
        elif s := _STAGE_NAME.match(entry.name):
            counts.add(int(s[3]))
    return counts


def check_stage_count(directory: str | os.PathLike, ext: str, stages: int) -> None:
    """A run resumes checkpoints written with its own ``--pipeline-stages`` (any number of
    replicas): a stage's file holds that stage's layers only."""
    found = stage_counts(directory, ext)
    if found and stages not in found:
        theirs = max(found)

        def say(n: int) -> str:
            return f"{n} pipeline stages" if n > 1 else "the whole model in one file (no pipeline)"

        raise UserError(f"--resume: {directory} holds checkpoints of {say(theirs)}, this run has "
                        f"--pipeline-stages {stages}; resume with --pipeline-stages {theirs} (any "
                        f"number of replicas) or use another --checkpoint-dir")


def latest(directory: str | os.PathLike, ext: str) -> Path | None:
    """Newest checkpoint by name."""
    found = newest_first(directory, ext)
    return found[0] if found else None


# --- reading: nothing in a file runs -----------------------------------------------------------

class Damaged(Exception):
    """A checkpoint that is not complete (truncated, bit rot): an earlier one can stand in."""


def refused(path: Path, why: str) -> UserError:
    return UserError(f"checkpoint {path} {why}: refused without loading it (loading would run "
                     f"code); ringtrain never writes such a file, so remove it and check who can "
                     f"write to {path.parent}")


def _is_pickle(data: bytes) -> bool:
    """Whether ``data`` parses as a pickle stream: read opcode by opcode, nothing is executed."""
    try:
        for _ in pickletools.genops(io.BytesIO(data)):
            pass
    except Exception:  # pickletools raises ValueError and friends on anything that is no pickle
        return False
    return bool(data)


def check_archive(path: Path) -> None:
    """Both frameworks' checkpoints are zip archives (``torch.save``, ``np.savez``): raise
    :class:`Damaged` for a file that is not a complete one (truncated, a failed CRC), and refuse
    a bare pickle, before any reader sees the file."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member and checks its CRC
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        if _is_pickle(path.read_bytes()):
            raise refused(path, "is a bare Python pickle, not a checkpoint archive") from None
        raise Damaged(f"not a complete checkpoint archive: {type(err).__name__}") from None
    if bad is not None:
        raise Damaged(f"member {bad} fails its CRC check")


def restore_newest(directory: str | os.PathLike, ext: str, read: Callable[[Path], tuple[Any, Any]],
                   identity: Identity, stage: Stage | None = None,
                   at_most: int | None = None) -> tuple[int, Any] | None:
    """``(epoch, payload)`` of the newest usable checkpoint (of pipeline ``stage``; of epoch
    ``at_most`` or before), or None when the folder has none.

    ``read(path)`` returns ``(metadata, payload)``; it raises :class:`Damaged` for an incomplete
    file, which is skipped with one warning line for the previous one, and :class:`UserError` for
    one that must stop the run (unsafe, another model, a newer format, another stage count).
    """
    check_stage_count(directory, ext, stage[1] if stage else 1)
    damaged: list[tuple[Path, Damaged]] = []
    for path in newest_first(directory, ext, stage):
        if at_most is not None and int(_epoch_of(path)) > at_most:
            continue
        try:
            check_archive(path)
            meta, payload = read(path)
        except Damaged as err:
            damaged.append((path, err))
            continue
        epoch = check_metadata(meta, path, identity.framework, identity.model_name,
                               identity.param_count, identity.data.record())
        if stage is not None:
            check_stage(meta, path, stage)
        if damaged:
            which = "; ".join(f"{p.name} is damaged ({err})" for p, err in damaged)
            sys.stderr.write(f"warning: checkpoint {which}; resuming from {path.name}, the newest "
                             f"intact one\n")  # one write: MPI's output tagging splits writes
            sys.stderr.flush()
        return epoch, payload
    if damaged:
        path, err = damaged[0]
        raise UserError(f"checkpoint {path} is corrupt ({err}) and no earlier checkpoint in "
                        f"{directory} is intact; delete the damaged files to start afresh, or "
                        f"point --checkpoint-dir at another folder")
    return None


# A save that fails for want of space is not worth the run: training itself is unaffected, the
# previous checkpoint is intact (saves are atomic), and stopping a fixed job would cost every
# rank's work since it, while an elastic job would only hand the failing save to the next rank 0.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _epoch_of(path: Path) -> str:
    return (_NAME.match(path.name) or _STAGE_NAME.match(path.name)).group(1)


def check_stage(meta: dict, path: Path, stage: Stage) -> None:
    """A stage's file holds that stage of a pipeline of that many stages."""
    saved = meta.get("pipeline") or {}
    if (saved.get("stage"), saved.get("stages")) != tuple(stage):
        raise UserError(f"{path} says it holds stage {saved.get('stage')} of {saved.get('stages')}, "
                        f"its name stage {stage[0]} of {stage[1]}: renamed by hand? use another "
                        f"--checkpoint-dir")


def save(directory: str | os.PathLike, epoch: int, ext: str, payload: bytes,
         stage: Stage | None = None) -> Path | None:
    """Write the epoch's checkpoint (of pipeline ``stage``) atomically.  On a full disk (or
    quota), print one warning line naming the checkpoint that is still intact and return None:
    the job trains on."""
    path = path_for(directory, epoch, ext, stage)
    try:
        atomic_write_bytes(path, payload)
    except OSError as err:
        if err.errno not in _DISK_FULL:
            raise
        newest = (newest_first(directory, ext, stage) or [None])[0]
        kept = f"{newest.name} is intact" if newest else "no earlier checkpoint exists"
        sys.stderr.write(f"warning: checkpoint {path.name} not saved: {err.strerror} in "
                         f"{directory} ({len(payload) / 1e6:.1f} MB needed); {kept}; training "
                         f"goes on, free space to save the next epochs\n")  # one write: MPI tags
        sys.stderr.flush()
        return None
    return path


def save_if_due(args, writes: bool, epoch: int, save: Callable[[int], None]) -> None:
    """After an epoch, the rank that ``writes`` (rank 0; a pipeline stage's first replica) writes
    its checkpoint with the framework's ``save`` (when there is a ``--checkpoint-dir``); a SIGTERM
    that arrives meanwhile lets the save finish."""
    if args.checkpoint_dir and writes:
        with termination.saving():
            save(epoch)


def config_of(args) -> dict[str, Any]:
    """The run's flags as a checkpoint records them (not those that only steer this session)."""
    return {k: v for k, v in vars(args).items() if k not in ("resume", "no_progress")}


def metadata(identity: Identity, epoch: int, config: dict[str, Any],
             stage: dict[str, Any] | None = None) -> dict[str, Any]:
    """Plain types only (``torch.load(weights_only=True)`` reads nothing else): the run's
    identity (framework, model, size, its data's :meth:`~ringtrain.data.dataset.DataInfo.record`),
    the epoch and the flags; a pipeline stage's file adds ``pipeline``: its stage, the stage
    count, its layers and parameter count."""
    meta = {"format_version": FORMAT_VERSION, "framework": identity.framework,
            "model": identity.model_name, "param_count": identity.param_count, "epoch": epoch,
            "config": config, "data": identity.data.record()}
    if stage is not None:
        meta["pipeline"] = stage
    return meta


# What checkpoints written before --data existed were trained on.
_MNIST_RECORD = {"spec": "mnist", "input_shape": [28, 28, 1], "num_classes": 10,
                 "classes": [str(i) for i in range(10)], "normalization": None}


def _data_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What makes a checkpoint's data unlike this run's, or None."""
    if saved.get("num_classes") != current.get("num_classes"):
        return f"{saved.get('num_classes')} classes there, {current.get('num_classes')} here"
    if list(saved.get("input_shape") or []) != list(current.get("input_shape") or []):
        return f"input shape {tuple(saved.get('input_shape') or [])} there, " \
               f"{tuple(current.get('input_shape') or [])} here"
    theirs, ours = saved.get("classes"), current.get("classes")
    if theirs is not None and ours is not None and list(theirs) != list(ours):
        return f"classes {', '.join(theirs[:4])}... there, {', '.join(ours[:4])}... here"
    ours, theirs = current.get("normalization"), saved.get("normalization")
    if ours and theirs and (theirs["mean"], theirs["std"]) != (ours["mean"], ours["std"]):
        return (f"normalisation mean {theirs['mean']} std {theirs['std']} there, mean "
                f"{ours['mean']} std {ours['std']} here (--normalize, --image-size, "
                f"--train-samples as then)")
    return None


def check_metadata(meta: Any, path: Path, framework: str, model: str, param_count: int,
                   data: dict[str, Any] | None = None) -> int:
    """Return the checkpoint's epoch, or raise one clear line on any mismatch (the data before
    the model: another class count changes the model's size too, and the data is the cause)."""
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise UserError(f"{path} is not a ringtrain checkpoint; remove it or pick another folder")
    version = meta["format_version"]
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise UserError(f"{path} was written by a newer ringtrain (checkpoint format {version}, "
                        f"this one reads up to {FORMAT_VERSION}); upgrade ringtrain to resume it, "
                        f"or start a fresh --checkpoint-dir")
    if version != FORMAT_VERSION:
        raise UserError(f"{path} has checkpoint format {version!r}, this version "
                        f"reads {FORMAT_VERSION}; start a fresh --checkpoint-dir")
    if meta.get("framework") == framework and data is not None:
        saved = meta.get("data") or _MNIST_RECORD
        why = _data_mismatch(saved, data)
        if why:
            raise UserError(f"{path} was trained on --data {saved.get('spec')}, this run's --data "
                            f"{data['spec']} differs ({why}); resume with the same data or use "
                            f"another --checkpoint-dir")
    for key, want in (("framework", framework), ("model", model), ("param_count", param_count)):
        if meta.get(key) != want:
            fix = "the matching trainer"
            config = meta.get("config")
            if key == "model" and isinstance(config, dict):  # the spec as the user typed it
                fix = f"--model {config.get('model', 'cnn')}"
            raise UserError(f"{path} belongs to {key} {meta.get(key)!r}, not {want!r}; resume "
                            f"with {fix} or use another --checkpoint-dir")
    return int(meta["epoch"])
