"""One rank of the waiting check: ``horovodrun -np N python -m bench.workers.wait_worker --op OP --out F``.

Every repetition the ranks meet at a barrier, then every rank but 0 sleeps ``--late-ms`` before
it calls the collective, so rank 0 waits that long inside it.  Rank 0 records the wall time and
the CPU time of its whole process (main thread, Horovod's background thread, MPI/Gloo progress)
over the call: CPU / wall is how many cores a rank holds while it waits for a late peer.  OP:

* ``torch-allreduce``: ``horovod.torch.allreduce_`` (waits in ``synchronize``,
  ``torch/mpi_ops_v2.cc: WaitAndClear``);
* ``tf-allreduce``: ``horovod.tensorflow.allreduce`` in eager mode (an asynchronous TensorFlow
  op: TensorFlow's executor waits for its callback);
* ``tf-broadcast-inplace``: ``horovod.tensorflow.broadcast_variables(..., inplace=True)`` (the
  op that waits inside Horovod, ``tensorflow/mpi_ops.cc: HorovodBroadcastInplaceOp``).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench.common import util

OPS = ("torch-allreduce", "tf-allreduce", "tf-broadcast-inplace")


def late_calls(call, barrier, rank: int, late_s: float, reps: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of this process over each of ``reps`` calls of ``call``, which every
    rank but 0 makes ``late_s`` after a ``barrier``; one more call first, not counted (it
    negotiates the names).  Also ``tests/loop_probe.py``'s ``late`` mode."""
    rows = []
    for rep in range(reps + 1):
        barrier()
        if rank != 0:
            time.sleep(late_s)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        call()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if rep:
            rows.append((wall, cpu))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--late-ms", type=float, default=50.0)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--bytes", type=int, default=4096)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from ringtrain.runtime import configure_mpi_progress

    configure_mpi_progress()  # as the trainers do
    n = args.bytes // 4
    if args.op == "torch-allreduce":
        import horovod.torch as hvd
        import torch

        hvd.init()
        torch.set_num_threads(1)
        buf = torch.ones(n)

        def call() -> None:
            hvd.allreduce_(buf, op=hvd.Sum, name="wait")

        def barrier() -> None:
            hvd.barrier()
    else:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        import horovod.tensorflow as hvd

        hvd.init()
        value = tf.ones([n])
        var = tf.Variable(tf.ones([n]))

        def call() -> None:
            if args.op == "tf-allreduce":
                hvd.allreduce(value, op=hvd.Sum, name="wait").numpy()
            else:
                hvd.broadcast_variables([var], root_rank=0, inplace=True)

        def barrier() -> None:
            hvd.allreduce(tf.zeros([1]), op=hvd.Sum, name="wait_barrier").numpy()

    rows = late_calls(call, barrier, hvd.rank(), args.late_ms / 1e3, args.reps)
    if hvd.rank() == 0:
        util.write_json(args.out, {
            "op": args.op, "world_size": hvd.size(), "late_ms": args.late_ms, "reps": args.reps,
            "wall_seconds": statistics.median(w for w, _ in rows),
            "cpu_seconds": statistics.median(c for _, c in rows),
            "cores_busy": statistics.median(c / w for w, c in rows)})


if __name__ == "__main__":
    main()
