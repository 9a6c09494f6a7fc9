"""What the bandwidth-bound training workers share (:mod:`bench.workers.bigmodel_torch`,
:mod:`bench.workers.bigmodel_tf`): flags, the start/end barrier of ``--wrapper alone``, the result file.

The setting is Horovod's synthetic benchmark (``examples/pytorch/pytorch_synthetic_benchmark.py``
in Horovod 0.28.1): an ImageNet model from the framework's model zoo, one fixed random batch per
rank (no input pipeline), SGD, untimed warm-up steps, then timed steps; smaller images than its
224x224 so that a step takes about a second on one CPU core, while the gradients stay the model's
full size (tens of MB), which is what the network has to carry.

Wrappers: ``horovod`` (under ``horovodrun``), ``ddp`` (torch only, one process per host with
``torch.distributed`` env:// variables), ``none`` (one process, no exchange) and ``alone``: N
processes started like ``ddp`` that compute side by side with *no* gradient exchange, meeting only
at a TCP barrier before the warm-up and after the timed steps, so that their timed windows
overlap: the compute time of N ranks sharing this machine's cores, without the network.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

from bench.common import util

WRAPPERS = ("none", "alone", "horovod", "ddp")


def parser(models: tuple[str, ...], default_model: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--wrapper", choices=WRAPPERS, required=True)
    p.add_argument("--model", choices=models, default=default_model)
    p.add_argument("--image-size", type=int, default=32, help="square RGB images, this many pixels a side")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--fp16", action="store_true", help="Horovod: fp16 compression; DDP: fp16 comm hook")
    p.add_argument("--out", default=None, help="rank 0 writes the JSON result here")
    return p


def env_rank() -> tuple[int, int]:
    """(rank, world size) of a process started with torch.distributed's env:// variables."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def tcp_barrier(rank: int, size: int, tag: int, timeout: float = 600.0) -> None:
    """All ``size`` processes wait here until every one has arrived (rank 0 at MASTER_ADDR:
    MASTER_PORT + 1 + tag collects a connection from each, then releases them)."""
    if size == 1:
        return
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]) + 1 + tag
    end = time.monotonic() + timeout
    if rank == 0:
        with socket.create_server((addr, port), backlog=size) as srv:
            srv.settimeout(timeout)
            peers = [srv.accept()[0] for _ in range(size - 1)]
            for conn in peers:
                conn.sendall(b"go")
                conn.close()
        return
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5) as conn:
                conn.settimeout(max(1.0, end - time.monotonic()))
                if conn.recv(2) == b"go":
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise TimeoutError(f"barrier {tag}: rank 0 at {addr}:{port} never released us")
        time.sleep(0.2)


def write(path: str | None, doc: dict) -> None:
    if path:
        util.write_json(path, doc)


def summary(args, *, framework: str, size: int, grad_bytes: int, step_seconds: list[float],
            timed_seconds: float, cpu_seconds: float, weight_sums: list[float],
            extra: dict | None = None) -> dict:
    """The result rank 0 writes: ``seconds_per_step`` is the slowest rank's timed window over
    the number of timed steps; ``rank0_step_seconds`` each of rank 0's steps; ``weight_sums``
    each rank's float64 sum of its trainable weights at the end (equal on every rank once the
    gradients are exchanged: ranks start from different seeds and batches; ``alone`` and
    ``none`` give rank 0's only)."""
    per_step = timed_seconds / args.steps
    return {"framework": framework, "wrapper": args.wrapper, "model": args.model,
            "image_size": args.image_size, "batch_size_per_rank": args.batch_size,
            "world_size": size, "threads_per_rank": args.threads, "fp16": args.fp16,
            "gradient_bytes": grad_bytes, "timed_steps": args.steps,
            "seconds_per_step": per_step, "images_per_second": args.batch_size * size / per_step,
            "rank0_step_seconds": step_seconds, "rank0_cores_busy": cpu_seconds / timed_seconds,
            "weight_sums": weight_sums, **(extra or {})}
