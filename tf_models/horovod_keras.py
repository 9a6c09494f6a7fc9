"""What Horovod's Keras API (as patched by ``.ci/horovod-patches/``) still lacks for ringtrain.

The fixed-size trainer (:class:`tf_models.run.KerasRun`) uses Horovod's own ``hvd.DistributedOptimizer``,
``BroadcastGlobalVariablesCallback`` and ``model.fit``.  What remains here:

* :func:`loss_sums` and :func:`allreduce_sums`: exact global means, from float64 (sum, count)
  pairs summed over ranks.  Horovod's ``MetricAverageCallback`` averages the ranks' averages,
  which is wrong when shards differ in size (docs/correctness.md, invariant 5).
* The elastic glue (:mod:`tf_models.elastic`):

  - :func:`peer_failures_roll_back` turns a collective's failure into the rollback signal;
    ``hvd.elastic.run`` re-raises an op error naming no Horovod op (a Gloo "Connection closed
    by peer"), which would end the job instead of rolling back.
  - :class:`ElasticKerasState` commits, restores and syncs a Keras 3 model and optimizer, its sync
    under that guard: ``run_fn`` syncs before it calls the training function, outside its guard,
    so with Horovod's ``KerasState`` a peer dying during a sync would end the job.
  - :class:`DistributedModel` + :func:`allreduce_gradients`: one train step that splits its K x B
    rows into K micro-batches, sums their gradients, allreduces once and applies once.  The
    elastic loop stops, commits and rolls back between any two optimizer steps.  Horovod's
    ``backward_passes_per_step`` keeps its micro-step counter and accumulated gradients in
    variables outside the optimizer and the elastic state, which a rollback does not restore:
    a peer dying in the K-th micro-step's allreduce leaves the counter at K, and it is reset
    only when it reaches K (``horovod/tensorflow/gradient_aggregation_eager.py``, read, not
    provoked), so no rank would allreduce or update again.  Its gradients equal the fixed
    trainer's bit for bit
    (``tests/test_elastic.py::test_elastic_without_changes_trains_exactly_like_the_fixed_job``).
  - :func:`broadcast_variables`, the sync's broadcast.

Every collective here is issued in the same order on every rank with a name that depends only
on the position of the variable, never on the rank: that is what Horovod matches ranks on.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import ObjectState
from horovod.common.exceptions import HorovodInternalError

__all__ = [
    "DistributedModel", "ElasticKerasState", "allreduce_gradients", "allreduce_sums",
    "broadcast_variables", "loss_sums", "peer_failures_roll_back", "sparse_logits_loss",
    "SparseLogitsLoss",
]


# --- broadcasting state -----------------------------------------------------------------------

def broadcast_variables(variables: Iterable, root_rank: int = 0, prefix: str = "bcast") -> None:
    """Overwrite ``variables`` on every rank with their values on ``root_rank`` (eager).

    Works for ``keras.Variable`` and ``tf.Variable`` alike: the value is read as a plain tensor
    (``tf.convert_to_tensor``), broadcast, and assigned back.  Names are ``{prefix}.{index}``,
    identical on all ranks as long as every rank passes the variables in the same order (true for
    ``model.weights`` and ``optimizer.variables`` of identically built models).
    """
    for i, var in enumerate(variables):
        var.assign(hvd.broadcast(tf.convert_to_tensor(var), root_rank, name=f"{prefix}.{i}"))


# Case matters: a model's own error also quotes where its node was defined, and those paths
# include ``horovod/common/elastic.py`` and ``tf_models/horovod_keras.py``.
PEER_FAILURE = re.compile(r"Horovod|horovod_\w*(allreduce|allgather|broadcast|alltoall)|gloo")


@contextlib.contextmanager
def peer_failures_roll_back() -> Iterator[None]:
    """Turn a collective's failure into ``HorovodInternalError``, the signal for
    ``horovod.common.elastic.run_fn`` to roll back to the last commit and re-form the world.

    Horovod's TF ops fail with a plain ``tf.errors.UnknownError``, and ``hvd.elastic.run`` (TF)
    converts only those that name an op it knows, returning None for the rest: a grouped
    allreduce whose peer died reports only Gloo's "Connection closed by peer", and the job then
    ended "successfully" after one epoch.  Model errors pass through unchanged.
    """
    try:
        yield
    except tf.errors.OpError as err:
        if PEER_FAILURE.search(str(err)) is None:  # the model's own error: no rollback cures it
            raise
        raise HorovodInternalError(err) from err


class ElasticKerasState(ObjectState):
    """``hvd.elastic`` state for a Keras 3 model and optimizer, plus plain Python attributes.

    What ``hvd.elastic.KerasState`` does on Keras 3 since the patch, with the sync guarded by
    :func:`peer_failures_roll_back` (``run_fn`` syncs outside the training function's guard;
    unguarded, a peer dying during the sync's broadcast ends the job).  A commit copies every
    model weight and optimizer variable to host memory; a rollback assigns them back; a sync
    broadcasts them from rank 0 the way :func:`broadcast_variables` does.  Build the optimizer
    before creating it.
    """

    def __init__(self, model: keras.Model, optimizer, bcast_object=hvd.broadcast_object,
                 **kwargs) -> None:
        self.model, self.optimizer = model, optimizer
        self._tracked = [*model.weights, *optimizer.variables]
        self._saved_values = [np.array(v.numpy()) for v in self._tracked]
        super().__init__(bcast_object=bcast_object, get_rank=hvd.rank, **kwargs)

    def save(self) -> None:
        self._saved_values = [np.array(v.numpy()) for v in self._tracked]
        super().save()

    def restore(self) -> None:
        for var, value in zip(self._tracked, self._saved_values, strict=True):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        with peer_failures_roll_back():  # a sync runs outside the training function's own guard
            broadcast_variables(self._tracked, root_rank=0, prefix="elastic")
        self._saved_values = [np.array(v.numpy()) for v in self._tracked]
        super().sync()


# --- gradients ---------------------------------------------------------------------------------

def allreduce_gradients(grads: Sequence[tf.Tensor], *, op=None, fp16: bool = False,
                        gradient_predivide_factor: float = 1.0,
                        name: str = "DistributedGradients",
                        process_set=hvd.global_process_set) -> list[tf.Tensor]:
    """Combine this rank's gradients with everyone else's: one grouped allreduce.

    ``op`` is ``hvd.Average`` (default) or ``hvd.Adasum`` (power-of-two world sizes only).
    ``fp16`` sends float16 on the wire (``hvd.Compression.fp16``) and restores the original dtype
    after.  With averaging, ``gradient_predivide_factor`` f splits the division the way
    ``hvd.DistributedOptimizer`` does: a sum of gradients pre-scaled by 1/f, post-scaled by
    f/size (keeps fp16 sums in range).  With one process this is the identity and issues no
    collective.  ``process_set`` limits it to a set of ranks (a pipeline stage's replicas).
    """
    op = hvd.Average if op is None else op
    grads = list(grads)
    size = hvd.size() if process_set is hvd.global_process_set else process_set.size()
    if size == 1 or not grads:
        return grads
    compression = hvd.Compression.fp16 if fp16 else hvd.Compression.none
    prescale = postscale = 1.0
    if gradient_predivide_factor != 1.0:
        if op != hvd.Average:
            raise ValueError("gradient_predivide_factor works only with averaging, not Adasum")
        op = hvd.Sum
        prescale = 1.0 / gradient_predivide_factor
        postscale = gradient_predivide_factor / size
    if op == hvd.Adasum:
        # Horovod 0.28.1's grouped_allreduce crashes on its Adasum branch (it reads an unbound
        # local, ``tensor``); per-tensor allreduces are fused by Horovod all the same, and Adasum
        # combines each tensor separately in either case.
        return [hvd.allreduce(g, op=op, compression=compression, name=f"{name}.{i}")
                for i, g in enumerate(grads)]
    return hvd.grouped_allreduce(grads, op=op, compression=compression, prescale_factor=prescale,
                                 postscale_factor=postscale, name=name, process_set=process_set)


def sparse_logits_loss(labels: tf.Tensor, logits: tf.Tensor) -> tf.Tensor:
    """Per-example cross-entropy from integer labels and logits (PyTorch's ``F.cross_entropy``).

    Label -1 marks an example the data could not deliver (a file that did not decode, an item
    unlike the others): its loss is NaN, so the step's averaged gradients make every rank's
    weights non-finite and every rank stops at that step, naming it
    (:mod:`ringtrain.training.divergence`).  Any other label is the class index, and its loss
    the same bits as without the mark (``tf.where`` picks it unchanged)."""
    labels = tf.cast(labels, tf.int64)
    if logits.dtype == tf.bfloat16:  # --precision bf16 (a user's model): the loss in float32
        logits = tf.cast(logits, tf.float32)
    loss = keras.losses.sparse_categorical_crossentropy(tf.maximum(labels, 0), logits,
                                                        from_logits=True)
    return tf.where(labels >= 0, loss, tf.constant(float("nan"), loss.dtype))


def logits_dtype(model: keras.Model) -> str | None:
    """``"float64"`` for a model whose logits are float64 (its loss then stays float64), else
    None (Keras' default, float32: mixed precision's logits are upcast to it).  A subclassed model
    has no ``outputs``: the default."""
    try:
        return "float64" if keras.backend.standardize_dtype(model.outputs[0].dtype) == "float64" \
            else None
    except (AttributeError, IndexError, TypeError, ValueError):
        return None


class SparseLogitsLoss(keras.losses.SparseCategoricalCrossentropy):
    """``model.fit``'s loss: Keras' sparse cross-entropy from logits, its reduction unchanged,
    with :func:`sparse_logits_loss`'s mark: a label of -1 gives a NaN loss.  ``dtype``: the
    logits' when they are float64 (Keras casts the logits to the loss's dtype, float32 unless
    told: a float64 model's gradients then carried float32's rounding, 1e-9 of a weight after
    one step where PyTorch's differ by 1e-17)."""

    def __init__(self, dtype: str | None = None) -> None:
        super().__init__(from_logits=True, dtype=dtype)

    def call(self, y_true, y_pred):
        loss = super().call(tf.maximum(y_true, tf.zeros_like(y_true)), y_pred)
        marked = tf.reshape(y_true, tf.shape(loss)) >= 0
        return tf.where(marked, loss, tf.constant(float("nan"), loss.dtype))


class DistributedModel(keras.Model):
    """Wrap ``model`` so that ``fit`` trains it data-parallel through Horovod.

    The train step (a ``tf.function`` compiled by ``fit``; XLA must stay off because Horovod's ops
    have no XLA kernels here, see :meth:`compile`):

    1. For each of ``backward_passes_per_step`` (K) micro-batches of ``micro_batch_size`` rows
       from the incoming batch: forward, per-example loss, ``tf.GradientTape`` gradient of the mean
       loss.  Gradients are summed locally and divided by K: with full micro-batches that is
       exactly the gradient of one batch K times larger.  The input pipeline therefore delivers
       K x ``micro_batch_size`` rows per step (the last step of an epoch may be short; its last
       micro-batch is then partial, like in the PyTorch trainer).
    2. One :func:`allreduce_gradients` (averaging or Adasum, fp16 compression, pre-division).
    3. One ``optimizer.apply_gradients``: the optimizer's iteration counter, which drives LR
       schedules, counts optimizer steps, not micro-batches.

    ``self.loss_tracker`` accumulates the float64 (sum of losses, count of examples) of this rank;
    the elastic loop reads its total after each step.  Weights,
    ``weights``/``trainable_variables`` and ``get_weights`` are those of the wrapped model, in its
    order.
    """

    def __init__(self, model: keras.Model, *, backward_passes_per_step: int = 1,
                 micro_batch_size: int | None = None, op=None, fp16_allreduce: bool = False,
                 gradient_predivide_factor: float = 1.0,
                 loss_fn: Callable[[tf.Tensor, tf.Tensor], tf.Tensor] = sparse_logits_loss,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        if backward_passes_per_step > 1 and not micro_batch_size:
            raise ValueError("micro_batch_size is needed to split a batch into micro-batches")
        self.inner = model
        self.backward_passes_per_step = backward_passes_per_step
        self.micro_batch_size = micro_batch_size
        self.op = hvd.Average if op is None else op
        self.fp16_allreduce = fp16_allreduce
        self.gradient_predivide_factor = gradient_predivide_factor
        self.loss_fn = loss_fn
        self.loss_tracker = keras.metrics.Mean(name="loss", dtype="float64")
        self.built = model.built

    def call(self, inputs, training=False):
        return self.inner(inputs, training=training)

    @property
    def metrics(self):
        return [self.loss_tracker]

    def compile(self, optimizer, **kwargs):
        """``keras.Model.compile`` with ``jit_compile=False`` forced: Horovod's TensorFlow ops have
        no XLA implementation in this build, and Keras 3 turns XLA on by default ("auto") when a
        GPU is visible."""
        if kwargs.get("jit_compile") not in (None, False):
            raise ValueError("DistributedModel cannot run under XLA (jit_compile must be False)")
        kwargs["jit_compile"] = False
        super().compile(optimizer=optimizer, **kwargs)

    def _micro_batches(self, x, y):
        k, b = self.backward_passes_per_step, self.micro_batch_size
        if k == 1:
            return [(x, y)]
        return [(x[i * b:(i + 1) * b], y[i * b:(i + 1) * b]) for i in range(k)]

    def train_step(self, data):
        x, y = data[0], data[1]
        variables = self.trainable_variables
        k = self.backward_passes_per_step
        accumulated = None
        for xs, ys in self._micro_batches(x, y):  # unrolled at trace time: K is a constant
            with tf.GradientTape() as tape:
                per_example = self.loss_fn(ys, self.inner(xs, training=True))
                loss = tf.reduce_mean(tf.cast(per_example, tf.float32))
                scaled = loss / k if k > 1 else loss
            grads = tape.gradient(scaled, variables)
            accumulated = grads if accumulated is None else [
                a + g for a, g in zip(accumulated, grads, strict=True)]
            self.loss_tracker.update_state(per_example)
        grads = allreduce_gradients(accumulated, op=self.op, fp16=self.fp16_allreduce,
                                    gradient_predivide_factor=self.gradient_predivide_factor)
        self.optimizer.apply_gradients(zip(grads, variables, strict=True))
        return {m.name: m.result() for m in self.metrics}


# --- exact metrics -----------------------------------------------------------------------------

def allreduce_sums(values: Sequence[float], name: str) -> np.ndarray:
    """Element-wise float64 sum of ``values`` over all ranks (eager, one collective)."""
    totals = np.asarray(values, dtype=np.float64)
    if hvd.size() == 1:
        return totals
    return hvd.allreduce(tf.constant(totals), op=hvd.Sum, name=name).numpy()


def loss_sums() -> keras.metrics.Metric:
    """A ``compile`` metric holding this rank's float64 (sum of per-example losses, examples) since
    the epoch began (``total``, ``count``): summed over ranks, the exact global mean, as if one
    process had seen everything.  (Horovod's ``MetricAverageCallback`` averages the ranks'
    float32 averages instead: wrong when shards differ in size.)"""
    return keras.metrics.MeanMetricWrapper(sparse_logits_loss, name="loss_sums", dtype="float64")
