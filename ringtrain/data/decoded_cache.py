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
and compared whole, has two parts.  The folder's (:func:`split_key`), made once on rank 0 and
sent to every rank with the folder's index: the split's folder and its file names in row order
(row i is the i-th name), the image size, ``--max-image-pixels``, Pillow's and its decoders'
versions, and this format's.  The host's (:func:`host_key`), added by every rank from its own
host's copy as it opens the file: each file's size, mtime, ctime, inode and device (one ``stat``
per file and rank, at start-up: 3 to 6 us a file here, 50,000 files on ext4 with the 2 cores
busy, so about a second for 200,000; rank 0 alone made such a stat before, for every host).

Why the stat is each host's own, not rank 0's: each host decodes its own copy of the folder, so
its rows are its own files' pixels, and only its own stat can say whether those files changed
(with rank 0's stat as the key, a host whose copy had changed while rank 0's had not kept its
old rows); and a file's ctime, inode and device differ between hosts' copies anyway, so they
could not travel.  What travels is what every host must agree on: which file is row i.  Why
ctime, inode and device besides size and mtime: ``cp -p``, ``tar x`` and ``rsync -t`` restore a
file's mtime, so a picture replaced by another of the same byte size kept its key and the cache
served the old pixels.  Writing a file, or renaming one into place, sets its ctime from the
kernel's clock, which no user can set (``utime`` sets atime and mtime only), and ``tar x`` and
``rsync`` write a new file: a new inode.  The contents are not hashed: that would read the whole
folder on every host at every start.  What the stat misses: a rewrite in place within the same
tick of the kernel's clock as the file's previous change (a few ms, where the file system keeps
coarse timestamps); root setting the clock back; a file changed while the run is running (the
stat is taken at start-up).  What it catches needlessly: a ``chmod`` or ``chown``, and a mount
that numbers its device anew (some network and btrfs mounts): the cache is made again, an
epoch of decoding, never a wrong pixel.
A file that fails any check (another key, a bad header, the wrong size, another owner) is
replaced, never read; the replacement is made under a new name and renamed over the old one, so
a process that has the old one open is not cut short.

The cache folder must be this user's and writable by no one else (else a private
``ringtrain-<uid>`` folder inside it is used); every file in it is opened relative to it,
without following symlinks.  The folder's own path is walked one name at a time (``openat`` with
``O_NOFOLLOW``), and a symbolic link on it is followed only where this user or root owns it: a
link that another user planted as the cache path (in ``/tmp`` or a shared scratch folder, before
the user's first run there) would otherwise steer the cache into a folder of their choosing.
Such a link means no cache.  The user's own links (``~/.cache`` on a scratch disk) are followed.

The file is allocated whole when made (``posix_fallocate``): a full disk is then found up front,
never as a crash while training.  Anything that keeps the cache from working (no room, a folder
that cannot be written, a lock held for too long) means no cache: one warning line, and the run
decodes as without it.  So does an I/O error once the file is open (a refused write: ``EFBIG``,
``ENOSPC``, ``EDQUOT``, ``EIO``; a read or write cut short: a file truncated under the run): the
cache is off in that process from then on, one warning line, and the batch is decoded.  Off, not
closed: TensorFlow's ``map`` calls :meth:`DecodedCache.gather` from several threads, and a
descriptor closed under another thread's read could be reused by a file opened meanwhile; it is
closed with the object.  The line goes through the rank's ``say`` (printed by the host's first
rank); a DataLoader worker, which cannot carry the rank's callback, prints it to its stderr where
its rank would: at most one line per process.
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
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ringtrain.errors import printable
from ringtrain.runtime import first_on_this_host

ENV = "RINGTRAIN_DECODE_CACHE"
DEFAULT_DIR = "~/.cache/ringtrain/decoded"
FORMAT = 2  # 2: the key adds each host's own stat of every file (ctime, inode, device)
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
LINK_HOPS = 40  # symbolic links followed on the cache folder's path, at most (Linux's own limit)

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
    """The folder's part of a split's key (SHA-256, hex), made on rank 0 and sent to every rank:
    the split's folder, its file names in row order, the decoded shape, the pixel limit, the
    decoder, and this format.  No file's stat: that is each host's (:func:`host_key`)."""
    digest = hashlib.sha256()
    head = {"format": FORMAT, "root": os.path.realpath(root), "shape": list(shape),
            "max_pixels": max_pixels, "decoder": decoder_versions(), "files": len(paths)}
    digest.update(json.dumps(head, sort_keys=True).encode())
    for name in paths:
        digest.update(bytes(name) + b"\0")
    return digest.hexdigest()


def host_key(key: str, root: str, paths: np.ndarray) -> str:
    """What this host's cache file of a split must have been made for (SHA-256, hex): the
    folder's part ``key`` and, per file of this host's copy, its size, mtime, ctime, inode and
    device (one ``stat`` each, when the rank opens the cache).  ctime, inode and device are what
    a same-size replacement with its mtime restored (``cp -p``, ``tar x``, ``rsync -t``)
    changes; the module's docstring says why they are this host's and not rank 0's."""
    digest = hashlib.sha256(key.encode() + b"\n")
    for name in paths:
        try:
            st = os.stat(os.path.join(root, os.fsdecode(name)))
            digest.update(b"%d %d %d %d %d\n" % (st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                                  st.st_ino, st.st_dev))
        except OSError:  # gone or unreadable: decoding will say so, naming it
            digest.update(b"missing\n")
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


def open_folder(path: str, make: bool = False) -> int:
    """An open descriptor of the folder ``path`` (made where missing, with the folders above it,
    where ``make``), its names resolved here one at a time with ``O_NOFOLLOW``: a symbolic link
    on the way is followed only where this user or root owns it (root's: ``/var/run`` and their
    like, and root can do anything anyway).  Another user's link is an ``OSError`` naming it."""
    absolute = path.startswith("/")
    todo = path.split("/")[::-1]  # a stack: the next name last
    fd = os.open("/" if absolute else ".", os.O_RDONLY | os.O_DIRECTORY)
    walked, hops = "/" if absolute else "", 0
    try:
        while todo:
            part = todo.pop()
            if part in ("", "."):
                continue
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except FileNotFoundError:
                hops += 1  # bounds a folder that another process keeps removing
                if not make or hops > LINK_HOPS:
                    raise
                last = all(p in ("", ".") for p in todo)
                with contextlib.suppress(FileExistsError):  # os.makedirs's modes
                    os.mkdir(part, 0o700 if last else 0o777, dir_fd=fd)
                todo.append(part)
                continue
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                # The name is not a folder: a symbolic link (ELOOP under O_NOFOLLOW), or a file.
                # Its owner is read before and after its target, so that a link swapped in
                # between (in a folder another user can write to) is not followed either.
                link = os.path.join(walked, part)
                before = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(before.st_mode):
                    raise
                target = os.readlink(part, dir_fd=fd)
                after = os.stat(part, dir_fd=fd, follow_symlinks=False)
                if (after.st_ino, after.st_uid) != (before.st_ino, before.st_uid) \
                        or before.st_uid not in (os.getuid(), 0):
                    raise OSError(errno.EPERM, f"{link} is a symbolic link of another user's (uid "
                                               f"{before.st_uid}), not followed") from None
                hops += 1
                if hops > LINK_HOPS:
                    raise OSError(errno.ELOOP, f"{link}: too many symbolic links") from None
                todo.extend(target.split("/")[::-1])
                if target.startswith("/"):
                    os.close(fd)
                    fd, walked = os.open("/", os.O_RDONLY | os.O_DIRECTORY), "/"
                continue
            os.close(fd)
            fd, walked = nxt, os.path.join(walked, part)
        return fd
    except BaseException:
        os.close(fd)
        raise


def private_dir(path: str) -> tuple[int, str]:
    """An open descriptor of a folder at or inside ``path`` that is this user's and writable by
    no one else (``path`` itself, else ``path/ringtrain-<uid>``, made with mode 0700), and its
    name; an ``OSError`` saying why there is none (another user's symbolic link on ``path``
    among the reasons: :func:`open_folder`)."""
    top = open_folder(path, make=True)
    inner = f"ringtrain-{os.getuid()}"
    try:
        st = os.fstat(top)
        if st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return os.dup(top), path
        with contextlib.suppress(FileExistsError):
            os.mkdir(inner, 0o700, dir_fd=top)
        fd = os.open(inner, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
    finally:
        os.close(top)
    st = os.fstat(fd)
    if st.st_uid == os.getuid() and not st.st_mode & 0o022:
        return fd, os.path.join(path, inner)
    os.close(fd)
    raise OSError(errno.EPERM, f"{path} is shared with other users, and so is its {inner} folder")


def say_on_stderr(message: str) -> None:
    """A DataLoader worker's ``say`` (the rank's own is a closure, which does not pickle): the
    line on stderr, where the rank's would be printed (the host's first rank's workers)."""
    if first_on_this_host():
        print(f"warning: {message}", file=sys.stderr, flush=True)


class DecodedCache:
    """One split's cache file, open in this process.  Pickled (to a DataLoader worker) as its
    folder, name, key and layout: the worker opens the same file again, after the same checks,
    or goes without.  An I/O error or a short read or write turns it off in this process, said
    once through ``say`` (the rank's; :func:`say_on_stderr` in a worker)."""

    # A gather of more rows than this reads the whole stamp block in one call (an epoch's share,
    # :meth:`filled`), fewer read a stamp each.
    WHOLE_STAMPS_FROM = 512

    def __init__(self, directory: str, name: str, key: str, layout: Layout,
                 say: Say | None = None) -> None:
        self.directory, self.name, self.key, self.layout = directory, name, key, layout
        self.say = say or say_on_stderr
        self._fd: int | None = None
        self._verified: np.ndarray | None = None  # rows whose CRC this process has checked
        self._attached = False
        self._off = False  # an I/O error was met: no more reads or writes (the fd stays open)
        self._off_lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "name": self.name, "key": self.key, "layout": self.layout}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], state["name"], state["key"], state["layout"])

    def __del__(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    # --- opening and turning off --------------------------------------------------------------

    def _open(self, fd: int) -> None:
        """Keep a descriptor of the checked file (``fd`` stays the caller's)."""
        self._fd = os.dup(fd)
        self._verified = np.zeros(self.layout.rows, bool)
        self._attached = True

    def _attach(self) -> bool:
        """Open the file again (a DataLoader worker): only if it is still the one the rank
        checked (same key); a worker without it decodes."""
        if self._attached:
            return self._fd is not None and not self._off
        self._attached = True
        try:
            dir_fd = open_folder(self.directory)
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

    def _turn_off(self, why: str) -> None:
        """No more cache in this process, said once: the file failed under it."""
        with self._off_lock:  # two threads of TensorFlow's map may fail at once
            if self._off:
                return
            self._off = True
        self.say(f"decode cache off in this process: {self.directory}/{self.name}: {why}; "
                 f"its images are decoded from now on")

    def _failed(self, err: OSError) -> None:
        self._turn_off(_reason(err) + (f" ({errno.errorcode[err.errno]})"
                                       if err.errno in errno.errorcode else ""))

    # --- rows ----------------------------------------------------------------------------------

    def _stamps(self, indices: np.ndarray) -> np.ndarray:
        """The stamps of ``indices`` as the file holds them now; a :class:`ShortRead` where the
        file ends before them."""
        if len(indices) >= self.WHOLE_STAMPS_FROM:
            block = os.pread(self._fd, 8 * self.layout.rows, HEADER_BYTES)
            if len(block) != 8 * self.layout.rows:
                raise ShortRead(len(block), 8 * self.layout.rows)
            return np.frombuffer(block, np.uint64)[indices]
        out = np.empty(len(indices), np.uint64)
        fd, view = self._fd, memoryview(out).cast("B")
        for j, i in enumerate(indices.tolist()):
            got = os.preadv(fd, [view[8 * j:8 * j + 8]], HEADER_BYTES + 8 * i)
            if got != 8:  # else the stamp would be whatever np.empty left there
                raise ShortRead(got, 8)
        return out

    def filled(self, indices: np.ndarray) -> np.ndarray:
        """Which of ``indices`` have a stamp (their CRC is checked when read)."""
        if self._attach():
            try:
                return (self._stamps(indices) & TAG_MASK) == STAMP_TAG
            except OSError as err:
                self._failed(err)
        return np.zeros(len(indices), bool)

    def gather(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows of ``indices`` (uint8 ``[B, H, W, C]``, a copy) and which of them are good
        (stamped, and their bytes match the stamp); the others' pixels are to be decoded (all of
        them once the cache is off)."""
        indices = np.asarray(indices, np.int64)
        layout = self.layout
        pixels = np.empty((len(indices), *layout.shape), np.uint8)
        if not self._attach():
            return pixels, np.zeros(len(indices), bool)
        try:
            stamps = self._stamps(indices)  # the stamps before the pixels: a row stamped later waits
            good = (stamps & TAG_MASK) == STAMP_TAG
            fd, verified, size, at = self._fd, self._verified, layout.row_bytes, layout.pixels_at
            for j in np.flatnonzero(good).tolist():
                i = int(indices[j])
                got = os.preadv(fd, [pixels[j]], at + i * size)
                if got != size:  # the file is allocated whole: cut short under the run
                    raise ShortRead(got, size)
                if not verified[i]:
                    if zlib.crc32(pixels[j]) == int(stamps[j] & CRC_MASK):
                        verified[i] = True
                    else:
                        good[j] = False
        except OSError as err:
            self._failed(err)
            return pixels, np.zeros(len(indices), bool)
        return pixels, good

    def put(self, i: int, pixels: np.ndarray) -> None:
        """Row ``i`` decoded: its pixels, then its stamp (no stamp if the row was not all
        written)."""
        if not self._attach():
            return
        layout = self.layout
        row = np.ascontiguousarray(pixels, np.uint8)
        stamp = np.array([STAMP_TAG | np.uint64(zlib.crc32(row))], np.uint64)
        try:
            for part, at in ((row, layout.pixels_at + i * layout.row_bytes), (stamp, HEADER_BYTES + 8 * i)):
                wrote = os.pwrite(self._fd, part, at)
                if wrote != part.nbytes:  # RLIMIT_FSIZE cuts a write at its limit, then EFBIG
                    raise ShortWrite(wrote, part.nbytes)
        except OSError as err:
            self._failed(err)
            return
        self._verified[i] = True


class ShortRead(OSError):
    """A read that ended before its bytes (no ``errno``: the kernel reported none)."""

    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"read {got} of {wanted} bytes: the file was cut short")


class ShortWrite(OSError):
    def __init__(self, got: int, wanted: int) -> None:
        super().__init__(f"wrote {got} of {wanted} bytes")


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
                cache = DecodedCache(where, name, key, layout, say)
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
    fs = os.fstatvfs(dir_fd)
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
