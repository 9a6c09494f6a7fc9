"""The decoded cache of an image folder (``--data folder:DIR``; ringtrain/data/decoded_cache.py).

In one process, on small folders written here: a row read from the cache is the decoded image
bit for bit, through both frameworks' readers (``FolderData.batch``, which TensorFlow's
``tf.data`` map calls; PyTorch's worker item, and the batches a rank reads itself once the cache
holds an epoch); every part of the key makes a new file; a row without its stamp or with the
wrong bytes is decoded again; a foreign, damaged, cut or linked file is replaced; a folder that
cannot hold the cache means no cache, said once; two processes fill one file together.  Issue 40's
third round: a same-size picture with its mtime restored, and a host whose own copy changed, are
decoded afresh; a refused write (monkeypatched, and the kernel's RLIMIT_FSIZE in a subprocess) or
a file cut short under the run turns the cache off with one line and the batch is decoded;
another user's symlink as the cache path is not followed.  Then a real two-rank job per
framework: the same weights with the cache, without it, and with a cache folder that cannot be
made (one warning line, the run goes on).
"""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, metrics, mounted_tmpfs, requires_horovod, train
from image_folders import corrupt, shapes_folder

from launch import cli
from ringtrain.data import dataset, decoded_cache
from ringtrain.data.dataset import FolderData
from ringtrain.data.decoded_cache import HEADER_BYTES, Layout
from ringtrain.errors import UserError

ALL = np.arange(30)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Path:
    return shapes_folder(tmp_path_factory.mktemp("pictures"), 30, 9, size=16)


@pytest.fixture()
def folder(pictures, tmp_path) -> Path:
    return Path(shutil.copytree(pictures, tmp_path / "data"))


def opened_saying(folder: Path, cache: Path | None, *flags: str) -> tuple[dataset.FolderData, list[str]]:
    """The folder as a rank opens it, its caches in ``cache`` (None: --no-decode-cache), and the
    list its warnings go to (the rank's ``say``)."""
    extra = ["--decode-cache", str(cache)] if cache else ["--no-decode-cache"]
    args = cli.parse("torch", ["--data", f"folder:{folder}", *extra, *flags])
    data = dataset.open_builtin(args)
    said: list[str] = []
    return (data.with_caches(str(cache), said.append) if cache else data), said


def opened(folder: Path, cache: Path | None, *flags: str) -> dataset.FolderData:
    data, said = opened_saying(folder, cache, *flags)
    assert not said, said
    return data


def cache_file(data: dataset.FolderData, split: str = "train") -> Path:
    cache = data.caches[split]
    return Path(cache.directory) / cache.name


# --- the same pixels -------------------------------------------------------------------------------

def test_a_cached_batch_is_the_decoded_batch_bit_for_bit(folder, tmp_path):
    """``FolderData.batch``: what TensorFlow's pipeline reads (and the rank's own batches)."""
    plain = opened(folder, None)
    cached = opened(folder, tmp_path / "cache")
    idx = np.array([3, 17, 0, 29, 8])
    decoded, labels, problem = plain.batch("train", idx)
    first = cached.batch("train", idx)  # decodes, fills
    assert cached.cached_share("train", idx) == 1.0 and cached.cached_share("train", ALL) < 1.0
    again = opened(folder, tmp_path / "cache").batch("train", idx)  # a new process's view
    for x, y, p in (first, again):
        assert x.dtype == np.float32 and np.array_equal(x, decoded) and np.array_equal(y, labels)
        assert p is None and problem is None


def test_normalisation_is_applied_after_the_cache(folder, tmp_path):
    """The cache holds uint8 pixels before normalisation, so it is not part of the key: a cache
    filled under one --normalize serves the other, with the other's numbers."""
    opened(folder, tmp_path / "cache").batch("train", ALL)
    other = opened(folder, tmp_path / "cache", "--normalize", "imagenet")
    assert other.cached_share("train", ALL) == 1.0
    x, _, _ = other.batch("train", ALL)
    assert np.array_equal(x, opened(folder, None, "--normalize", "imagenet").batch("train", ALL)[0])


def test_pytorchs_readers_give_the_decoded_tensors(folder, tmp_path):
    """A DataLoader worker's item (the cache pickled to it, mapped again there), and the epoch a
    rank reads itself once the cache holds it, against the uncached loader's tensors."""
    import pickle

    import torch

    from torch_models.data import FolderImages, Streamed

    plain, cached = opened(folder, None), opened(folder, tmp_path / "cache")
    worker = pickle.loads(pickle.dumps(FolderImages(cached, "train")))
    item = FolderImages(plain, "train")[4]
    assert torch.equal(worker[4][0], item[0]) and worker[4][1:] == item[1:]  # decoded there
    assert cached.cached_share("train", np.array([4])) == 1.0  # and written for everyone
    assert torch.equal(FolderImages(cached, "train")[4][0], item[0])  # read back

    args = cli.parse("torch", ["--data", f"folder:{folder}", "--workers", "0", "--batch-size", "8"])

    def epoch(data: dataset.FolderData, batches):
        streamed = Streamed(data.info, FolderImages(data, "train"), FolderImages(data, "test"),
                            reload=None, args=args, device=torch.device("cpu"), local_size=1,
                            folder=data)
        return list(streamed.epoch(batches)), streamed

    batches = [ALL[s:s + 8] for s in range(0, 30, 8)]
    expected, _ = epoch(plain, batches)
    filled, _ = epoch(cached, batches)  # the loader: the cache is empty yet
    assert cached.cached_share("train", ALL) == 1.0
    read, streamed = epoch(cached, batches)
    assert streamed.sampler.batches == []  # read in the rank: the loader was not asked
    for (xe, ye), (xf, yf), (xr, yr) in zip(expected, filled, read, strict=True):
        assert torch.equal(xe, xf) and torch.equal(xe, xr) and xr.is_contiguous()
        assert torch.equal(ye, yf) and torch.equal(ye, yr) and yr.dtype == torch.int64


def test_an_image_that_does_not_decode_is_named_on_the_rank_path(folder, tmp_path):
    """A cache holding all of an epoch but one image that does not decode: read in the rank,
    the image is NaN and the problem names the file, as the workers' path does."""
    import torch

    from torch_models.data import FolderImages, Streamed

    cached = opened(folder, tmp_path / "cache")
    cached.batch("train", ALL[ALL != 7])
    victim = cached.split("train").path(7)
    corrupt(victim)
    args = cli.parse("torch", ["--data", f"folder:{folder}", "--workers", "0", "--batch-size", "10"])
    streamed = Streamed(cached.info, FolderImages(cached, "train"), FolderImages(cached, "test"),
                        reload=None, args=args, device=torch.device("cpu"), local_size=1, folder=cached)
    batches = [ALL[s:s + 10] for s in range(0, 30, 10)]
    assert cached.cached_share("train", ALL) >= 0.95
    x, _ = next(streamed.epoch(batches))
    assert streamed.bad_batch and torch.isnan(x[7]).all() and not torch.isnan(x[6]).any()
    assert streamed.problem.startswith(f"{victim} is not a readable image")


# --- what makes a new file ------------------------------------------------------------------------

def test_every_part_of_the_key_makes_a_new_cache(folder, tmp_path, monkeypatch):
    base = opened(folder, tmp_path / "cache")
    base.batch("train", ALL)
    path, key = cache_file(base), base.caches["train"].key
    made = os.stat(path).st_ino

    def changed(data: dataset.FolderData) -> bool:
        new = cache_file(data)
        return data.caches["train"].key != key and data.cached_share("train", ALL) == 0.0 \
            and (new != path or os.stat(new).st_ino != made)

    victim = Path(base.split("train").path(5))
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    assert changed(opened(folder, tmp_path / "cache")), "mtime"
    victim.write_bytes(victim.read_bytes() + b"\0")
    assert changed(opened(folder, tmp_path / "cache")), "size"
    shutil.copy(victim, victim.with_name("extra.jpg"))
    assert changed(opened(folder, tmp_path / "cache")), "file list"
    os.unlink(victim.with_name("extra.jpg"))
    assert changed(opened(folder, tmp_path / "cache", "--image-size", "12")), "image size"
    assert changed(opened(folder, tmp_path / "cache", "--max-image-pixels", "5000")), "pixel limit"
    monkeypatch.setattr(decoded_cache, "decoder_versions", lambda: "Pillow 0.0")
    assert changed(opened(folder, tmp_path / "cache")), "decoder"
    monkeypatch.undo()
    # The folder as it is now, opened twice: the same key, the same file, its rows kept.
    now = opened(folder, tmp_path / "cache")
    now.batch("train", ALL[:4])
    assert opened(folder, tmp_path / "cache").cached_share("train", ALL[:4]) == 1.0


def another_picture_of_the_same_size(data: dataset.FolderData, i: int) -> bytes:
    """Another image of the split, its bytes padded to image ``i``'s size with zeros after its
    end marker (which JPEG and PNG decoders do not read): other pixels, the same byte size."""
    part = data.split("train")
    size = os.path.getsize(part.path(i))
    for j in range(len(part.labels)):
        donor = Path(part.path(j)).read_bytes()
        if j != i and part.labels[j] != part.labels[i] and len(donor) <= size:
            return donor + b"\0" * (size - len(donor))
    raise AssertionError("no smaller image of another class")


@pytest.mark.parametrize("how", ["in place (cp -p)", "renamed into place (tar x, rsync -t)"])
def test_a_same_size_picture_with_its_mtime_restored_is_decoded_afresh(how, folder, tmp_path):
    """The key was each file's name, size and mtime: an image replaced by another picture of the
    same byte size, its mtime restored, kept it, and the cache served the old pixels."""
    first = opened(folder, tmp_path / "cache")
    old_x = first.batch("train", ALL)[0]
    victim = Path(first.split("train").path(5))
    before = victim.stat()
    picture = another_picture_of_the_same_size(first, 5)
    # Past the tick of the kernel's clock that stamped the copy's ctime (a few ms where the file
    # system has no fine-grained timestamps): a user's replacement comes later than that.
    time.sleep(0.02)
    if how.startswith("in place"):
        victim.write_bytes(picture)  # cp -p: truncate, write, then restore the times
        os.utime(victim, ns=(before.st_atime_ns, before.st_mtime_ns))
    else:
        tmp = victim.with_name(".incoming")  # rsync -t: a new file, its times set, renamed
        tmp.write_bytes(picture)
        os.utime(tmp, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(tmp, victim)
    after = victim.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert (after.st_ino == before.st_ino) == how.startswith("in place")
    again = opened(folder, tmp_path / "cache")
    assert again.cached_share("train", ALL) == 0.0
    fresh = opened(folder, None).batch("train", ALL)[0]
    assert not np.array_equal(fresh[5], old_x[5])  # the picture did change
    assert np.array_equal(again.batch("train", ALL)[0], fresh)


def test_every_host_checks_its_own_copy_of_the_folder(folder, tmp_path):
    """Rank 0 sends the folder's index and key to every rank.  A host whose own copy changed
    since its cache was filled (rank 0's copy, elsewhere, did not: the index it sends is the
    same) used to match its old file with rank 0's key and serve the old pixels."""
    from ringtrain.training import wire

    rank0 = dataset.open_builtin(cli.parse("torch", ["--data", f"folder:{folder}"]))  # its key
    plain = wire.decode(wire.encode(rank0.to_plain()))  # what another host's rank receives
    said: list[str] = []
    earlier = FolderData.from_plain(plain).with_caches(str(tmp_path / "cache"), said.append)
    old_x = earlier.batch("train", ALL)[0]
    assert earlier.cached_share("train", ALL) == 1.0
    part = earlier.split("train")
    victim = Path(part.path(7))  # this host's copy changes: another picture, another size
    victim.write_bytes(Path(part.path(8)).read_bytes())
    now = FolderData.from_plain(plain).with_caches(str(tmp_path / "cache"), said.append)
    assert not said and now.cached_share("train", ALL) == 0.0
    x = now.batch("train", ALL)[0]
    assert not np.array_equal(x[7], old_x[7]) and np.array_equal(x[7], x[8])
    assert np.array_equal(x, FolderData.from_plain(plain).batch("train", ALL)[0])  # no cache


def test_no_decode_cache_opens_none_and_other_data_refuse_the_flags(folder, tmp_path):
    data = opened(folder, None)
    assert data.cache_keys is None and not data.caches
    assert data.with_caches(str(tmp_path / "cache"), print).caches == {}
    assert not (tmp_path / "cache").exists()
    for flags in (["--no-decode-cache"], ["--decode-cache", "x"]):
        with pytest.raises(UserError, match="works with --data folder:DIR only"):
            cli.parse("torch", flags)
    with pytest.raises(UserError, match="contradict"):
        cli.parse("torch", ["--data", "folder:x", "--decode-cache", "x", "--no-decode-cache"])


# --- rows and files that cannot be trusted ----------------------------------------------------------

def damage_row(cache, i: int, change) -> None:
    """Change row ``i``'s bytes in the file behind the cache's back, as a crash or a disk would."""
    layout = cache.layout
    at = layout.pixels_at + i * layout.row_bytes
    row = np.frombuffer(os.pread(cache._fd, layout.row_bytes, at), np.uint8).copy()
    change(row)
    os.pwrite(cache._fd, row, at)


def test_a_row_without_its_stamp_or_with_other_bytes_is_decoded_again(folder, tmp_path):
    data = opened(folder, tmp_path / "cache")
    plain_x = opened(folder, None).batch("train", ALL)[0]
    cache = data.caches["train"]
    data.batch("train", ALL[:10])
    # A process that died after a row's pixels, before its stamp: the row is not there.
    damage_row(cache, 12, lambda row: row.fill(255))
    # A machine that crashed with a stamp on disk but not its row's page: bytes that do not match.
    reopened = opened(folder, tmp_path / "cache")
    raw = reopened.caches["train"]
    damage_row(raw, 3, lambda row: row.__setitem__(0, row[0] ^ 0xFF))
    fresh = opened(folder, tmp_path / "cache").caches["train"]  # checks CRCs anew
    _, good = fresh.gather(np.array([3, 4, 12]))
    assert good.tolist() == [False, True, False]
    x, _, _ = opened(folder, tmp_path / "cache").batch("train", ALL)
    assert np.array_equal(x, plain_x)  # decoded again where needed, and rewritten
    assert opened(folder, tmp_path / "cache").caches["train"].gather(np.array([3, 12]))[1].all()


@pytest.mark.parametrize("damage", ["garbage", "cut", "header", "link", "foreign"])
def test_a_file_that_is_not_this_caches_is_replaced(damage, folder, tmp_path):
    first = opened(folder, tmp_path / "cache")
    first.batch("train", ALL)
    path = cache_file(first)
    size = path.stat().st_size
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own file")
    if damage == "garbage":
        path.write_bytes(os.urandom(size))
    elif damage == "cut":
        os.truncate(path, size // 2)
    elif damage == "header":  # the right size, another key
        with open(path, "r+b") as fh:
            fh.write(decoded_cache.header("0" * 64, Layout(30, (16, 16, 3)), str(folder), "train"))
    elif damage == "link":
        path.unlink()
        path.symlink_to(victim)
    else:
        if os.getuid() != 0:
            pytest.skip("making another user's file needs root")
        os.chown(path, 4321, 4321)
    again = opened(folder, tmp_path / "cache")
    assert again.cached_share("train", ALL) == 0.0  # nothing read from it
    assert not path.is_symlink() and path.stat().st_uid == os.getuid() and path.stat().st_size == size
    assert victim.read_bytes() == b"the user's own file"
    assert np.array_equal(again.batch("train", ALL)[0], opened(folder, None).batch("train", ALL)[0])


def test_a_shared_cache_folder_gets_a_private_one_inside(folder, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    data = opened(folder, shared)
    assert Path(data.caches["train"].directory) == shared / f"ringtrain-{os.getuid()}"
    assert (shared / f"ringtrain-{os.getuid()}").stat().st_mode & 0o777 == 0o700


def test_a_folder_that_cannot_hold_the_cache_means_none_said_once(folder, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    data = dataset.open_builtin(cli.parse("torch", ["--data", f"folder:{folder}"]))
    said: list[str] = []
    without = data.with_caches(str(blocker / "cache"), said.append)
    assert without.caches == {} and len(said) == 1 and "no decode cache" in said[0]
    assert np.array_equal(without.batch("train", ALL)[0], data.batch("train", ALL)[0])
    with mounted_tmpfs(tmp_path / "small", "2m") as small:  # less free than the cache leaves
        said.clear()
        assert data.with_caches(str(small), said.append).caches == {}
        assert len(said) == 1 and "GB free" in said[0], said


def test_the_caches_of_folders_that_are_gone_are_removed(pictures, tmp_path):
    gone = Path(shutil.copytree(pictures, tmp_path / "gone"))
    old = cache_file(opened(gone, tmp_path / "cache"))
    shutil.rmtree(gone)
    opened(Path(shutil.copytree(pictures, tmp_path / "new")), tmp_path / "cache")
    assert not old.exists() and not Path(f"{old}.lock").exists()


# --- I/O errors once the file is open -----------------------------------------------------------------

def one_line_off(said: list[str], *needles: str) -> None:
    assert len(said) == 1, said
    assert said[0].startswith("decode cache off in this process: ") and "\n" not in said[0], said
    for needle in needles:
        assert needle in said[0], said


@pytest.mark.parametrize("code", [errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.EIO],
                         ids=errno.errorcode.get)
def test_a_refused_write_turns_the_cache_off_with_one_line(code, folder, tmp_path, monkeypatch,
                                                           capfd):
    """A write the kernel refuses after the file was opened (it is allocated whole, but a quota,
    a thin or copy-on-write file system, a failing disk) raised OSError out of the batch."""
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)  # this process is its host's first rank
    data, said = opened_saying(folder, tmp_path / "cache")
    assert not said
    worker = pickle.loads(pickle.dumps(data))  # a DataLoader worker's copy, opened again there
    plain_x = opened(folder, None).batch("train", ALL)[0]

    def refused(fd, data, offset):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "pwrite", refused)
    x, _, problem = data.batch("train", ALL[:10])
    assert problem is None and np.array_equal(x, plain_x[:10])
    one_line_off(said, os.strerror(code), errno.errorcode[code])
    x, _, _ = data.batch("train", ALL)  # off from then on: decoded, said once
    assert np.array_equal(x, plain_x) and len(said) == 1
    assert data.cached_share("train", ALL) == 0.0
    # The worker has no rank's callback: the same line on stderr, once.
    capfd.readouterr()
    assert np.array_equal(worker.batch("train", ALL)[0], plain_x)
    assert np.array_equal(worker.batch("train", ALL)[0], plain_x)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: decode cache off in this process: "), err


FILE_SIZE_LIMIT = """
import json, resource, sys
from dataclasses import replace
import numpy as np
from launch import cli
from ringtrain.data import dataset
folder, cache = sys.argv[1:3]
data = dataset.open_builtin(cli.parse("torch", ["--data", f"folder:{folder}"]))
said = []
data = data.with_caches(cache, said.append)
layout = data.caches["train"].layout
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
# Rows 0-4 fit under the limit, row 5 is cut after 100 bytes, row 6 on is refused (EFBIG).
resource.setrlimit(resource.RLIMIT_FSIZE, (layout.pixels_at + 5 * layout.row_bytes + 100, hard))
x, _, problem = data.batch("train", np.arange(30))
again, _, _ = data.batch("train", np.arange(30))
resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
plain = replace(data, caches={}).batch("train", np.arange(30))[0]
print(json.dumps({"said": said, "problem": problem, "same": bool(np.array_equal(x, plain)),
                  "again": bool(np.array_equal(again, plain))}))
"""


@pytest.mark.timeout(300)
def test_the_file_size_limit_cuts_a_write_and_the_run_goes_on(folder, tmp_path):
    """The kernel's own refusal, in a process of its own (RLIMIT_FSIZE; Python ignores SIGXFSZ):
    a write cut short at the limit, then EFBIG.  The cut row gets no stamp."""
    proc = subprocess.run([sys.executable, "-c", FILE_SIZE_LIMIT, str(folder), str(tmp_path / "cache")],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["problem"] is None and out["same"] and out["again"], out
    one_line_off(out["said"], "wrote 100 of 768 bytes")
    cache = opened(folder, tmp_path / "cache").caches["train"]
    assert cache.filled(ALL).tolist() == [True] * 5 + [False] * 25


@pytest.mark.parametrize("cut", ["stamps, read whole", "stamps, read one by one", "rows"])
def test_a_file_cut_short_under_the_run_turns_the_cache_off_with_one_line(cut, folder, tmp_path,
                                                                          monkeypatch):
    """A cache file truncated while open: the whole stamp block read short raised IndexError;
    stamps read one by one were whatever ``np.empty`` held; rows read short were decoded again
    without a word, every epoch."""
    data, said = opened_saying(folder, tmp_path / "cache")
    plain_x = opened(folder, None).batch("train", ALL)[0]
    data.batch("train", ALL)
    cache = data.caches["train"]
    if cut == "stamps, read whole":  # as an epoch's share of a large folder is read
        monkeypatch.setattr(decoded_cache.DecodedCache, "WHOLE_STAMPS_FROM", 1)
    layout = cache.layout
    os.truncate(cache_file(data), HEADER_BYTES + 8 * 10 if cut.startswith("stamps")
                else layout.pixels_at + 3 * layout.row_bytes)
    x, _, problem = data.batch("train", ALL)
    assert problem is None and np.array_equal(x, plain_x)
    one_line_off(said, "the file was cut short")
    assert np.array_equal(data.batch("train", ALL)[0], plain_x) and len(said) == 1
    assert data.cached_share("train", ALL) == 0.0 and len(said) == 1


# --- the cache folder's path ---------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["the cache folder", "a folder above it"])
def test_another_users_symlink_as_the_cache_path_is_not_followed(where, folder, tmp_path,
                                                                 monkeypatch):
    """A symlink another user planted as the cache path (``--decode-cache /tmp/cache`` before
    the user's first run) steered the cache into a folder of their choosing: the folder was
    opened following it, and the files made there."""
    target = tmp_path / "theirs"
    target.mkdir(mode=0o700)
    link = tmp_path / "planted"
    link.symlink_to(target)
    if os.getuid() == 0:
        os.lchown(link, 4321, 4321)
    else:  # a link of another user's cannot be made: this process takes another uid instead
        uid = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: uid)
    data = dataset.open_builtin(cli.parse("torch", ["--data", f"folder:{folder}"]))
    said: list[str] = []
    cache = link if where == "the cache folder" else link / "cache"
    without = data.with_caches(str(cache), said.append)
    assert without.caches == {} and len(said) == 1, said
    assert f"{link} is a symbolic link of another user's" in said[0] and "not followed" in said[0]
    assert list(target.iterdir()) == []  # nothing made where the link points
    assert np.array_equal(without.batch("train", ALL)[0], data.batch("train", ALL)[0])


def test_the_users_own_symlinks_on_the_cache_path_are_followed(folder, tmp_path):
    """``~/.cache`` on a scratch disk: a link of the user's own is followed as before."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o700)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".cache").symlink_to(scratch)
    (tmp_path / "relative").symlink_to("home/.cache/../scratch")
    for path in (tmp_path / "home" / ".cache" / "ringtrain", tmp_path / "relative" / "decoded"):
        data = opened(folder, path)
        assert cache_file(data).parent == path and cache_file(data).resolve().parent.parent == scratch
        data.batch("train", ALL[:3])
        assert opened(folder, path).cached_share("train", ALL[:3]) == 1.0


# --- two processes, one file --------------------------------------------------------------------------

def fill(folder: str, cache: str, rows: list[int], start, out) -> None:
    data = dataset.open_builtin(cli.parse("torch", ["--data", f"folder:{folder}"]))
    start.wait(60)  # then both open the split's file at once
    data = data.with_caches(cache, print)
    for i in rows:  # one image per call: the two processes interleave
        data.batch("train", np.array([i]))
    out.put((os.stat(cache_file(data)).st_ino, data.cached_share("train", ALL)))


@pytest.mark.timeout(300)
def test_two_processes_fill_one_file(folder, tmp_path):
    """Two ranks of a host open the split's file at the same moment (one makes it, the other
    waits on the lock and maps the same one) and fill rows in turn, some the same ones."""
    ctx = multiprocessing.get_context("spawn")
    start, out = ctx.Barrier(2), ctx.Queue()
    rows = [list(range(0, 20)), list(range(10, 30))[::-1]]
    procs = [ctx.Process(target=fill, args=(str(folder), str(tmp_path / "cache"), r, start, out))
             for r in rows]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=240) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert results[0][0] == results[1][0], "the two processes mapped different files"
    data = opened(folder, tmp_path / "cache")
    assert data.cached_share("train", ALL) == 1.0 and data.caches["train"].gather(ALL)[1].all()
    assert np.array_equal(data.batch("train", ALL)[0], opened(folder, None).batch("train", ALL)[0])


# --- a real job ------------------------------------------------------------------------------------------

@requires_horovod
@pytest.mark.parametrize("fw", ["torch", "tf"])
def test_a_job_trains_the_same_with_the_cache_without_it_and_when_it_cannot_be_made(fw, pictures,
                                                                                   tmp_path):
    """-np 2, three epochs: the first fills the host's file, the others read it (PyTorch: in the
    rank).  A cache folder that cannot be made: one warning line (the host's first rank), the
    run goes on, decoding every epoch.  The weights are the same bit for bit both ways."""
    base = ["--framework", fw, "--data", f"folder:{pictures}", "--epochs", "3", "--batch-size", "5",
            "--no-progress"]
    blocker = tmp_path / "file"
    blocker.write_text("")
    sums = {}
    for name, flags in (("cache", ["--decode-cache", str(tmp_path / "cache")]),
                        ("cannot", ["--decode-cache", str(blocker / "cache")])):
        proc = train("launch", [*base, *flags, "--metrics-out", str(tmp_path / f"{name}.json")],
                     np=2, timeout=600)
        warnings = [ln for ln in proc.stderr.splitlines() if "warning: no decode cache" in ln]
        assert len(warnings) == (name == "cannot"), proc.stderr[-2000:]
        sums[name] = metrics(tmp_path / f"{name}.json")["param_checksums"]
    assert sums["cache"] == sums["cannot"] and len(set(sums["cache"])) == 1
    files = sorted(p.name.split("-", 1)[1] for p in (tmp_path / "cache").glob("*.pixels"))
    assert files == ["test.pixels", "train.pixels"]  # one per split for the host, not per rank
