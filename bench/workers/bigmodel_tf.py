"""Bandwidth-bound TensorFlow/Keras 3 training step (see :mod:`bench.workers.bigmodel`): a Keras
Applications model on one fixed synthetic batch, ``--wrapper none|alone|horovod``.

``horovod`` is what our TF trainer (:mod:`tf_models.run`) does, on Horovod's own Keras API:
``hvd.DistributedOptimizer`` averages the gradients inside the optimizer's ``apply()`` (one
allreduce per gradient tensor in the train step's graph, fused by Horovod), and rank 0's weights
and optimizer state are broadcast before the first step, as ``BroadcastGlobalVariablesCallback``
does when ``fit`` begins; ``--fp16`` is ``hvd.Compression.fp16``.  The step is a ``tf.function``
of our own rather than ``fit``, so that each step can be timed; Keras 3's ``fit`` reaches the
optimizer the same way, through ``apply_gradients()`` -> ``apply()``.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench.workers.bigmodel import env_rank, parser, summary, tcp_barrier, write  # noqa: E402
from bench.workers.loopcommon import StepClock  # noqa: E402

MODELS = {"resnet50": "ResNet50", "resnet101": "ResNet101", "vgg16": "VGG16", "tiny": None}


def build(name: str, image_size: int) -> keras.Model:
    """A Keras Applications model with its 1000-class head, or ``tiny``: one convolution and the
    head (4 tensors), for the smoke tests, where only the exchange's code matters (tracing
    ResNet-50's step, 214 tensors, with ``DistributedOptimizer`` took 118 s at -np 2 here, at load
    15)."""
    if name == "tiny":
        return keras.Sequential([keras.Input((image_size, image_size, 3)),
                                 keras.layers.Conv2D(8, 3, activation="relu"),
                                 keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(1000)])
    return getattr(keras.applications, MODELS[name])(weights=None, input_shape=(image_size, image_size, 3),
                                                     classes=1000)


def main() -> None:
    args = parser(tuple(MODELS), "resnet50").parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size, hvd = 0, 1, None
    if args.wrapper == "horovod":
        import horovod.tensorflow as hvd
        import horovod.tensorflow.keras as hvd_keras

        # Horovod: initialise.
        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif args.wrapper == "alone":
        rank, size = env_rank()
    elif args.wrapper == "ddp":
        raise SystemExit("bigmodel_tf: --wrapper ddp is PyTorch's")

    keras.utils.set_random_seed(rank)
    net = build(args.model, args.image_size)
    grad_bytes = sum(int(np.prod(v.shape)) * 4 for v in net.trainable_variables)
    optimizer = keras.optimizers.SGD(0.01 * size, momentum=0.9)
    if hvd is not None:
        # Horovod: average the gradients over all ranks inside apply_gradients().
        compression = hvd.Compression.fp16 if args.fp16 else hvd.Compression.none
        optimizer = hvd_keras.DistributedOptimizer(optimizer, compression=compression)
    optimizer.build(net.trainable_variables)
    if hvd is not None:
        # Horovod: every rank starts from rank 0's weights and optimizer state.
        hvd.broadcast_variables([*net.weights, *optimizer.variables], root_rank=0)
    rng = np.random.default_rng(1000 + rank)
    x = tf.constant(rng.standard_normal((args.batch_size, args.image_size, args.image_size, 3),
                                        dtype=np.float32))
    y = tf.constant(rng.integers(0, 1000, args.batch_size))

    @tf.function
    def train_step():
        with tf.GradientTape() as tape:
            logits = net(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits))
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))
        return loss

    if args.wrapper == "alone":
        tcp_barrier(rank, size, 0)
    clock = StepClock(args.warmup_steps)
    steps = []
    for _ in range(args.warmup_steps + args.steps):
        t0 = time.perf_counter()
        train_step().numpy()  # wait for the step
        steps.append(time.perf_counter() - t0)
        clock.tick()
    clock.stop()
    seconds = clock.seconds
    if hvd is not None:
        seconds = float(hvd.allreduce(tf.constant([seconds]), op=hvd.Max, name="bench_seconds")[0])
    elif args.wrapper == "alone":
        tcp_barrier(rank, size, 1)
    weight_sum = float(sum(tf.reduce_sum(tf.cast(v, tf.float64)) for v in net.trainable_variables))
    weight_sums = [weight_sum] if hvd is None else hvd.allgather_object(weight_sum, name="bench_weight_sums")
    if rank == 0:
        write(args.out, summary(args, framework="tf", size=size, grad_bytes=grad_bytes,
                                step_seconds=steps[args.warmup_steps:], timed_seconds=seconds,
                                cpu_seconds=clock.cpu_seconds, weight_sums=weight_sums,
                                extra={"tensorflow": tf.__version__, "keras": keras.__version__}))


if __name__ == "__main__":
    main()
