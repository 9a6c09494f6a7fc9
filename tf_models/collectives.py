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
COLLECTIVES = Collectives(sum=lambda values, name: allreduce_sums(values, name=name).tolist(),
                          broadcast_object=hvd.broadcast_object,
                          allgather_object=hvd.allgather_object)
