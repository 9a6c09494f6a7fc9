"""What the framework-free code (:class:`ringtrain.training.world.World`) needs from
``horovod.tensorflow``: its collectives, and the versions a run's summary records.

Only ``horovod.tensorflow`` is imported: loading ``horovod.torch`` as well would put a second copy
of Horovod's native library into the process.
"""

from __future__ import annotations

import horovod
import horovod.tensorflow as hvd
import keras
import tensorflow as tf

from ringtrain.training.world import Collectives
from tf_models.horovod_keras import allreduce_sums

VERSIONS = {"tensorflow": tf.__version__, "keras": keras.__version__, "horovod": horovod.__version__}
# Plain arrays only: World sends JSON in them (ringtrain.training.wire), never a pickle.
COLLECTIVES = Collectives(
    sum=lambda values, name: allreduce_sums(values, name=name).tolist(),
    broadcast=lambda array, name: hvd.broadcast(tf.constant(array), root_rank=0, name=name).numpy(),
    allgather=lambda array, name: hvd.allgather(tf.constant(array), name=name).numpy())


def average_statistics(net: keras.Model, process_set=hvd.global_process_set) -> None:
    """Average the model's non-trainable float weights (BatchNorm's moving mean and variance)
    over the ranks, in place: Horovod never syncs them, and each rank's follow its own shard.
    Called at every epoch's end on every rank; a model without them issues nothing.  A pipeline
    stage averages its own over its replicas (``process_set``: the stage's)."""
    stats = [w for w in net.non_trainable_weights if w.dtype in ("float16", "float32", "float64")]
    if stats:
        averaged = hvd.grouped_allreduce([w.value for w in stats], op=hvd.Average, name="statistics",
                                         process_set=process_set)
        for w, avg in zip(stats, averaged, strict=True):
            w.assign(avg)
