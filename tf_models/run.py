"""A TensorFlow/Keras 3 run through Horovod's Keras API: the run object the shared loops drive.

:class:`KerasRun` opens the run once, in the order it happens, every Horovod line marked
``# Horovod:``.  A fixed-size job is Horovod's own Keras recipe (its
``tensorflow2_keras_mnist.py``), on the Horovod that ``make setup`` patches for Keras 3:
``hvd.DistributedOptimizer`` averages the gradients, ``BroadcastGlobalVariablesCallback`` hands
rank 0's weights and optimizer state to every rank when training begins, and ``model.fit`` runs
the steps (:meth:`KerasRun.fit`), reporting each optimizer step and epoch to the shared
:class:`~ringtrain.training.fixed_loop.FixedLoop` through :class:`~tf_models.fit_callback.FixedLoopCallback`.
With ``--backward-passes-per-step K`` fit runs K micro-batch steps of B rows per optimizer step
(each loss weighted 1/K; the wrapper sums their gradients locally and allreduces on the K-th).
``--shard-optimizer`` (ZeRO stage 1) compiles :class:`~tf_models.sharded.ShardedOptimizer` in
place of Horovod's wrapper: rank 0's weights are broadcast and its restored state handed out in
slices when the run opens, and every rank gathers its slice of the state for rank 0's checkpoint.
Train loss comes from :func:`~tf_models.horovod_keras.loss_sums` (float64 sums allreduced at the
epoch's end, exact over ranks), not from Horovod's ``MetricAverageCallback``, which averages the
ranks' averages.

An elastic job's loop must stop, commit and roll back between any two optimizer steps, so it
calls :meth:`KerasRun.step` itself: :class:`~tf_models.horovod_keras.DistributedModel`'s train
step (K micro-batches, one allreduce, one update), whose gradients equal the fixed job's bit for
bit.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import keras
import numpy as np
import tensorflow as tf

from ringtrain import optimizer_spec
from ringtrain.optimizer_options import distributed_optimizer_options
from ringtrain.output.progress import Loss
from ringtrain.strategies.ring import options as ring_options
from ringtrain.training import startup as startup_checks
from ringtrain.training.fixed_loop import FixedLoop
from ringtrain.training.run import FrameworkRun, RunIdentity, StepTag
from ringtrain.training.world import World
from tf_models import checkpoints, optimizers, sharded, startup
from tf_models.collectives import COLLECTIVES, VERSIONS, average_statistics
from tf_models.evaluation import WeightsTotal, make_batch_sums, make_weights_finite, parameters
from tf_models.fit_callback import FixedLoopCallback
from tf_models.horovod_keras import DistributedModel, SparseLogitsLoss, logits_dtype, loss_sums
from tf_models.model import build


class KerasModelRun(FrameworkRun):
    """A Keras rank that holds the whole model: what the ring (:class:`KerasRun`) and the
    parameter servers (:class:`tf_models.ps.KerasPSRun`) share once the run is open: the batches,
    the loss sums, the finiteness check, BatchNorm's statistics, evaluation, checkpoints, the
    checksums.  The strategy's constructor calls :meth:`open_model`, then adds its optimizer."""

    optimizer: keras.optimizers.Optimizer | None = None

    def open_model(self, args: argparse.Namespace, *, check_world, elastic: bool = False) -> None:
        """The framework's start-up (:func:`tf_models.startup.open_rank`), then the model, seeded
        per rank, the run's identity and the output folders' check (an elastic worker issues no
        collective while it opens: rank 0 alone checks the folders)."""
        self.args, self.elastic = args, elastic
        rank = startup.open_rank(args, check_world=check_world, elastic=elastic)
        self.world, self.data, self.tools = rank.world, rank.data, rank.tools
        # Different seeds per rank on purpose: the broadcast, not luck, makes ranks agree.
        keras.utils.set_random_seed(args.seed + self.world.rank)
        with optimizers.policy(args) as dtype_policy:  # --amp, --precision bf16, else None
            self.net = build(args.model, self.data.info, args.dropout, dtype_policy)  # checked
        self.identity = RunIdentity.of(args, "tf", VERSIONS, self.data.info, self.net.count_params())
        if not elastic or self.world.rank == 0:
            startup_checks.check_output_folders(None if elastic else self.world, args,
                                                self.identity.param_count)
        self.batch_sums = make_batch_sums(self.net, self.data.info)
        self.weights_finite = make_weights_finite(self.net)
        self.loss_sum = 0.0

    def batches(self, steps):
        return self.data.batches(steps)

    def take_loss_sum(self) -> float:
        total, self.loss_sum = self.loss_sum, 0.0
        return total

    def diverged(self, tag: StepTag) -> StepTag | None:
        return None if self.weights_finite() else tag

    @property
    def problem(self) -> str | None:
        return self.data.problem

    def sync_buffers(self) -> None:
        average_statistics(self.net)

    def eval_sums(self) -> list[float]:
        return self.data.eval_sums(self.batch_sums, self.world.rank, self.world.size)

    def save(self, epoch: int) -> None:
        checkpoints.save(self.args.checkpoint_dir, epoch, self.net, self.optimizer, self.identity,
                         self.args)

    def restore(self) -> int:
        return checkpoints.restore(self.args.checkpoint_dir, self.net, self.optimizer, self.identity,
                                   self.args.optimizer)

    def parameters(self) -> Iterator[np.ndarray]:
        return parameters(self.net)


class KerasRun(KerasModelRun):
    """One rank's Keras run on the ring.  ``elastic``: a worker of an elastic job, which trains
    through :class:`DistributedModel` and gets rank 0's state from Horovod's elastic state."""

    sharded = False  # --shard-optimizer (the fixed job's only: parsing refuses it with --elastic)

    def __init__(self, args: argparse.Namespace, *, elastic: bool = False) -> None:
        self.open_model(args, check_world=ring_options.check_world, elastic=elastic)
        # Horovod: its timeline (--timeline-out) records from here on, written by rank 0.
        self.tools.start(self.world.rank, hvd)
        k = args.backward_passes_per_step
        # Horovod: scale the learning rate with the number of workers (warm-up and decay per step).
        lr = self.target_lr if not elastic else args.base_lr  # elastic: set per step, per world
        # --optimizer, checked; Horovod's wrapper counts K micro-batch steps per optimizer step
        optimizer = optimizers.build(args, lr, micro_steps=1 if elastic else k)
        if elastic:
            self.optimizer = optimizer
            optimizer.build(self.net.trainable_variables)
            self.start_epoch = self.restore() if args.resume and self.world.rank == 0 else 0
            # Horovod: wrap the model: its train step averages the gradients over all ranks.
            self.model = DistributedModel(
                self.net, backward_passes_per_step=k, micro_batch_size=args.batch_size,
                fp16_allreduce=args.fp16_allreduce,
                gradient_predivide_factor=args.gradient_predivide_factor)
            self.model.compile(optimizer=optimizer)
            return
        self.sharded = args.shard_optimizer  # ZeRO stage 1: state for this rank's slice only
        if self.sharded:
            self._sharded_optimizer(args, optimizer)
        else:
            self._unsharded_optimizer(args, optimizer)
        self.sums, weights_total = loss_sums(), WeightsTotal(self.net)
        # Each micro-batch's loss weighs 1/K, so the K summed gradients are their mean, as in
        # the PyTorch trainer (loss / K) and for every op: Horovod's own
        # average_aggregated_gradients refuses Adasum.  XLA off: this Horovod build has no XLA
        # kernels (Keras turns it on on GPUs).
        self.net.compile(optimizer=self.optimizer, loss=SparseLogitsLoss(logits_dtype(self.net)),
                         loss_weights=1.0 / k,
                         metrics=[self.sums, weights_total], jit_compile=False)
        self.weights_finite = weights_total.finite  # the train step's own sum: no second pass

    def _sharded_optimizer(self, args: argparse.Namespace, optimizer) -> None:
        """--shard-optimizer: the chosen optimizer over this rank's slice of the flat weights
        (:class:`~tf_models.sharded.ShardedOptimizer`: reduce-scatter, clip, update, allgather),
        resumed, then rank 0's weights broadcast and its restored state handed out in slices."""
        opts = distributed_optimizer_options(args, hvd)  # --fp16-allreduce, predivide (no Adasum)
        self.optimizer = sharded.ShardedOptimizer(
            optimizer, hvd, clip=args.clip_grad_norm, compression=opts["compression"],
            predivide=opts["gradient_predivide_factor"], micro_steps=args.backward_passes_per_step)
        self.optimizer.build(self.net.trainable_variables)  # the slice's state: 1/R of the whole
        self.start_epoch = startup_checks.resume_epoch(self.world, args, self.restore)
        # Horovod: broadcast rank 0's weights, then hand out rank 0's restored optimizer state,
        # each rank keeping its slice (every rank's step count and slots: the same start).
        hvd.broadcast_variables(self.net.weights, root_rank=0)
        self.optimizer.scatter_state()

    def _unsharded_optimizer(self, args: argparse.Namespace, optimizer) -> None:
        """Horovod's DistributedOptimizer over the chosen optimizer, resumed; fit's callback
        broadcasts rank 0's weights and optimizer state."""
        if args.amp:  # wrapped inside: the loss-scale skip is decided on allreduced gradients
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        inner = optimizer
        # Horovod: wrap the optimizer: gradients are averaged over all ranks (allreduce) every
        # K-th micro-batch step, after summing the K locally.
        self.optimizer = optimizer = optimizers.wrap(args.optimizer, lambda: hvd_keras.DistributedOptimizer(
            inner, **distributed_optimizer_options(args, hvd)))
        optimizer.build(self.net.trainable_variables)  # slots exist: checkpoints, broadcast
        self.start_epoch = startup_checks.resume_epoch(self.world, args, self.restore)
        if self.start_epoch >= args.epochs:  # resumed at the end: no fit, so no fit broadcast
            # Horovod: broadcast rank 0's weights and optimizer state: every rank evaluates them.
            hvd.broadcast_variables([*self.net.weights, *optimizer.variables], root_rank=0)

    @property
    def writes_checkpoints(self) -> bool:
        """--shard-optimizer: every rank, each gathering its slice of the state for rank 0's file
        (which alone writes it, :meth:`save`); else rank 0."""
        return self.sharded or self.world.rank == 0

    def save(self, epoch: int) -> None:
        if not self.sharded:
            super().save(epoch)
            return
        whole = self.optimizer.gathered_state()  # a collective: the unsharded file's format
        if self.world.rank == 0:
            checkpoints.save(self.args.checkpoint_dir, epoch, self.net, self.optimizer,
                             self.identity, self.args, optimizer_arrays=whole)

    def describe(self) -> list[str]:
        """Under the banner: the update, when it is not the default SGD's."""
        cpu = not tf.config.list_logical_devices("GPU")
        line = optimizer_spec.describe(self.args, optimizer_spec.cpu_has_bf16() if cpu else None)
        return [line] if line else []

    def new_world(self) -> World:
        """After an elastic re-form: this rank's new :class:`World`, and the train step traced
        anew: the gradient exchange is decided at trace time (a world of one issues no
        allreduce), so a step traced for one worker must not run with two."""
        self.world = World(hvd, COLLECTIVES)
        self.train_step = tf.function(self.model.train_step, jit_compile=False)
        return self.world

    # --- the fixed job: model.fit runs the steps ------------------------------------------------

    def fit(self, fixed: FixedLoop) -> None:
        b, k = self.args.batch_size, self.args.backward_passes_per_step
        # fit takes one micro-batch per call of its train step: K per optimizer step.
        micro = [step[m * b:(m + 1) * b] for epoch in fixed.epochs()
                 for step in fixed.index_batches(epoch) for m in range(k)]
        # (--shard-optimizer: broadcast and handed out when the run opened; each rank's optimizer
        # state is its own slice, which the callback below would overwrite with rank 0's.)
        callbacks = [FixedLoopCallback(fixed, self.sums)]
        if not self.sharded:
            # Horovod: broadcast rank 0's weights and optimizer state (fresh or resumed) as fit
            # begins.
            callbacks.insert(0, hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0))
        self.net.fit(self.data.fit_dataset(micro), epochs=self.args.epochs,
                     initial_epoch=fixed.start_epoch, steps_per_epoch=fixed.steps * k,
                     shuffle=False, verbose=0, callbacks=callbacks)

    # --- an elastic job: the shared loop runs the steps -----------------------------------------

    def step(self, batch, lr: float) -> tuple[Loss, int]:
        x, y = batch
        self.optimizer.learning_rate = lr
        self.model.loss_tracker.reset_state()
        self.train_step((tf.constant(x), tf.constant(y)))
        total = float(self.model.loss_tracker.total.numpy())
        self.loss_sum += total
        return total / max(len(y), 1), len(y)
