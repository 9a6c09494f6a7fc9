"""Issue 40's reproductions, each now a normal run or one line: what a writer of the run's
folders, a file in a --data folder, a peer on the job's links or a datagram on the heartbeat
port could do to a run (docs/security.md's table names these tests).

Most run in-process and fast; the two that would exhaust memory or block for ever on the old code
(/dev/zero and a FIFO under a checkpoint's name) run the reader in a child with a memory limit and
a timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import itertools
import json
import os
import pickle
import resource
import socket
import stat
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fuzz_seeds as seeds
import numpy as np
import pytest
from conftest import REPO

from launch import cli
from ringtrain.data import images
from ringtrain.data.dataset import FolderData, Normalization
from ringtrain.errors import UserError, printable
from ringtrain.faults.watchdog import MAC_BYTES, Watchdog
from ringtrain.output import checkpoint, files, tensorboard
from ringtrain.training import wire
from ringtrain.training.world import Collectives, World, state_broadcast

CORPUS = seeds.CORPUS


def one_line(err: BaseException, *needles: str) -> str:
    text = str(err)
    assert text == printable(text, 10**6), text
    for needle in needles:
        assert needle in text, text
    return text


# --- the run's folders: planted symlinks ---------------------------------------------------------

def test_a_planted_probe_symlink_does_not_empty_its_target(tmp_path):
    """A writer of the checkpoint folder links ``.write-test-<pid>`` to one of the user's files:
    the start-up check used to open it with write_bytes, which followed the link and emptied it."""
    target = tmp_path / "precious.txt"
    target.write_text("the user's work\n")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / f".write-test-{os.getpid()}").symlink_to(target)
    files.ensure_writable(folder)
    assert target.read_text() == "the user's work\n"


def test_a_planted_event_file_symlink_is_not_appended_to(tmp_path, monkeypatch):
    """The next TensorBoard event file's name is predictable (time, host, pid, a counter); a
    symlink planted under it is skipped, not written through."""
    monkeypatch.setattr(tensorboard.time, "time", lambda: 1_000_000.0)
    monkeypatch.setattr(tensorboard, "_FILES", itertools.count())
    target = tmp_path / "precious.txt"
    target.write_bytes(b"the user's work\n")
    logdir = tmp_path / "tb"
    logdir.mkdir()
    planted = logdir / f"events.out.tfevents.1000000.{socket.gethostname()}.{os.getpid()}.0.ringtrain"
    planted.symlink_to(target)
    writer = tensorboard.EventWriter(logdir)
    writer.scalars(1, {"loss": 0.5})
    writer.close()
    assert target.read_bytes() == b"the user's work\n"
    written = [p for p in logdir.iterdir() if not p.is_symlink()]
    assert len(written) == 1 and written[0].name.endswith(".1.ringtrain"), written


# --- checkpoints -----------------------------------------------------------------------------------

def torch_restore(folder: Path) -> int:
    from torch_models import checkpoints

    model, optimizer = seeds.torch_target()
    return checkpoints.restore(str(folder), model, optimizer, seeds.identity("torch"))


def tf_restore(folder: Path) -> int:
    from tf_models import checkpoints

    net, optimizer = seeds.tf_target()
    return checkpoints.restore(str(folder), net, optimizer, seeds.identity("tf"))


def folder_with(tmp_path: Path, name: str, data: bytes) -> Path:
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    return folder


def test_the_valid_seed_checkpoints_restore():
    """What the refusals below are measured against: the corpus's valid files load."""
    import tempfile

    for name, restore in (("torch-valid.pt", torch_restore), ("tf-valid.npz", tf_restore)):
        with tempfile.TemporaryDirectory() as tmp:
            folder = folder_with(Path(tmp), f"ckpt-epoch0001.{name.rsplit('.', 1)[1]}",
                                 (CORPUS / "ckpt" / name).read_bytes())
            assert restore(folder) == 1


CHILD = """
import sys
sys.path[:0] = [{repo!r}, {tests!r}]
import fuzz_seeds as seeds
from ringtrain.errors import UserError
from torch_models import checkpoints
model, optimizer = seeds.torch_target()
try:
    checkpoints.restore({folder!r}, model, optimizer, seeds.identity("torch"))
except UserError as err:
    print("one line:", err)
"""


def restore_in_a_child(folder: Path) -> str:
    """The torch restore in a child limited to 4 GiB of address space and 60 s."""
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    proc = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), tests=str(REPO / "tests"),
                                                              folder=str(folder))],
                          capture_output=True, text=True, timeout=60, preexec_fn=limit)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("special", ["dev-zero", "fifo"])
def test_a_checkpoint_that_is_no_regular_file_is_one_line(special, tmp_path):
    """/dev/zero linked under a checkpoint's name ended in a MemoryError traceback (the archive
    check read the whole "file"); a FIFO of that name blocked rank 0 for ever."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / "ckpt-epoch9999.pt"
    if special == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        os.mkfifo(path)
    out = restore_in_a_child(folder)
    assert out.startswith("one line:") and "ckpt-epoch9999.pt" in out, out
    assert ("symbolic link" if special == "dev-zero" else "not a regular file") in out, out


@pytest.mark.parametrize("name,restore", [("torch-deflated.pt", torch_restore),
                                          ("tf-deflated.npz", tf_restore)])
def test_a_compressed_checkpoint_is_refused_before_it_is_unpacked(name, restore, tmp_path):
    """Both writers store members uncompressed; a deflated member is what let a 262 KB .pt
    become a 256 MiB tensor (and a 522 KB .npz a 512 MiB array)."""
    folder = folder_with(tmp_path, f"ckpt-epoch0001.{name.rsplit('.', 1)[1]}",
                         (CORPUS / "ckpt" / name).read_bytes())
    with pytest.raises(UserError) as err:
        restore(folder)
    one_line(err.value, "ckpt-epoch0001", "compressed member")


def test_a_small_deflated_archive_claiming_a_large_tensor_is_refused_unread(tmp_path):
    """The issue's case at a 64 MiB scale: 64 MiB of zeros deflate to ~64 KB; refused from the
    zip directory alone (the process does not grow by the tensor)."""
    import torch

    buf = io.BytesIO()
    torch.save({"meta": seeds.meta("torch"), "big": torch.zeros(16 << 20)}, buf)
    small = seeds.recompressed(buf.getvalue())
    assert len(small) < 1 << 20
    folder = folder_with(tmp_path, "ckpt-epoch0001.pt", small)
    with pytest.raises(UserError) as err:
        torch_restore(folder)
    one_line(err.value, "compressed member")


def test_a_checkpoint_larger_than_the_model_allows_is_refused_unread(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with open(folder / "ckpt-epoch0001.pt", "wb") as fh:
        fh.truncate(checkpoint.size_limit(seeds.PARAMS) + 1)  # sparse: no time, no disk
    with pytest.raises(UserError) as err:
        torch_restore(folder)
    one_line(err.value, "more than a checkpoint of this model can be")


def test_an_npz_member_the_writer_never_makes_is_refused(tmp_path):
    """TF's reader loaded every member of the archive, expected or not."""
    folder = folder_with(tmp_path, "ckpt-epoch0001.npz",
                         (CORPUS / "ckpt" / "tf-extra-member.npz").read_bytes())
    with pytest.raises(UserError) as err:
        tf_restore(folder)
    one_line(err.value, "member ringtrain does not write", "extra_0000.npy")


CURRENT = {**seeds.DATA, "normalization": {"mean": [0.5], "std": [0.25], "source": "here"}}
MALFORMED = {  # what used to happen
    "data is text": ({"data": "mnist"}, "data is not a mapping"),  # AttributeError
    "classes are numbers": ({"data": {**seeds.DATA, "classes": [1, 2, 3]}}, "data.classes"),  # TypeError
    "normalisation is empty": ({"data": {**CURRENT, "normalization": {}}}, "data.normalization"),  # KeyError
    "epoch is a word": ({"epoch": "nine"}, "epoch is 'nine'"),  # ValueError
    "epoch is missing": ({"epoch": None}, "epoch is None"),  # TypeError
    "epoch is negative": ({"epoch": -5}, "epoch is -5"),  # accepted
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_metadata_is_one_line(case):
    changes, needle = MALFORMED[case]
    meta = seeds.meta("torch", **changes)
    with pytest.raises(UserError) as err:
        checkpoint.check_metadata(meta, Path("/ckpt/ckpt-epoch0001.pt"), "torch", seeds.TORCH_MODEL,
                                  seeds.PARAMS, CURRENT)
    one_line(err.value, "ckpt-epoch0001.pt", "malformed metadata", needle)


@pytest.mark.parametrize("name,restore,needle", [("torch-nan.pt", torch_restore, "model weight weight"),
                                                 ("tf-nan.npz", tf_restore, "model_0000")])
def test_a_checkpoint_of_non_finite_weights_is_one_line(name, restore, needle, tmp_path):
    """A NaN-filled checkpoint loaded, and the next step blamed the learning rate."""
    folder = folder_with(tmp_path, f"ckpt-epoch0001.{name.rsplit('.', 1)[1]}",
                         (CORPUS / "ckpt" / name).read_bytes())
    with pytest.raises(UserError) as err:
        restore(folder)
    one_line(err.value, "ckpt-epoch0001", "not finite numbers", needle)


# --- images ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["bmp-named.png", "tiff-named.png", "eps-named.png"])
def test_only_jpeg_and_png_are_decoded(name, tmp_path):
    """PIL decoded a BMP or TIFF named .png, and opened an EPS (which it hands to Ghostscript to
    decode, where Ghostscript is installed)."""
    path = tmp_path / name
    path.write_bytes((CORPUS / "images" / name).read_bytes())
    with pytest.raises(images.ImageError) as err:
        images.probe(path)
    one_line(err.value, name)


def test_a_decompression_bomb_is_one_line(tmp_path):
    """69 bytes of PNG claiming 200 megapixels: PIL's DecompressionBombError was not caught."""
    path = tmp_path / "bomb.png"
    path.write_bytes((CORPUS / "images" / "bomb-200mp.png").read_bytes())
    assert path.stat().st_size < 100
    for read in (lambda: images.probe(path), lambda: images.load(path, (8, 8, 1))):
        with pytest.raises(images.ImageError) as err:
            read()
        one_line(err.value, "bomb.png", "decompression bomb")


def test_images_over_the_pixel_cap_are_refused_from_their_header(tmp_path):
    """A 30-megapixel PNG (its header: 65 bytes) is over the 25-megapixel default; raising
    --max-image-pixels lets it through, past PIL's own limit too."""
    path = tmp_path / "big.png"
    path.write_bytes((CORPUS / "images" / "30mp-header.png").read_bytes())
    with pytest.raises(images.ImageError) as err:
        images.probe(path)
    one_line(err.value, "6000 x 5000 pixels", "--max-image-pixels 25000000")
    assert images.probe(path, 40_000_000) == (5000, 6000, 1)
    huge = tmp_path / "huge.png"
    huge.write_bytes(seeds.png_header(10_000, 20_000))  # 200 MP: beyond PIL's error limit
    assert images.probe(huge, 250_000_000) == (20_000, 10_000, 1)


@pytest.mark.parametrize("argv,needle", [(["--max-image-pixels", "0"], "must be a positive"),
                                         (["--max-image-pixels", "100"], "folder:DIR only")])
def test_max_image_pixels_is_checked_with_the_other_flags(argv, needle):
    with pytest.raises(UserError) as err:
        cli.parse("torch", argv)
    one_line(err.value, "--max-image-pixels", needle)
    assert cli.parse("torch", ["--data", "folder:/x", "--max-image-pixels", "100"]).max_image_pixels == 100


# --- ringtrain's own collectives -----------------------------------------------------------------

class Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class OneRank:
    """Horovod's array collectives for a world of one, recording what would travel."""

    def __init__(self, answer: bytes | None = None) -> None:
        self.sent: list[bytes] = []
        self.answer = answer  # what "rank 0" sends instead, for the receiving side

    def broadcast(self, array: np.ndarray, name: str) -> np.ndarray:
        self.sent.append(array.tobytes())
        if self.answer is not None:
            payload = np.frombuffer(self.answer, np.uint8)
            return np.array([len(payload)], np.int64) if name.endswith(".size") else payload
        return array

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        self.sent.append(array.tobytes())
        return array

    def collectives(self) -> Collectives:
        return Collectives(sum=lambda values, name: values, broadcast=self.broadcast,
                           allgather=self.allgather)


class FakeHvd:
    def __init__(self, rank: int) -> None:
        self._rank = rank

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return 2

    def mpi_enabled(self) -> bool:
        return False

    def gloo_enabled(self) -> bool:
        return True


def test_world_sends_json_never_a_pickle():
    comm = OneRank()
    world = World(FakeHvd(0), comm.collectives())
    assert world.broadcast(("a", 1.5, None), "x") == ["a", 1.5, None]
    assert world.gather({"loss": float("nan"), "problem": None}, "y")[0]["problem"] is None
    assert world.rank0_verdict(lambda: 7, 0, "z") == 7
    payloads = [data for data in comm.sent if len(data) > 8]
    assert payloads and all(json.loads(data) is not None for data in payloads)
    assert not any(data.startswith(b"\x80") for data in comm.sent), "a pickle was sent"
    with pytest.raises(TypeError):
        world.broadcast(Exploit(Path("/nonexistent")), "w")


def test_a_pickle_from_a_peer_is_refused_and_never_run(tmp_path):
    """What Horovod's broadcast_object would have unpickled on every rank (cloudpickle over
    unauthenticated Gloo or MPI links) is not ringtrain's encoding: refused, nothing runs."""
    marker = tmp_path / "pwned"
    world = World(FakeHvd(1), OneRank(answer=pickle.dumps(Exploit(marker))).collectives())
    with pytest.raises(wire.WireError):
        world.broadcast(None, "data")
    assert not marker.exists()
    pickle.loads(pickle.dumps(Exploit(marker)))  # the payload is real
    assert marker.exists()


def test_a_folder_index_travels_as_plain_data(tmp_path):
    from ringtrain.data.dataset import DataInfo
    from ringtrain.data.folder import FolderIndex, Split

    paths = np.array([os.fsencode("a/caf\u00e9.png"), b"b/\xff.png"], dtype=np.bytes_)
    split = Split(str(tmp_path), paths, np.array([0, 1], np.int64))
    data = FolderData(DataInfo("folder:x", "folder", (8, 8, 3), 2, ("a", "b"), 2, 2,
                               Normalization((0.5, 0.5, 0.5), (0.2, 0.2, 0.2), "computed")),
                      FolderIndex(str(tmp_path), ("a", "b"), split, split, (8, 8, 3), 1234))
    shared = FolderData.from_plain(wire.decode(wire.encode(data.to_plain())))
    assert shared.info == data.info and shared.index.max_pixels == 1234
    assert (shared.index.train.paths == paths).all()
    assert shared.index.train.path(1) == data.index.train.path(1)
    with pytest.raises(ValueError):
        FolderData.from_plain({"info": {}, "index": []})


def test_horovods_elastic_state_syncs_as_plain_data():
    """Horovod's ObjectState (elastic jobs' committed attributes, and the host-update check at
    every commit) through state_broadcast: JSON, and the same values back."""
    elastic = pytest.importorskip("horovod.common.elastic")
    comm = OneRank()
    state = elastic.ObjectState(bcast_object=state_broadcast(comm.collectives(), lambda: 0),
                                get_rank=lambda: 0, epoch=3, records=[{"loss": 0.25}],
                                loss_sum=[1.5, 64.0])
    state.sync()
    state.check_host_updates()
    assert (state.epoch, state.records, state.loss_sum) == (3, [{"loss": 0.25}], [1.5, 64.0])
    assert not any(data.startswith(b"\x80") for data in comm.sent)


# --- the watchdog's heartbeats -------------------------------------------------------------------

def channel(everyone_here: bool) -> list[Watchdog]:
    """Two watchdogs with their channel open, as the start-up allgather makes it."""
    dogs = [Watchdog(4, r, 2, "gloo", elastic=False) for r in range(2)]
    records, ready = [None, None], threading.Barrier(2)

    def gather(record, name):
        records[record["rank"]] = wire.decode(wire.encode(record))
        ready.wait()
        return list(records)

    with ThreadPoolExecutor(2) as pool:  # both ranks in the allgather at once
        list(pool.map(lambda dog: dog.open_channel(gather, everyone_here), dogs))
    return dogs


def signed(dog: Watchdog, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return hmac.new(dog.key, raw, hashlib.sha256).digest()[:MAC_BYTES] + raw


def test_heartbeats_listen_on_loopback_when_every_rank_is_here():
    """Rank 0's heartbeat socket was bound to 0.0.0.0 on every rank's host."""
    dogs = channel(everyone_here=True)
    try:
        assert dogs[0].sock.getsockname()[0] == "127.0.0.1"
        assert dogs[1].sock.getpeername() == dogs[0].sock.getsockname()
        for _ in range(2):
            for d in dogs:
                d.exchange()
        assert dogs[0].counters.get(1) and dogs[1].counters.get(0), "no heartbeat went through"
    finally:
        for d in dogs:
            d.sock.close()


def test_the_key_never_crosses_the_heartbeat_channel():
    """The job token crossed loopback in clear in every datagram; now a datagram carries an HMAC
    of its body, never the key."""
    dogs = channel(everyone_here=True)
    try:
        dogs[1]._send()
        data = dogs[0].sock.recv(1024)
        assert dogs[0].key not in data and dogs[0].key.hex().encode() not in data
        assert dogs[0].accept(data) == 1
        assert dogs[0].accept(data) is None, "a replayed heartbeat was taken"
    finally:
        for d in dogs:
            d.sock.close()


def test_a_malformed_heartbeat_is_counted_and_dropped_and_the_thread_lives_on():
    """{"r": []} carrying the job's credentials killed the watchdog thread (TypeError), and the
    guardian then killed the rank."""
    dogs = channel(everyone_here=True)
    try:
        sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for body in ({"r": []}, {"r": 1, "n": 1, "s": 0, "o": {}},
                     {"r": [], "n": 1, "s": 0, "o": None}):
            sender.sendto(signed(dogs[0], body), dogs[0].sock.getsockname())
        sender.sendto(b"\x00" * 40, dogs[0].sock.getsockname())
        sender.close()
        deadline = time.monotonic() + 10
        while dogs[0].dropped < 4 and time.monotonic() < deadline:
            dogs[0].exchange()  # raises nothing
        assert dogs[0].dropped == 4
    finally:
        for d in dogs:
            d.sock.close()


def test_text_from_a_peer_reaches_the_error_line_without_control_characters():
    dogs = channel(everyone_here=True)
    try:
        forged = "x\n\x1b[31merror: forged\x1b[0m"
        assert dogs[0].accept(signed(dogs[0], {"r": 1, "n": 5, "s": 3, "o": forged})) == 1
        line = dogs[0].diagnose(time.monotonic())
        assert "stuck outside Horovod" in line and "\n" not in line and "\x1b" not in line, line
    finally:
        for d in dogs:
            d.sock.close()


# --- the GPU check's build folder ----------------------------------------------------------------

def test_gpu_check_refuses_a_build_folder_others_can_write(tmp_path):
    """Its build folder's Horovod and cffi go first on PYTHONPATH; the old default
    /tmp/ringtrain-gpu was anyone's to create first."""
    build = tmp_path / "build"
    build.mkdir()
    build.chmod(0o777)
    proc = subprocess.run(["bash", str(REPO / ".ci" / "gpu-check")], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "GPU_CHECK_BUILD": str(build),
                                           "GPU_CHECK_OUT": str(tmp_path / "out"), "PYTHON": "false"})
    assert proc.returncode != 0
    assert "writable by others" in proc.stderr, proc.stderr
    assert "===" not in proc.stdout, "it went on to build"
    assert stat.S_IMODE(build.stat().st_mode) == 0o777 and not list(build.iterdir())
