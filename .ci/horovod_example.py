"""Run one of Horovod's own example scripts unchanged in logic, offline and short, and record the
weights every rank ends with (used by .ci/horovod-examples; docs/horovod-suite.md).

    python .ci/horovod_example.py SCRIPT OUT_DIR [SCRIPT_ARGS ...]     (one per rank, under a launcher)

What it changes around the script, never inside it:
* MNIST comes from the project's IDX files (ringtrain.data.mnist: $MNIST_DIR, ../shared/data/mnist, ...):
  Keras' ``mnist.load_data()`` gets an npz written to a temp folder (its download checks a
  SHA-256 and cannot run offline); torchvision finds the .gz files in ``--data-dir``.
* The run is short: ``Dataset.take`` and ``Model.fit`` (epochs, steps_per_epoch) are capped by
  HVD_EXAMPLE_STEPS / HVD_EXAMPLE_EPOCHS, torchvision's MNIST by HVD_EXAMPLE_SAMPLES.
* Every Keras model the script builds (and the torch state_dict it broadcasts) is remembered; at
  exit, rank r writes OUT_DIR/rank{r}.json with a SHA-256 of each model's final weights.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import runpy
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ringtrain.data import mnist  # noqa: E402

STEPS = int(os.environ.get("HVD_EXAMPLE_STEPS", "20"))
EPOCHS = int(os.environ.get("HVD_EXAMPLE_EPOCHS", "2"))
SAMPLES = int(os.environ.get("HVD_EXAMPLE_SAMPLES", "4096"))
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("HOROVOD_RANK", "0")))


def digest(arrays) -> dict:
    h, count = hashlib.sha256(), 0
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(a.tobytes())
        count += a.size
    return {"sha256": h.hexdigest(), "params": int(count)}


def keras_hooks(tmp: Path, models: list) -> None:
    import keras
    import tensorflow as tf
    from keras.src.datasets import mnist as keras_mnist
    from keras.src.models import model as keras_model

    data = mnist.load()
    npz = tmp / "mnist.npz"
    np.savez(npz, x_train=data.train_images, y_train=data.train_labels.astype(np.uint8),
             x_test=data.test_images, y_test=data.test_labels.astype(np.uint8))
    keras_mnist.get_file = lambda *args, **kwargs: str(npz)

    init = keras_model.Model.__init__

    def remember(self, *args, **kwargs):
        init(self, *args, **kwargs)
        models.append(self)
    keras_model.Model.__init__ = remember

    fit = keras.Model.fit

    def short_fit(self, *args, **kwargs):
        kwargs["epochs"] = min(kwargs.get("epochs", 1), EPOCHS)
        if kwargs.get("steps_per_epoch"):
            kwargs["steps_per_epoch"] = min(kwargs["steps_per_epoch"], STEPS)
        return fit(self, *args, **kwargs)
    keras.Model.fit = short_fit

    take = tf.data.Dataset.take
    tf.data.Dataset.take = lambda self, count, name=None: take(self, min(int(count), STEPS), name=name)

    atexit.register(lambda: write([digest(w.numpy() for w in m.weights) for m in models if m.weights]))


def torch_hooks(tmp: Path, states: list) -> list[str]:
    import horovod.torch as hvd
    from torchvision import datasets

    raw = tmp / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for path in mnist.ensure_files(mnist.resolve_data_dir(None), download=False).values():
        shutil.copy(path, raw / path.name)

    init = datasets.MNIST.__init__

    def small(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.data, self.targets = self.data[:SAMPLES], self.targets[:SAMPLES]
    datasets.MNIST.__init__ = small

    broadcast = hvd.broadcast_parameters

    def remember(params, root_rank, *args, **kwargs):
        if isinstance(params, dict):
            states.append(params)  # a state_dict's tensors share storage with the live model
        return broadcast(params, root_rank, *args, **kwargs)
    hvd.broadcast_parameters = remember

    atexit.register(lambda: write([digest(t.detach().cpu().numpy() for t in s.values()) for s in states]))
    return ["--data-dir", str(tmp / "data")]


def write(models: list[dict]) -> None:
    out = Path(OUT) / f"rank{RANK}.json"
    out.write_text(json.dumps({"rank": RANK, "models": models}))


if __name__ == "__main__":
    script, OUT, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    tmp = Path(tempfile.mkdtemp(prefix="hvd-example-"))
    atexit.register(shutil.rmtree, tmp, True)  # registered first: runs last
    extra = torch_hooks(tmp, []) if "pytorch" in Path(script).name else (keras_hooks(tmp, []) or [])
    sys.argv = [script, *args, *extra]
    os.chdir(tmp)  # the examples write checkpoints to the working directory
    runpy.run_path(script, run_name="__main__")
