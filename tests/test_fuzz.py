"""A fuzzing campaign: generated checkpoints (PyTorch and TensorFlow), image files, ``--data``
folders, flag lines, heartbeat datagrams, rendezvous requests, parameter-server messages and
pipeline messages, fed in-process to the functions that read them: the trainers' checkpoint
restore, :mod:`ringtrain.data.images`, the folder's scan and
:class:`~ringtrain.data.dataset.FolderData`, the commands' parser, the watchdog's
:meth:`~ringtrain.faults.watchdog.Watchdog.accept`, Horovod's rendezvous server, a parameter
server's and a worker's header checks, the pipeline's boundary checks (received and sent).

Every input must end in a normal return or the project's one line (:class:`UserError`, the
:class:`~ringtrain.data.images.ImageError` a folder turns into one, the parser's exit 2 with one
line, a dropped datagram, a refused request): any other exception fails the test with
Hypothesis's report; an input that takes more than :data:`BOUND` seconds fails it as a hang; a
file planted outside the run's folders (the inputs link to it) must keep its bytes and time.
Inputs start from tests/fuzz_corpus/ (the issue's reproductions and valid files; rewritten by
``python tests/fuzz_seeds.py``) and are mutated or generated from scratch.  Hypothesis runs
derandomized without its example database, so every CI run tries the same inputs; the last test
prints how many (at least 2,000) and checks each target ran.  A handful of the generated cases
also run end to end through the commands (exit 2, one line).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import io
import json
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import zipfile
from collections import Counter
from pathlib import Path
from unittest import mock

import fuzz_seeds as seeds
import numpy as np
import pytest
from conftest import one_error_line, requires_horovod, run
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from launch import cli
from ringtrain.data import dataset, images
from ringtrain.data.dataset import FolderData
from ringtrain.errors import UserError, printable
from ringtrain.faults.watchdog import MAC_BYTES, Watchdog
from ringtrain.strategies.pipeline.engine import Boundary, EvalRelay, run_step
from ringtrain.strategies.pipeline.placement import Placement
from ringtrain.strategies.pipeline.schedule import BACKWARD, FORWARD
from ringtrain.strategies.ps import engine as ps
from ringtrain.training import wire

BOUND = 20.0  # seconds one input may take (the slowest here take ~0.1 s)
TRIED: Counter = Counter()  # target -> inputs tried
ENDINGS: Counter = Counter()  # (target, how it ended) -> inputs
# The parameter servers' headers and the pipeline's boundaries (issue 5 and 6's targets, ~1 ms an
# input) took their 200 inputs from the images' and flag lines' share: the total is unchanged.
EXAMPLES = {"torch-checkpoint": 350, "tf-checkpoint": 250, "image": 350, "folder": 120,
            "flags": 400, "datagram": 450, "rendezvous": 150, "ps-header": 120,
            "pipeline-boundary": 80}
FAILED_FLAG_LINES: list[list[str]] = []  # generated flag lines that ended in one line, for the CLI
REFUSED_CHECKPOINTS: dict[str, bytes] = {}  # the first generated .pt of each refusal, for the CLI


def campaign(target: str):
    """Hypothesis's settings for one target: a fixed sequence of inputs, no database."""
    return settings(max_examples=EXAMPLES[target], derandomize=True, database=None, deadline=None,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink), print_blob=False,
                    suppress_health_check=list(HealthCheck))


class Hang(BaseException):
    """An input that ran past :data:`BOUND` (raised in the main thread by a timer's signal)."""


def _hang(signum, frame):
    raise Hang(f"an input ran past {BOUND:g} s")


@contextlib.contextmanager
def bounded(target: str):
    """Count one input of ``target``; interrupt it (SIGUSR1 to the main thread, which breaks a
    blocking open() of a FIFO too) if it runs past :data:`BOUND`."""
    TRIED[target] += 1
    previous = signal.signal(signal.SIGUSR1, _hang)
    timer = threading.Timer(BOUND, signal.pthread_kill, (threading.main_thread().ident, signal.SIGUSR1))
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, previous)


def corpus(folder: str, suffix: str = "") -> list[bytes]:
    return [p.read_bytes() for p in sorted((seeds.CORPUS / folder).glob(f"*{suffix}"))]


@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with up to four byte-level changes: flips, cuts, insertions, overwrites."""
    data = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "overwrite"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:at + draw(st.integers(1, 64))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif data:
            chunk = draw(st.binary(min_size=1, max_size=8))
            data[at:at + len(chunk)] = chunk
    return bytes(data)


PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10)


@st.composite
def metadata(draw, framework: str) -> object:
    """The valid metadata with some fields replaced, dropped or added, or anything plain."""
    if draw(st.integers(0, 9)) == 0:
        return draw(PLAIN)
    meta = seeds.meta(framework)
    keys = [*meta, "data.spec", "data.input_shape", "data.num_classes", "data.classes",
            "data.normalization", "weight_keys"]
    for key in draw(st.lists(st.sampled_from(keys), max_size=3)):
        where, _, field = key.rpartition(".")
        holder = meta.get(where) if where else meta
        if not isinstance(holder, dict):
            continue
        holder = holder if not where else meta.setdefault(where, dict(holder))
        if draw(st.booleans()):
            holder[field] = draw(PLAIN | st.integers(-10, 10))
        else:
            holder.pop(field, None)
    return meta


# A member name zipfile can write: it cuts a name at its first NUL (an empty name then fails
# inside zipfile's own writer, which is the generator's problem, not the reader's).
MEMBER_NAME = st.text(min_size=1, max_size=20).filter(lambda name: "\x00" not in name)


@st.composite
def zip_changed(draw, data: bytes) -> bytes:
    """``data``'s archive rebuilt: members deflated, renamed, added or dropped; then mutated."""
    change = draw(st.sampled_from(["none", "none", "deflate", "rename", "add", "drop"]))
    if not zipfile.is_zipfile(io.BytesIO(data)):
        change = "none"
    if change == "deflate":
        data = seeds.recompressed(data)
    elif change in ("rename", "add", "drop"):
        src = zipfile.ZipFile(io.BytesIO(data))
        members = src.infolist()
        out = io.BytesIO()
        victim = draw(st.integers(0, len(members) - 1))
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
            for i, info in enumerate(members):
                name = info.filename
                if i == victim and change == "drop":
                    continue
                if i == victim and change == "rename":
                    name = draw(MEMBER_NAME)
                dst.writestr(name, src.read(info))
            if change == "add":
                dst.writestr(draw(MEMBER_NAME), draw(st.binary(max_size=64)))
        data = out.getvalue()
    return draw(mutated(data)) if draw(st.booleans()) else data


def seed_or_special(draw, ext: str) -> bytes | str | None:
    """A corpus checkpoint of ``ext`` changed, a special file (``"symlink"``, ``"fifo"``,
    ``"folder"``, ``"dev-zero"``), or None: the caller generates one."""
    how = draw(st.sampled_from(["seed", "seed", "structured", "structured", "special"]))
    if how == "special":
        return draw(st.sampled_from(["symlink", "fifo", "folder", "dev-zero"]))
    if how == "seed":
        return draw(zip_changed(draw(st.sampled_from(corpus("ckpt", ext)))))
    return None


@st.composite
def torch_checkpoint(draw) -> bytes | str:
    """Bytes of a ``.pt``, or a special file."""
    found = seed_or_special(draw, ".pt")
    if found is not None:
        return found
    import torch

    model, optimizer = seeds.torch_target()
    state = {"meta": draw(metadata("torch")), "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state()}
    for key in draw(st.lists(st.sampled_from(["model", "optimizer", "torch_rng", "meta"]), max_size=2)):
        choice = draw(st.sampled_from(["plain", "tensor", "drop"]))
        if choice == "drop":
            state.pop(key, None)
        elif choice == "plain":
            state[key] = draw(PLAIN)
        else:
            shape = draw(st.lists(st.integers(0, 5), max_size=3))
            value = draw(st.sampled_from([0.0, float("nan"), float("inf"), 1e38]))
            dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.uint8, torch.int64]))
            tensor = torch.full(shape, value if dtype.is_floating_point else 1, dtype=dtype)
            state[key] = {"weight": tensor, "bias": tensor} if key == "model" else tensor
    buf = io.BytesIO()
    torch.save(state, buf)
    return draw(zip_changed(buf.getvalue()))


@st.composite
def tf_checkpoint(draw) -> bytes | str:
    found = seed_or_special(draw, ".npz")
    if found is not None:
        return found
    arrays = {}
    names = st.sampled_from(["model_0000", "model_0001", "optimizer_0000", "optimizer_0001",
                             "optimizer_0002", "rng_0000", "extra"]) | st.text(min_size=1, max_size=10)
    for name in draw(st.lists(names, max_size=6, unique=True)):
        dtype = draw(st.sampled_from(["float32", "float64", "int64", "bool", "U3", "complex64"]))
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        fill = draw(st.sampled_from([0, 1, float("nan"), float("inf")]))
        arrays[name] = np.full(shape, fill if dtype.startswith("float") else 1).astype(dtype)
    meta = draw(metadata("tf"))
    text = draw(st.sampled_from(["json", "json", "not-json", "array"]))
    if text == "json":
        arrays["meta"] = np.array(json.dumps(meta))
    elif text == "not-json":
        arrays["meta"] = np.array(draw(st.text(max_size=30)))
    else:
        arrays["meta"] = np.zeros(3)
    buf = io.BytesIO()
    try:
        np.savez(buf, **arrays)
    except (ValueError, TypeError):  # a name numpy will not take
        np.savez(buf, meta=arrays["meta"])
    return draw(zip_changed(buf.getvalue()))


@contextlib.contextmanager
def run_folders():
    """A temporary root holding the run's folder (``run/``) and, outside it, a victim file that
    inputs link to: it must keep its bytes and time, and nothing may appear beside it."""
    with tempfile.TemporaryDirectory() as root:
        root = Path(root)
        (root / "run").mkdir()
        victim = root / "victim.txt"
        victim.write_bytes(b"the user's file\n")
        before = (victim.stat().st_mtime_ns, sorted(os.listdir(root)))
        yield root / "run", victim
        assert victim.read_bytes() == b"the user's file\n", "a file outside the run was changed"
        assert (victim.stat().st_mtime_ns, sorted(os.listdir(root))) == before, \
            "a file outside the run was touched"


def place(folder: Path, name: str, content: bytes | str, victim: Path) -> Path:
    path = folder / name
    if content == "symlink":
        path.symlink_to(victim)
    elif content == "dev-zero":
        path.symlink_to("/dev/zero")
    elif content == "fifo":
        os.mkfifo(path)
    elif content == "folder":
        path.mkdir()
    else:
        path.write_bytes(content)
    return path


def restore_ends_well(target: str, folder: Path, restore) -> None:
    """``restore()`` returns an epoch, or raises :class:`UserError` (counted by its start)."""
    listing = sorted(os.listdir(folder))
    try:
        epoch = restore()
        assert isinstance(epoch, int) and epoch >= 0
        ENDINGS[target, "restored"] += 1
    except UserError as err:
        ENDINGS[target, "one line"] += 1
        newest = folder / "ckpt-epoch0002.pt"
        if target == "torch-checkpoint" and newest.is_file() and not newest.is_symlink():
            kind = " ".join(str(err).split(str(newest))[-1].split()[:3])  # "holds a compressed"
            REFUSED_CHECKPOINTS.setdefault(kind, newest.read_bytes())
    assert sorted(os.listdir(folder)) == listing, "restore changed the checkpoint folder"


@campaign("torch-checkpoint")
@given(content=torch_checkpoint(), older=st.booleans())
def test_generated_torch_checkpoints(content, older):
    from torch_models import checkpoints

    with run_folders() as (folder, victim), bounded("torch-checkpoint"):
        if older:  # an intact older one to fall back to
            (folder / "ckpt-epoch0001.pt").write_bytes(seeds.CORPUS.joinpath(
                "ckpt/torch-valid.pt").read_bytes())
        place(folder, "ckpt-epoch0002.pt", content, victim)
        model, optimizer = seeds.torch_target()
        restore_ends_well("torch-checkpoint", folder, lambda: checkpoints.restore(
            str(folder), model, optimizer, seeds.identity("torch")))


_TF: list = []  # the Keras model and optimizer, built once: restores only assign to them


@campaign("tf-checkpoint")
@given(content=tf_checkpoint(), older=st.booleans())
def test_generated_tf_checkpoints(content, older):
    from tf_models import checkpoints

    if not _TF:
        _TF.extend(seeds.tf_target())
    net, optimizer = _TF
    with run_folders() as (folder, victim), bounded("tf-checkpoint"):
        if older:
            (folder / "ckpt-epoch0001.npz").write_bytes(seeds.CORPUS.joinpath(
                "ckpt/tf-valid.npz").read_bytes())
        place(folder, "ckpt-epoch0002.npz", content, victim)
        restore_ends_well("tf-checkpoint", folder, lambda: checkpoints.restore(
            str(folder), net, optimizer, seeds.identity("tf")))


@st.composite
def image_content(draw) -> bytes:
    how = draw(st.sampled_from(["seed", "encoded", "encoded", "raw"]))
    if how == "seed":
        data = draw(st.sampled_from(corpus("images")))
    elif how == "raw":
        magic = draw(st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"BM", b"GIF89a"]))
        data = magic + draw(st.binary(max_size=200))
    else:
        fmt = draw(st.sampled_from(["PNG", "JPEG", "BMP", "GIF", "TIFF", "PPM", "ICO"]))
        mode = draw(st.sampled_from(["L", "RGB", "RGBA", "P", "1", "I;16", "LA"]))
        size = (draw(st.integers(1, 40)), draw(st.integers(1, 40)))
        try:
            data = seeds.image_bytes(fmt, size, mode)
        except (OSError, ValueError, KeyError):  # a mode this format cannot hold
            data = seeds.image_bytes(fmt, size, "RGB")
    return draw(mutated(data)) if draw(st.booleans()) else data


@campaign("image")
@given(content=image_content(),
       shape=st.tuples(st.integers(1, 24), st.integers(1, 24), st.sampled_from([1, 3])),
       max_pixels=st.sampled_from([1, 40, 1000, images.MAX_PIXELS, images.MAX_PIXELS]))
def test_generated_images(content, shape, max_pixels):
    with run_folders() as (folder, _), bounded("image"):
        path = folder / "picture.png"
        path.write_bytes(content)
        for step in (lambda: images.probe(path, max_pixels), lambda: images.load(path, shape, max_pixels)):
            try:
                result = step()
                ENDINGS["image", "decoded"] += 1
            except images.ImageError as err:
                ENDINGS["image", "one line"] += 1
                assert err.reason == printable(err.reason), err.reason
                continue
            if isinstance(result, np.ndarray):
                assert result.shape == shape and result.dtype == np.uint8


NAMES = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1,
                max_size=10).filter(lambda n: n not in (".", ".."))


VALID_IMAGES = [(seeds.CORPUS / "images" / name).read_bytes()
                for name in ("valid.png", "valid.jpg", "gray.png")]


FOLDER_FAULTS = ["no-test", "val", "no-train", "one-class", "empty-class", "other-classes",
                 "bad-name", "fuzzed-image", "symlink", "hidden", "odd-names"]


@st.composite
def image_folder(draw, root: Path, victim: Path) -> str | None:
    """A --data folder: train/ and test/ with the same classes of valid images, and (in about
    half of them) one fault of :data:`FOLDER_FAULTS` somewhere; returns the fault.  Choices
    other than names and contents come from a ``random.Random`` seeded by one draw (Hypothesis's
    own lean to the extremes, which made almost every folder a broken one)."""
    rnd = random.Random(draw(st.integers(0, 2**32)))
    fault = rnd.choice(FOLDER_FAULTS) if rnd.random() < 0.5 else None
    names = draw(st.lists(NAMES, min_size=4, max_size=4, unique=True))
    classes = names[:rnd.randint(2, 4)] if fault != "odd-names" else names
    splits = {"no-test": ["train"], "no-train": ["test"], "val": ["train", "val"]}.get(
        fault, ["train", "test"])
    files = [(split, cls, f"{i}.png") for split in splits for cls in classes
             for i in range(rnd.randint(1, 3))]
    for split, cls, name in files:
        (root / split / cls).mkdir(parents=True, exist_ok=True)
        (root / split / cls / name).write_bytes(rnd.choice(VALID_IMAGES))
    split, cls, name = rnd.choice(files)
    where = root / split / cls
    if fault == "one-class":
        for other in classes[1:]:
            shutil.rmtree(root / split / other, ignore_errors=True)
    elif fault == "empty-class":
        for path in where.iterdir():
            path.unlink()
    elif fault == "other-classes":
        where.rename(root / split / (names[-1] + "x"))
    elif fault == "bad-name":
        suffix = draw(st.sampled_from([".txt", "", ".gif", ".PNG.bak"]))
        (where / name).rename(where / (name[:-4] + suffix))
    elif fault == "fuzzed-image":
        (where / name).write_bytes(draw(image_content()))
    elif fault == "symlink":
        (where / name).unlink()
        (where / name).symlink_to(victim)
    elif fault == "hidden":
        (where / ("." + name)).write_bytes(b"not an image")
    elif fault == "odd-names":
        (where / (draw(NAMES) + ".png")).write_bytes(rnd.choice(VALID_IMAGES))
    return fault


@campaign("folder")
@given(data=st.data(), flags=st.lists(st.sampled_from([
    ["--image-size", "8"], ["--image-size", "3x5"], ["--normalize", "imagenet"],
    ["--train-samples", "2"], ["--test-samples", "1"], ["--max-image-pixels", "50"]]), max_size=3))
def test_generated_data_folders(data, flags):
    with run_folders() as (folder, victim), bounded("folder"):
        data.draw(image_folder(folder, victim))
        args = cli.parse("torch", ["--data", f"folder:{folder}", *[w for f in flags for w in f]])
        try:
            opened = dataset.open_builtin(args)
        except UserError:
            ENDINGS["folder", "one line"] += 1
            return
        ENDINGS["folder", "opened"] += 1
        shared = FolderData.from_plain(wire.decode(wire.encode(opened.to_plain())))
        assert shared.info == opened.info and (shared.index.train.paths == opened.index.train.paths).all()
        x, labels, problem = shared.batch("train", np.arange(min(4, opened.info.train_size)))
        assert x.shape[1:] == opened.info.input_shape and len(labels) == len(x)
        assert problem is None or "\n" not in problem


FLAG_NAMES = sorted(opt for action in cli.build_parser("torch")._actions
                    for opt in action.option_strings if opt not in ("-h", "--help"))
VALUES = (st.integers(-10, 10**6).map(str) | st.floats().map(str)
          | st.sampled_from(["", "0", "-0", "nan", "inf", "1e400", "folder:", "mnist", "cnn", "a:b",
                             "64", "3x4", "0x5", "data", "linear", "none", "cosine"])
          | st.text(max_size=12))
FLAG_LINE = st.lists(st.tuples(st.sampled_from(FLAG_NAMES), st.none() | VALUES), max_size=6).map(
    lambda pairs: [w for flag, value in pairs for w in ([flag] if value is None else [flag, value])])


@campaign("flags")
@given(argv=st.sampled_from([shlex.split(line) for line in
                             (seeds.CORPUS / "flags.txt").read_text().splitlines()]) | FLAG_LINE)
def test_generated_flag_lines(argv):
    err = io.StringIO()
    with bounded("flags"), contextlib.redirect_stderr(err):
        try:
            cli.parse("torch", argv)
            ENDINGS["flags", "accepted"] += 1
            return
        except SystemExit as exit_:  # the parser's one line
            assert exit_.code == 2
            lines = err.getvalue().splitlines()
            assert len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()
        except UserError as problem:  # the commands print it with cli.fail
            assert str(problem)
    ENDINGS["flags", "one line"] += 1
    if len(FAILED_FLAG_LINES) < 5:
        FAILED_FLAG_LINES.append(argv)


KEY = bytes(range(32))


def signed(body: bytes) -> bytes:
    return hmac.new(KEY, body, hashlib.sha256).digest()[:MAC_BYTES] + body


def watchdog(rank: int) -> Watchdog:
    dog = Watchdog(4, rank, 3, "gloo", elastic=False)
    dog.peers = {r: {"rank": r, "host": f"host{r}", "addr": "127.0.0.1", "pid": 100 + r} for r in range(3)}
    dog.key = KEY
    return dog


BEAT = st.fixed_dictionaries({"r": st.integers(-1, 3) | PLAIN, "n": st.integers(-2, 5) | PLAIN,
                              "s": st.integers(-1, 10**20) | PLAIN,
                              "o": st.none() | st.text(max_size=40) | PLAIN},
                             optional={"t": PLAIN})
SEED_BEATS = [line.encode() for line in (seeds.CORPUS / "datagrams.jsonl").read_text().splitlines()]
DATAGRAM = (st.binary(max_size=600)
            | st.sampled_from(SEED_BEATS).map(signed)
            | BEAT.map(lambda beat: signed(json.dumps(beat).encode()))
            | PLAIN.map(lambda value: signed(json.dumps(value).encode()))
            | st.binary(max_size=80).map(signed))


@campaign("datagram")
@given(rank=st.sampled_from([0, 1]), datagrams=st.lists(DATAGRAM, min_size=1, max_size=5))
def test_generated_heartbeat_datagrams(rank, datagrams):
    dog = watchdog(rank)
    with bounded("datagram"):
        for data in datagrams:
            got = dog.accept(data)
            ENDINGS["datagram", "dropped" if got is None else "accepted"] += 1
            assert got is None or got in dog.peers
        for where in dog.outside.values():
            assert where is None or where == printable(where)
        line = dog.diagnose(time.monotonic())
        assert line == printable(line, 10**6), line


# --- the parameter servers' headers and the pipeline's boundaries -------------------------------

PS_WORKERS, PS_STEPS, PS_SIZE, PS_EPOCH = 2, 3, 7, 3
PS_ANY = (st.integers(-3, 9) | st.sampled_from([ps.NONE, 2**31 - 1, -2**31, 255, 65536])
          | st.integers(-2**31, 2**31 - 1))


def ps_server(servers: int, index: int, staleness: int | None) -> ps.Server:
    from test_ps import Net

    cfg = ps.Config(ps.Roles(servers, servers + PS_WORKERS), PS_SIZE, staleness, 0.5, "torch",
                    PS_STEPS, lambda epoch, t: 0.25 if 0 <= t < PS_STEPS else float("nan"),
                    deadline=1.0, tick=0.01)
    server = ps.Server(cfg, Net().link(index), index, np.zeros(cfg.length(index), np.float32))
    server.begin_epoch(PS_EPOCH)
    return server


def ps_refused(err: ps.BadMessage, peer: str) -> None:
    line = str(err)
    assert line == printable(line, 10**6) and f"from {peer}:" in line and "expected" in line, line
    ENDINGS["ps-header", "one line"] += 1


@st.composite
def ps_message(draw, valid: dict[str, int], length: int, room: int, push: int | None = None):
    """A header and a length: the valid ones (as far as the sequence so far makes one) in about
    half the messages, else with one fault: the length (the header's alone, none, anything up to
    the buffer: MPI refuses a longer one in the transport, tests/test_ps.py), one field or several
    fields anything.  ``length``: a message's valid length (``push``: a PUSH's, where other)."""
    fields = dict(valid)
    fault = draw(st.sampled_from(["none", "none", "none", "length", "field", "fields"]))
    if fault == "field":
        fields[draw(st.sampled_from(sorted(fields)))] = draw(PS_ANY)
    elif fault == "fields":
        fields = {name: draw(PS_ANY) if draw(st.booleans()) else value
                  for name, value in fields.items()}
    count = push if push is not None and fields["kind"] == ps.PUSH else length
    if fault == "length":
        count = draw(st.sampled_from([ps.HEADER, -1, count - 1, count + 1]) | st.integers(0, room))
        count = min(count, room)
    return fields, count


def ps_worker_messages(draw, server: ps.Server) -> None:
    """Up to 6 messages from workers (and, on a server but 0, server 0's DEAD notices), each
    accepted exactly when the protocol allows it; a refused one is one line and changes nothing."""
    cfg, workers = server.cfg, PS_WORKERS
    pushes, finals = [0] * workers, set()
    for _ in range(draw(st.integers(1, 6))):
        ctrl = server.index != 0 and draw(st.integers(0, 4)) == 0
        live = [w for w in range(workers) if server.recvs[w] is not None]
        if not ctrl and not live:
            return
        if ctrl:
            h = ps.header(server.ctrl_buf)
            fields, count = draw(ps_message({"kind": ps.DEAD, "owner": draw(st.integers(0, workers - 1))},
                                            ps.HEADER, ps.HEADER))
            h[ps.KIND], h[ps.OWNER] = fields["kind"], fields["owner"]
            ok = count == ps.HEADER and fields["kind"] == ps.DEAD and 0 <= fields["owner"] < workers
            peer, index = "server rank 0", workers
        else:
            w = draw(st.sampled_from(live))
            kind = draw(st.sampled_from([ps.PULL, ps.PUSH, ps.PUSH, ps.FINAL]))
            clock = {ps.PULL: 0, ps.PUSH: pushes[w] + 1, ps.FINAL: pushes[w]}[kind]
            buf = server.inbox[w]
            fields, count = draw(ps_message(
                {"kind": kind, "epoch": PS_EPOCH, "clock": clock,
                 "owner": draw(st.integers(0, workers - 1)), "t": draw(st.integers(0, PS_STEPS - 1)),
                 "version": draw(st.integers(0, server.books.updates))},
                ps.HEADER, len(buf), push=len(buf)))
            length = len(buf) if fields["kind"] == ps.PUSH else ps.HEADER
            msg = np.zeros(len(buf), np.float32)
            h = ps.header(msg)
            for name, slot in (("kind", ps.KIND), ("epoch", ps.EPOCH), ("clock", ps.CLOCK),
                               ("owner", ps.OWNER), ("t", ps.T), ("version", ps.VERSION)):
                h[slot] = fields[name]
            msg[ps.HEADER:] = draw(st.sampled_from([1.0, -2.0, 0.5, float("nan"), 1e30]))
            buf[:max(count, 0)] = msg[:max(count, 0)]
            k, c = fields["kind"], fields["clock"]
            ok = (count == length and k in (ps.PULL, ps.PUSH, ps.FINAL)
                  and fields["epoch"] == PS_EPOCH and w not in finals
                  and (k != ps.PULL or (c == 0 and pushes[w] == 0))
                  and (k != ps.FINAL or c == pushes[w])
                  and (k != ps.PUSH or (c == pushes[w] + 1 and 0 <= fields["owner"] < workers
                                        and 0 <= fields["t"] < PS_STEPS
                                        and 0 <= fields["version"] <= server.books.updates)))
            peer, index = f"worker rank {cfg.roles.worker_rank(w)}", w
        before = (server.weights.copy(), list(server.books.applied), server.books.updates)
        try:
            server.handle(index, count)
        except ps.BadMessage as err:
            assert not ok, f"a valid message refused: {err}"
            ps_refused(err, peer)
            assert np.array_equal(server.weights, before[0], equal_nan=True)
            assert (server.books.applied, server.books.updates) == (before[1], before[2])
            return
        assert ok, "a message the protocol does not allow was accepted"
        ENDINGS["ps-header", "accepted"] += 1
        if not ctrl:
            pushes[w] += k == ps.PUSH
            if k == ps.FINAL:
                finals.add(w)


def ps_reply(draw, servers: int) -> None:
    """One reply to a worker from a server (server 0's names its next batch, or none)."""
    cfg = ps.Config(ps.Roles(servers, servers + PS_WORKERS), PS_SIZE, None, 0.0, "torch", PS_STEPS,
                    lambda epoch, t: 0.1)
    from test_ps import Net

    worker = ps.Worker(cfg, Net().link(servers), 0)
    s = draw(st.integers(0, servers - 1))
    worker.versions[s] = last = draw(st.integers(0, 3))
    none = draw(st.booleans())
    buf = worker.inbox[s]
    fields, count = draw(ps_message(
        {"kind": ps.WEIGHTS, "epoch": PS_EPOCH, "version": last + draw(st.integers(0, 2)),
         "flags": draw(st.sampled_from([0, ps.STOP])),
         "owner": ps.NONE if none else draw(st.integers(0, PS_WORKERS - 1)),
         "t": ps.NONE if none else draw(st.integers(0, PS_STEPS - 1))},
        len(buf), len(buf)))
    h = ps.header(buf)
    for name, slot in (("kind", ps.KIND), ("epoch", ps.EPOCH), ("version", ps.VERSION),
                       ("flags", ps.FLAGS), ("owner", ps.OWNER), ("t", ps.T)):
        h[slot] = fields[name]
    owner, t = fields["owner"], fields["t"]
    ok = (count == len(buf) and fields["kind"] == ps.WEIGHTS and fields["epoch"] == PS_EPOCH
          and fields["version"] >= last and fields["flags"] in (0, ps.STOP)
          and (s != 0 or (owner, t) == (ps.NONE, ps.NONE)
               or (0 <= owner < PS_WORKERS and 0 <= t < PS_STEPS)))
    try:
        worker.check_reply(s, count, PS_EPOCH)
    except ps.BadMessage as err:
        assert not ok, f"a valid reply refused: {err}"
        ps_refused(err, f"server rank {s}")
        return
    assert ok, "a reply the protocol does not allow was accepted"
    ENDINGS["ps-header", "accepted"] += 1


@campaign("ps-header")
@given(data=st.data(), servers=st.sampled_from([1, 2]), staleness=st.sampled_from([0, 1, None]),
       side=st.sampled_from(["server", "server", "reply"]))
@example(data=None, servers=1, staleness=None, side="header-only push")
@example(data=None, servers=2, staleness=None, side="dead -1")
@example(data=None, servers=2, staleness=None, side="dead 7")
def test_generated_parameter_server_headers(data, servers, staleness, side):
    """Messages to a server (a worker's PULL, PUSH and FINAL, server 0's DEAD notice) and replies
    to a worker, with generated lengths and header fields: each is accepted exactly when the
    protocol allows it, else refused in one line naming the peer, with nothing applied.  The
    examples are issue 5's reproductions."""
    with bounded("ps-header"):
        if data is None:  # the reproductions, by hand
            server = ps_server(servers, servers - 1, staleness)
            if side == "header-only push":
                h = ps.header(server.inbox[0])
                h[ps.KIND], h[ps.EPOCH], h[ps.CLOCK] = ps.PUSH, PS_EPOCH, 1
                server.inbox[0][ps.HEADER:] = 1.0  # the previous gradient, still in the buffer
                where, count, peer = 0, ps.HEADER, f"worker rank {servers}"
            else:
                h = ps.header(server.ctrl_buf)
                h[ps.KIND], h[ps.OWNER] = ps.DEAD, -1 if side == "dead -1" else 7
                where, count, peer = PS_WORKERS, ps.HEADER, "server rank 0"
            with pytest.raises(ps.BadMessage) as err:
                server.handle(where, count)
            ps_refused(err.value, peer)
            assert not server.weights.any() and not server.dead
            return
        if side == "reply":
            ps_reply(data.draw, servers)
        else:
            ps_worker_messages(data.draw, ps_server(servers, data.draw(st.integers(0, servers - 1)),
                                                    staleness))


class Ended(Exception):
    """watchdog.end_job's line, where the job would have ended."""


def end_job(line: str) -> None:
    raise Ended(line)


DTYPES = [np.float32, np.float64, np.float16, np.int32]


@st.composite
def cut_and_output(draw):
    """A boundary, a micro-batch's rows, and an array: the boundary's, or one changed in shape
    (a dimension off, one more or fewer, transposed) and/or dtype."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    dtype, rows = draw(st.sampled_from(DTYPES)), draw(st.integers(1, 4))
    out_shape = [rows, *shape]
    change = draw(st.sampled_from(["none", "none", "dim", "more", "fewer", "transpose"]))
    if change == "dim":
        at = draw(st.integers(0, len(out_shape) - 1))
        out_shape[at] = draw(st.integers(0, 6))
    elif change == "more":
        out_shape.insert(draw(st.integers(0, len(out_shape))), draw(st.integers(1, 3)))
    elif change == "fewer":
        out_shape.pop(draw(st.integers(0, len(out_shape) - 1)))
    elif change == "transpose":
        out_shape.reverse()
    out_dtype = dtype if draw(st.booleans()) else draw(st.sampled_from(DTYPES))
    return Boundary(shape, np.dtype(dtype)), rows, np.zeros(out_shape, out_dtype)


@campaign("pipeline-boundary")
@given(case=cut_and_output(), path=st.sampled_from(["receive", "forward", "backward", "eval"]),
       got=st.sampled_from(["whole", "whole", "truncated"]) | st.integers(0, 400))
def test_generated_pipeline_boundaries(case, path, got):
    """What crosses a pipeline's cut: a received message of generated length (the transport, on
    a stand-in for MPI), or a stage's generated output (a forward, a backward, a test batch): it
    is used or sent exactly when it fills the boundary's shape and dtype, else the job ends in
    one line naming the peer, and nothing is sent."""
    from test_pipeline_core import FakeComm, FakeMPI, Outbox, Returns

    from ringtrain.faults import watchdog as dog
    from ringtrain.strategies.pipeline import transport

    cut, rows, out = case
    want = cut.rows(rows)
    with bounded("pipeline-boundary"), mock.patch.object(dog, "end_job", end_job):
        try:
            if path == "receive":
                nbytes = int(np.prod(want)) * cut.dtype.itemsize
                got = {"whole": nbytes, "truncated": FakeMPI.Exception(FakeMPI.ERR_TRUNCATE)}.get(got, got)
                ok, peer = got == nbytes, "from rank 0"
                mpi = FakeMPI(got)
                with mock.patch.object(transport, "mpi", lambda: mpi):
                    link = transport.Link(FakeComm(mpi), rank=1, timeout=5.0)
                    incoming = link.post(want, cut.dtype, 0, 4, "stage 0's activations")
                    assert link.wait(incoming) is incoming.buffer
            else:
                ok = out.shape == want and out.dtype == cut.dtype
                link = Outbox([np.zeros(want, cut.dtype)])
                if path == "forward":
                    peer = "stage 1, rank 1"
                    run_step(Placement(2, 2, 0), link, Returns(forward=out), [(FORWARD, 0)], [rows],
                             None, cut)
                elif path == "backward":
                    peer = "stage 0, rank 0"
                    run_step(Placement(2, 2, 1), link, Returns(backward=out),
                             [(FORWARD, 0), (BACKWARD, 0)], [rows], cut, None)
                else:
                    peer = "stage 1, rank 1"
                    EvalRelay(Placement(2, 2, 0), link, None, cut)(lambda x: out, None, rows, np.asarray)
                assert len(link.sent) == 1 and link.sent[0][0] is out
        except Ended as line:
            assert not ok, f"a valid message refused: {line}"
            text = str(line)
            assert text == printable(text, 10**6) and peer in text and "expected" in text, text
            if path != "receive":
                assert link.sent == []
            ENDINGS["pipeline-boundary", "one line"] += 1
            return
        assert ok, "a message that does not fill its boundary was used"
        ENDINGS["pipeline-boundary", "accepted"] += 1


@pytest.fixture(scope="module")
def rendezvous():
    """An elastic rendezvous server on loopback (Horovod's, as horovodrun starts it)."""
    pytest.importorskip("horovod.runner.http.auth", reason="needs the patched Horovod (make setup)")
    from horovod.runner.common.util import secret
    from horovod.runner.elastic.rendezvous import create_rendezvous_handler
    from horovod.runner.http.http_server import RendezvousServer
    from test_rendezvous_auth import StubDriver

    driver = StubDriver()
    server = RendezvousServer(key=secret.make_secret_key())
    port = server.start(create_rendezvous_handler(driver), address="127.0.0.1")
    yield port, driver
    server.stop()


REQUEST = st.tuples(
    st.sampled_from(["GET", "PUT", "POST", "DELETE", "HEAD", "OPTIONS"]) | st.text(max_size=6),
    st.sampled_from(["/worker_addresses/localhost:0", "/rank_and_size/localhost:0", "/global/0",
                     "/", "/etc/passwd"]) | st.text(max_size=30).map(lambda p: "/" + p),
    st.dictionaries(st.sampled_from(["Horovod-Signature", "Content-Length", "Host", "X"]),
                    st.text(max_size=70) | st.sampled_from(["0" * 64, "f" * 64]), max_size=3),
    st.binary(max_size=200))


def raw_request(port: int, method: str, path: str, headers: dict, body: bytes) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if "Content-Length" not in headers:
        head += f"Content-Length: {len(body)}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(head.encode("utf-8", "surrogateescape") + b"\r\n" + body)
        conn.shutdown(socket.SHUT_WR)
        return conn.recv(64)


@campaign("rendezvous")
@given(request=REQUEST)
def test_generated_rendezvous_requests(rendezvous, request):
    """No request without the job key's signature is served: 403 (or 400 for what is not
    HTTP, 501 for an unknown method, or no answer at all), and the driver never hears of it."""
    port, driver = rendezvous
    with bounded("rendezvous"):
        try:
            answer = raw_request(port, *request)
        except OSError:  # the server closed on a request it could not parse
            answer = b""
        status = answer.split(b" ")[1] if answer.startswith(b"HTTP/") else b""
        ENDINGS["rendezvous", status.decode() or "closed"] += 1
        assert status in (b"", b"400", b"403", b"404", b"405", b"408", b"411", b"413", b"414",
                          b"431", b"501", b"505"), answer
        assert driver.registered == [] and driver.ready == []


# --- a handful of the generated cases, end to end through the commands --------------------------

def test_generated_flag_lines_end_in_one_line_through_the_command():
    lines = FAILED_FLAG_LINES or [shlex.split(line) for line in
                                  (seeds.CORPUS / "flags.txt").read_text().splitlines()[:5]]
    for argv in lines[:5]:
        one_error_line(run([sys.executable, "-m", "launch.torch_mnist", *argv], timeout=120))


@requires_horovod
def test_generated_checkpoints_end_in_one_line_through_the_command(tmp_path):
    """Refused generated checkpoints (two kinds of refusal) as the newest of a real run's
    folder: the resume ends in one line, exit 2."""
    cases = [data for data in REFUSED_CHECKPOINTS.values() if data][:2] or [
        seeds.CORPUS.joinpath(f"ckpt/{name}.pt").read_bytes() for name in ("torch-deflated", "torch-nan")]
    for i, data in enumerate(cases):
        folder = tmp_path / f"ckpt{i}"
        folder.mkdir()
        (folder / "ckpt-epoch0003.pt").write_bytes(data)
        proc = run([sys.executable, "-m", "launch.torch_mnist", "--train-samples", "64",
                    "--test-samples", "32", "--epochs", "4", "--no-progress", "--checkpoint-dir",
                    str(folder), "--resume"], timeout=240)
        one_error_line(proc, "ckpt-epoch0003.pt")


@requires_horovod
def test_a_bomb_as_the_first_image_ends_in_one_line_through_the_command(tmp_path):
    image = seeds.CORPUS / "images"
    for split, cls in (("train", "a"), ("train", "b"), ("test", "a"), ("test", "b")):
        (tmp_path / split / cls).mkdir(parents=True)
        (tmp_path / split / cls / "1.png").write_bytes((image / "valid.png").read_bytes())
    (tmp_path / "train" / "a" / "0.png").write_bytes((image / "bomb-200mp.png").read_bytes())
    proc = run([sys.executable, "-m", "launch.torch_mnist", "--data", f"folder:{tmp_path}",
                "--epochs", "1", "--no-progress"], timeout=240)
    one_error_line(proc, "train/a/0.png", "decompression bomb")


def test_the_campaign_tried_enough_inputs(capsys):
    """Printed: the inputs each target was fed and how they ended.  Run after the others (file
    order); checks only what ran in this session."""
    total = sum(TRIED.values())
    with capsys.disabled():
        endings = ", ".join(f"{t} {how} {n}" for (t, how), n in sorted(ENDINGS.items()))
        print(f"\nfuzz campaign: {total} inputs, 0 tracebacks, 0 hangs "
              f"({', '.join(f'{t} {n}' for t, n in sorted(TRIED.items()))}); {endings}")
    ran_all = all(TRIED[t] for t in EXAMPLES if t != "rendezvous")
    if ran_all:
        assert total >= 2000, TRIED
