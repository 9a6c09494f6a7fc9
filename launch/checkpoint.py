"""Checkpoint files: where they live, how they are named, and what makes one usable.

The payload is framework-specific (the trainers serialise it), but every checkpoint carries the
same metadata, so a checkpoint from another model, framework or format version is refused with one
line rather than loaded into the wrong tensors.  Files are written atomically (see
:func:`launch.report.atomic_write_bytes`), so a kill mid-save leaves the previous one intact.
"""

from __future__ import annotations

import errno
import os
import re
import sys
from pathlib import Path
from typing import Any

from launch.errors import UserError
from launch.report import atomic_write_bytes

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-epoch(\d{4,})\.(\w+)$")


def ensure_writable(directory: str | os.PathLike, flag: str = "--checkpoint-dir") -> Path:
    """Create the folder and prove we can write into it, before training starts."""
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        what = "checkpoint folder" if flag == "--checkpoint-dir" else f"{flag} folder"
        raise UserError(f"{what} {path} is not writable ({err.strerror}); choose another "
                        f"{flag}") from None
    return path


def path_for(directory: str | os.PathLike, epoch: int, ext: str) -> Path:
    return Path(directory) / f"ckpt-epoch{epoch:04d}.{ext}"


def latest(directory: str | os.PathLike, ext: str) -> Path | None:
    """Newest complete checkpoint (temporary files from interrupted saves never match)."""
    found = []
    for entry in Path(directory).glob(f"ckpt-epoch*.{ext}"):
        m = _NAME.match(entry.name)
        if m:
            found.append((int(m.group(1)), entry))
    return max(found)[1] if found else None


# A save that fails for want of space is not worth the run: training itself is unaffected, the
# previous checkpoint is intact (saves are atomic), and stopping a fixed job would cost every
# rank's work since it, while an elastic job would only hand the failing save to the next rank 0.
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def save(directory: str | os.PathLike, epoch: int, ext: str, payload: bytes) -> Path | None:
    """Write the epoch's checkpoint atomically.  On a full disk (or quota), print one warning
    line naming the checkpoint that is still intact and return None: the job trains on."""
    path = path_for(directory, epoch, ext)
    try:
        atomic_write_bytes(path, payload)
    except OSError as err:
        if err.errno not in _DISK_FULL:
            raise
        newest = latest(directory, ext)
        kept = f"{newest.name} is intact" if newest else "no earlier checkpoint exists"
        sys.stderr.write(f"warning: checkpoint {path.name} not saved: {err.strerror} in "
                         f"{directory} ({len(payload) / 1e6:.1f} MB needed); {kept}; training "
                         f"goes on, free space to save the next epochs\n")  # one write: MPI tags
        sys.stderr.flush()
        return None
    return path


def config_of(args) -> dict[str, Any]:
    """The run's flags as a checkpoint records them (not those that only steer this session)."""
    return {k: v for k, v in vars(args).items() if k not in ("resume", "no_progress")}


def metadata(framework: str, model: str, param_count: int, epoch: int,
             config: dict[str, Any]) -> dict[str, Any]:
    return {"format_version": FORMAT_VERSION, "framework": framework, "model": model,
            "param_count": param_count, "epoch": epoch, "config": config}


def check_metadata(meta: Any, path: Path, framework: str, model: str, param_count: int) -> int:
    """Return the checkpoint's epoch, or raise one clear line on any mismatch."""
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise UserError(f"{path} is not a ringtrain checkpoint; remove it or pick another folder")
    if meta["format_version"] != FORMAT_VERSION:
        raise UserError(f"{path} has checkpoint format {meta['format_version']}, this version "
                        f"reads {FORMAT_VERSION}; start a fresh --checkpoint-dir")
    for key, want in (("framework", framework), ("model", model), ("param_count", param_count)):
        if meta.get(key) != want:
            fix = "the matching trainer"
            config = meta.get("config")
            if key == "model" and isinstance(config, dict):  # the spec as the user typed it
                fix = f"--model {config.get('model', 'cnn')}"
            raise UserError(f"{path} belongs to {key} {meta.get(key)!r}, not {want!r}; resume "
                            f"with {fix} or use another --checkpoint-dir")
    return int(meta["epoch"])
