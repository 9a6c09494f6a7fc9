"""``python -m bench --smoke --out DIR``: the smallest run of every part, for
``tests/test_bench_smoke.py``.

Each launch line and each worker mode a part uses runs once, for one or two steps at -np 1 or 2,
so that an import or API drift anywhere in the suite fails a test in seconds instead of surfacing
in the next full run.  The numbers mean nothing (the report says QUICK MODE and prints no
comparison), which is why ``--smoke`` refuses to write into ``bench/results`` or
``BENCHMARKS.md``.
"""

from __future__ import annotations

from bench.parts import emulated_cluster, floor
from bench.parts.config import Config

# Throughput: every launch line (plain python, the real trainer, horovodrun with MPI and with
# Gloo, torchrun, MultiWorkerMirrored), each loop's Horovod and peer wrappers and both data
# sources once, instead of the plan's product of them.
THROUGHPUT_RUNS = [
    "torch/trainer/horovod/mnist/np1",
    "torch/loop/horovod-gloo/mnist/np2",
    "torch/loop/ddp/synthetic/np2",
    "tf/loop/none/mnist/np1-1thread",
    "tf/trainer/horovod/mnist/np1",
    "tf/loop/horovod/synthetic/np2",
    "tf/loop/mwms/synthetic/np2",
]
TIMEOUT_S = 240  # per launch


def config() -> Config:
    """Throughput, collectives (every implementation at -np 2, one 4 KiB message) and accuracy
    (each trainer at -np 1, stopped when its first epoch reaches a target of 0%, which is how
    the part stops a real run at 99%)."""
    return Config(
        quick=True, nps=[1, 2], warmup_steps=1, steps=1, trainer_steps=1, runs=THROUGHPUT_RUNS,
        coll_nps=[2], coll_sizes=[4096], coll_warmup=1, coll_reps=1, coll_budget_s=0.1,
        acc_nps=[1], acc_target=0.0,
        acc_args=["--epochs", "2", "--train-samples", "256", "--test-samples", "128", "--batch-size", "32"],
        acc_proxy="smoke test: 256 training images, stopped after epoch 1 at a target of 0%",
        timeout_s=TIMEOUT_S, copy_bytes=8 << 20)


def floor_config() -> floor.FloorConfig:
    """Every cell kind of the floor part once (-np 2, 4 KiB, one step): :func:`bench.parts.floor.smoke`."""
    return floor.smoke()


def cluster_config() -> emulated_cluster.ClusterConfig:
    """Two hosts, the unshaped and the 1 Gbit/s profile (the link probe on each); on 1 Gbit/s one
    64 KiB message through each launcher (horovodrun --gloo with the sleeping wait, torch.distributed
    started directly on each host, mpirun's parameter server) and one Keras step under horovodrun
    across the two hosts (bigmodel_tf's ``tiny`` model: the cluster's launch, not ResNet-50's
    tracing)."""
    return emulated_cluster.ClusterConfig(
        quick=True, hosts=2, profiles=["1g"], coll_hosts={"1g": [2]},
        coll_impls=["horovod-gloo-sleepwait", "torch-gloo", "mpi4py-param-server"],
        coll_sizes=[64 * 1024], coll_warmup=1, coll_reps=1, coll_budget_s=0.1, hier_hosts=[],
        train_hosts={}, train_warmup=1, train_steps=1, ddp=False, knob_profile=None,
        tf_model="tiny", tf_hosts={"1g": [2]}, tf_alone_hosts=[], tf_batch_size=2,
        timeout_s=TIMEOUT_S)
