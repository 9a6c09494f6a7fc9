"""``python -m bench.workers.decodecost --folder DIR --images N --out FILE``: what one image costs to read.

In one process on one thread (as a DataLoader worker runs: PyTorch sets one thread in each), over
the first ``N`` training images of an image folder, CPU seconds (``time.process_time``) and wall
seconds per image of:

* ``load``: :func:`ringtrain.data.images.load` at the folder's own size: PIL decodes and converts
  (what every training image costs in both frameworks);
* ``load_resize``: the same to half the size: decode + bilinear resize (a folder of photos larger
  than ``--image-size``);
* ``item``: ``torch_models.data.FolderImages[i]``, the whole item a PyTorch worker produces
  (decode, normalise, channels first, to a tensor), before the DataLoader batches it;
* ``batch``: ``FolderData.batch`` on 64 indices at a time, per image: what TensorFlow's
  ``tf.data`` map runs (decode and normalise a whole batch).
* ``cached_batch``: the same from a decoded cache (``ringtrain/data/decoded_cache.py``) that holds
  every image already: what both frameworks read from the second epoch on (PyTorch in the rank,
  then channels first); the cache in a temporary folder, removed after.

Each is timed twice over the same files (the first pass also warms the page cache); the second
counts.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np


def timed(fn, items) -> dict[str, float]:
    for i in items:  # untimed: page cache, lazy imports
        fn(i)
    cpu, wall = time.process_time(), time.perf_counter()
    for i in items:
        fn(i)
    n = len(items)
    return {"cpu_us": (time.process_time() - cpu) / n * 1e6,
            "wall_us": (time.perf_counter() - wall) / n * 1e6}


def per_image(cost: dict[str, float], images: int, calls: int) -> dict[str, float]:
    """A per-call cost as per image, over ``calls`` calls that read ``images`` images."""
    return {k: v * calls / images for k, v in cost.items()}


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--folder", required=True)
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch

    torch.set_num_threads(1)
    from bench.common.util import write_json
    from ringtrain.data import images
    from ringtrain.data.dataset import DataInfo, FolderData, Normalization
    from ringtrain.data.folder import scan
    from torch_models.data import FolderImages

    index = scan(args.folder)
    height, width, channels = index.shape
    n = min(args.images, len(index.train.labels))
    picks = list(range(n))
    paths = [index.train.path(i) for i in picks]
    half = (max(1, height // 2), max(1, width // 2), channels)
    info = DataInfo(f"folder:{args.folder}", "folder", index.shape, len(index.classes), index.classes,
                    len(index.train.labels), len(index.test.labels),
                    Normalization((0.5,) * channels, (0.25,) * channels, "bench"))
    dataset = FolderImages(FolderData(info, index), "train")
    with tempfile.TemporaryDirectory(prefix="decodecost-") as where:
        keyed = FolderData(info, index).with_keys()
        cached = keyed.with_caches(where, print)
        batches = [np.arange(s, min(s + 64, n)) for s in range(0, n, 64)]
        for b in batches:  # fill it
            cached.batch("train", b)
        cached_batch = per_image(timed(lambda b: cached.batch("train", b), batches), n, len(batches))
    result = {"images": n, "shape": list(index.shape),
              "load": timed(lambda i: images.load(paths[i], index.shape), picks),
              "load_resize": timed(lambda i: images.load(paths[i], half), picks),
              "load_resize_to": list(half),
              "item": timed(lambda i: dataset[i], picks),
              "batch": per_image(timed(lambda s: dataset.data.batch("train", np.arange(s, min(s + 64, n))),
                                       list(range(0, n, 64))), n, len(range(0, n, 64))),
              "cached_batch": cached_batch,
              "mean_file_bytes": float(np.mean([len(open(p, "rb").read()) for p in paths]))}
    write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
