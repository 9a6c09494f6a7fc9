"""A run's data as PyTorch batches.

* MNIST (:class:`InMemory`): normalised NCHW tensors made once, indexed per batch, which beats a
  DataLoader's per-image Python work by a wide margin on small CPU machines (and gives the same
  numbers as ringtrain always has).
* An image folder or the user's own dataset (:class:`Streamed`): a ``DataLoader`` with worker
  processes (``--workers``), persistent across epochs, pinned memory on GPU, two batches
  prefetched per worker.  Its ``batch_sampler`` is :class:`ShardBatches`, ringtrain's own
  sharding rather than ``DistributedSampler``: the same semantics (``perm[r::N]``, equal steps on
  every rank) but ringtrain's permutation, which both frameworks and the elastic re-shard share.

A file that does not decode (or a user's item that raises) becomes a NaN image, its index
reported beside the batch: every rank's weights turn non-finite in that step, all ranks stop
there (:mod:`ringtrain.training.divergence`), and the message names the file.
"""

from __future__ import annotations

import argparse
import multiprocessing
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ringtrain.data import user_data
from ringtrain.data.dataset import ArrayData, DataInfo, FolderData
from ringtrain.data.sharding import eval_indices, fixed_sample
from ringtrain.errors import UserError
from ringtrain.runtime import threads_per_rank
from ringtrain.training import startup
from ringtrain.training.evaluation import EVAL_BATCH
from ringtrain.training.world import World


def to_tensors(data: ArrayData, images: np.ndarray, labels: np.ndarray, device: torch.device):
    """Normalised NCHW float tensors of in-memory images."""
    x = data.inputs(images)  # [N, H, W, C]
    n, height, width, channels = x.shape
    if channels > 1:
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    # A reshape, not a permuted view: with one channel the view's strides look channels-last to
    # PyTorch, whose convolutions then take another path and round differently.
    x = torch.from_numpy(x.reshape(n, channels, height, width))
    return x.to(device), torch.from_numpy(labels).to(device)


class TorchData:
    """What the trainers read: ``info``; ``epoch(index_batches)``, the batches of this rank's
    shard as ``(x, y)`` on the device; ``eval_sums(model, rank, size)``; ``problem``, the first
    data problem this rank met."""

    info: DataInfo
    problem: str | None = None

    def epoch(self, index_batches: Sequence[np.ndarray]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        raise NotImplementedError

    def eval_sums(self, model, rank: int, size: int) -> list[float]:
        raise NotImplementedError


def _sums(model, batches) -> torch.Tensor:
    """(test loss sum, correct, count) over ``(x, y)`` batches, summed on the device."""
    model.eval()
    totals = None
    with torch.no_grad():
        for x, y in batches:
            if totals is None:
                totals = torch.zeros(3, dtype=torch.float64, device=x.device)
            logits = model(x)
            totals[0] += F.cross_entropy(logits, y, reduction="sum").double()
            totals[1] += (logits.argmax(1) == y).sum()
            totals[2] += len(y)
    return totals if totals is not None else torch.zeros(3, dtype=torch.float64)


class InMemory(TorchData):
    def __init__(self, data: ArrayData, device: torch.device) -> None:
        self.info = data.info
        self.train_x, self.train_y = to_tensors(data, data.train_images, data.train_labels, device)
        self.test_x, self.test_y = to_tensors(data, data.test_images, data.test_labels, device)
        self.device = device

    def epoch(self, index_batches):
        if not index_batches:
            return
        # The epoch's indices go to the device in one copy: a copy per batch from a host array
        # makes the CPU wait for the GPU every step (PyTorch syncs a pageable host-to-device copy).
        flat = torch.from_numpy(np.concatenate(index_batches)).to(self.device)
        for idx in torch.split(flat, [len(b) for b in index_batches]):
            yield self.train_x[idx], self.train_y[idx]

    def eval_sums(self, model, rank: int, size: int) -> list[float]:
        idx = torch.from_numpy(eval_indices(len(self.test_y), rank, size)).to(self.device)
        x, y = self.test_x[idx], self.test_y[idx]
        batches = ((x[s:s + EVAL_BATCH], y[s:s + EVAL_BATCH]) for s in range(0, len(y), EVAL_BATCH))
        return [*_sums(model, batches).tolist(), 0.0]


class FolderImages(torch.utils.data.Dataset):
    """One split of an image folder: item ``i`` is ``(image [C, H, W] float32, label, bad)``,
    ``bad`` = -1, or ``i`` when the file does not decode (the image is then NaN)."""

    def __init__(self, data: FolderData, split: str) -> None:
        self.data, self.split = data, split

    def __len__(self) -> int:
        return len(self.data.split(self.split).labels)

    def __getitem__(self, i: int):
        x, y, problem = self.data.batch(self.split, np.array([i]))
        return torch.from_numpy(np.ascontiguousarray(x[0].transpose(2, 0, 1))), int(y[0]), \
            i if problem else -1


class Guarded(torch.utils.data.Dataset):
    """The user's dataset, its items checked: ``(image, label, bad)`` as :class:`FolderImages`."""

    def __init__(self, ds, shape: tuple[int, int, int]) -> None:
        self.ds, self.shape = ds, shape

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        try:
            image, label = self.ds[i]
            return torch.as_tensor(image, dtype=torch.float32), int(label), -1
        except Exception:  # the main process reloads it to name the problem
            return torch.full(self.shape, float("nan")), 0, i


class ShardBatches(torch.utils.data.Sampler):
    """The index batches of this rank's shard for the coming pass, set before each (an epoch, or
    the rest of one after an elastic re-form); a DataLoader's ``batch_sampler``."""

    def __init__(self) -> None:
        self.batches: Sequence[np.ndarray] = []

    def __iter__(self):
        return iter([b.tolist() for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def worker_context() -> multiprocessing.context.BaseContext:
    """Where DataLoader workers come from: a fork server that has imported PyTorch and this
    module, so every worker is a fork sharing their pages.  Without the preload each worker
    imported PyTorch itself: about 1.2 s of CPU and 283 MiB of private memory (USS) per worker, 4
    workers per rank at -np 1 on 2 cores (--workers for training and as many for evaluation);
    forked from a server that holds it, 0.02 s and 12 MiB each, and the server's 283 MiB once
    per rank (bench/owndata.py, measured with bench/procs.py).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", __name__])
    return context


def workers(args: argparse.Namespace, local_size: int) -> int:
    return args.workers if args.workers is not None else threads_per_rank(local_size)


class Streamed(TorchData):
    def __init__(self, info: DataInfo, train, test, *, reload, args: argparse.Namespace,
                 device: torch.device, local_size: int) -> None:
        self.info, self.device, self.reload = info, device, reload
        self.batch_size = args.batch_size
        n = workers(args, local_size)
        options: dict[str, Any] = {"num_workers": n, "pin_memory": device.type == "cuda"}
        if n:
            # Horovod's examples start workers from a fork server: forking the rank itself copies
            # a process with MPI and Horovod's threads running, which some interconnects do not
            # survive.  Persistent: started once, not every epoch.
            options.update(persistent_workers=True, prefetch_factor=2,
                           multiprocessing_context=worker_context())
        self.sampler, self.test_sampler = ShardBatches(), ShardBatches()
        self.loader = torch.utils.data.DataLoader(train, batch_sampler=self.sampler, **options)
        self.test_loader = torch.utils.data.DataLoader(test, batch_sampler=self.test_sampler, **options)

    def _batches(self, loader, split: str):
        for x, y, bad in loader:
            if self.problem is None and int(bad.max()) >= 0:
                self.problem = self.reload(split, int(bad[bad >= 0][0]))
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def epoch(self, index_batches):
        self.sampler.batches = index_batches
        return self._batches(self.loader, "train")

    def eval_sums(self, model, rank: int, size: int) -> list[float]:
        idx = eval_indices(self.info.test_size, rank, size)
        self.test_sampler.batches = [idx[s:s + self.batch_size] for s in range(0, len(idx), self.batch_size)]
        before = self.problem
        totals = _sums(model, self._batches(self.test_loader, "test")).tolist()
        return [*totals, 1.0 if self.problem is not None and before is None else 0.0]


def open_data(args: argparse.Namespace, world: World | None, device: torch.device,
              local_size: int) -> TorchData:
    """The run's data (``--data``), checked; ``world`` None in an elastic worker (no collective)."""
    builtin = startup.open_data(world, args)
    if isinstance(builtin, ArrayData):
        return InMemory(builtin, device)
    if isinstance(builtin, FolderData):
        def reload_folder(split: str, i: int) -> str:
            x, _, problem = builtin.batch(split, np.array([i]))
            return problem or f"{builtin.split(split).path(i)} did not decode in a worker"

        return Streamed(builtin.info, FolderImages(builtin, "train"), FolderImages(builtin, "test"),
                        reload=reload_folder, args=args, device=device, local_size=local_size)
    info, train, test = startup.every_rank(world, lambda: open_user_data(args))

    def reload_user(split: str, i: int) -> str:
        try:
            (train if split == "train" else test)[i]
        except Exception as err:
            return f"item {i} of --data {args.data}'s {split} split raised {type(err).__name__}: {err}"
        return f"item {i} of --data {args.data}'s {split} split failed in a worker"

    shape = tuple(channels_first(info.input_shape))
    return Streamed(info, Guarded(train, shape), Guarded(test, shape), reload=reload_user, args=args,
                    device=device, local_size=local_size)


def channels_first(shape: tuple[int, int, int]) -> tuple[int, int, int]:
    height, width, channels = shape
    return channels, height, width


def open_user_data(args: argparse.Namespace) -> tuple[DataInfo, Any, Any]:
    """``--data package.module:function`` for PyTorch: both splits, their first items checked."""
    spec = args.data
    splits = {split: user_data.call(spec, split, "torch") for split in user_data.SPLITS}
    shapes = {}
    for split, ds in splits.items():
        image, _ = user_data.first_item(spec, split, ds)
        if not isinstance(image, torch.Tensor) or image.dim() != 3 or not image.is_floating_point():
            what = (f"a {tuple(image.shape)} {image.dtype} tensor" if isinstance(image, torch.Tensor)
                    else f"a {type(image).__module__}.{type(image).__qualname__}")
            raise UserError(f"--data {spec}: the image of item 0 of its {split} split is {what}; "
                            f"--framework torch needs a float tensor [channels, height, width] "
                            f"(e.g. a torchvision transform ending in ToTensor())")
        shapes[split] = tuple(image.shape)
    if shapes["train"] != shapes["test"]:
        raise UserError(f"--data {spec}: its train images are {shapes['train']}, its test images "
                        f"{shapes['test']}; give both splits the same shape")
    num_classes, classes = user_data.classes(spec, splits["train"])
    channels, height, width = shapes["train"]
    train, test = splits["train"], splits["test"]
    n_train, n_test = user_data.sizes(args, spec, train, test)
    train, test = _subset(train, n_train), _subset(test, n_test)
    info = DataInfo(spec, spec, (height, width, channels), num_classes, classes, n_train, n_test, None)
    return info, train, test


def _subset(ds, n: int):
    """``n`` items drawn once with a fixed seed (``--train-samples``), or the whole dataset."""
    if n >= len(ds):
        return ds
    return torch.utils.data.Subset(ds, fixed_sample(len(ds), n).tolist())
