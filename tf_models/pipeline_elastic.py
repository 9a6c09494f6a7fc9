"""The elastic pipeline on TensorFlow/Keras 3 (``--elastic --pipeline-stages S``): the twin of
:mod:`torch_models.pipeline_elastic`, on Horovod's global collectives alone (docs/pipeline.md,
"Elastic pipeline"; the engine :mod:`ringtrain.strategies.pipeline.lockstep`, the loop and the
elastic state :mod:`ringtrain.strategies.pipeline.elastic`).

Every rank builds every stage's layers and optimizer (the model one process builds with
``--seed``) and trains its own.  A stage's micro-batch maths is the fixed Keras pipeline's
(:class:`tf_models.pipeline.Traced`: a stage before the last recomputes its forward pass in the
backward, with the forward's dropout masks; the last stage runs forward, loss and backward in its
forward op).  The loop runs inside Horovod's ``run_fn`` with :func:`peer_failures_roll_back`, as the
ring's Keras elastic job does.
"""

from __future__ import annotations

import argparse
from typing import Any

import horovod.tensorflow as hvd
import keras
import numpy as np
import tensorflow as tf
from horovod.common.elastic import run_fn

from ringtrain.output.summary import Summary
from ringtrain.strategies.pipeline import elastic as loop
from ringtrain.strategies.pipeline import lockstep
from ringtrain.training import startup as startup_checks
from ringtrain.training.run import RunIdentity
from ringtrain.training.world import World, state_broadcast
from tf_models import checkpoints, optimizers, stages, startup
from tf_models.collectives import COLLECTIVES, VERSIONS
from tf_models.evaluation import make_weights_finite, parameters
from tf_models.horovod_keras import peer_failures_roll_back, sparse_logits_loss
from tf_models.pipeline import Traced


class TfComm:
    """:class:`ringtrain.strategies.pipeline.lockstep.Comm` on ``horovod.tensorflow``."""

    def alltoall(self, data: np.ndarray, splits, name: str) -> tuple[np.ndarray, list[int]]:
        # Horovod: one alltoall, a split (bytes) per destination rank, and the bytes received.
        out, got = hvd.alltoall(tf.constant(data), splits=tf.constant(list(splits), tf.int32),
                                name=name)
        return out.numpy(), [int(n) for n in got.numpy()]

    def allreduce_sum(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allreduce(tf.constant(array), op=hvd.Sum, name=name).numpy()

    def broadcast(self, array: np.ndarray, root: int, name: str) -> np.ndarray:
        return hvd.broadcast(tf.constant(array), root_rank=root, name=name).numpy()

    def allgather(self, array: np.ndarray, name: str) -> np.ndarray:
        return hvd.allgather(tf.constant(array), name=name).numpy()


def _statistics(net: keras.Model) -> list:
    """BatchNorm's moving statistics: the float non-trainable weights."""
    return [w for w in net.non_trainable_weights if w.dtype in ("float16", "float32", "float64")]


class KerasElasticPipeline:
    """One rank of the elastic pipeline on Keras (the loop's
    :class:`ringtrain.strategies.pipeline.elastic.ElasticStages`)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        # Horovod: initialise (Gloo, under horovodrun's elastic driver; no process sets), pin,
        # open the data: the start-up every Keras run shares, without collectives.
        rank = startup.open_rank(args, check_world=lambda a, n: None, elastic=True)
        self.world, self.data = rank.world, rank.data
        self.stage_count = args.pipeline_stages
        self.micro = args.batch_size // args.microbatches
        keras.utils.set_random_seed(args.seed)  # every stage: the model one process builds
        split = stages.build_split(args.model, self.data.info, args.dropout, self.stage_count)
        self.models, self.stages, self.cuts = split.models, split.stages, split.cuts
        self.identity = RunIdentity.of(args, "tf", VERSIONS, self.data.info, split.param_count,
                                       strategy="pipeline")
        self.n_train = self.identity.data.train_size
        if self.world.rank == 0:
            startup_checks.check_output_folders(None, args, self.identity.param_count)
        plain = argparse.Namespace(**{**vars(args), "clip_grad_norm": None})
        self.optimizers = []
        for net in self.models:  # each stage's optimizer, its slots built (broadcast, snapshots)
            opt = optimizers.build(plain, args.base_lr, micro_steps=1)
            opt.build(net.trainable_variables)
            self.optimizers.append(opt)
        self.traced = [Traced(net, self.data.info, self.cuts[s - 1] if s else None,
                              self.cuts[s] if s < self.stage_count - 1 else None)
                       for s, net in enumerate(self.models)]
        self.finite = [make_weights_finite(net) for net in self.models]
        self.rng = [checkpoints.rng_variables(net) for net in self.models]
        self.sizes = [sum(int(np.prod(v.shape)) for v in net.trainable_variables)
                      for net in self.models]
        self.stat_sizes = [sum(int(np.prod(w.shape)) for w in _statistics(net))
                           for net in self.models]
        self.comm = TfComm()
        self.layout = lockstep.Layout(self.stage_count, self.world.size, self.world.rank)

    # --- the state a commit keeps, and what a re-form hands over ---------------------------------

    def tracked(self, s: int) -> list:
        return [*self.models[s].weights, *self.optimizers[s].variables]

    def snapshot(self, s: int) -> list[np.ndarray]:
        return [np.array(v.numpy()) for v in self.tracked(s)]

    def load_snapshot(self, s: int, values: list[np.ndarray]) -> None:
        for var, value in zip(self.tracked(s), values, strict=True):
            var.assign(value)

    def reform(self, state: loop.PipelineState) -> None:
        """As :meth:`torch_models.pipeline_elastic.TorchElasticPipeline.reform`."""
        self.world = World(hvd, COLLECTIVES)  # Horovod: this world's rank and size
        lockstep.check_world(self.stage_count, self.world.size)
        self.layout = lockstep.Layout(self.stage_count, self.world.size, self.world.rank)
        plain, sources, newest = lockstep.handover(self.comm, self.world.rank, self.stage_count,
                                                   (state.held_stage, state.commits), state.plain())
        state.set_plain(plain)
        state.commits = newest
        for s, src in enumerate(sources):
            # Horovod: broadcast stage s from the rank that held it at the newest commit.
            for i, var in enumerate(self.tracked(s)):
                var.assign(hvd.broadcast(tf.convert_to_tensor(var), root_rank=src,
                                         name=f"pipeline.elastic.s{s}.{i}"))
        state.keep()
        state._plain = state.plain()

    # --- one step ---------------------------------------------------------------------------------

    def batches(self, steps):
        if self.layout.first or self.layout.last:
            yield from self.data.batches(steps)
        else:
            for _ in steps:
                yield None

    def step(self, data, rows: list[int], lr: float) -> tuple[float, bool]:
        layout = self.layout
        s = layout.stage
        if s is None:  # a spare: every collective, nothing computed
            lockstep.spare_step(layout, self.comm, rows, self.sizes)
            return 0.0, True
        opt, net = self.optimizers[s], self.models[s]
        opt.learning_rate = lr
        bounds = np.cumsum([0, *rows])
        cut = list(zip(bounds[:-1], bounds[1:], strict=True))
        x, y = data if data is not None else (None, None)
        self.inputs = [x[a:b] for a, b in cut] if layout.first else None
        self.labels = [tf.constant(y[a:b]) for a, b in cut] if layout.last else None
        self.rows_total = int(bounds[-1])
        self.saved: dict[int, Any] = {}
        self.grads = None
        self.step_loss = 0.0
        lockstep.train_step(layout, self.comm, self, rows, len(rows),
                            self.cuts[s - 1] if not layout.first else None,
                            self.cuts[s] if not layout.last else None)
        variables = net.trainable_variables
        flat = np.concatenate([tf.reshape(tf.cast(tf.convert_to_tensor(g), tf.float64), [-1]).numpy()
                               for g in self.grads])
        # Horovod: the stage's mean gradient over its replicas (one allreduce over every rank).
        mean = lockstep.average_stage(self.comm, layout, self.sizes, flat, lockstep.GRADS)
        grads, offset = [], 0
        for v in variables:
            n = int(np.prod(v.shape))
            grads.append(tf.constant(mean[offset:offset + n].reshape(v.shape), dtype=v.dtype))
            offset += n
        opt.apply_gradients(zip(grads, variables, strict=True))
        return self.step_loss, self.finite[s]()

    def forward(self, m: int, x):
        s, layout = self.layout.stage, self.layout
        traced = self.traced[s]
        if layout.last:
            # forward, loss and backward in one call (the fixed Keras pipeline's order)
            grads, back, total = traced.loss_backward(
                self.inputs[m] if layout.first else x, self.labels[m], self.rows_total)
            self.step_loss += float(total)
            self.add_grads(grads)
            self.saved[m] = back
            return None
        inp = self.inputs[m] if layout.first else x
        self.saved[m] = (inp, [tf.identity(v.value) for v in self.rng[s]])
        return traced.forward(inp).numpy()

    def backward(self, m: int, grad):
        s, layout = self.layout.stage, self.layout
        if layout.last:
            back = self.saved.pop(m)
        else:
            inp, state = self.saved.pop(m)
            now = [tf.identity(v.value) for v in self.rng[s]]
            for v, saved in zip(self.rng[s], state, strict=True):  # the forward's dropout masks
                v.assign(saved)
            grads, back = self.traced[s].backward(inp, grad)
            for v, saved in zip(self.rng[s], now, strict=True):
                v.assign(saved)
            self.add_grads(grads)
        return None if layout.first else back.numpy()

    def add_grads(self, grads) -> None:
        self.grads = list(grads) if self.grads is None else [
            a + g for a, g in zip(self.grads, grads, strict=True)]

    # --- the epoch's end ------------------------------------------------------------------------

    def sync_buffers(self) -> None:
        if not any(self.stat_sizes):
            return
        s = self.layout.stage
        stats = _statistics(self.models[s]) if s is not None else []
        mine = (np.concatenate([np.asarray(w.numpy(), np.float64).reshape(-1) for w in stats])
                if s is not None and stats else (None if s is None else np.zeros(0)))
        mean = lockstep.average_stage(self.comm, self.layout, self.stat_sizes, mine,
                                      "pipeline.elastic.buffers")
        offset = 0
        for w in stats:
            n = int(np.prod(w.shape))
            w.assign(mean[offset:offset + n].reshape(w.shape).astype(w.dtype))
            offset += n

    @property
    def problem(self) -> str | None:
        """The first data problem this rank's data met (a stage that reads the data), or None."""
        return self.data.problem

    def eval_sums(self) -> list[float]:
        """As the PyTorch glue's: the first stage records its replica's test inputs through the
        data's own evaluation, the stages run them forward in lockstep ticks, the last stage
        replays the logits to the data's evaluation, which reads the labels."""
        layout = self.layout
        replica, replicas = layout.replica or 0, layout.replicas
        inputs: list[np.ndarray] = []
        if layout.first:
            def record(x, y):
                inputs.append(x)
                return 0.0, 0.0
            self.data.eval_sums(record, replica, replicas)
        counts = self.world.gather([len(x) for x in inputs] if layout.first else None,
                                   "pipeline.elastic.eval_rows")
        rows = counts[layout.rank_of(0, replica)] if not layout.spare else []
        most = max(len(counts[layout.rank_of(0, r)]) for r in range(replicas))
        s = layout.stage
        net = self.models[s] if s is not None else None

        def compute(m: int, x):
            out = net(tf.constant(inputs[m] if layout.first else x), training=False)
            return out if layout.last else out.numpy()

        logits = lockstep.forward_only(
            layout, self.comm, compute, rows, most,
            self.cuts[s - 1] if s is not None and not layout.first else None,
            self.cuts[s] if s is not None and not layout.last else None, "pipeline.elastic.eval")
        if not layout.last:
            return [0.0, 0.0, 0.0, 0.0]
        replay = iter(logits)

        def batch_sums(x, y):
            out = next(replay)
            loss = tf.reduce_sum(tf.cast(sparse_logits_loss(y, out), tf.float64))
            correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(out, axis=1), y), tf.float64))
            return loss, correct

        return self.data.eval_sums(batch_sums, replica, replicas)

    def save(self, epoch: int) -> None:
        s = self.layout.stage
        checkpoints.save(self.args.checkpoint_dir, epoch, self.models[s], self.optimizers[s],
                         self.identity, self.args,
                         {**self.stages[s].record(), "stages": self.stage_count})

    def parameters(self) -> list[np.ndarray]:
        s = self.layout.stage
        return [] if s is None else parameters(self.models[s])

    # --- what the run says about itself -----------------------------------------------------------

    def facts(self) -> dict[str, Any]:
        a, layout = self.args, self.layout
        return {"stages": layout.stages, "replicas": layout.replicas, "elastic": True,
                "spares": layout.size - layout.replicas * layout.stages,
                "schedule": "gpipe (lockstep)", "microbatches": a.microbatches,
                "microbatch_size": self.micro, "split": [s.record() for s in self.stages]}

    def describe(self) -> list[str]:
        f = self.facts()
        return [f"elastic pipeline: {f['stages']} stages, rank = replica x {f['stages']} + "
                f"stage, ranks beyond R x S spare; GPipe in lockstep ticks (one alltoall per "
                f"tick over every rank), {f['microbatches']} micro-batches of "
                f"{f['microbatch_size']}; each stage's gradients averaged by one allreduce of "
                f"the whole model's size over every rank",
                *(s.line() for s in self.stages)]


def train(args: argparse.Namespace) -> Summary:
    run = KerasElasticPipeline(args)
    # Horovod: the elastic state: the rank's stage and the plain attributes, committed and rolled
    # back; its commits check for host updates with a broadcast of plain data.
    state = loop.PipelineState(run, bcast_object=state_broadcast(COLLECTIVES, hvd.rank),
                               get_rank=hvd.rank)

    def train_world(state) -> Summary:
        with peer_failures_roll_back():
            run.reform(state)  # each world: its layout; every stage from a rank that held it
            return loop.train_world(state, run)

    # Horovod: run the loop elastically, re-joining (shut down, initialise) after every change;
    # Horovod's own run_fn, as the ring's Keras elastic job (tf_models/elastic.py says why).
    return run_fn(train_world, startup.rejoin)(state)
