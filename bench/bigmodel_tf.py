"""Bandwidth-bound TensorFlow/Keras 3 training step (see :mod:`bench.bigmodel`): a Keras
Applications model on one fixed synthetic batch, ``--wrapper none|alone|horovod``.

``horovod`` is what our TF trainer does (:func:`tf_models.horovod_keras.allreduce_gradients`): the
whole gradient list in one grouped allreduce after the backward pass, so nothing overlaps the
exchange; ``--fp16`` sends float16.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench.bigmodel import env_rank, parser, summary, tcp_barrier, write  # noqa: E402
from bench.loopcommon import StepClock  # noqa: E402

MODELS = {"resnet50": "ResNet50", "resnet101": "ResNet101", "vgg16": "VGG16"}


def main() -> None:
    args = parser(tuple(MODELS), "resnet50").parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size, hvd = 0, 1, None
    if args.wrapper == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    elif args.wrapper == "alone":
        rank, size = env_rank()
    elif args.wrapper == "ddp":
        raise SystemExit("bigmodel_tf: --wrapper ddp is PyTorch's")

    keras.utils.set_random_seed(rank)
    net = getattr(keras.applications, MODELS[args.model])(
        weights=None, input_shape=(args.image_size, args.image_size, 3), classes=1000)
    grad_bytes = sum(int(np.prod(v.shape)) * 4 for v in net.trainable_variables)
    optimizer = keras.optimizers.SGD(0.01 * size, momentum=0.9)
    optimizer.build(net.trainable_variables)
    if hvd is not None:
        from tf_models.horovod_keras import allreduce_gradients, broadcast_initial_state

        broadcast_initial_state(net, optimizer, root_rank=0)
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
        if hvd is not None:
            grads = allreduce_gradients(grads, fp16=args.fp16)
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
    if rank == 0:
        write(args.out, summary(args, framework="tf", size=size, grad_bytes=grad_bytes,
                                step_seconds=steps[args.warmup_steps:], timed_seconds=seconds,
                                cpu_seconds=clock.cpu_seconds,
                                extra={"tensorflow": tf.__version__, "keras": keras.__version__}))


if __name__ == "__main__":
    main()
