"""PyTorch glue shared by the fixed-size trainer (:mod:`torch_models.train`) and the elastic one
(:mod:`torch_models.elastic`): device pinning, tensors, evaluation sums, checkpoint files and the
collectives :class:`ringtrain.training.job.Job` issues through ``horovod.torch``."""

from __future__ import annotations

import argparse
import io
import math
import pickle

import horovod
import horovod.torch as hvd
import numpy as np
import torch
import torch.nn.functional as F

from ringtrain.data.dataset import Dataset, model_inputs
from ringtrain.errors import UserError
from ringtrain.faults import termination
from ringtrain.output import checkpoint
from ringtrain.runtime import threads_per_rank
from ringtrain.training.job import EVAL_BATCH, Collectives

CKPT_EXT = "pt"
VERSIONS = {"torch": torch.__version__, "horovod": horovod.__version__}


def _sum(values, name: str) -> list[float]:
    return hvd.allreduce(torch.tensor(values, dtype=torch.float64), op=hvd.Sum, name=name).tolist()


COLLECTIVES = Collectives(sum=_sum, broadcast_object=hvd.broadcast_object,
                          allgather_object=hvd.allgather_object)


def pin(local_rank: int, local_size: int) -> torch.device:
    """This rank's share of the host's cores, and its GPU (the local rank's) where there are GPUs."""
    torch.set_num_threads(threads_per_rank(local_size))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():  # NCCL refuses two ranks on one GPU
        raise UserError(f"{local_size} ranks on this host but only {torch.cuda.device_count()} "
                        f"GPU(s); run at most {torch.cuda.device_count()} processes per host")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda")


def to_tensors(dataset: Dataset, images: np.ndarray, labels: np.ndarray, device: torch.device):
    """Normalised NCHW float tensors, made once: indexing them per batch beats a DataLoader's
    per-image Python work by a wide margin on small CPU machines."""
    x = model_inputs(dataset, images)  # [N, H, W, C]
    n, height, width, channels = x.shape
    if channels > 1:
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    # A reshape, not a permuted view: with one channel the view's strides look channels-last to
    # PyTorch, whose convolutions then take another path and round differently.
    x = torch.from_numpy(x.reshape(n, channels, height, width))
    return x.to(device), torch.from_numpy(labels).to(device)


def eval_sums(model, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """This rank's (test loss sum, correct, count), summed on the device and read once."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=x.device)
    with torch.no_grad():
        for start in range(0, len(x), EVAL_BATCH):
            logits = model(x[start:start + EVAL_BATCH])
            target = y[start:start + EVAL_BATCH]
            totals[0] += F.cross_entropy(logits, target, reduction="sum").double()
            totals[1] += (logits.argmax(1) == target).sum()
            totals[2] += len(target)
    return totals.tolist()


def weights_finite(model) -> bool:
    """Whether every parameter is a finite number: one float64 sum per tensor, which a single NaN
    or inf anywhere makes non-finite (30 us per step for the CNN on one core, where
    ``isfinite().all()`` took 600 us)."""
    with torch.no_grad():
        total = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()]).sum()
    return math.isfinite(float(total))


def parameters(model) -> list[np.ndarray]:
    return [p.detach().cpu().numpy() for p in model.parameters()]


def save_checkpoint(path_dir: str, epoch: int, model, optimizer, model_name: str, param_count: int,
                    args: argparse.Namespace) -> None:
    with termination.saving():
        _save(path_dir, epoch, model, optimizer, model_name, param_count, args)


def _save(path_dir, epoch, model, optimizer, model_name, param_count, args) -> None:
    buf = io.BytesIO()
    torch.save({
        "meta": checkpoint.metadata("torch", model_name, param_count, epoch,
                                    checkpoint.config_of(args)),
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "torch_rng": torch.get_rng_state(),
    }, buf)
    checkpoint.save(path_dir, epoch, CKPT_EXT, buf.getvalue())


def read_checkpoint(path) -> tuple[object, dict]:
    """``(metadata, state)`` of one checkpoint archive: tensors and plain data only
    (``weights_only=True``), so nothing in the file runs while it is read."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:  # the archive is intact (its CRCs passed): it holds objects
        raise checkpoint.refused(path, "holds Python objects beyond tensors and plain data") from None
    except Exception as err:  # torch raises many types for damaged files
        raise checkpoint.Damaged(type(err).__name__) from None
    return (state.get("meta") if isinstance(state, dict) else None), state


def load_checkpoint(path_dir: str, model, optimizer, model_name: str, param_count: int) -> int:
    """Restore rank 0's model/optimizer from the newest intact checkpoint; return its epoch (0 if
    there is none)."""
    found = checkpoint.restore_newest(path_dir, CKPT_EXT, read_checkpoint, framework="torch",
                                      model=model_name, param_count=param_count)
    if found is None:
        return 0
    epoch, state = found
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    return epoch
