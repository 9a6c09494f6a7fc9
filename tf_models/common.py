"""TensorFlow/Keras 3 glue shared by the fixed-size trainer (:mod:`tf_models.train`) and the
elastic one (:mod:`tf_models.elastic`): device set-up, evaluation sums, checkpoint files and the
collectives :class:`ringtrain.training.job.Job` issues through ``horovod.tensorflow``.

Only ``horovod.tensorflow`` is imported: loading ``horovod.torch`` as well would put a second copy
of Horovod's native library into the process.
"""

from __future__ import annotations

import argparse
import io
import json
import math

import horovod
import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from ringtrain.errors import UserError
from ringtrain.faults import termination
from ringtrain.output import checkpoint
from ringtrain.runtime import threads_per_rank
from ringtrain.training.job import EVAL_BATCH, Collectives
from tf_models.horovod_keras import allreduce_sums, sparse_logits_loss

CKPT_EXT = "npz"
VERSIONS = {"tensorflow": tf.__version__, "keras": keras.__version__, "horovod": horovod.__version__}
COLLECTIVES = Collectives(sum=lambda values, name: allreduce_sums(values, name=name).tolist(),
                          broadcast_object=hvd.broadcast_object,
                          allgather_object=hvd.allgather_object)


def configure_devices(local_rank: int, local_size: int) -> bool:
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
    if local_rank >= len(gpus):
        raise UserError(f"{local_size} ranks on this host but only {len(gpus)} GPU(s); run at most "
                        f"{len(gpus)} processes per host")
    tf.config.set_visible_devices(gpus[local_rank], "GPU")
    tf.config.experimental.set_memory_growth(gpus[local_rank], True)
    return True


def make_eval_sums(net: keras.Model, input_shape: tuple[int, ...]):
    """``eval_sums(x, y)``: this rank's (test loss sum, correct, count), batch by batch."""

    @tf.function(input_signature=[tf.TensorSpec([None, *input_shape], tf.float32),
                                  tf.TensorSpec([None], tf.int64)])
    def batch_sums(x, y):
        logits = net(x, training=False)
        loss = tf.reduce_sum(tf.cast(sparse_logits_loss(y, logits), tf.float64))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float64))
        return loss, correct

    def eval_sums(x: np.ndarray, y: np.ndarray) -> list[float]:
        loss = correct = 0.0
        for start in range(0, len(x), EVAL_BATCH):
            batch_loss, batch_correct = batch_sums(x[start:start + EVAL_BATCH],
                                                   y[start:start + EVAL_BATCH])
            loss += float(batch_loss)
            correct += float(batch_correct)
        return [loss, correct, len(x)]

    return eval_sums


def make_weights_finite(net: keras.Model):
    """``weights_finite()``: whether every trainable weight is a finite number (one float64 sum
    per tensor, in one traced function)."""
    weights = net.trainable_weights

    @tf.function
    def total():
        return tf.add_n([tf.reduce_sum(tf.cast(w, tf.float64)) for w in weights])

    return lambda: math.isfinite(float(total()))


def parameters(net: keras.Model) -> list[np.ndarray]:
    return [w.numpy() for w in net.weights]


# --- checkpoints -------------------------------------------------------------------------------

def rng_variables(net: keras.Model) -> list:
    """The dropout seed-generator state: in ``net.variables`` but not in ``net.weights``."""
    weights = {id(w) for w in net.weights}
    return [v for v in net.variables if id(v) not in weights]


def save_checkpoint(path_dir: str, epoch: int, net: keras.Model, optimizer, model_name: str,
                    param_count: int, args: argparse.Namespace) -> None:
    """One ``.npz``: ``model_NNNN`` (weights in model order), ``optimizer_NNNN`` (iteration
    counter, momentum slots), ``rng_NNNN`` (rank 0's dropout seed state) and ``meta``, the JSON
    of :func:`ringtrain.output.checkpoint.metadata` plus ``weight_keys``, the names of the weight arrays in
    model order (what tools that compare checkpoints across frameworks read)."""
    with termination.saving():
        _save(path_dir, epoch, net, optimizer, model_name, param_count, args)


def _save(path_dir, epoch, net, optimizer, model_name, param_count, args) -> None:
    arrays = {}
    for prefix, variables in (("model", net.weights), ("optimizer", optimizer.variables),
                              ("rng", rng_variables(net))):
        for i, var in enumerate(variables):
            arrays[f"{prefix}_{i:04d}"] = np.asarray(var.numpy())
    meta = checkpoint.metadata("tf", model_name, param_count, epoch, checkpoint.config_of(args))
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


def read_checkpoint(path) -> tuple[object, dict]:
    """``(metadata, arrays)`` of one ``.npz``, read with ``allow_pickle=False``: an object array
    (a pickle inside) is refused, never unpickled."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
        meta = json.loads(str(arrays["meta"])) if "meta" in arrays else None
    except ValueError as err:
        if "allow_pickle" in str(err):
            raise checkpoint.refused(path, "holds pickled Python objects") from None
        raise checkpoint.Damaged(type(err).__name__) from None
    except Exception as err:  # zipfile, numpy and json raise many types for damaged files
        raise checkpoint.Damaged(type(err).__name__) from None
    return meta, arrays


def load_checkpoint(path_dir: str, net: keras.Model, optimizer, model_name: str,
                    param_count: int) -> int:
    """Restore rank 0's model/optimizer from the newest intact checkpoint; return its epoch (0 if
    there is none)."""
    found = checkpoint.restore_newest(path_dir, CKPT_EXT, read_checkpoint, framework="tf",
                                      model=model_name, param_count=param_count)
    if found is None:
        return 0
    epoch, arrays = found
    path = checkpoint.path_for(path_dir, epoch, CKPT_EXT)
    _restore(net.weights, arrays, "model", path)
    opt_vars = optimizer.variables
    if len([k for k in arrays if k.startswith("optimizer_")]) == len(opt_vars) - 1:
        # Written while the fixed trainer's LR was a schedule, which the optimizer does not hold
        # as a variable; the LR is set before every step now, so only the others are restored.
        opt_vars = [v for v in opt_vars if v.name != "learning_rate"]
    _restore(opt_vars, arrays, "optimizer", path)
    rng = rng_variables(net)
    if len([k for k in arrays if k.startswith("rng_")]) == len(rng):
        _restore(rng, arrays, "rng", path)
    return epoch
