"""Parameter servers' snapshots: each server's slice and optimizer state every ``--commit-every``
updates, so that a lost server costs at most that many of its updates, not the epoch since the
last checkpoint.

A server writes its snapshot into ``--checkpoint-dir`` right after the update that completes
``--commit-every`` updates of the epoch, once the replies that update allows have gone out (the
workers compute meanwhile): one NumPy ``.npz`` archive of uncompressed members, written atomically
(:func:`ringtrain.output.files.atomic_write_bytes`: a temporary file of a fresh name, fsync,
rename), then its previous snapshot is removed.  Synchronous on purpose: a write handed to a
thread would leave the newest snapshot on disk up to twice ``--commit-every`` updates behind
while it runs, and the bound would no longer hold.  Its name says what it holds:
``ps-server1of2-values92293to184586-epoch0002-update000040.npz`` is server 1 of 2, the values
92293..184585 of the flat parameter vector, after 40 updates of epoch 2.  Members:

* ``meta``: JSON text: the format, the model (framework, name, parameter count), the layout
  (server, servers, values, the optimizer (``--optimizer``), its rule and the names of its state
  arrays), the epoch's batches (workers, steps, rows, seed, shuffle, training examples: what
  makes the epoch's batch ``(owner, t)`` the same batch in the resumed job), the epoch, the
  updates, and the optimizer's step count (``optimizer_steps``, Adam's bias correction: a JSON
  integer, exact at any count, where a float32 array would not be past 2^24);
* ``weights``: the slice, float32;
* ``state.NAME``: each of the optimizer's state arrays for the slice, float32 (SGD with momentum:
  ``state.velocity``, none without momentum; Adam and AdamW: ``state.exp_avg``,
  ``state.exp_avg_sq``; RMSprop: ``state.square_avg`` and, with momentum, ``state.velocity``);
  a snapshot of another optimizer is refused in one line naming both;
* ``done``: bool, workers x steps: the batches of the epoch whose gradients this slice holds.

Beside them each server keeps ``ps-server1of2-values92293to184586.updates``, 24 bytes rewritten in
place after every update (its epoch and the updates applied in it; no fsync: it must outlive the
process, which the page cache does, not the machine): what the resumed job compares with the
snapshot to count the updates that were lost.

Loading runs nothing: the file is opened without following a symbolic link
(:func:`ringtrain.output.checkpoint.open_regular`: ``O_NOFOLLOW``, a regular file, a size bound),
checked as an archive of the expected members only (:func:`~ringtrain.output.checkpoint.check_archive`:
a pickle, a compressed or unexpected member, a truncated file are refused before NumPy reads it)
and read with ``allow_pickle=False``; then its metadata must match this job's layout, and every
array its shape, dtype and finiteness.  Any failure is one line naming the file.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain.errors import UserError, printable
from ringtrain.output import checkpoint
from ringtrain.output.files import atomic_write_bytes
from ringtrain.strategies.ps.engine import split

FORMAT, VERSION = "ringtrain-ps-snapshot", 1
_NAME = re.compile(r"^ps-server(\d+)of(\d+)-values(\d+)to(\d+)-epoch(\d{4,})-update(\d{6,})\.npz$")
_MARK_NAME = re.compile(r"^ps-server(\d+)of(\d+)-values(\d+)to(\d+)\.updates$")
_STATE = re.compile(r"^state\.\w+\.npy$")
_MARK = struct.Struct("<8sqq")  # magic, epoch, updates applied in it
_MAGIC = b"RTPSUPD1"
_FIXED = ("meta.npy", "weights.npy", "done.npy")


@dataclass(frozen=True)
class Layout:
    """What one server's snapshot must match to be resumed by this job."""

    framework: str
    model: str
    param_count: int
    size: int                     # the flat vector's length (the trainable parameters)
    server: int
    servers: int
    rule: str                     # the optimizer's form ("torch" | "keras" arithmetic)
    state: tuple[str, ...]        # the names of the optimizer's state arrays
    batches: Mapping[str, Any] = field(default_factory=dict)  # workers, steps, rows, seed, ...
    optimizer: str = "sgd"        # --optimizer (a built-in: the servers apply it)

    @property
    def lo(self) -> int:
        return split(self.size, self.servers)[self.server]

    @property
    def hi(self) -> int:
        return split(self.size, self.servers)[self.server + 1]

    @property
    def workers(self) -> int:
        return int(self.batches["workers"])

    @property
    def steps(self) -> int:
        return int(self.batches["steps"])

    def stem(self) -> str:
        return f"ps-server{self.server}of{self.servers}-values{self.lo}to{self.hi}"

    def file_name(self, epoch: int, updates: int) -> str:
        return f"{self.stem()}-epoch{epoch:04d}-update{updates:06d}.npz"

    def record(self) -> dict[str, Any]:
        return {"framework": self.framework, "model": self.model, "param_count": self.param_count,
                "size": self.size, "server": self.server, "servers": self.servers,
                "values": [self.lo, self.hi], "optimizer": self.optimizer, "rule": self.rule,
                "state": list(self.state),
                "batches": dict(self.batches)}


@dataclass
class Snapshot:
    path: Path
    epoch: int
    updates: int                   # updates of ``epoch`` it holds
    weights: np.ndarray
    state: dict[str, np.ndarray]
    done: np.ndarray               # bool, workers x steps
    steps: int = 0                 # the optimizer's step count


def _names(directory: Path) -> list[tuple[re.Match, Path]]:
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    return [(m, Path(e.path)) for e in entries if (m := _NAME.match(e.name))]


def remove_all(directory: str | os.PathLike, stem: str | None = None) -> None:
    """Every server's snapshots and update marks, of any layout, or of the server whose names
    start with ``stem`` (a fresh run's start: a snapshot of an earlier run must never be resumed
    as this one's; each server clears its own, in case its folder is its host's, and server 0
    every one).  ``unlink`` removes a symbolic link, never what it points to."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return
    for entry in entries:
        ours = stem is None or entry.name.startswith(f"{stem}-") or entry.name == f"{stem}.updates"
        if ours and (_NAME.match(entry.name) or _MARK_NAME.match(entry.name)):
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass


class Store:
    """One server's snapshots in ``directory``: written every ``every`` updates of an epoch, the
    update mark after each update, and at ``--resume`` the newest one of the epoch."""

    def __init__(self, directory: str | os.PathLike, layout: Layout, every: int) -> None:
        self.dir, self.layout, self.every = Path(directory), layout, every
        self.fd: int | None = None
        self.warned = False

    @property
    def mark_path(self) -> Path:
        return self.dir / f"{self.layout.stem()}.updates"

    # --- writing ----------------------------------------------------------------------------

    def start(self) -> None:
        """This session's update mark: a new file of a fresh name renamed over the old one (never
        a file planted under the name), kept open to be rewritten in place."""
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{self.mark_path.name}.", suffix=".tmp")
        try:
            os.write(fd, _MARK.pack(_MAGIC, 0, 0))
            os.replace(tmp, self.mark_path)
        except BaseException:
            os.close(fd)
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        self.fd = fd

    def mark(self, epoch: int, updates: int) -> None:
        """After every update: one ``pwrite`` of 24 bytes into the page cache (1-3 us)."""
        if self.fd is None:
            return
        try:
            os.pwrite(self.fd, _MARK.pack(_MAGIC, epoch, updates), 0)
        except OSError as err:
            # A mark left behind would undercount the updates a resume loses: remove it, so that
            # the resume says it does not know.
            self.fd = None
            try:
                os.unlink(self.mark_path)
            except OSError:
                pass
            self.warn(f"cannot record its updates in {self.mark_path.name} ({err.strerror})")

    def write(self, epoch: int, updates: int, weights: np.ndarray, state: Mapping[str, np.ndarray],
              done: np.ndarray, steps: int = 0) -> float | None:
        """The snapshot after ``updates`` updates of ``epoch``; the seconds it took, or None where
        it could not be written (one warning line, once: training goes on, a lost server then
        costing the updates since its last snapshot)."""
        t0 = time.perf_counter()
        meta = {"format": FORMAT, "version": VERSION, **self.layout.record(), "epoch": epoch,
                "updates": updates, "optimizer_steps": int(steps)}
        buf = io.BytesIO()
        np.savez(buf, meta=np.array(json.dumps(meta)), weights=weights, done=done,
                 **{f"state.{name}": array for name, array in state.items()})
        path = self.dir / self.layout.file_name(epoch, updates)
        try:
            atomic_write_bytes(path, buf.getvalue())
        except OSError as err:
            self.warn(f"could not write its snapshot {path.name} ({err.strerror}); training goes "
                       f"on, and losing this server would cost every update since its last one")
            return None
        for match, old in _names(self.dir):  # its earlier snapshots: this one supersedes them
            if old != path and self._mine(match):
                try:
                    os.unlink(old)
                except FileNotFoundError:
                    pass
        return time.perf_counter() - t0

    def warn(self, what: str) -> None:
        if not self.warned:
            self.warned = True
            sys.stderr.write(f"warning: server rank {self.layout.server} {what}\n")  # one write
            sys.stderr.flush()

    def _mine(self, m: re.Match) -> bool:
        lay = self.layout
        return [int(m[i]) for i in range(1, 5)] == [lay.server, lay.servers, lay.lo, lay.hi]

    # --- reading ----------------------------------------------------------------------------

    def read_mark(self) -> tuple[int, int] | None:
        """(epoch, updates applied in it) that the last session of this server recorded, or None
        where no intact mark is there (then the updates lost are unknown, and said so)."""
        try:
            with checkpoint.open_regular(self.mark_path, 64) as fh:
                raw = fh.read()
        except (UserError, OSError):
            return None
        if len(raw) != _MARK.size:
            return None
        magic, epoch, updates = _MARK.unpack(raw)
        if magic != _MAGIC or epoch < 0 or updates < 0:
            return None
        return epoch, updates

    def newest(self, epoch: int) -> Snapshot | None:
        """This server's newest snapshot of ``epoch``, checked, or None.  A snapshot of that epoch
        of another layout (server count, slices) is one line naming both."""
        lay, fix = self.layout, self._fix()
        mine = []
        for m, path in _names(self.dir):
            if int(m[5]) != epoch:
                continue  # older: the checkpoint holds more; newer: its epoch's checkpoint is gone
            s, servers, lo, hi = (int(m[i]) for i in range(1, 5))
            bounds = split(lay.size, servers) if servers >= 1 else []
            if servers != lay.servers or s >= servers or [lo, hi] != bounds[s:s + 2]:
                raise UserError(
                    f"snapshot {path} holds values {lo}..{hi - 1} of server {s} of {servers}, and "
                    f"this job has {lay.servers} server(s) over {lay.size:,} values (server "
                    f"{lay.server}: {lay.lo}..{lay.hi - 1}); resume with --ps-servers {servers} and "
                    f"the same model, or {fix}")
            if s == lay.server:
                mine.append((int(m[6]), path))
        if not mine:
            return None
        updates, path = max(mine)
        return self._load(path, epoch, updates)

    def _fix(self) -> str:
        return (f"remove the ps-server*.npz files from {self.dir} to resume from the epoch's "
                f"checkpoint (losing the epoch's updates)")

    def _load(self, path: Path, epoch: int, updates: int) -> Snapshot:
        lay = self.layout
        # Any state array's name passes here: another optimizer's state is the layout's line below.
        wanted = {*_FIXED, *(f"state.{name}.npy" for name in lay.state)}
        # Two float32 arrays per state name and the slice, the done matrix and the metadata: the
        # checkpoint's bound for the whole model is far above any slice's.
        limit = checkpoint.size_limit(lay.param_count)
        with checkpoint.open_regular(path, limit) as fh:
            try:
                checkpoint.check_archive(fh, path, limit,
                                         lambda name: name in wanted or _STATE.match(name))
            except checkpoint.Damaged as err:
                raise UserError(f"snapshot {path} is damaged ({err}); {self._fix()}") from None
            try:
                with np.load(fh, allow_pickle=False) as z:
                    got = {name: z[name] for name in z.files}
            except (ValueError, OSError, EOFError) as err:  # an object array: it would need pickle
                raise checkpoint.not_ours(path, f"cannot be read without running code "
                                                f"({printable(str(err), 80)})") from None
        if "meta" not in got:
            raise checkpoint.not_ours(path, "lacks meta.npy")
        meta = self._meta(got["meta"], path)
        self._check_layout(meta, path, epoch, updates)  # before its arrays: they follow the layout
        missing = sorted(wanted - {f"{name}.npy" for name in got})
        extra = sorted({f"{name}.npy" for name in got} - wanted)
        if missing or extra:
            raise checkpoint.not_ours(path, f"holds {', '.join(extra) or 'no other member'} and "
                                            f"lacks {', '.join(missing) or 'none'} of its members")
        n = lay.hi - lay.lo
        arrays = {"weights": got["weights"], **{f"state.{k}": got[f"state.{k}"] for k in lay.state}}
        for name, array in arrays.items():
            if array.dtype != np.float32 or array.shape != (n,):
                raise checkpoint.not_ours(path, f"holds {name} of {array.dtype} {array.shape}, "
                                                f"expected float32 ({n},)")
            if not np.isfinite(array).all():
                raise checkpoint.not_finite(path, name)
        done = got["done"]
        if done.dtype != np.bool_ or done.shape != (lay.workers, lay.steps):
            raise checkpoint.not_ours(path, f"holds done of {done.dtype} {done.shape}, expected "
                                            f"bool ({lay.workers}, {lay.steps})")
        steps = meta.get("optimizer_steps", 0)
        if type(steps) is not int or steps < 0:
            raise checkpoint.not_ours(path, f"holds an optimizer step count of "
                                            f"{printable(repr(steps), 40)}, expected an integer >= 0")
        return Snapshot(path, epoch, updates, arrays["weights"],
                        {k: arrays[f"state.{k}"] for k in lay.state}, done, steps)

    @staticmethod
    def _meta(raw: np.ndarray, path: Path) -> dict[str, Any]:
        try:
            if raw.dtype.kind != "U" or raw.shape != ():
                raise ValueError("not one text")
            meta = json.loads(str(raw))
        except ValueError:
            meta = None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise checkpoint.not_ours(path, "has no parameter-server snapshot metadata")
        if meta.get("version") != VERSION:
            raise UserError(f"snapshot {path} has format version "
                            f"{printable(repr(meta.get('version')), 40)}, this ringtrain reads "
                            f"{VERSION}; remove it, or resume with the ringtrain that wrote it")
        return meta

    def _check_layout(self, meta: dict[str, Any], path: Path, epoch: int, updates: int) -> None:
        """Each recorded fact against this job's, the model first (its size makes the slices)."""
        ours = self.layout.record()
        for key in ("framework", "model", "param_count", "size", "servers", "server", "values",
                    "optimizer", "rule", "state", "batches"):
            # (a snapshot written before the servers applied other optimizers is SGD's)
            recorded = meta.get(key, "sgd" if key == "optimizer" else None)
            if recorded != ours[key]:
                theirs = printable(json.dumps(recorded), 120)
                if key == "optimizer":
                    name = printable(str(recorded), 60)
                    raise UserError(f"snapshot {path} holds the state of --optimizer {name}, this "
                                    f"job runs --optimizer {ours[key]}; resume with --optimizer "
                                    f"{name}, or {self._fix()}")
                raise UserError(f"snapshot {path} was written with {key} {theirs}, this job has "
                                f"{json.dumps(ours[key])}; resume with the job that wrote it "
                                f"(-np, --ps-servers, --model, --optimizer, --momentum, "
                                f"--batch-size, --seed, the data as then), or {self._fix()}")
        if meta.get("epoch") != epoch or meta.get("updates") != updates:
            raise UserError(f"snapshot {path} says it holds epoch "
                            f"{printable(repr(meta.get('epoch')), 20)} after "
                            f"{printable(repr(meta.get('updates')), 20)} updates, its name epoch "
                            f"{epoch} after {updates}: renamed by hand? {self._fix()}")


def held(done: list[np.ndarray | None], workers: int, steps: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Each server's batches of the resumed epoch (its snapshot's ``done``; none without one) and
    those every server holds: the batches server 0 never hands out again."""
    masks = [np.zeros((workers, steps), bool) if d is None else np.asarray(d, bool) for d in done]
    return masks, np.logical_and.reduce(masks)


def lost_updates(mark: tuple[int, int] | None, epoch: int, since: int) -> int | None:
    """The updates a server applied after the snapshot it resumes from (``since`` updates of
    ``epoch``; 0: the epoch's start) that are gone, from its last session's mark; None where that
    is unknown (no intact mark, or one that is behind the snapshot or past the epoch)."""
    if mark is None:
        return None
    mark_epoch, updates = mark
    if mark_epoch < epoch:  # it ended in an earlier epoch, which the checkpoint holds whole
        return 0
    if mark_epoch > epoch or updates < since:
        return None
    return updates - since
