"""What the bench-local training loops share: flags, synthetic/MNIST batches, the result file.

The loops exist so that comparisons differ in one thing only, the distribution wrapper (none,
Horovod, DDP, MultiWorkerMirrored): same model (``torch_models.model`` / ``tf_models.model``),
same per-rank batch, same optimizer (SGD with momentum, LR x world size), same thread count
(:func:`ringtrain.runtime.threads_per_rank`), same timing.

The ``data`` part (:mod:`bench.parts.owndata`) also runs them with another model (``--model``, as the
trainers take it) on one fixed batch of another shape (``--input-shape``, ``--classes``), and on
an image folder (``--data folder:DIR``) read through the trainers' own input pipeline.
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from bench.common import util
from bench.workers import procs
from ringtrain.data import mnist
from ringtrain.data.sharding import shard_indices
from ringtrain.strategies import registry


def data_kind(text: str) -> str:
    if text in ("synthetic", "mnist") or (text.startswith("folder:") and len(text) > len("folder:")):
        return text
    raise argparse.ArgumentTypeError(f"expected synthetic, mnist or folder:DIR, got {text!r}")


def input_shape(text: str) -> tuple[int, int, int]:
    """``HxWxC``, e.g. ``28x28x1``."""
    try:
        height, width, channels = (int(v) for v in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HxWxC, got {text!r}") from None
    return height, width, channels


def parser(wrappers: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--wrapper", choices=wrappers, required=True)
    p.add_argument("--data", type=data_kind, default="synthetic",
                   help="synthetic: one fixed random batch (no input pipeline); mnist: per-step "
                        "gather from the in-memory training set, like the trainers; folder:DIR: "
                        "the trainers' own input pipeline on an image folder")
    p.add_argument("--model", default="cnn", help="as the trainers' --model (cnn, mlp, pkg.mod:fn)")
    p.add_argument("--input-shape", type=input_shape, default=(28, 28, 1),
                   help="synthetic: one example's HxWxC (default 28x28x1, MNIST's)")
    p.add_argument("--classes", type=int, default=10, help="synthetic: the class count (default 10)")
    p.add_argument("--workers", type=int, default=None, help="folder: as the trainers' --workers")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--warmup-steps", type=int, default=10, help="untimed steps first")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: cores // local ranks)")
    p.add_argument("--base-lr", type=float, default=0.01)
    p.add_argument("--out", default=None, help="rank 0 writes the JSON result here")
    return p


def synthetic_batch(batch: int, seed: int, shape: tuple[int, int, int] = (28, 28, 1),
                    classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """One normalised-looking float32 batch [B, H, W, C] and int64 labels, fixed for the run (on
    MNIST's shape, the same numbers as before the shape was a parameter)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, *shape), dtype=np.float32), rng.integers(0, classes, batch)


def image_data(shape: tuple[int, int, int], classes: int) -> SimpleNamespace:
    """What a built-in model's builder reads of a :class:`ringtrain.data.dataset.DataInfo`, for
    the loops' images (MNIST, synthetic or a folder: float32, height x width x channels)."""
    return SimpleNamespace(input_shape=shape, num_classes=classes, image=True, input_dtype="float32",
                           spec="bench")


def trainer_args(args: argparse.Namespace) -> argparse.Namespace:
    """The trainer flags that ``--data folder:DIR`` reads, as the trainers would parse them."""
    # The decoding pipeline, as before the decoded cache: the loop's batches run through epochs
    # it does not finish, which the cache would serve partly from each (bench/parts/owndata.py
    # measures the cache with the real trainer).
    argv = ["--data", args.data, "--batch-size", str(args.batch_size), "--no-decode-cache"]
    if args.workers is not None:
        argv += ["--workers", str(args.workers)]
    trainer = registry.add_trainer_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    registry.validate(trainer)
    return trainer


def folder_batches(n_train: int, rank: int, size: int, batch: int, count: int) -> list[np.ndarray]:
    """``count`` index batches of this rank's shard, epoch after epoch, as the trainers shard them
    (seed 42, their default)."""
    out, epoch = [], 1
    while len(out) < count:
        idx = shard_indices(n_train, rank, size, 42, epoch)
        out += [idx[i * batch:(i + 1) * batch] for i in range(len(idx) // batch)]
        epoch += 1
    return out[:count]


def mnist_shard(rank: int, size: int, seed: int = 42) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(normalised training images, labels, this rank's epoch-1 index order), as the trainers
    shard them."""
    data = mnist.load(download=False)
    idx = shard_indices(len(data.train_labels), rank, size, seed, 1)
    return mnist.normalize(data.train_images), data.train_labels, idx


class StepClock:
    """Wall time of the timed steps only (after ``warmup`` untimed ones), on this rank, and the
    CPU time the whole process (all its threads: compute, Horovod's background thread, MPI/Gloo
    progress) burnt meanwhile: ``cpu_seconds / seconds`` is how many cores this rank kept busy.
    With ``workers``, also the CPU time its DataLoader workers burnt meanwhile
    (``workers_cpu_seconds``)."""

    def __init__(self, warmup: int, workers: bool = False, sync=None) -> None:
        self.warmup, self.count, self.t0, self.seconds = warmup, 0, None, 0.0
        self.sync = sync or (lambda: None)  # e.g. torch.cuda.synchronize: the GPU's queue drained
        self.cpu0, self.cpu_seconds = 0.0, 0.0
        self.workers, self.workers0, self.workers_cpu_seconds = workers, {}, 0.0

    def tick(self) -> None:
        """Call after each finished step."""
        self.count += 1
        if self.count == self.warmup:
            self.sync()
            if self.workers:
                self.workers0 = procs.workers_cpu()
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if self.t0 is None:
            raise RuntimeError("fewer steps than warm-up steps")
        self.sync()
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.cpu0
        if self.workers:
            self.workers_cpu_seconds = procs.since(self.workers0, procs.workers_cpu())


def slowest_torch(seconds: float, hvd, dist) -> float:
    """The slowest rank's timed window (PyTorch loops; ``hvd`` or ``dist``, whichever is in use,
    else this process's own): every rank issues the same collective under the same name."""
    import torch

    t = torch.tensor([seconds])
    if hvd is not None:
        t = hvd.allreduce(t, op=hvd.Max, name="bench_seconds")
    elif dist is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def write_result(path: str | None, *, framework: str, wrapper: str, data: str, size: int,
                 batch: int, steps: int, seconds: float, threads: int, extra: dict | None = None) -> None:
    if not path:
        return
    images = steps * batch * size
    doc = {"framework": framework, "wrapper": wrapper, "data": data, "world_size": size,
           "batch_size_per_rank": batch, "timed_steps": steps, "seconds": seconds,
           "images_per_second": images / seconds, "threads_per_rank": threads, **(extra or {})}
    util.write_json(path, doc)
