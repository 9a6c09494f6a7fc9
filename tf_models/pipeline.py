"""Model parallelism on TensorFlow/Keras 3 through ``horovod.tensorflow``: a pipeline of S stages
x R replicas (``--pipeline-stages S``), the fixed-size job; the twin of
:mod:`torch_models.pipeline`.

``model.fit`` runs one model's steps, so a pipeline's stage runs its own (:class:`Traced`): each
micro-batch's forward pass, and later its backward pass from the next stage's gradient
(``output_gradients``), which recomputes the forward pass under a tape with the same dropout
masks, BatchNorm's moving statistics not updated a second time (a Keras stage always keeps only
its input, ``--checkpoint-activations`` or not); the gradients summed over the step's
micro-batches; then one grouped allreduce in the stage's Horovod process set
(:func:`tf_models.horovod_keras.allreduce_gradients`: ``--fp16-allreduce`` and
``--gradient-predivide-factor`` as in the data-parallel step) and one ``apply_gradients``.  The
stage's first replica broadcasts its weights and optimizer state within the set.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf

from ringtrain.strategies.pipeline import options as pipeline_options
from ringtrain.strategies.pipeline import run as pipeline
from ringtrain.strategies.pipeline import timing
from ringtrain.strategies.pipeline.transport import Link
from ringtrain.training import startup as startup_checks
from ringtrain.training.run import RunIdentity
from tf_models import checkpoints, optimizers, stages, startup
from tf_models.collectives import VERSIONS, average_statistics
from tf_models.evaluation import make_weights_finite, parameters
from tf_models.horovod_keras import allreduce_gradients, sparse_logits_loss


class KerasPipelineRun(pipeline.PipelineRun):
    """One rank's stage of one replica."""

    checkpoints = checkpoints

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        sets = pipeline.before_init(args, hvd)  # MPI up (mpi4py), S divides the world
        # Horovod: initialise with one process set per stage (its replicas' gradient allreduce),
        # pin, open the data (read by the R replicas): the start-up every Keras run shares.
        rank = startup.open_rank(args, check_world=pipeline_options.check_world, process_sets=sets,
                                 data_width=lambda world: world.size // args.pipeline_stages)
        self.world, self.data = rank.world, rank.data
        self.locate(hvd, sets)
        self.link = Link.open(self.world.rank, args.stall_timeout)
        self.open_pipeline(args)
        # Seeded per replica: replica 0's stages together are the model one process builds with
        # --seed; other replicas draw other weights on purpose, the broadcast makes them agree.
        # Only this rank's stage gets weights where the model allows (tf_models/stages.py).
        keras.utils.set_random_seed(args.seed + self.place.replica)
        # --precision bf16: the stages' layers made under mixed_bfloat16 (bfloat16 compute,
        # float32 weights, as the ring's; their cuts then carry bfloat16), the policy put back after.
        precision = contextlib.ExitStack()
        precision.enter_context(optimizers.policy(args))
        # --partition time: rank 0 times the layers, every rank splits on its figures.
        split = startup_checks.every_rank(self.world, lambda: stages.build_split(
            args.model, self.data.info, args.dropout, self.place.stages, keep=self.place.stage,
            fits=self.fits, timing=timing.for_run(self.world, args, self.micro)))
        precision.close()
        self.stage = split.models[self.keep(split.stages, split.cuts)]
        self.weights_built = split.built
        del split.models  # the other stages' layers go (when built whole)
        self.identity = RunIdentity.of(args, "tf", VERSIONS, self.data.info, split.param_count,
                                       strategy="pipeline")
        startup_checks.check_output_folders(self.world, args, self.identity.param_count)

        # Horovod: scale the learning rate with the replicas (R, the data-parallel width).
        # --optimizer by the ring's factory (the default SGD's call unchanged), applied once per
        # step (micro_steps 1).  Without Keras' global_clipnorm: it would clip by this stage's
        # norm alone; --clip-grad-norm is the whole model's norm, over the stages (end_step).
        self.clip = args.clip_grad_norm
        self.optimizer = optimizers.build(argparse.Namespace(**{**vars(args), "clip_grad_norm": None}),
                                          self.target_lr, micro_steps=1)
        self.optimizer.build(self.stage.trainable_variables)  # slots exist: checkpoints, broadcast
        # Horovod: wrap the gradient step: the stage's summed micro-batch gradients are averaged
        # over its replicas (one grouped allreduce in its process set) before apply_gradients.
        self.allreduce = functools.partial(
            allreduce_gradients, fp16=args.fp16_allreduce, process_set=self.stage_set,
            gradient_predivide_factor=args.gradient_predivide_factor, name="StageGradients")
        self.start_epoch = pipeline.resume_epoch(self.world, self.place, args, self.find, self.load)
        # Horovod: broadcast the stage's first replica's weights and optimizer state within its
        # set (root_rank is a global rank, also for a process set, in Horovod 0.28.1).
        hvd.broadcast_variables([*self.stage.weights, *self.optimizer.variables],
                                root_rank=self.place.stage_root, process_set=self.stage_set)
        self.weights_finite = make_weights_finite(self.stage)
        self.traced = Traced(self.stage, self.data.info, self.inbound, self.outbound)
        self.rng = checkpoints.rng_variables(self.stage)

    # --- one step ----------------------------------------------------------------------------------

    def stage_batches(self, steps):
        return self.data.batches(steps)

    def begin_step(self, data, rows: list[int], lr: float) -> None:
        self.optimizer.learning_rate = lr
        bounds = np.cumsum([0, *rows])
        x, y = data if data is not None else (None, None)
        cut = list(zip(bounds[:-1], bounds[1:], strict=True))
        self.inputs = [x[a:b] for a, b in cut] if self.place.first else None
        self.labels = [tf.constant(y[a:b]) for a, b in cut] if self.place.last else None
        self.rows_total = int(bounds[-1])
        self.saved: dict[int, tuple] = {}
        self.grads = None

    def forward(self, m: int, x):
        if self.place.last:
            # Forward, loss and backward run together, in the forward op: the micro-batches' draws
            # (dropout masks, BatchNorm's moving statistics) then come in micro-batch order under
            # every schedule, as in one process (GPipe runs the backward ops in reverse order);
            # what waits for the backward op is the gradient to send, the size of the input.
            grads, back, total = self.traced.loss_backward(x, self.labels[m], self.rows_total)
            self.step_loss += float(total)
            self.add_grads(grads)
            self.saved[m] = back
            return None
        inp = self.inputs[m] if self.place.first else x
        self.saved[m] = (inp, [tf.identity(v.value) for v in self.rng])  # the dropout draws' state
        return self.traced.forward(inp).numpy()

    def backward(self, m: int, grad):
        if self.place.last:
            back = self.saved.pop(m)
        else:
            inp, state = self.saved.pop(m)
            now = [tf.identity(v.value) for v in self.rng]
            for v, s in zip(self.rng, state, strict=True):  # the forward's dropout masks again
                v.assign(s)
            grads, back = self.traced.backward(inp, grad)
            for v, s in zip(self.rng, now, strict=True):
                v.assign(s)
            self.add_grads(grads)
        return None if self.place.first else back.numpy()

    def add_grads(self, grads) -> None:
        self.grads = list(grads) if self.grads is None else [
            a + g for a, g in zip(self.grads, grads, strict=True)]

    def end_step(self) -> bool:
        grads = self.allreduce(self.grads)
        if self.clip is not None:  # the global norm of the averaged gradients, over every stage
            grads = [tf.convert_to_tensor(g) for g in grads]  # a sparse gradient's rows too
            squares = float(tf.add_n([tf.reduce_sum(tf.square(tf.cast(g, tf.float64)))
                                      for g in grads]))
            scale = self.clip_scale(squares)
            grads = [g * tf.cast(scale, g.dtype) for g in grads]  # always, as Keras' clip
        self.optimizer.apply_gradients(zip(grads, self.stage.trainable_variables, strict=True))
        return self.weights_finite()

    def clip_factor(self, norm: float) -> float:
        """Keras' ``clip_by_global_norm`` factor, the ring's (``global_clipnorm``), to the bit."""
        return self.clip * min(1.0 / norm, 1.0 / self.clip) if norm else 1.0  # (Keras: 1/0 = inf)

    @property
    def recomputes(self) -> bool:
        """Always: a stage's backward computes its forward again (:class:`Traced`), with or
        without ``--checkpoint-activations``."""
        return True

    # --- the epoch's end and the run's -------------------------------------------------------------

    def sync_buffers(self) -> None:
        average_statistics(self.stage, self.stage_set)

    def evaluator(self, relay):
        def batch_sums(x, y):
            logits = relay(lambda v: self.stage(tf.constant(v), training=False), x, len(x),
                           lambda t: t.numpy())
            if logits is None:  # stages before the last: their sums are dropped
                return 0.0, 0.0
            loss = tf.reduce_sum(tf.cast(sparse_logits_loss(y, logits), tf.float64))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, axis=1), y), tf.float64))
            return loss, correct

        return batch_sums

    def meta_of(self, arrays) -> dict:
        return json.loads(str(arrays["meta"]))

    def parameters(self) -> list[np.ndarray]:
        return parameters(self.stage)

    def stage_param_bytes(self) -> int:
        return sum(math.prod(w.shape) * np.dtype(w.dtype).itemsize for w in self.stage.weights)


class Traced:
    """A stage's micro-batch maths as traced functions (any number of rows).  A stage before the
    last runs its forward pass, and later its backward pass from the next stage's gradient, which
    computes the forward pass again under a tape (a tape cannot outlive a ``tf.function`` call; the
    run restores the dropout seed state first, so the masks are the forward's; the stage's
    non-trainable weights, BatchNorm's moving statistics, are put back after it, so only the
    forward updates them).  The last stage runs forward, loss and backward in one call, in its forward
    op (the gradient to send waits for the backward op).  Traced, the
    CNN at S = 2 ran 2.2x the images/s of eager stages keeping a tape per micro-batch, with the
    same weights (the same dropout masks); the measurement is in docs/pipeline.md."""

    def __init__(self, stage: keras.Model, info, inbound, outbound) -> None:
        self.stage = stage
        variables = stage.trainable_variables
        state = stage.non_trainable_weights  # BatchNorm's moving statistics (not the seed state)
        x_spec = (tf.TensorSpec([None, *info.input_shape], info.input_dtype) if inbound is None
                  else tf.TensorSpec([None, *inbound.shape], tf.as_dtype(inbound.dtype)))
        watch = inbound is not None

        def grads_of(tape, target, x, **kw):
            got = tape.gradient(target, [*variables, x] if watch else variables, **kw)
            return (got[:-1], got[-1]) if watch else (got, tf.zeros([0]))

        @tf.function(input_signature=[x_spec], jit_compile=False)
        def forward(x):
            return stage(x, training=True)

        if outbound is not None:
            @tf.function(input_signature=[x_spec, tf.TensorSpec([None, *outbound.shape],
                                                                tf.as_dtype(outbound.dtype))],
                         jit_compile=False)
            def backward(x, grad):
                # The recompute runs in training mode (batch statistics, the forward's dropout
                # masks) but must not update the layers' state a second time: BatchNorm's moving
                # statistics, any layer's non-trainable weights, are read before it and put back
                # after (the ops on each variable run in program order inside a tf.function).
                kept = [tf.identity(v.value) for v in state]
                with tf.GradientTape() as tape:
                    if watch:
                        tape.watch(x)
                    out = stage(x, training=True)
                got = grads_of(tape, out, x, output_gradients=grad)
                for v, k in zip(state, kept, strict=True):
                    v.assign(k)
                return got

            self.backward = backward

        logits = tf.as_dtype(stage.outputs[0].dtype)
        if logits == tf.bfloat16:  # --precision bf16: the loss is float32's (sparse_logits_loss)
            logits = tf.float32

        @tf.function(input_signature=[x_spec, tf.TensorSpec([None], tf.int64),
                                      tf.TensorSpec([], logits)], jit_compile=False)
        def loss_backward(x, y, rows):
            with tf.GradientTape() as tape:
                if watch:
                    tape.watch(x)
                per_example = sparse_logits_loss(y, stage(x, training=True))
                # The examples' summed loss over the step's rows: the micro-batches' gradients
                # add up to the step's mean gradient (the set's allreduce then averages replicas).
                loss = tf.reduce_sum(per_example) / rows
            grads, back = grads_of(tape, loss, x)
            return grads, back, tf.reduce_sum(tf.cast(per_example, tf.float64))

        self.forward, self.loss_backward = forward, loss_backward

