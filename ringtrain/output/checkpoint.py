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
import stat
import sys
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from ringtrain.errors import UserError, printable
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


def estimated_bytes(param_count: int, state_slots: int) -> int:
    """About one checkpoint's size: float32 weights and ``state_slots`` tensors of optimizer state
    per weight (:func:`ringtrain.optimizer_spec.state_slots`)."""
    return param_count * 4 * (1 + state_slots)


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


def not_ours(path: Path, why: str) -> UserError:
    """A file that is no checkpoint ringtrain wrote, though nothing in it would run."""
    return UserError(f"checkpoint {path} {why}: refused; ringtrain never writes such a file, so "
                     f"remove it (and check who can write to {path.parent}) or use another "
                     f"--checkpoint-dir")


# What resume reads of one file, whatever its zip directory claims: the largest checkpoint of a
# model of N parameters is its float64 weights and momentum (16 bytes each), plus buffers,
# metadata and the RNG state; 32 bytes per parameter and 64 MiB leave room for all of them (the
# MNIST CNN's 184,586 parameters: 1.5 MB written, 70 MB allowed).  A file or an archive beyond
# that is refused before anything in it is read: a 522 KB .npz of deflated zeros held a 512 MiB
# array, and /dev/zero under a checkpoint's name ended in a MemoryError.
FIXED_BYTES = 64 << 20
BYTES_PER_PARAM = 32


def size_limit(param_count: int) -> int:
    return FIXED_BYTES + BYTES_PER_PARAM * max(param_count, 0)


def open_regular(path: Path, limit: int) -> BinaryIO:
    """The checkpoint opened for reading: a regular file (not a symlink, FIFO or device, which
    are refused; a FIFO would block rank 0 for ever), of at most ``limit`` bytes.  The checks are
    made on the open file, so a name swapped after them changes nothing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise not_ours(path, "is a symbolic link (resume follows none)") from None
        raise UserError(f"checkpoint {path} cannot be read ({err.strerror}); fix its "
                        f"permissions or remove it") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise not_ours(path, "is not a regular file (a FIFO, device or folder)")
    if info.st_size > limit:
        os.close(fd)
        raise not_ours(path, f"is {info.st_size / 1e6:.1f} MB, more than a checkpoint of this "
                             f"model can be ({limit / 1e6:.0f} MB)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _is_pickle(data: bytes) -> bool:
    """Whether ``data`` parses as a pickle stream: read opcode by opcode, nothing is executed."""
    try:
        with warnings.catch_warnings():  # its STRING opcodes warn of escapes they parse
            warnings.simplefilter("ignore")
            for _ in pickletools.genops(io.BytesIO(data)):
                pass
    except Exception:  # pickletools raises ValueError and friends on anything that is no pickle
        return False
    return bool(data)


def check_archive(fh: BinaryIO, path: Path, limit: int, expected: Callable[[str], bool]) -> None:
    """Both frameworks' checkpoints are zip archives of stored (uncompressed) members
    (``torch.save``, ``np.savez``): raise :class:`Damaged` for a file that is not a complete one
    (truncated, a failed CRC), and refuse a bare pickle, a compressed member, a member whose
    name ``expected`` rejects and members adding up to more than ``limit`` bytes, all before any
    reader sees the file (``fh``, open on ``path``)."""
    try:
        with zipfile.ZipFile(fh) as archive:
            members = archive.infolist()
            for member in members:
                if member.compress_type != zipfile.ZIP_STORED:
                    raise not_ours(path, f"holds a compressed member ({member.filename}); "
                                         f"ringtrain stores its members uncompressed")
                if not expected(member.filename):
                    raise not_ours(path, f"holds a member ringtrain does not write "
                                         f"({printable(member.filename)})")
            total = sum(member.file_size for member in members)
            if total > limit:
                raise not_ours(path, f"unpacks to {total / 1e6:.1f} MB, more than a checkpoint "
                                     f"of this model can be ({limit / 1e6:.0f} MB)")
            bad = archive.testzip()  # reads every member (stored: no bigger than the file)
    except (zipfile.BadZipFile, EOFError, OSError, ValueError, NotImplementedError) as err:
        fh.seek(0)
        if _is_pickle(fh.read()):
            raise refused(path, "is a bare Python pickle, not a checkpoint archive") from None
        raise Damaged(f"not a complete checkpoint archive: {type(err).__name__}") from None
    finally:
        fh.seek(0)
    if bad is not None:
        raise Damaged(f"member {printable(bad)} fails its CRC check")


def load(path: Path, read: Callable[[BinaryIO, Path], tuple[Any, Any]], limit: int,
         expected: Callable[[str], bool]) -> tuple[Any, Any]:
    """``read``'s ``(metadata, payload)`` of the file at ``path``, once it has passed
    :func:`open_regular` and :func:`check_archive`."""
    with open_regular(path, limit) as fh:
        check_archive(fh, path, limit, expected)
        return read(fh, path)


def restore_newest(directory: str | os.PathLike, ext: str,
                   read: Callable[[BinaryIO, Path], tuple[Any, Any]], identity: Identity, *,
                   expected: Callable[[str], bool] = lambda name: True,
                   stage: Stage | None = None, at_most: int | None = None,
                   optimizer: str | None = None) -> tuple[int, Any, Path] | None:
    """``(epoch, payload, path)`` of the newest usable checkpoint (of pipeline ``stage``; of epoch
    ``at_most`` or before), or None when the folder has none.

    ``read(file, path)`` returns ``(metadata, payload)``; it raises :class:`Damaged` for an
    incomplete file, which is skipped with one warning line for the previous one, and
    :class:`UserError` for one that must stop the run (unsafe, another model, a newer format,
    another stage count, another ``optimizer``: this run's ``--optimizer``, when given).
    ``expected`` says which archive members the framework writes.
    """
    check_stage_count(directory, ext, stage[1] if stage else 1)
    damaged: list[tuple[Path, Damaged]] = []
    limit = size_limit(identity.param_count)
    for path in newest_first(directory, ext, stage):
        if at_most is not None and _epoch_of(path) > at_most:
            continue
        try:
            meta, payload = load(path, read, limit, expected)
        except Damaged as err:
            damaged.append((path, err))
            continue
        epoch = check_metadata(meta, path, identity.framework, identity.model_name,
                               identity.param_count, identity.data.record(), optimizer)
        if stage is not None:
            check_stage(meta, path, stage)
        if damaged:
            which = "; ".join(f"{p.name} is damaged ({err})" for p, err in damaged)
            sys.stderr.write(f"warning: checkpoint {which}; resuming from {path.name}, the newest "
                             f"intact one\n")  # one write: MPI's output tagging splits writes
            sys.stderr.flush()
        return epoch, payload, path
    if damaged:
        path, err = damaged[0]
        raise UserError(f"checkpoint {path} is corrupt ({err}) and no earlier checkpoint in "
                        f"{directory} is intact; delete the damaged files to start afresh, or "
                        f"point --checkpoint-dir at another folder")
    return None


def not_finite(path: Path, what: str) -> UserError:
    """Restored weights that are not finite numbers: ringtrain saves none (a run stops before
    it would, :mod:`ringtrain.training.divergence`), and training from them would only diverge
    at the first step, blaming the learning rate."""
    return not_ours(path, f"holds weights that are not finite numbers ({printable(what)} has "
                          f"NaN or inf values)")


# A save that fails for want of space is not worth the run: training itself is unaffected, the
# previous checkpoint is intact (saves are atomic), and stopping a fixed job would cost every
# rank's work since it, while an elastic job would only hand the failing save to the next rank 0.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _epoch_of(path: Path) -> int:
    return int((_NAME.match(path.name) or _STAGE_NAME.match(path.name)).group(1))


def check_stage(meta: dict, path: Path, stage: Stage) -> None:
    """A stage's file holds that stage of a pipeline of that many stages, as its metadata's
    ``pipeline`` record says (checked for shape first: the file may be anyone's)."""
    saved = meta.get("pipeline")
    if not (isinstance(saved, dict) and _is_int(saved.get("stage"), 0)
            and _is_int(saved.get("stages"), 2) and _is_int(saved.get("params"), 0)
            and _is_list(saved.get("layers"), lambda v: isinstance(v, str))):
        raise not_ours(path, "has malformed metadata (pipeline is not a stage's record)")
    if (saved["stage"], saved["stages"]) != tuple(stage):
        raise UserError(f"{path} says it holds stage {saved['stage']} of {saved['stages']}, its "
                        f"name stage {stage[0]} of {stage[1]}: renamed by hand? use another "
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
    the optimizer whose state it holds (``--optimizer`` as given), the epoch and the flags; a
    pipeline stage's file adds ``pipeline``: its stage, the stage count, its layers and
    parameter count."""
    meta = {"format_version": FORMAT_VERSION, "framework": identity.framework,
            "model": identity.model_name, "param_count": identity.param_count, "epoch": epoch,
            "config": config, "data": identity.data.record(),
            "optimizer": config.get("optimizer") or DEFAULT_OPTIMIZER}
    if stage is not None:
        meta["pipeline"] = stage
    return meta


# What checkpoints written before --optimizer existed hold the state of.
DEFAULT_OPTIMIZER = "sgd"
# What checkpoints written before --data existed were trained on.
_MNIST_RECORD = {"spec": "mnist", "input_shape": [28, 28, 1], "num_classes": 10,
                 "classes": [str(i) for i in range(10)], "normalization": None}


def _data_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    """What makes a checkpoint's data unlike this run's, or None (``saved`` passed
    :func:`_malformed`)."""
    if saved.get("num_classes") != current.get("num_classes"):
        return f"{saved.get('num_classes')} classes there, {current.get('num_classes')} here"
    if list(saved.get("input_shape") or []) != list(current.get("input_shape") or []):
        return f"input shape {tuple(saved.get('input_shape') or [])} there, " \
               f"{tuple(current.get('input_shape') or [])} here"
    # Checkpoints from before inputs of any shape hold float32 images: no input_dtype.
    if saved.get("input_dtype", "float32") != current.get("input_dtype", "float32"):
        return f"{saved.get('input_dtype', 'float32')} inputs there, {current.get('input_dtype')} here"
    theirs, ours = saved.get("classes"), current.get("classes")
    if theirs is not None and ours is not None and list(theirs) != list(ours):
        return printable(f"classes {', '.join(theirs[:4])}... there, {', '.join(ours[:4])}... here")
    ours, theirs = current.get("normalization"), saved.get("normalization")
    if ours and theirs and (theirs["mean"], theirs["std"]) != (ours["mean"], ours["std"]):
        return (f"normalisation mean {theirs['mean']} std {theirs['std']} there, mean "
                f"{ours['mean']} std {ours['std']} here (--normalize, --image-size, "
                f"--train-samples as then)")
    return None


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_list(value: Any, item: Callable[[Any], bool], length: int | None = None) -> bool:
    return (isinstance(value, list) and (length is None or len(value) == length)
            and all(item(v) for v in value))


def _data_malformed(data: Any) -> str | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        return "data is not a mapping"
    if not isinstance(data.get("spec"), str):
        return "data.spec is not text"
    shape = data.get("input_shape")
    if not (_is_list(shape, lambda v: _is_int(v, 1)) and 1 <= len(shape) <= 8):
        return "data.input_shape is not a shape (one to eight positive integers)"
    if data.get("input_dtype", "float32") not in ("float32", "int64"):
        return "data.input_dtype is neither float32 nor int64"
    if not isinstance(data.get("image", True), bool):
        return "data.image is not true or false"
    if not _is_int(data.get("num_classes"), 1):
        return "data.num_classes is not a positive integer"
    if data.get("classes") is not None and not _is_list(data["classes"], lambda v: isinstance(v, str)):
        return "data.classes is not a list of names"
    norm = data.get("normalization")
    if norm is not None and not (isinstance(norm, dict) and _is_list(norm.get("mean"), _is_number)
                                 and _is_list(norm.get("std"), _is_number)):
        return "data.normalization is not a mean and std per channel"
    return None


def _malformed(meta: dict[str, Any]) -> str | None:
    """What in a checkpoint's metadata (of this format) ringtrain could not have written, or
    None: each field's type and range, so that a bad one is a line, not a traceback later."""
    for key in ("framework", "model"):
        if not isinstance(meta.get(key), str):
            return f"{key} is not text"
    if not _is_int(meta.get("param_count"), 0):
        return "param_count is not a whole number"
    if not _is_int(meta.get("epoch"), 1):
        return f"epoch is {printable(repr(meta.get('epoch')), 40)}, not a positive whole number"
    config = meta.get("config")
    if config is not None and not (isinstance(config, dict) and all(isinstance(k, str) for k in config)):
        return "config is not a mapping of flags"
    if isinstance(config, dict) and not isinstance(config.get("model", "cnn"), str):
        return "config.model is not text"
    if not isinstance(meta.get("optimizer", DEFAULT_OPTIMIZER), str):
        return "optimizer is not text"
    if "weight_keys" in meta and not _is_list(meta["weight_keys"], lambda v: isinstance(v, str)):
        return "weight_keys is not a list of names"
    return _data_malformed(meta.get("data"))


def check_metadata(meta: Any, path: Path, framework: str, model: str, param_count: int,
                   data: dict[str, Any] | None = None, optimizer: str | None = None) -> int:
    """Return the checkpoint's epoch, or raise one clear line on any mismatch (the data before
    the model: another class count changes the model's size too, and the data is the cause; the
    optimizer, ``--optimizer`` as given, last: its state is shaped by the model)."""
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise UserError(f"{path} is not a ringtrain checkpoint; remove it or pick another folder")
    version = meta["format_version"]
    if _is_int(version, FORMAT_VERSION + 1):
        raise UserError(f"{path} was written by a newer ringtrain (checkpoint format {version}, "
                        f"this one reads up to {FORMAT_VERSION}); upgrade ringtrain to resume it, "
                        f"or start a fresh --checkpoint-dir")
    if not _is_int(version, FORMAT_VERSION) or version != FORMAT_VERSION:
        raise UserError(f"{path} has checkpoint format {printable(repr(version), 40)}, this "
                        f"version reads {FORMAT_VERSION}; start a fresh --checkpoint-dir")
    why = _malformed(meta)
    if why:
        raise not_ours(path, f"has malformed metadata ({why})")
    if meta["framework"] == framework and data is not None:
        saved = meta.get("data") or _MNIST_RECORD
        why = _data_mismatch(saved, data)
        if why:
            raise UserError(f"{path} was trained on --data {printable(saved['spec'], 80)}, this "
                            f"run's --data {data['spec']} differs ({why}); resume with the same "
                            f"data or use another --checkpoint-dir")
    for key, want in (("framework", framework), ("model", model), ("param_count", param_count)):
        if meta[key] != want:
            fix = "the matching trainer"
            config = meta.get("config")
            if key == "model" and isinstance(config, dict):  # the spec as the user typed it
                fix = f"--model {printable(config.get('model', 'cnn'), 80)}"
            raise UserError(f"{path} belongs to {key} {printable(repr(meta[key]), 80)}, not "
                            f"{want!r}; resume with {fix} or use another --checkpoint-dir")
    saved = meta.get("optimizer", DEFAULT_OPTIMIZER)
    if optimizer is not None and saved != optimizer:
        saved = printable(saved, 80)
        raise UserError(f"{path} holds the state of --optimizer {saved}, this run has --optimizer "
                        f"{optimizer}; resume with --optimizer {saved}, or use another "
                        f"--checkpoint-dir to start {optimizer} afresh")
    return meta["epoch"]
