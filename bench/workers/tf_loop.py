"""Bench-local TensorFlow/Keras 3 training loop; ``--wrapper none|horovod|mwms`` is the only
difference.

One ``tf.function`` train step for all three: forward, loss, gradient, ``reduce``,
``optimizer.apply_gradients`` (Keras 3 SGD with momentum).  ``reduce`` is the identity for
``none``; Horovod's grouped allreduce (:func:`tf_models.horovod_keras.allreduce_gradients`, what the
elastic trainer uses; the fixed trainer's ``hvd.DistributedOptimizer`` issues one allreduce per
tensor, which Horovod fuses) for ``horovod``; and the identity for ``mwms`` as well, because under
``tf.distribute.MultiWorkerMirroredStrategy`` the step runs in ``strategy.run`` and Keras 3's
optimizer all-reduces (sums) the gradients itself inside ``apply_gradients``.

Why a custom loop rather than ``model.fit``: Keras 3's ``fit`` cannot run under MWMS here (TF 2.21,
Keras 3.15): before the first step it reduces a batch of per-replica *inputs* eagerly and fails
with ``ValueError: Attempt to convert a value (PerReplica:{...}) with an unsupported type
(<class 'tensorflow.python.distribute.values.PerReplica'>) to a Tensor``
(keras-team/keras#20585, open).  A custom loop is what TensorFlow's MWMS guide documents as the
alternative, and using it on all three sides keeps them identical.  MWMS jobs are started by
:mod:`bench.parts.throughput` with one ``TF_CONFIG`` per process.

``--data folder:DIR`` (``none`` and ``horovod``) reads the batches through the trainers' own
``tf.data`` pipeline (:func:`tf_models.data.open_data`: parallel decode on ``--workers`` threads,
prefetch), whose CPU time is part of the rank's process.
"""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from bench.workers.loopcommon import (  # noqa: E402
    StepClock,
    folder_batches,
    image_data,
    mnist_shard,
    parser,
    synthetic_batch,
    trainer_args,
    write_result,
)
from ringtrain.runtime import configure_mpi_progress, threads_per_rank  # noqa: E402
from tf_models.model import build  # noqa: E402


def dataset(args, rank: int, size: int, global_batch: int, folder=None) -> tf.data.Dataset:
    if args.data == "synthetic":
        x, y = synthetic_batch(global_batch, rank, args.input_shape, args.classes)
        return tf.data.Dataset.from_tensors((x, y)).repeat()  # [B, H, W, C]
    if folder is not None:
        batches = folder_batches(folder.info.train_size, rank, size, args.batch_size,
                                 args.warmup_steps + args.steps)
        return folder.fit_dataset(batches)
    images, labels, idx = mnist_shard(rank, size)
    ds = tf.data.Dataset.from_tensor_slices((images[idx][..., None], labels[idx]))
    return ds.repeat().batch(global_batch, drop_remainder=True).prefetch(2)


def main() -> None:
    args = parser(("none", "horovod", "mwms")).parse_args()
    rank, size, local_size, hvd, strategy = 0, 1, 1, None, None
    if args.wrapper == "horovod":
        import horovod.tensorflow as hvd

        configure_mpi_progress()  # as the trainers do (ringtrain.runtime.before_init)
        hvd.init()
        rank, size, local_size = hvd.rank(), hvd.size(), hvd.local_size()
    elif args.wrapper == "mwms":
        cluster = json.loads(os.environ["TF_CONFIG"])
        rank, size = cluster["task"]["index"], len(cluster["cluster"]["worker"])
        local_size = size  # bench starts every worker on this host
    threads = args.threads or threads_per_rank(local_size)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(2)

    folder, shape, classes = None, args.input_shape, args.classes
    if args.data.startswith("folder:"):
        if args.wrapper == "mwms":
            raise SystemExit("--data folder:DIR: with --wrapper none or horovod only")
        from tf_models.data import open_data

        folder = open_data(trainer_args(args), None, local_size)
        shape, classes = folder.info.input_shape, folder.info.num_classes
    keras.utils.set_random_seed(rank)
    if args.wrapper == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        # Each worker feeds the global batch from its own copy of the data (no auto-sharding);
        # the strategy hands each replica batch-size rows of it.
        ds = dataset(args, rank, size, args.batch_size * size)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        ds = strategy.experimental_distribute_dataset(ds.with_options(options))
        scope = strategy.scope()
    else:
        ds = dataset(args, rank, size, args.batch_size, folder)
        scope = tf.name_scope("bench")
    with scope:
        net = build(args.model, image_data(shape, classes), 0.5)
        optimizer = keras.optimizers.SGD(args.base_lr * size, momentum=0.9)
        optimizer.build(net.trainable_variables)
    if hvd is not None:
        from tf_models.horovod_keras import allreduce_gradients

        hvd.broadcast_variables([*net.weights, *optimizer.variables], root_rank=0)

    def step(x, y):
        if os.environ.get("BENCH_DEBUG_ROWS"):
            tf.print("rows per replica step:", tf.shape(x)[0])
        with tf.GradientTape() as tape:
            logits = net(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
            if strategy is not None:  # SUM over replicas in apply_gradients: pre-divide
                loss = loss / strategy.num_replicas_in_sync
        grads = tape.gradient(loss, net.trainable_variables)
        if hvd is not None:
            grads = allreduce_gradients(grads)
        optimizer.apply_gradients(zip(grads, net.trainable_variables, strict=True))

    @tf.function
    def train_step(iterator):
        x, y = next(iterator)
        if strategy is not None:
            strategy.run(step, args=(x, y))
        else:
            step(x, y)

    iterator = iter(ds)
    clock = StepClock(args.warmup_steps)
    for _ in range(args.warmup_steps + args.steps):
        train_step(iterator)
        clock.tick()
    clock.stop()
    seconds = clock.seconds
    if hvd is not None:
        seconds = float(hvd.allreduce(tf.constant([seconds]), op=hvd.Max, name="bench_seconds")[0])
    elif strategy is not None:
        per_worker = strategy.gather(strategy.run(lambda: tf.constant([seconds])), axis=0)
        seconds = float(tf.reduce_max(per_worker))
    if rank == 0:
        write_result(args.out, framework="tf", wrapper=args.wrapper, data=args.data, size=size,
                     batch=args.batch_size, steps=args.steps, seconds=seconds, threads=threads,
                     extra={"tensorflow": tf.__version__, "keras": keras.__version__,
                            "model": args.model, "input_shape": list(shape), "classes": classes,
                            "rank0_cores_busy": clock.cpu_seconds / clock.seconds,
                            **({"workers": folder.workers} if folder is not None else {})})


if __name__ == "__main__":
    main()
