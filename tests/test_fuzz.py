"""A fuzzing campaign: generated checkpoints (PyTorch and TensorFlow), image files, ``--data``
folders, flag lines, heartbeat datagrams and rendezvous requests, fed in-process to the functions
that read them: the trainers' checkpoint restore, :mod:`ringtrain.data.images`, the folder's
scan and :class:`~ringtrain.data.dataset.FolderData`, the commands' parser, the watchdog's
:meth:`~ringtrain.faults.watchdog.Watchdog.accept`, Horovod's rendezvous server.

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

import fuzz_seeds as seeds
import numpy as np
import pytest
from conftest import one_error_line, requires_horovod, run
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from launch import cli
from ringtrain.data import dataset, images
from ringtrain.data.dataset import FolderData
from ringtrain.errors import UserError, printable
from ringtrain.faults.watchdog import MAC_BYTES, Watchdog
from ringtrain.training import wire

BOUND = 20.0  # seconds one input may take (the slowest here take ~0.1 s)
TRIED: Counter = Counter()  # target -> inputs tried
ENDINGS: Counter = Counter()  # (target, how it ended) -> inputs
EXAMPLES = {"torch-checkpoint": 350, "tf-checkpoint": 250, "image": 450, "folder": 120,
            "flags": 500, "datagram": 450, "rendezvous": 150}
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
