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
from torch_models.model import model_shape


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
    data problem this rank met; ``bad_batch``, whether the batch ``epoch`` yielded last held an
    item that could not be read (its step must then poison its loss: see
    :meth:`torch_models.run.TorchRun.step`)."""

    info: DataInfo
    problem: str | None = None
    bad_batch: bool = False

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
    """The user's dataset, its items checked as they are read: ``(input, label, bad)`` as
    :class:`FolderImages`, an item that raises or does not match item 0 (shape, kind, label in
    range) replaced by a stand-in (NaN features, zero token ids) and its index in ``bad``."""

    def __init__(self, ds, info: DataInfo, spec: str, split: str) -> None:
        self.ds, self.info, self.spec, self.split = ds, info, spec, split
        self.shape = model_shape(info)
        self.dtype = torch.float32 if info.input_dtype == user_data.FLOAT else torch.int64

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int):
        try:
            return (*self.checked(i), -1)
        except Exception:  # the main process reloads it to name the problem
            fill = torch.full(self.shape, float("nan")) if self.dtype.is_floating_point \
                else torch.zeros(self.shape, dtype=self.dtype)
            return fill, 0, i

    def checked(self, i: int) -> tuple[torch.Tensor, int]:
        """Item ``i`` as the model reads it, or an exception saying why it cannot be."""
        x, label = self.ds[i]
        x = torch.as_tensor(x)
        problem = user_data.item_problem(
            self.spec, self.split, i, tuple(x.shape), _kind(x.dtype), label, self.shape,
            self.info.input_dtype, self.info.num_classes)
        if problem:
            raise ValueError(problem)
        return x.to(self.dtype), int(label)


def _kind(dtype: torch.dtype) -> str | None:
    """What a tensor of ``dtype`` trains as (:func:`ringtrain.data.user_data.input_dtype`)."""
    probe = torch.empty((), dtype=dtype).numpy().dtype if dtype != torch.bfloat16 else np.dtype("f4")
    return user_data.input_dtype(probe.kind, probe.itemsize)


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
    per rank (bench/parts/owndata.py, measured with bench/workers/procs.py).
    """
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["__main__", "torch", __name__])
    return context


def workers(args: argparse.Namespace, local_size: int) -> int:
    return args.workers if args.workers is not None else threads_per_rank(local_size)


# An epoch (or evaluation) whose images are all in the folder's decoded cache but at most this
# share is read in the rank itself, a gather from the cache file per batch (the rest decoded
# there), rather than through the DataLoader's workers: the read is then a gather and a
# normalisation per batch (bench/workers/decodecost.py's cached_batch), which the workers'
# per-item work and their competition for the cores would only add to.  Not yet measured against the workers
# in BENCHMARKS.md.
IN_RANK_MISSING = 0.05


class Streamed(TorchData):
    def __init__(self, info: DataInfo, train, test, *, reload, args: argparse.Namespace,
                 device: torch.device, local_size: int, folder: FolderData | None = None) -> None:
        self.info, self.device, self.reload = info, device, reload
        self.folder = folder  # an image folder, read in the rank where its cache holds it
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
            self.bad_batch = int(bad.max()) >= 0
            if self.problem is None and self.bad_batch:
                self.problem = self.reload(split, int(bad[bad >= 0][0]))
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _in_rank(self, split: str, index_batches: Sequence[np.ndarray]):
        """The batches read in this process: from the decoded cache, the few images not in it
        decoded here (the same numbers as the workers' items, batched)."""
        for idx in index_batches:
            x, y, problem = self.folder.batch(split, idx)
            self.bad_batch = problem is not None
            if problem is not None and self.problem is None:
                self.problem = problem
            x = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))
            yield x.to(self.device), torch.from_numpy(y).to(self.device)

    def _cached(self, split: str, index_batches: Sequence[np.ndarray]) -> bool:
        return (self.folder is not None and len(index_batches) > 0 and self.folder.cached_share(
            split, np.concatenate(index_batches)) >= 1.0 - IN_RANK_MISSING)

    def epoch(self, index_batches):
        if self._cached("train", index_batches):
            return self._in_rank("train", index_batches)
        self.sampler.batches = index_batches
        return self._batches(self.loader, "train")

    def eval_sums(self, model, rank: int, size: int) -> list[float]:
        idx = eval_indices(self.info.test_size, rank, size)
        batches = [idx[s:s + self.batch_size] for s in range(0, len(idx), self.batch_size)]
        before = self.problem
        if self._cached("test", batches):
            read = self._in_rank("test", batches)
        else:
            self.test_sampler.batches = batches
            read = self._batches(self.test_loader, "test")
        totals = _sums(model, read).tolist()
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
                        reload=reload_folder, args=args, device=device, local_size=local_size,
                        folder=builtin)
    info, train, test = startup.every_rank(world, lambda: open_user_data(args))

    def reload_user(split: str, i: int) -> str:
        try:
            (train_items if split == "train" else test_items).checked(i)
        except Exception as err:
            if isinstance(err, ValueError) and str(err).startswith("item "):
                return str(err)
            return f"item {i} of --data {args.data}'s {split} split raised {type(err).__name__}: {err}"
        return f"item {i} of --data {args.data}'s {split} split failed in a worker"

    train_items, test_items = (Guarded(train, info, args.data, "train"),
                               Guarded(test, info, args.data, "test"))
    return Streamed(info, train_items, test_items, reload=reload_user, args=args, device=device,
                    local_size=local_size)


def first_input(spec: str, split: str, ds) -> tuple[tuple[int, ...], str, bool]:
    """Item 0's input of ``split``: its shape, what it trains as, whether it is an image."""
    x, _ = user_data.first_item(spec, split, ds)
    try:  # a tensor or an array; not a PIL image (a transform ending in ToTensor() is missing)
        tensor = torch.as_tensor(x) if isinstance(x, (torch.Tensor, np.ndarray)) else None
    except Exception:
        tensor = None
    if tensor is None:
        raise UserError(user_data.input_problem(spec, split, "torch", None,
                                                f"a {type(x).__module__}.{type(x).__qualname__}", None))
    kind = _kind(tensor.dtype)
    problem = user_data.input_problem(spec, split, "torch", tuple(tensor.shape), tensor.dtype, kind)
    if problem:
        raise UserError(problem)
    return tuple(tensor.shape), kind, kind == user_data.FLOAT and tensor.dim() == 3


def open_user_data(args: argparse.Namespace) -> tuple[DataInfo, Any, Any]:
    """``--data package.module:function`` for PyTorch: both splits, their first items checked."""
    spec = args.data
    splits = {split: user_data.call(spec, split, "torch") for split in user_data.SPLITS}
    firsts = {split: first_input(spec, split, ds) for split, ds in splits.items()}
    user_data.same_inputs(spec, firsts["train"][:2], firsts["test"][:2])
    shape, dtype, image = firsts["train"]
    num_classes, classes = user_data.classes(spec, splits["train"])
    train, test = splits["train"], splits["test"]
    n_train, n_test = user_data.sizes(args, spec, train, test)
    train, test = _subset(train, n_train), _subset(test, n_test)
    # DataInfo keeps an image channels last, as both frameworks' summaries and checkpoints do.
    info = DataInfo(spec, spec, (*shape[1:], shape[0]) if image else shape, num_classes, classes,
                    n_train, n_test, None, input_dtype=dtype, image=image)
    return info, train, test


def _subset(ds, n: int):
    """``n`` items drawn once with a fixed seed (``--train-samples``), or the whole dataset."""
    if n >= len(ds):
        return ds
    return torch.utils.data.Subset(ds, fixed_sample(len(ds), n).tolist())
