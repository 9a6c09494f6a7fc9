"""Files rank 0 writes: atomically, into folders it has checked before training starts."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from ringtrain.errors import UserError


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int | None = None,
                       durable: bool = True) -> None:
    """Write-then-rename in the target folder: readers see the old file or the new, never half.
    The new file is ``mkstemp``'s (``O_CREAT|O_EXCL``: never a name someone planted), so a symlink
    planted at ``path`` is replaced, not followed.  ``mode``: the file's permissions (mkstemp's
    0600 otherwise); ``durable``: fsync before the rename (checkpoints; not a report)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if mode is not None:
                os.fchmod(fh.fileno(), mode)
            fh.write(data)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def ensure_writable(directory: str | os.PathLike, flag: str = "--checkpoint-dir",
                    need_bytes: int = 0) -> Path:
    """Create the folder and prove we can write into it, and that it has room for ``need_bytes``
    (one checkpoint), before training starts."""
    path = Path(directory)
    what = "checkpoint folder" if flag == "--checkpoint-dir" else f"{flag} folder"
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A new file of a fresh random name, never an existing one: whoever else can write to
        # the folder could have planted a symlink under a name we chose (a ".write-test-<pid>"
        # linked to one of the user's files was emptied by write_bytes, which follows it).
        fd, probe = tempfile.mkstemp(dir=path, prefix=".write-test-")
        os.close(fd)
        os.unlink(probe)
        free = shutil.disk_usage(path).free
    except OSError as err:
        raise UserError(f"{what} {path} is not writable ({err.strerror}); choose another "
                        f"{flag}") from None
    if free < need_bytes:
        raise UserError(f"{what} {path} has {free / 1e6:.1f} MB free, one checkpoint of this model "
                        f"needs about {need_bytes / 1e6:.1f} MB; free space there or choose another "
                        f"{flag}")
    return path
