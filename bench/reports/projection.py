"""Scaling efficiency projected to hundreds of workers, beside the Horovod paper's own numbers.

Gradient sizes come from the models (torchvision's parameter counts, measured by the cluster
part).  Compute per step is the published single-GPU throughput of the paper's hardware
generation (Tesla P100) at its batch size (64 per GPU):

* TensorFlow's benchmarks, NVIDIA DGX-1 (8x P100), synthetic ImageNet data, batch 64 per GPU,
  May 2017 (tensorflow/docs ``site/en/r1/guide/performance/benchmarks.md``): ResNet-50 219
  images/s, ResNet-152 91.8, VGG16 154.
* ResNet-101 is not in that table; its time per image is interpolated between ResNet-50 and
  ResNet-152 by forward FLOPs (He et al. 2015, Table 1: 3.8, 7.6 and 11.3 x 10^9): 129 images/s.
  Cross-check: Horovod's ``docs/benchmarks.rst`` shows 16 GPUs running ResNet-101 at
  1656.82 images/s in total with tf_cnn_benchmarks, 104 per GPU at ~90% efficiency, i.e. ~115
  for one GPU alone.
* The paper (Sergeev & Del Balso 2018, arXiv:1802.05799; Horovod README and
  ``docs/benchmarks.rst``): 128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s, 90% scaling
  efficiency for ResNet-101 and Inception V3, 68% for VGG-16 at 512 GPUs.
"""

from __future__ import annotations

from bench.common import costmodel

BATCH = 64
GPUS_PER_SERVER = 4
WORKERS = [16, 32, 64, 128, 256, 512]
LINKS = {"25 GbE": 25e9, "100 GbE": 100e9}
P100_IMAGES_PER_S = {"resnet50": 219.0, "resnet152": 91.8, "vgg16": 154.0}
RESNET_GFLOPS = {"resnet50": 3.8, "resnet101": 7.6, "resnet152": 11.3}
PAPER_512 = {"resnet101": 0.90, "vgg16": 0.68}
NAMES = {"resnet101": "ResNet-101", "vgg16": "VGG-16"}
FUSION_BYTES = 128 * 2**20  # Horovod 0.28.1's default HOROVOD_FUSION_THRESHOLD


def seconds_per_image(model: str) -> float:
    if model in P100_IMAGES_PER_S:
        return 1 / P100_IMAGES_PER_S[model]
    if model == "resnet101":  # linear in FLOPs between ResNet-50 and ResNet-152
        lo, hi = 1 / P100_IMAGES_PER_S["resnet50"], 1 / P100_IMAGES_PER_S["resnet152"]
        f = (RESNET_GFLOPS["resnet101"] - RESNET_GFLOPS["resnet50"]) / (
            RESNET_GFLOPS["resnet152"] - RESNET_GFLOPS["resnet50"])
        return lo + f * (hi - lo)
    raise KeyError(model)


def compute_seconds(model: str) -> float:
    """One step's compute on one P100 at batch 64."""
    return BATCH * seconds_per_image(model)


def table(params: dict[str, int], alpha: float, c: float) -> list[dict]:
    """Efficiency for each model, link and worker count, without overlap (the allreduce after
    the backward pass) and with all of it hidden behind compute (the allreduce of a layer's
    gradient running while the backward pass goes on: at best max(compute, comm))."""
    rows = []
    for model in NAMES:
        grad = 4 * params[model]
        comp = compute_seconds(model)
        for link, bits in LINKS.items():
            for w in WORKERS:
                serial = costmodel.projected_efficiency(comp, grad, w, GPUS_PER_SERVER, bits, alpha, c,
                                                        FUSION_BYTES, overlap=0.0)
                hidden = comp / max(comp, serial["comm_s"])
                rows.append({"model": model, "link": link, "workers": w, "grad_bytes": grad,
                             "compute_s": comp, "comm_s": serial["comm_s"],
                             "latency_s": serial["latency_s"], "transfer_s": serial["transfer_s"],
                             "efficiency_serial": serial["efficiency"], "efficiency_overlapped": hidden})
    return rows
