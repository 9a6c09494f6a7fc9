"""Where a TensorFlow rank computes: its share of the host's cores, and its GPU where there are GPUs."""

from __future__ import annotations

import tensorflow as tf

from ringtrain.runtime import check_gpu_count, threads_per_rank


def configure(local_rank: int, local_size: int) -> bool:
    """Threads and GPU for this rank; must run before TensorFlow executes its first op.

    Intra-op threads are the host's cores split among its ranks (see
    :func:`ringtrain.runtime.threads_per_rank`); 2 inter-op threads allow a little overlap between
    independent ops (the input gather, the allreduce) without oversubscribing the cores.  On GPU
    machines each rank sees only its local-rank GPU, with memory growth so it does not grab the
    whole card up front.
    """
    tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank(local_size))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False
    check_gpu_count(local_rank, local_size, len(gpus))
    tf.config.set_visible_devices(gpus[local_rank], "GPU")
    tf.config.experimental.set_memory_growth(gpus[local_rank], True)
    return True
