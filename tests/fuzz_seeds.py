"""The seed corpus of tests/test_fuzz.py, and the targets its checkpoints are restored into.

``python tests/fuzz_seeds.py`` (from the repository root, with the venv's Python) rewrites
tests/fuzz_corpus/: small files, each a reproduction from issue 40 or a valid file the campaign
mutates.  Binary files are made here, never by hand; torch.save writes a random serialisation id,
so regenerating changes their bytes, not what they are.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np

CORPUS = Path(__file__).resolve().parent / "fuzz_corpus"
REPO = CORPUS.parents[1]
TORCH_MODEL, TF_MODEL = "fuzz-linear", "fuzz-dense"
PARAMS = 15  # Linear(4, 3) / Dense(3) on 4 inputs: 12 weights, 3 biases
DATA = {"spec": "fuzz", "input_shape": [2, 2, 1], "num_classes": 3, "classes": ["a", "b", "c"],
        "train_size": 9, "test_size": 3, "normalization": None}


def data_info():
    """The :class:`ringtrain.data.dataset.DataInfo` whose record is :data:`DATA`."""
    from ringtrain.data.dataset import DataInfo

    return DataInfo("fuzz", "fuzz", (2, 2, 1), 3, ("a", "b", "c"), 9, 3, None)


def torch_target():
    """The model and optimizer torch checkpoints are restored into (built afresh, seeded)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def tf_target():
    import keras

    keras.utils.set_random_seed(0)
    net = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    optimizer.build(net.trainable_variables)
    return net, optimizer


def identity(framework: str):
    """The :class:`ringtrain.training.run.RunIdentity` the seed checkpoints are written for and
    restored into."""
    from ringtrain.training.run import RunIdentity

    return RunIdentity(framework, {}, "fuzz", TORCH_MODEL if framework == "torch" else TF_MODEL,
                       PARAMS, data_info())


def meta(framework: str, **changes) -> dict:
    from ringtrain.output import checkpoint

    record = checkpoint.metadata(identity(framework), 1, {"model": "fuzz"})
    record["data"] = dict(DATA)  # as the corpus was written: before input_dtype was recorded
    record.update(changes)
    return record


def torch_bytes(meta_record: dict | None = None, nan: bool = False, extra: dict | None = None) -> bytes:
    import torch

    model, optimizer = torch_target()
    model(torch.zeros(1, 4)).sum().backward()
    optimizer.step()  # momentum buffers exist
    state = model.state_dict()
    if nan:
        state["weight"][0, 0] = float("nan")
    buf = io.BytesIO()
    torch.save({"meta": meta("torch") if meta_record is None else meta_record, "model": state,
                "optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                **(extra or {})}, buf)
    return buf.getvalue()


def npz_bytes(meta_record: dict | None = None, nan: bool = False, compressed: bool = False,
              **extra: np.ndarray) -> bytes:
    arrays = {"model_0000": np.ones((4, 3), np.float32), "model_0001": np.zeros(3, np.float32),
              "optimizer_0000": np.array(1, np.int64), "optimizer_0001": np.zeros((4, 3), np.float32),
              "optimizer_0002": np.zeros(3, np.float32)}
    if nan:
        arrays["model_0000"][1, 1] = np.inf
    record = meta("tf") if meta_record is None else meta_record
    record.setdefault("weight_keys", ["model_0000", "model_0001"])
    arrays["meta"] = np.array(json.dumps(record))
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays, **extra)
    return buf.getvalue()


def recompressed(data: bytes) -> bytes:
    """The same archive with every member deflated (ringtrain stores them)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def with_member(data: bytes, name: str, body: bytes) -> bytes:
    out = io.BytesIO(data)
    with zipfile.ZipFile(out, "a", zipfile.ZIP_STORED) as archive:
        archive.writestr(name, body)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that is all header (no pixel data): what a decompression bomb claims, in 69 bytes."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + \
        chunk(b"IEND", b"")


def image_bytes(fmt: str, size: tuple[int, int] = (8, 6), mode: str = "RGB") -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new(mode, size, 128).save(buf, format=fmt)
    return buf.getvalue()


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\n%%EOF\n"
DATAGRAMS = [  # heartbeat bodies; the campaign signs them with the job's key
    {"r": []}, {"r": 1, "n": 1, "s": 0, "o": "x\n\x1b[31merror: forged\x1b[0m"},
    {"r": 1, "n": 1, "s": 0, "o": None}, {"r": 0, "n": 1, "s": 0, "o": None},
    {"r": True, "n": 1, "s": 0, "o": None}, {"r": 1, "n": -1, "s": 0, "o": None},
    {"r": 1, "n": 1, "s": 1e300, "o": None}, {"r": 1, "n": 1, "s": 0, "o": {"a": 1}},
    {"r": 99, "n": 1, "s": 0, "o": None}, {"t": "old-token", "r": 1, "s": 0}, [1, 2], "text", None,
]
FLAG_LINES = [
    "--max-image-pixels 0", "--max-image-pixels -5", "--max-image-pixels 1e9",
    "--max-image-pixels 100 --data mnist", "--epochs -1", "--epochs 0", "--batch-size 0",
    "--data folder:", "--data folder", "--data ../x", "--image-size 0x5", "--image-size 5x",
    "--image-size 64 --data mnist", "--stall-timeout -1", "--stall-timeout nan",
    "--base-lr 0", "--base-lr inf", "--dropout 1", "--workers -2", "--resume",
    "--tensorboard-steps", "--elastic --amp", "--adasum --gradient-predivide-factor 2",
    "--model os:system", "--model cnn --model 'a b'", "--train-samples 70000", "--test-samples 0",
    "--commit-every 0", "--data-dir /tmp --data folder:/tmp", "--data \x1b[31m",
]


def files() -> dict[str, bytes]:
    """Every corpus file's relative path and bytes."""
    torch_ok = torch_bytes()
    tf_ok = npz_bytes()
    bare = b"cbuiltins\nprint\n(Vunpickled: print ran\ntR."  # harmless if run, but it would run
    return {
        "ckpt/torch-valid.pt": torch_ok,
        "ckpt/torch-deflated.pt": recompressed(torch_ok),
        "ckpt/torch-nan.pt": torch_bytes(nan=True),
        "ckpt/torch-epoch-negative.pt": torch_bytes(meta("torch", epoch=-5)),
        "ckpt/torch-epoch-text.pt": torch_bytes(meta("torch", epoch="9")),
        "ckpt/torch-data-text.pt": torch_bytes(meta("torch", data="mnist")),
        "ckpt/torch-normalization-empty.pt": torch_bytes(
            meta("torch", data={**DATA, "normalization": {}})),
        "ckpt/torch-config-list.pt": torch_bytes(meta("torch", config=[1], model="other")),
        "ckpt/torch-classes-numbers.pt": torch_bytes(meta("torch", data={**DATA, "classes": [1, 2, 3]})),
        "ckpt/torch-extra-member.pt": with_member(torch_ok, "archive/extra", b"\0" * 64),
        "ckpt/torch-bare-pickle.pt": bare,
        "ckpt/tf-valid.npz": tf_ok,
        "ckpt/tf-deflated.npz": npz_bytes(compressed=True),
        "ckpt/tf-nan.npz": npz_bytes(nan=True),
        "ckpt/tf-epoch-negative.npz": npz_bytes(meta("tf", epoch=-5)),
        "ckpt/tf-extra-member.npz": npz_bytes(extra_0000=np.zeros(8)),
        "ckpt/tf-object-array.npz": npz_bytes(model_0002=np.array([[1], "two"], dtype=object)),
        "images/valid.png": image_bytes("PNG"),
        "images/valid.jpg": image_bytes("JPEG"),
        "images/gray.png": image_bytes("PNG", mode="L"),
        "images/bmp-named.png": image_bytes("BMP"),
        "images/tiff-named.png": image_bytes("TIFF"),
        "images/gif-named.png": image_bytes("GIF", mode="P"),
        "images/eps-named.png": EPS,
        "images/bomb-200mp.png": png_header(20_000, 10_000),
        "images/30mp-header.png": png_header(6_000, 5_000),
        "images/truncated.png": image_bytes("PNG")[:40],
        "datagrams.jsonl": "".join(json.dumps(d) + "\n" for d in DATAGRAMS).encode(),
        "flags.txt": "".join(line + "\n" for line in FLAG_LINES).encode(),
    }


def main() -> None:
    sys.path.insert(0, str(REPO))
    for name, data in files().items():
        path = CORPUS / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    print(f"{CORPUS}: {len(files())} files")


if __name__ == "__main__":
    main()
