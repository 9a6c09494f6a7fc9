"""Where a PyTorch rank computes: its share of the host's cores, and its GPU where there are GPUs."""

from __future__ import annotations

import torch

from ringtrain.runtime import check_gpu_count, threads_per_rank


def pin(local_rank: int, local_size: int) -> torch.device:
    """Intra-op threads = the host's cores split among its ranks; GPU ``local_rank`` if any."""
    torch.set_num_threads(threads_per_rank(local_size))
    if not torch.cuda.is_available():
        return torch.device("cpu")
    check_gpu_count(local_rank, local_size, torch.cuda.device_count())
    torch.cuda.set_device(local_rank)
    return torch.device("cuda")
