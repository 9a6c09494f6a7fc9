"""What the bench-local training loops share: flags, synthetic/MNIST batches, the result file.

The loops exist so that comparisons differ in one thing only, the distribution wrapper (none,
Horovod, DDP, MultiWorkerMirrored): same model (``torch_models.model`` / ``tf_models.model``),
same per-rank batch, same optimizer (SGD with momentum, LR x world size), same thread count
(:func:`ringtrain.runtime.threads_per_rank`), same timing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from ringtrain.data import mnist
from ringtrain.data.sharding import shard_indices


def parser(wrappers: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--wrapper", choices=wrappers, required=True)
    p.add_argument("--data", choices=("synthetic", "mnist"), default="synthetic",
                   help="synthetic: one fixed random batch (no input pipeline); mnist: per-step "
                        "gather from the in-memory training set, like the trainers")
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--warmup-steps", type=int, default=10, help="untimed steps first")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: cores // local ranks)")
    p.add_argument("--base-lr", type=float, default=0.01)
    p.add_argument("--out", default=None, help="rank 0 writes the JSON result here")
    return p


def synthetic_batch(batch: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """One normalised-looking float32 batch [B, 28, 28] and int64 labels, fixed for the run."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, 28, 28), dtype=np.float32), rng.integers(0, 10, batch)


def mnist_shard(rank: int, size: int, seed: int = 42) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(normalised training images, labels, this rank's epoch-1 index order), as the trainers
    shard them."""
    data = mnist.load(download=False)
    idx = shard_indices(len(data.train_labels), rank, size, seed, 1)
    return mnist.normalize(data.train_images), data.train_labels, idx


class StepClock:
    """Wall time of the timed steps only (after ``warmup`` untimed ones), on this rank, and the
    CPU time the whole process (all its threads: compute, Horovod's background thread, MPI/Gloo
    progress) burnt meanwhile: ``cpu_seconds / seconds`` is how many cores this rank kept busy."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.count, self.t0, self.seconds = warmup, 0, None, 0.0
        self.cpu0, self.cpu_seconds = 0.0, 0.0

    def tick(self) -> None:
        """Call after each finished step."""
        self.count += 1
        if self.count == self.warmup:
            self.t0, self.cpu0 = time.perf_counter(), time.process_time()

    def stop(self) -> None:
        if self.t0 is None:
            raise RuntimeError("fewer steps than warm-up steps")
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.cpu0


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
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2))
