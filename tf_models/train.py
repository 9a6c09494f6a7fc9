"""Data-parallel MNIST on TensorFlow/Keras 3 through ``horovod.tensorflow``.

The twin of :mod:`torch_models.train`: same flags, same shards, same LR rule, same output.  The
Horovod part is init, pin threads/GPU, shard, scale the LR, broadcast from rank 0, and a train
step that allreduces gradients; Horovod's own Keras integration does not work with Keras 3, so
the last two come from :mod:`tf_models.horovod_keras`.  Training runs through ``model.fit`` with a
:class:`~tf_models.horovod_keras.DistributedModel`; the per-epoch work (exact metrics,
evaluation, the epoch line, the checkpoint) happens in callbacks, which run on every rank in the
same order, so every rank issues the same collectives.

Only ``horovod.tensorflow`` is imported: loading ``horovod.torch`` as well would put a second copy
of Horovod's native library into the process.
"""

from __future__ import annotations

import argparse
import io
import json
import time

import horovod
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from launch import checkpoint, cli, mnist, watchdog
from launch.elastic import check_launcher
from launch.errors import UserError
from launch.lr import lr_at, scaled_lr
from launch.report import EpochRecord, Reporter, Summary
from launch.runtime import before_init, controller, threads_per_rank
from launch.sharding import optimizer_steps, shard_indices
from tf_models.horovod_keras import (
    DistributedModel,
    MetricAverage,
    WarmupSchedule,
    allreduce_sums,
    broadcast_initial_state,
    sparse_logits_loss,
)
from tf_models.model import MODEL_NAME, build_model

CKPT_EXT = "npz"
EVAL_BATCH = 1000


def configure_devices(local_rank: int, local_size: int) -> bool:
    """Threads and GPU for this rank; must run before TensorFlow executes its first op.

    Intra-op threads are the host's cores split among its ranks (see
    :func:`launch.runtime.threads_per_rank`); 2 inter-op threads allow a little overlap between
    independent ops (the input gather, the allreduce) without oversubscribing the cores.  On GPU
    machines each rank sees only its local-rank GPU, with memory growth so it does not grab the
    whole card up front.
    """
    tf.config.threading.set_intra_op_parallelism_threads(threads_per_rank(local_size))
    tf.config.threading.set_inter_op_parallelism_threads(2)
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return False
    if local_rank >= len(gpus):
        raise UserError(f"{local_size} ranks on this host but only {len(gpus)} GPU(s); run at most "
                        f"{len(gpus)} processes per host")
    tf.config.set_visible_devices(gpus[local_rank], "GPU")
    tf.config.experimental.set_memory_growth(gpus[local_rank], True)
    return True


def config_of(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("resume", "no_progress")}


# --- data --------------------------------------------------------------------------------------

def normalize_images(images_u8: tf.Tensor) -> tf.Tensor:
    """:func:`launch.mnist.normalize` in TensorFlow ops, plus the channel axis Keras expects."""
    x = (tf.cast(images_u8, tf.float32) / 255.0 - mnist.PIXEL_MEAN) / mnist.PIXEL_STD
    return x[..., tf.newaxis]


def epoch_batches(n_train: int, rank: int, size: int, args: argparse.Namespace, epoch: int,
                  steps: int) -> list[np.ndarray]:
    """This rank's index batches for ``epoch``: ``steps`` slices of K x batch-size indices from
    the shard the PyTorch trainer uses, so both frameworks see the same images in the same order
    (the last slice of an epoch may be short)."""
    idx = shard_indices(n_train, rank, size, args.seed, epoch, shuffle=not args.no_shuffle)
    rows = args.batch_size * args.backward_passes_per_step
    return [idx[s * rows:(s + 1) * rows] for s in range(steps)]


def train_dataset(images_u8: np.ndarray, labels: np.ndarray, batches: list[np.ndarray]):
    """A ``tf.data`` pipeline over the given index batches, in order, each exactly once.

    The images stay uint8 in memory and are gathered and normalised per batch.  The number of
    elements is the number of batches, the same on every rank, so ``fit`` runs the same number of
    steps (and allreduces) everywhere.
    """
    images = tf.constant(images_u8)
    targets = tf.constant(labels)
    rows = tf.RaggedTensor.from_row_lengths(
        np.concatenate(batches).astype(np.int64), [len(b) for b in batches])

    def gather(idx):
        return normalize_images(tf.gather(images, idx)), tf.gather(targets, idx)

    # No autotuning: a gather per step has nothing to tune, and with it on, tearing the iterator
    # down at the end of ``fit`` stalled for up to a minute on long runs (tf.data's autotune
    # thread naps for ever longer periods, up to 60 s, and the teardown waited for it).
    options = tf.data.Options()
    options.autotune.enabled = False
    return tf.data.Dataset.from_tensor_slices(rows).map(gather).prefetch(2).with_options(options)


def make_evaluator(net: keras.Model):
    @tf.function(input_signature=[tf.TensorSpec([None, 28, 28, 1], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def batch_sums(x, y):
        logits = net(x, training=False)
        loss = tf.reduce_sum(tf.cast(sparse_logits_loss(y, logits), tf.float64))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float64))
        return loss, correct

    def evaluate(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Exact global (loss, accuracy): sums and counts are added across ranks, then divided."""
        loss = correct = 0.0
        for start in range(0, len(x), EVAL_BATCH):
            batch_loss, batch_correct = batch_sums(x[start:start + EVAL_BATCH],
                                                   y[start:start + EVAL_BATCH])
            loss += float(batch_loss)
            correct += float(batch_correct)
        loss, correct, count = allreduce_sums([loss, correct, len(x)], name="eval_totals")
        return loss / count, correct / count

    return evaluate


# --- checkpoints -------------------------------------------------------------------------------

def rng_variables(net: keras.Model) -> list:
    """The dropout seed-generator state: in ``net.variables`` but not in ``net.weights``."""
    weights = {id(w) for w in net.weights}
    return [v for v in net.variables if id(v) not in weights]


def save_checkpoint(path_dir: str, epoch: int, net: keras.Model, optimizer, param_count: int,
                    args: argparse.Namespace) -> None:
    """One ``.npz``: ``model_NNNN`` (weights in model order), ``optimizer_NNNN`` (iteration
    counter, momentum slots), ``rng_NNNN`` (rank 0's dropout seed state) and ``meta``, the JSON
    of :func:`launch.checkpoint.metadata` plus ``weight_keys``, the names of the weight arrays in
    model order (what tools that compare checkpoints across frameworks read)."""
    arrays = {}
    for prefix, variables in (("model", net.weights), ("optimizer", optimizer.variables),
                              ("rng", rng_variables(net))):
        for i, var in enumerate(variables):
            arrays[f"{prefix}_{i:04d}"] = np.asarray(var.numpy())
    meta = checkpoint.metadata("tf", MODEL_NAME, param_count, epoch, config_of(args))
    meta["weight_keys"] = [f"model_{i:04d}" for i in range(len(net.weights))]
    arrays["meta"] = np.array(json.dumps(meta))
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    checkpoint.save(path_dir, epoch, CKPT_EXT, buf.getvalue())


def _restore(variables: list, arrays: dict, prefix: str, path) -> None:
    saved = sorted(k for k in arrays if k.startswith(prefix + "_"))
    if len(saved) != len(variables):
        raise UserError(f"{path} holds {len(saved)} {prefix} variables, this run has "
                        f"{len(variables)} (saved with different --momentum or --amp?); resume "
                        f"with the original flags or use another --checkpoint-dir")
    for key, var in zip(saved, variables, strict=True):
        if tuple(arrays[key].shape) != tuple(var.shape):
            raise UserError(f"{path}: {prefix} variable {var.path} has shape "
                            f"{tuple(arrays[key].shape)} there, {tuple(var.shape)} here; use "
                            f"another --checkpoint-dir")
        var.assign(arrays[key])


def load_checkpoint(path_dir: str, net: keras.Model, optimizer, param_count: int,
                    steps: int) -> int:
    """Restore rank 0's model/optimizer from the newest checkpoint; return its epoch (0 if none)."""
    path = checkpoint.latest(path_dir, CKPT_EXT)
    if path is None:
        return 0
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else None
    except Exception as err:  # zipfile, numpy and json raise many types for damaged files
        raise UserError(f"checkpoint {path} is corrupt ({type(err).__name__}); delete it to "
                        f"resume from the one before") from None
    epoch = checkpoint.check_metadata(meta, path, "tf", MODEL_NAME, param_count)
    _restore(net.weights, arrays, "model", path)
    _restore(optimizer.variables, arrays, "optimizer", path)
    rng = rng_variables(net)
    if len([k for k in arrays if k.startswith("rng_")]) == len(rng):
        _restore(rng, arrays, "rng", path)
    # The LR schedule reads the optimizer's step counter.  Put it where this run's epoch/step
    # arithmetic says it is, so warm-up resumes at the same point as in the PyTorch trainer even
    # if --train-samples, --batch-size or --max-steps changed since the checkpoint was written.
    optimizer.iterations.assign(epoch * steps)
    return epoch


# --- per-epoch work ----------------------------------------------------------------------------

class EpochEnd(keras.callbacks.Callback):
    """After each epoch, on every rank: evaluate (one allreduce), then on rank 0 report and save.

    Runs after :class:`MetricAverage` (which has summed the training loss over ranks) and after
    the progress bar, so the epoch line comes out below the finished bar.
    """

    def __init__(self, *, args, rank, net, optimizer, param_count, steps, target_lr, evaluate,
                 test_x, test_y, averages: MetricAverage, report: Reporter,
                 summary: Summary) -> None:
        super().__init__()
        self.args, self.rank, self.net, self.optimizer = args, rank, net, optimizer
        self.param_count, self.steps, self.target_lr = param_count, steps, target_lr
        self.evaluate, self.test_x, self.test_y = evaluate, test_x, test_y
        self.averages, self.report, self.summary = averages, report, summary
        self.t0 = 0.0
        self.train_seconds = self.images_seen = 0.0

    def on_epoch_begin(self, epoch, logs=None) -> None:
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None) -> None:
        seconds = time.perf_counter() - self.t0
        args, epoch = self.args, epoch + 1  # Keras counts epochs from 0, the reports from 1
        loss_total, images = self.averages.totals["loss"]
        test_loss, test_acc = self.evaluate(self.test_x, self.test_y)
        self.train_seconds += seconds
        self.images_seen += images
        # the LR of the epoch's last step, as the torch trainer reports it
        lr = lr_at(epoch - 1 + (self.steps - 1) / self.steps, args.base_lr, self.target_lr,
                   args.warmup_epochs, args.epochs, args.lr_decay)
        rec = EpochRecord(epoch=epoch, train_loss=loss_total / images, test_loss=test_loss,
                          test_accuracy=test_acc, lr=lr, seconds=seconds,
                          images_per_second=images / seconds)
        self.summary.epochs.append(rec)
        self.report.epoch(rec, args.epochs)
        if args.checkpoint_dir and self.rank == 0:
            save_checkpoint(args.checkpoint_dir, epoch, self.net, self.optimizer,
                            self.param_count, args)


# --- the job -----------------------------------------------------------------------------------

def train(args: argparse.Namespace) -> Summary:
    before_init(args.stall_timeout)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    use_gpu = configure_devices(hvd.local_rank(), hvd.local_size())
    cli.validate_world(args, size)
    watchdog.start(args.stall_timeout, hvd)  # watchdog: a frozen or cut-off rank ends the job
    if args.amp and not use_gpu:
        raise UserError("--amp needs a CUDA GPU; drop the flag on CPU machines")
    report = Reporter(rank == 0, progress=not args.no_progress)
    if args.checkpoint_dir and rank == 0:
        checkpoint.ensure_writable(args.checkpoint_dir)

    data = mnist.load_on_all_ranks(args.data_dir, rank, hvd.broadcast_object)
    train_images, train_labels, test_images, test_y = mnist.rank_view(
        data, args.train_samples, args.test_samples, rank, size)
    n_train = len(train_labels)
    test_x = mnist.normalize(test_images)[..., np.newaxis]

    k = args.backward_passes_per_step
    steps = optimizer_steps(n_train, size, args.batch_size, k, args.max_steps)

    # Different seeds per rank on purpose: the broadcast below, not luck, makes ranks agree.
    keras.utils.set_random_seed(args.seed + rank)
    net = build_model(args.dropout, "mixed_float16" if args.amp else None)
    param_count = net.count_params()
    target_lr = scaled_lr(args.base_lr, size, args.lr_scaling, args.adasum)
    optimizer = keras.optimizers.SGD(
        learning_rate=WarmupSchedule(args.base_lr, target_lr, args.warmup_epochs, steps,
                                     args.epochs, args.lr_decay),
        momentum=args.momentum)
    if args.amp:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    optimizer.build(net.trainable_variables)  # slots exist now: checkpoints and broadcast see them

    start_epoch = 0
    if args.resume and rank == 0:
        start_epoch = load_checkpoint(args.checkpoint_dir, net, optimizer, param_count, steps)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")
    broadcast_initial_state(net, optimizer, root_rank=0)

    model = DistributedModel(
        net, backward_passes_per_step=k, micro_batch_size=args.batch_size,
        op=hvd.Adasum if args.adasum else hvd.Average, fp16_allreduce=args.fp16_allreduce,
        gradient_predivide_factor=args.gradient_predivide_factor)
    model.compile(optimizer=optimizer)

    summary = Summary(
        framework="tf",
        versions={"tensorflow": tf.__version__, "keras": keras.__version__,
                  "horovod": horovod.__version__},
        controller=controller(hvd), world_size=size, batch_size_per_rank=args.batch_size,
        global_batch_size=args.batch_size * size * k, base_lr=args.base_lr,
        effective_lr=target_lr, lr_scaling="none (adasum)" if args.adasum else args.lr_scaling,
        param_count=param_count, resumed_from_epoch=start_epoch or None,
    )
    report.info(f"tensorflow {tf.__version__} + keras {keras.__version__} + horovod "
                f"{horovod.__version__} ({summary.controller}): {size} rank(s), "
                f"{param_count:,} params, lr {args.base_lr:g} -> {target_lr:g}, "
                f"{steps} steps/epoch of {args.batch_size * size * k} images")

    evaluate = make_evaluator(net)
    averages = MetricAverage()
    epoch_end = EpochEnd(args=args, rank=rank, net=net, optimizer=optimizer,
                         param_count=param_count, steps=steps, target_lr=target_lr,
                         evaluate=evaluate, test_x=test_x, test_y=test_y, averages=averages,
                         report=report, summary=summary)
    if start_epoch < args.epochs:
        batches_left = [b for epoch in range(start_epoch + 1, args.epochs + 1)
                        for b in epoch_batches(n_train, rank, size, args, epoch, steps)]
        callbacks = [averages]
        if report.progress:  # rank 0 on a terminal: Keras' bar, drawn before the epoch line
            callbacks.append(keras.callbacks.ProgbarLogger())
        callbacks.append(epoch_end)
        callbacks.append(watchdog.keras_callback())  # watchdog: steps and epoch ends completed
        model.fit(train_dataset(train_images, train_labels, batches_left), epochs=args.epochs,
                  initial_epoch=start_epoch, steps_per_epoch=steps,
                  shuffle=False, verbose=1 if report.progress else 0, callbacks=callbacks)

    if summary.epochs:
        test_loss, test_acc = summary.epochs[-1].test_loss, summary.epochs[-1].test_accuracy
    else:  # resumed past the last epoch: still report where the model stands
        test_loss, test_acc = evaluate(test_x, test_y)
    return report.finish(summary, test_loss=test_loss, test_acc=test_acc,
                         train_seconds=epoch_end.train_seconds, images_seen=epoch_end.images_seen,
                         params=[w.numpy() for w in net.weights],
                         allgather_object=hvd.allgather_object, metrics_out=args.metrics_out)


def main_with(args: argparse.Namespace) -> int:
    check_launcher(args.elastic)
    if args.elastic:
        from tf_models.elastic import train_elastic

        train_elastic(args)
    else:
        train(args)
    return 0
