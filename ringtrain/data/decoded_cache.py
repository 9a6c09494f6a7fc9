"""An image folder's decoded pixels kept on local disk, so that only the first epoch decodes.

One file per folder split (``train``, ``test``) and host, in the cache folder (``--decode-cache
DIR``, else ``$RINGTRAIN_DECODE_CACHE``, else ``~/.cache/ringtrain/decoded``), shared by the
host's ranks and their DataLoader workers: a row per image of the split, its uint8 pixels as
:func:`ringtrain.data.images.load` returns them, and a stamp per row.
Whoever decodes an image first writes its row, then its stamp (a tag and the CRC-32 of the row),
so a row is used only once it is whole: a process that dies halfway leaves a row without its
stamp, and a row whose bytes do not match its stamp (a machine that crashed before the kernel
wrote both pages, a damaged disk) is decoded again.  Every process checks a row's CRC the first
time it reads it.

Rows are read and written with ``pread``/``pwrite``, not through a mapping: the pages stay the
kernel's page cache, outside the rank's RSS.  Mapped (``MAP_SHARED``), every row a rank read
counted in its RSS with the pages the kernel maps around it: a TensorFlow rank, which reads the
rows itself, grew 67 MiB of file-backed RSS on a 200,000-image folder in 20 steps, and mapping
1,280 random rows of a cached 586 MiB file put all of it in RSS (Linux 6.18: the whole file in
large folios).  Reading costs 5 us a row against 1 us mapped, under 2% of a 32x32 image's step.

Why one file per host rather than one per rank: each epoch gives every rank another shard, so a
rank's own file would hold only what it decoded itself (half the folder after one epoch at -np
2), while the host's file holds, after the first epoch, every image any of its ranks read.
(Not yet measured against a file per rank.)

The pixels are kept before normalisation (``Normalization.apply`` runs on every read), so a
changed ``--normalize`` needs no new cache.  What does invalidate it, held in the file's header
and compared whole (:func:`split_key`): the split's file list, each file's size and mtime, the
image size, ``--max-image-pixels``, Pillow's and its decoders' versions, and this format's.  A
file that fails any check (another key, a bad header, the wrong size, another owner) is replaced,
never read; the replacement is made under a new name and renamed over the old one, so a process
that has the old one open is not cut short.

The cache folder must be this user's and writable by no one else (else a private
``ringtrain-<uid>`` folder inside it is used); every file in it is opened relative to it,
without following symlinks.  The file is allocated whole when made (``posix_fallocate``): a
full disk is then found up front, never as a crash while training.  Anything that keeps the
cache from working (no room, a folder that cannot be written, a lock held for too long) means
no cache: one warning line, and the run decodes as without it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import math
import os
import secrets
import stat
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import printable

ENV = "RINGTRAIN_DECODE_CACHE"
DEFAULT_DIR = "~/.cache/ringtrain/decoded"
FORMAT = 1
MAGIC = b"ringtrain decoded images\n"
HEADER_BYTES = 4096
PAGE = 4096
STAMP_TAG = np.uint64(0x5254 << 48)  # "RT": a row's stamp is this | the row's CRC-32
TAG_MASK = np.uint64(0xFFFF << 48)
CRC_MASK = np.uint64(0xFFFFFFFF)
# Free space the cache leaves on its file system, at least: the larger of these.
KEEP_FREE_BYTES = 1 << 30
KEEP_FREE_SHARE = 0.05
LOCK_SECONDS = 60.0  # how long a rank waits for another that is making the same file

Say = Callable[[str], None]


def cache_dir(flag: str | None) -> str:
    """The cache folder: ``--decode-cache``, else ``$RINGTRAIN_DECODE_CACHE``, else the default."""
    return os.path.expanduser(flag or os.environ.get(ENV) or DEFAULT_DIR)


def decoder_versions() -> str:
    """Pillow's version and its JPEG and PNG libraries': another decoder may round differently."""
    import PIL
    from PIL import features

    return ";".join([f"Pillow {PIL.__version__}"] + [
        f"{name} {features.version(name) or '-'}" for name in ("jpg", "zlib")])


def split_key(root: str, paths: np.ndarray, shape: tuple[int, int, int], max_pixels: int) -> str:
    """What a cache file of a split must have been made for (SHA-256, hex): the split's folder,
    every file's name, size and mtime (one ``stat`` each, on rank 0 at start-up), the decoded
    shape, the pixel limit, the decoder, and this format."""
    digest = hashlib.sha256()
    head = {"format": FORMAT, "root": os.path.realpath(root), "shape": list(shape),
            "max_pixels": max_pixels, "decoder": decoder_versions(), "files": len(paths)}
    digest.update(json.dumps(head, sort_keys=True).encode())
    for name in paths:
        path = os.path.join(root, os.fsdecode(name))
        try:
            st = os.stat(path)
            digest.update(b"%s\0%d\0%d\n" % (bytes(name), st.st_size, st.st_mtime_ns))
        except OSError:  # gone or unreadable: decoding will say so, naming it
            digest.update(b"%s\0missing\n" % bytes(name))
    return digest.hexdigest()


@dataclass(frozen=True)
class Layout:
    rows: int
    shape: tuple[int, int, int]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape)

    @property
    def pixels_at(self) -> int:
        return HEADER_BYTES + -(-8 * self.rows // PAGE) * PAGE

    @property
    def size(self) -> int:
        return self.pixels_at + self.rows * self.row_bytes


def file_name(root: str, split: str) -> str:
    """One name per folder split: a changed folder, size or decoder replaces its file."""
    return hashlib.sha256(f"{os.path.realpath(root)}\0{split}".encode()).hexdigest()[:24] + f"-{split}.pixels"


def header(key: str, layout: Layout, root: str, split: str) -> bytes:
    text = json.dumps({"format": FORMAT, "key": key, "rows": layout.rows, "shape": list(layout.shape),
                       "root": os.path.realpath(root), "split": split}).encode()
    return (MAGIC + text + b"\n").ljust(HEADER_BYTES, b"\0")


def header_matches(fd: int, key: str, layout: Layout) -> bool:
    """The file at ``fd`` is this user's regular file of the layout's size, and its header is
    ours and names ``key``."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != layout.size:
        return False
    head = os.pread(fd, HEADER_BYTES, 0)
    if not head.startswith(MAGIC):
        return False
    try:
        meta = json.loads(head[len(MAGIC):].split(b"\n", 1)[0])
        return (meta.get("format") == FORMAT and meta.get("key") == key
                and meta.get("rows") == layout.rows and meta.get("shape") == list(layout.shape))
    except (ValueError, AttributeError):
        return False


def private_dir(path: str) -> tuple[int, str]:
    """An open descriptor of a folder at or inside ``path`` that is this user's and writable by
    no one else (``path`` itself, else ``path/ringtrain-<uid>``, made with mode 0700), and its
    name; an ``OSError`` saying why there is none."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    for candidate in (path, os.path.join(path, f"ringtrain-{os.getuid()}")):
        if candidate != path:
            try:
                os.mkdir(candidate, 0o700)
            except FileExistsError:
                pass
        fd = os.open(candidate, os.O_RDONLY | os.O_DIRECTORY | (0 if candidate == path else os.O_NOFOLLOW))
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return fd, candidate
        os.close(fd)
    raise OSError(errno.EPERM, f"{path} is shared with other users, and so is its ringtrain-"
                               f"{os.getuid()} folder")


class DecodedCache:
    """One split's cache file, open in this process.  Pickled (to a DataLoader worker) as its
    folder, name, key and layout: the worker opens the same file again, after the same checks,
    or goes without."""

    # A gather of more rows than this reads the whole stamp block in one call (an epoch's share,
    # :meth:`filled`), fewer read a stamp each.
    WHOLE_STAMPS_FROM = 512

    def __init__(self, directory: str, name: str, key: str, layout: Layout) -> None:
        self.directory, self.name, self.key, self.layout = directory, name, key, layout
        self._fd: int | None = None
        self._verified: np.ndarray | None = None  # rows whose CRC this process has checked
        self._attached = False

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "name": self.name, "key": self.key, "layout": self.layout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], state["name"], state["key"], state["layout"])

    def __del__(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    # --- opening -------------------------------------------------------------------------------

    def _open(self, fd: int) -> None:
        """Keep a descriptor of the checked file (``fd`` stays the caller's)."""
        self._fd = os.dup(fd)
        self._verified = np.zeros(self.layout.rows, bool)
        self._attached = True

    def _attach(self) -> bool:
        """Open the file again (a DataLoader worker): only if it is still the one the rank
        checked (same key); a worker without it decodes."""
        if self._attached:
            return self._fd is not None
        self._attached = True
        try:
            dir_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                st = os.fstat(dir_fd)
                if st.st_uid != os.getuid() or st.st_mode & 0o022:
                    return False
                fd = os.open(self.name, os.O_RDWR | os.O_NOFOLLOW, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            try:
                if header_matches(fd, self.key, self.layout):
                    self._open(fd)
            finally:
                os.close(fd)
        except (OSError, ValueError):
            self._fd = None
        return self._fd is not None

    # --- rows ----------------------------------------------------------------------------------

    def _stamps(self, indices: np.ndarray) -> np.ndarray:
        """The stamps of ``indices`` as the file holds them now."""
        if len(indices) >= self.WHOLE_STAMPS_FROM:
            block = os.pread(self._fd, 8 * self.layout.rows, HEADER_BYTES)
            return np.frombuffer(block, np.uint64)[indices]
        out = np.empty(len(indices), np.uint64)
        fd, view = self._fd, memoryview(out).cast("B")
        for j, i in enumerate(indices.tolist()):
            os.preadv(fd, [view[8 * j:8 * j + 8]], HEADER_BYTES + 8 * i)
        return out

    def filled(self, indices: np.ndarray) -> np.ndarray:
        """Which of ``indices`` have a stamp (their CRC is checked when read)."""
        if not self._attach():
            return np.zeros(len(indices), bool)
        return (self._stamps(indices) & TAG_MASK) == STAMP_TAG

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``indices`` (uint8 ``[B, H, W, C]``, a copy) and which of them are good
        (stamped, and their bytes match the stamp); the others' pixels are to be decoded."""
        indices = np.asarray(indices, np.int64)
        layout = self.layout
        pixels = np.empty((len(indices), *layout.shape), np.uint8)
        if not self._attach():
            return pixels, np.zeros(len(indices), bool)
        stamps = self._stamps(indices)  # the stamps before the pixels: a row stamped later waits
        good = (stamps & TAG_MASK) == STAMP_TAG
        fd, verified, size, at = self._fd, self._verified, layout.row_bytes, layout.pixels_at
        for j in np.flatnonzero(good).tolist():
            i = int(indices[j])
            if os.preadv(fd, [pixels[j]], at + i * size) != size:
                good[j] = False
            elif not verified[i]:
                if zlib.crc32(pixels[j]) == int(stamps[j] & CRC_MASK):
                    verified[i] = True
                else:
                    good[j] = False
        return pixels, good

    def put(self, i: int, pixels: np.ndarray) -> None:
        """Row ``i`` decoded: its pixels, then its stamp."""
        if not self._attach():
            return
        layout = self.layout
        row = np.ascontiguousarray(pixels, np.uint8)
        stamp = np.array([STAMP_TAG | np.uint64(zlib.crc32(row))], np.uint64)
        os.pwrite(self._fd, row, layout.pixels_at + i * layout.row_bytes)
        os.pwrite(self._fd, stamp, HEADER_BYTES + 8 * i)
        self._verified[i] = True


def open_split(directory: str, root: str, split: str, key: str, rows: int,
               shape: tuple[int, int, int], say: Say) -> DecodedCache | None:
    """The split's cache under ``directory``: the existing file if it was made for ``key``,
    else a new one (a rank of this host may be making it: the lock file waits for it).  None,
    with one line through ``say``, where there can be none."""
    layout = Layout(rows, shape)
    name = file_name(root, split)
    try:
        dir_fd, where = private_dir(directory)
    except OSError as err:
        say(f"no decode cache: {directory} cannot hold it ({_reason(err)}); give --decode-cache "
            f"a folder of yours, or --no-decode-cache")
        return None
    try:
        lock = os.open(name + ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
        try:
            if not _lock(lock):
                say(f"no decode cache: {where}/{name}.lock was held for {LOCK_SECONDS:.0f} s "
                    f"(another run making the same cache?); this run decodes every epoch")
                return None
            fd = _existing(dir_fd, name, key, layout)
            if fd is None:
                sweep(dir_fd)
                fd = _create(dir_fd, where, name, key, layout, root, split, say)
                if fd is None:
                    return None
            try:
                cache = DecodedCache(where, name, key, layout)
                cache._open(fd)
            finally:
                os.close(fd)
            return cache
        finally:
            os.close(lock)  # releases the lock
    except OSError as err:
        say(f"no decode cache: {where} ({_reason(err)}); this run decodes every epoch")
        return None
    finally:
        os.close(dir_fd)


def sweep(dir_fd: int) -> None:
    """Remove the cache files of folders that are gone (their header's root no longer exists):
    a deleted data set's cache is not kept for ever.  Only this user's regular files with this
    format's header; a file in use keeps its pages for whoever has it open."""
    for entry in os.listdir(dir_fd):
        if not entry.endswith(".pixels") or entry.startswith("."):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dir_fd)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            head = os.pread(fd, HEADER_BYTES, 0)
        finally:
            os.close(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or not head.startswith(MAGIC):
            continue
        try:
            root = json.loads(head[len(MAGIC):].split(b"\n", 1)[0])["root"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(root, str) and root and not os.path.exists(root):
            for gone in (entry, entry + ".lock"):
                try:
                    os.unlink(gone, dir_fd=dir_fd)
                except OSError:
                    pass


def _lock(fd: int) -> bool:
    deadline = time.monotonic() + LOCK_SECONDS
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)


def _existing(dir_fd: int, name: str, key: str, layout: Layout) -> int | None:
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:  # none, a symlink, not ours to open: a new file replaces it
        return None
    try:
        if header_matches(fd, key, layout):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _create(dir_fd: int, where: str, name: str, key: str, layout: Layout, root: str, split: str,
            say: Say) -> int | None:
    """A new file for ``key``, allocated whole, renamed over ``name``; None (said) if there is
    no room for it."""
    fs = os.statvfs(where)
    free, total = fs.f_bavail * fs.f_frsize, fs.f_blocks * fs.f_frsize
    keep = max(KEEP_FREE_BYTES, int(KEEP_FREE_SHARE * total))
    if free - layout.size < keep:
        say(f"no decode cache: {where} has {free / 1e9:.1f} GB free, and the cache of this folder's "
            f"{split} split needs {layout.size / 1e9:.2f} GB (leaving at least {keep / 1e9:.1f} GB "
            f"free); give --decode-cache a folder with room, or --no-decode-cache")
        return None
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    try:
        try:
            os.posix_fallocate(fd, 0, layout.size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            os.ftruncate(fd, layout.size)  # no fallocate here: the room was checked above
        os.pwrite(fd, header(key, layout, root, split), 0)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError as err:
        os.close(fd)
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        say(f"no decode cache: cannot make it in {where} ({_reason(err)}); give --decode-cache "
            f"a folder with room, or --no-decode-cache")
        return None
    return fd


def _reason(err: OSError) -> str:
    return printable(err.strerror or str(err))
