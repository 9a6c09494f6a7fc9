"""``--shard-optimizer`` in Keras 3: ZeRO stage 1 over Horovod on the ring.

The model's trainable variables, in model order, are read as one flat vector of their elements
(padded with zeros to a multiple of the world size R); rank r owns the slice ``[r*S, (r+1)*S)``.
:class:`ShardedOptimizer` is the optimizer ``model.fit`` compiles with; its :meth:`apply` (inside
fit's traced train step) does what the PyTorch trainer's :mod:`torch_models.sharded` does:

1. reduce-scatter the gradients, averaged (``hvd.reducescatter``, op Average: Horovod splits a
   tensor's first dimension evenly among the ranks when it divides), in chunks of the slice
   (:data:`CHUNK`): each chunk's input is every rank's piece of the flat gradient, cut from the
   gradient tensors by static slices (no whole flat gradient is ever made);
2. ``--clip-grad-norm``: Keras' ``global_clipnorm`` rule, from the global norm, the square root of
   every slice's squared norm summed (one allreduce of a scalar);
3. the chosen built-in optimizer's rule (:class:`SliceRule`: Keras' SGD, Adam, AdamW and RMSprop
   as their ``update_step`` and AdamW's decoupled decay compute them, ``RingUpdate``'s L2 term and
   step count included) updates this rank's slice chunk by chunk: the chunk's weights read from
   the model's own variables, its state from slot variables of the slice's length (1/R of the
   unsharded state), the new weights straight into the allgather.  No copy of the slice's weights
   is kept (Keras' optimizer would need one, a variable of its own to update: W / R more per
   rank, docs/training.md).  The rules are
   element-wise, so the slice's update is the unsharded one's;
4. allgather the updated slices, in the same chunks, written back into every rank's model
   variables by rectangular slice assignments (:func:`flat_pieces`); then the variables'
   ``constraint``, as Keras' ``apply`` does.  A variable with no gradient is left as it is, its
   state too (Keras' ``apply`` skips it).

Collective names depend on the chunk's offset only, and every rank issues the same ones.  Each
chunk waits for the one before it (control dependencies), so that a traced step never holds more
than a chunk's transient buffers: without ``--clip-grad-norm`` each chunk is updated as soon as
it is reduce-scattered; the clip's norm needs the whole reduce-scattered slice first.
``--backward-passes-per-step K``: the gradients are summed locally over K calls (as Horovod's
wrapper does) and the K-th call updates; the optimizer's ``iterations`` counts every call, as
unsharded.

Checkpoints hold the whole, unsharded state (:meth:`ShardedOptimizer.gathered_state`, a
collective, every rank calling it) in the unsharded optimizer's ``variables`` order, so a sharded
run resumes unsharded and at another R, and the other way round; rank 0 alone reads a checkpoint
(:meth:`ShardedOptimizer.load_state`) and :meth:`ShardedOptimizer.scatter_state` hands each rank
its slice.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from ringtrain.errors import UserError
from ringtrain.training.world import Collectives, broadcast_plain

# The least elements per collective call and rank: a slice of S elements goes in S // CHUNK
# equal chunks (one if S < CHUNK), each of CHUNK to 2 x CHUNK elements.  A chunk's buffers are
# the sharded step's largest transients besides the gradients (the reduce-scatter's input and the
# allgather's output are R chunks each, the rule's intermediates a few chunks): 16 MiB of float32,
# as PyTorch's; 32 MiB chunks raised the largest rank's peak by 64 MiB (docs/training.md).
CHUNK = 1 << 22


def layout(numel: int, world: int) -> tuple[int, int]:
    """``(padded, shard)``: the flat length, ``numel`` rounded up to a multiple of ``world``, and
    each rank's slice of it."""
    shard = -(-numel // world)
    return shard * world, shard


def flat_pieces(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple, tuple[int, ...]]]:
    """The elements ``[a, b)`` of a row-major tensor of ``shape`` as rectangular slices, in order:
    ``(index, slice shape)`` pairs, each index a tuple of ints and one ``slice`` (at most
    2 x rank - 1 of them), what a variable's sliced ``assign`` takes."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [((slice(a, b),), (b - a,))]
    inner = math.prod(shape[1:])
    r0, o0 = divmod(a, inner)
    r1, o1 = divmod(b, inner)
    if r0 == r1:
        return [((r0, *idx), shp) for idx, shp in flat_pieces(shape[1:], o0, o1)]
    out = []
    if o0:
        out += [((r0, *idx), shp) for idx, shp in flat_pieces(shape[1:], o0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((slice(r0, r1),), (r1 - r0, *shape[1:])))
    if o1:
        out += [((r1, *idx), shp) for idx, shp in flat_pieces(shape[1:], 0, o1)]
    return out


def _tf_var(var):
    return var.value if isinstance(var, keras.Variable) else var


def state_layout(inner: keras.optimizers.Optimizer, count: int) -> list[tuple]:
    """The unsharded optimizer's ``variables`` over ``count`` model variables, as entries
    ``("scalar", j)`` (its j-th variable that is not a slot: the step count, the learning rate)
    or ``("slot", i, k)`` (the k-th slot of model variable i).  Read from a twin of ``inner``
    built over ``count`` tiny variables of distinct shapes, ``(i + 1,)``: Keras orders slots by
    variable then slot (Adam) or by slot then variable (RMSprop), and this reads either."""
    twin = type(inner).from_config(inner.get_config())
    twin.build([keras.Variable(np.zeros(i + 1, "float32"), name=f"w{i}") for i in range(count)])
    entries, scalars, slots = [], 0, [0] * count
    for var in twin.variables:
        if len(var.shape) == 0:
            entries.append(("scalar", scalars))
            scalars += 1
        else:
            i = var.shape[0] - 1
            entries.append(("slot", i, slots[i]))
            slots[i] += 1
    return entries


class SliceRule:
    """The update of a built-in Keras optimizer (``inner``) on a chunk of a slice, as tensors: what
    its ``update_step`` computes (Keras 3's SGD, Adam, AdamW, RMSprop, in their order of
    operations, so float64 results equal to the last bit), with ``RingUpdate``'s L2 term and
    step count (:mod:`tf_models.optimizers`) and AdamW's decoupled decay (Keras'
    ``_apply_weight_decay``, before the update).  :attr:`slots`: the state's names per weight, in
    the order Keras makes them (a checkpoint's order, :func:`state_layout`).  Any other optimizer
    is a ``ValueError``: parsing refuses a factory with ``--shard-optimizer``."""

    def __init__(self, inner: keras.optimizers.Optimizer) -> None:
        self.inner = inner
        self.l2 = float(getattr(inner, "l2", 0.0))
        if getattr(inner, "amsgrad", False) or getattr(inner, "nesterov", False):
            raise ValueError("--shard-optimizer: amsgrad and nesterov are not written out here "
                             "(tf_models.optimizers.build sets neither)")
        if isinstance(inner, keras.optimizers.Adam):  # AdamW's class is Adam's
            self.kind, self.slots = "adam", ["momentum", "velocity"]
        elif isinstance(inner, keras.optimizers.RMSprop):
            self.kind = "rmsprop"
            self.slots = ["velocity", *(["momentum"] if inner.momentum > 0 else []),
                          *(["average_gradient"] if inner.centered else [])]
        elif isinstance(inner, keras.optimizers.SGD):
            self.kind, self.slots = "sgd", ["momentum"] if inner.momentum != 0 else []
        else:
            raise ValueError(f"--shard-optimizer has no slice rule for {type(inner).__name__}")

    def __call__(self, w: tf.Tensor, g: tf.Tensor, state: list) -> tuple[tf.Tensor, list]:
        """The chunk's new weights and new state, from its weights ``w``, its averaged (clipped)
        gradient ``g`` and its state (one tensor per :attr:`slots`)."""
        opt, dtype = self.inner, w.dtype
        lr = ops.cast(opt.learning_rate, dtype)
        if opt.weight_decay is not None:  # Keras' _apply_weight_decay (AdamW), before the step
            w = w - w * ops.cast(opt.weight_decay, dtype) * lr
        g = ops.cast(g, dtype)
        if self.l2:  # RingUpdate.update_step
            g = ops.add(g, ops.multiply(ops.cast(self.l2, dtype), w))
        return getattr(self, self.kind)(opt, w, g, lr, state)

    @staticmethod
    def sgd(opt, w, g, lr, state):
        if not state:
            return ops.subtract(w, ops.multiply(g, lr)), []
        momentum = ops.cast(opt.momentum, w.dtype)
        m = ops.subtract(ops.multiply(state[0], momentum), ops.multiply(g, lr))
        return ops.add(w, m), [m]

    @staticmethod
    def adam(opt, w, g, lr, state):
        local_step = ops.cast(opt.iterations + 1, w.dtype)
        beta_1_power = ops.power(ops.cast(opt.beta_1, w.dtype), local_step)
        beta_2_power = ops.power(ops.cast(opt.beta_2, w.dtype), local_step)
        alpha = lr * ops.sqrt(1 - beta_2_power) / (1 - beta_1_power)
        m = ops.add(state[0], ops.multiply(ops.subtract(g, state[0]), 1 - opt.beta_1))
        v = ops.add(state[1], ops.multiply(ops.subtract(ops.square(g), state[1]), 1 - opt.beta_2))
        step = ops.divide(ops.multiply(m, alpha), ops.add(ops.sqrt(v), opt.epsilon))
        return ops.subtract(w, step), [m, v]

    @staticmethod
    def rmsprop(opt, w, g, lr, state):
        rho, rest = opt.rho, list(state[1:])
        velocity = ops.add(ops.multiply(rho, state[0]), ops.multiply(1 - rho, ops.square(g)))
        new = [velocity]
        momentum = rest.pop(0) if opt.momentum > 0 else None
        if opt.centered:
            average = ops.add(ops.multiply(rho, rest[0]), ops.multiply(1 - rho, g))
            denominator = velocity - ops.square(average) + opt.epsilon
        else:
            denominator = ops.add(velocity, opt.epsilon)
        increment = ops.divide(ops.multiply(lr, g), ops.sqrt(denominator))
        if momentum is not None:
            momentum = ops.add(ops.multiply(opt.momentum, momentum), increment)
            new.append(momentum)
            w = ops.subtract(w, momentum)
        else:
            w = ops.subtract(w, increment)
        if opt.centered:
            new.append(average)
        return w, new


class ShardedOptimizer(keras.optimizers.Optimizer):
    """``inner`` (the chosen ``--optimizer``, built by :func:`tf_models.optimizers.build`) over
    this rank's slice of the model's flat weights, as the optimizer ``model.fit`` compiles with.
    ``hvd``: ``horovod.tensorflow`` (or a stand-in with its collectives); ``clip``:
    ``--clip-grad-norm``; ``compression``/``predivide``: ``--fp16-allreduce`` and
    ``--gradient-predivide-factor``; ``micro_steps``: ``--backward-passes-per-step``."""

    def __init__(self, inner: keras.optimizers.Optimizer, hvd, *, clip: float | None = None,
                 compression=None, predivide: float = 1.0, micro_steps: int = 1,
                 name: str = "sharded") -> None:
        super().__init__(learning_rate=0.0, name=name)
        self.inner, self.hvd, self.clip = inner, hvd, clip
        self.inner.global_clipnorm = None  # the clip is the global one, applied here
        self.world, self.rank = hvd.size(), hvd.rank()
        self.compression, self.micro_steps = compression, int(micro_steps)
        # Horovod's own split of an average around a predivide factor (its DistributedOptimizer)
        self.scale = ({"prescale_factor": 1.0 / predivide, "postscale_factor": predivide}
                      if predivide != 1.0 else {})
        self.pending: list | None = None  # rank 0's restored whole state, until scatter_state

    # --- what Keras and the trainer read ---------------------------------------------------------

    def build(self, var_list) -> None:
        if self.built:
            return
        var_list = list(var_list)
        dtypes = {keras.backend.standardize_dtype(v.dtype) for v in var_list}
        if len(dtypes) != 1:  # (every rank builds the same model: every rank says it)
            raise UserError(f"--shard-optimizer needs the model's trainable weights in one type, "
                            f"this model's are {', '.join(sorted(dtypes))} (one flat slice of "
                            f"them is updated); drop --shard-optimizer or give the weights one "
                            f"type")
        self.dtype_ = dtypes.pop()
        self.shapes = [tuple(int(d) for d in v.shape) for v in var_list]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = list(np.cumsum([0, *self.numels[:-1]]).tolist())
        self.numel = sum(self.numels)
        self.padded, self.shard_len = layout(self.numel, self.world)
        self.lo = self.rank * self.shard_len
        # This rank's state: S elements per slot (1/R of the unsharded state); the inner optimizer
        # keeps its scalars (step count, learning rate) and no slots: it is built over nothing.
        self.rule = SliceRule(self.inner)
        self.slots = [keras.Variable(np.zeros(self.shard_len, self.dtype_), name=name,
                                     trainable=False) for name in self.rule.slots]
        self.accumulators = [] if self.micro_steps == 1 else [
            keras.Variable(np.zeros(s, self.dtype_), name=f"accumulator_{i}", trainable=False)
            for i, s in enumerate(self.shapes)]
        self.inner.build([])
        self.layout = state_layout(self.inner, len(var_list))
        super().build(var_list)

    @property
    def variables(self) -> list:
        """This rank's state: the inner optimizer's scalars (step count, learning rate), then its
        slots of S elements."""
        return [*self.inner.variables, *self.slots]

    @property
    def learning_rate(self):
        return self.inner.learning_rate

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        self.inner.learning_rate = value

    @property
    def iterations(self):
        return self.inner.iterations

    def get_config(self) -> dict:
        return {"name": self.name, "inner": keras.saving.serialize_keras_object(self.inner)}

    # --- the flat view ---------------------------------------------------------------------------

    def _chunks(self):
        count = max(1, self.shard_len // CHUNK)
        size, more = divmod(self.shard_len, count)
        start = 0
        for c in range(count):
            n = size + (c < more)
            yield start, n
            start += n

    def _segments(self, a: int, b: int):
        """The flat range ``[a, b)`` as ``(variable index, lo, hi)`` within each variable it
        covers, and ``(None, lo, hi)`` for the padding."""
        out = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels, strict=True)):
            lo, hi = max(a, off), min(b, off + n)
            if lo < hi:
                out.append((i, lo - off, hi - off))
        if b > self.numel:
            out.append((None, max(a, self.numel), b))
        return out

    def _read(self, tensors, a: int, b: int) -> tf.Tensor:
        """Elements ``[a, b)`` of the flat concatenation of ``tensors`` (padded with zeros)."""
        parts = []
        for i, lo, hi in self._segments(a, b):
            if i is None:
                parts.append(tf.zeros(hi - lo, self.dtype_))
            else:
                parts.append(tf.reshape(tf.cast(tensors[i], self.dtype_), [-1])[lo:hi])
        return parts[0] if len(parts) == 1 else tf.concat(parts, 0)

    def _write(self, variables, values: tf.Tensor, a: int, n: int) -> list:
        """Assign the ``n`` ``values`` to elements ``[a, a + n)`` of the flat model (padding
        skipped)."""
        ops, at = [], 0
        for i, lo, hi in self._segments(a, a + n):
            if i is not None:
                handle, full, pos = _tf_var(variables[i]).handle, self.shapes[i], at
                for index, shape in flat_pieces(full, lo, hi):
                    count, k = math.prod(shape), len(index) - 1
                    # the box: index's ints, its slice, then every element of the dims after
                    begin = [*index[:k], index[k].start, *([0] * (len(full) - k - 1))]
                    end = [*(j + 1 for j in index[:k]), index[k].stop, *full[k + 1:]]
                    value = tf.reshape(values[pos:pos + count], [*([1] * k), *shape])
                    ops.append(tf.raw_ops.ResourceStridedSliceAssign(
                        ref=handle, begin=begin, end=end, strides=[1] * len(full), value=value))
                    pos += count
            at += hi - lo
        return ops

    # --- the step --------------------------------------------------------------------------------

    def apply(self, grads, trainable_variables=None) -> None:
        if not self.built:
            self.build(list(trainable_variables))
        variables = self._trainable_variables  # in fit's order, those it was built with
        # (a variable with no gradient: zeros through the collectives, its update undone)
        missing = [g is None for g in grads]
        grads = [tf.zeros(s, self.dtype_) if g is None else tf.convert_to_tensor(g)
                 for g, s in zip(grads, self.shapes, strict=True)]
        if self.micro_steps == 1:
            self._step(grads, variables, missing)
            return
        # K micro-batch steps: sum locally, update on the K-th (every call counted, as unsharded)
        for acc, g in zip(self.accumulators, grads, strict=True):
            acc.assign_add(tf.cast(g, self.dtype_))
        steps = self.inner._iterations

        def update():
            self._step([tf.convert_to_tensor(a) for a in self.accumulators], variables, missing)
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))

        def count():
            steps.assign_add(1)

        tf.cond(tf.equal((steps + 1) % self.micro_steps, 0), update, count)

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars, strict=True)
        self.apply(list(grads), list(variables))
        return self.inner._iterations

    def _kept(self, missing: list[bool], a: int, b: int) -> np.ndarray | None:
        """Which of the flat elements ``[a, b)`` belong to a variable with no gradient (kept as
        they are), or None when none does."""
        if not any(missing):
            return None
        mask = np.zeros(b - a, bool)
        for i, lo, hi in self._segments(a, b):
            if i is not None and missing[i]:
                mask[self.offsets[i] + lo - a:self.offsets[i] + hi - a] = True
        return mask if mask.any() else None

    def _step(self, grads, variables, missing) -> None:
        """Reduce-scatter the averaged gradient, clip its global norm, update this rank's slice
        chunk by chunk (:class:`SliceRule`, from the model's own weights) and allgather the new
        slices into every rank's model variables.  Without a clip each chunk is updated as soon
        as it is reduce-scattered; the clip's norm needs every chunk first (the slice whole)."""
        hvd, S, R = self.hvd, self.shard_len, self.world
        extra = {} if self.compression is None else {"compression": self.compression}

        def scatter(start: int, n: int) -> tf.Tensor:
            # Each rank's piece [start, start+n) of its slice, in rank order: rank r gets the
            # average of piece r.
            pieces = tf.concat([self._read(grads, r * S + start, r * S + start + n)
                                for r in range(R)], 0) if R > 1 else \
                self._read(grads, start, start + n)
            return tf.ensure_shape(hvd.reducescatter(  # (Horovod's output shape is unknown)
                pieces, name=f"shard.grad.{start}", op=hvd.Average, **extra, **self.scale), [n])

        after: list = []
        if self.clip is None:
            for start, n in self._chunks():
                with tf.control_dependencies(after):  # one chunk's transients at a time
                    after = self._update(variables, scatter(start, n), start, n, missing)
        else:
            outs = []
            for start, n in self._chunks():
                with tf.control_dependencies(after):
                    outs.append(scatter(start, n))
                after = [outs[-1]]
            # Keras' clip_by_global_norm, the norm from every slice's squared sum (in the
            # gradient's type, as Keras sums: a float64 copy of the slice would cost 2 x its size)
            local = tf.add_n([tf.reduce_sum(tf.square(out)) for out in outs])
            sq = hvd.allreduce(tf.cast(local, tf.float64), name="shard.grad_norm", op=hvd.Sum)
            norm = tf.cast(tf.sqrt(sq), outs[0].dtype)
            scale = self.clip * tf.minimum(1.0 / norm, 1.0 / self.clip) + (norm - norm)
            after = []
            for (start, n), out in zip(self._chunks(), outs, strict=True):
                with tf.control_dependencies(after):
                    after = self._update(variables, out * scale, start, n, missing)
        with tf.control_dependencies(after):
            self.inner._iterations.assign_add(1)
            for var in variables:  # as Keras' apply, after the update
                if getattr(var, "constraint", None) is not None:
                    var.assign(var.constraint(var))

    def _update(self, variables, g: tf.Tensor, start: int, n: int, missing) -> list:
        """The chunk ``[start, start + n)`` of this rank's slice: its averaged gradient ``g``
        into the rule with the chunk's weights and state, the state written in place, the new
        weights allgathered and written into every rank's variables; returns the writes."""
        R, S, a = self.world, self.shard_len, self.lo + start
        w = self._read(variables, a, a + n)
        state = [tf.convert_to_tensor(slot)[start:start + n] for slot in self.slots]
        new_w, new_state = self.rule(w, g, state)
        kept = self._kept(missing, a, a + n)
        if kept is not None:  # Keras' apply skips a variable with no gradient
            new_w = tf.where(kept, w, new_w)
            new_state = [tf.where(kept, old, new) for old, new in zip(state, new_state, strict=True)]
        writes = [self._assign_slice(slot, value, start)
                  for slot, value in zip(self.slots, new_state, strict=True)]
        with tf.control_dependencies(writes):
            gathered = tf.ensure_shape(self.hvd.allgather(new_w, name=f"shard.weights.{start}"),
                                       [R * n])
        out = []
        for r in range(R):
            out += self._write(variables, gathered[r * n:(r + 1) * n], r * S + start, n)
        return out

    @staticmethod
    def _assign_slice(var, value: tf.Tensor, start: int):
        """``var[start:start + len(value)] = value`` in place."""
        n = int(value.shape[0])
        return tf.raw_ops.ResourceStridedSliceAssign(
            ref=_tf_var(var).handle, begin=[start], end=[start + n], strides=[1], value=value)

    # --- checkpoints: the whole state, in the unsharded optimizer's format -----------------------

    def _slots(self) -> tuple[list, list]:
        """The inner optimizer's scalar variables and this rank's slot variables (of S), in
        order."""
        return list(self.inner.variables), list(self.slots)

    def gathered_state(self) -> list[np.ndarray]:
        """The whole optimizer state as the unsharded optimizer's ``variables`` would hold it (a
        collective: every rank calls it, every rank gets it)."""
        scalars, slots = self._slots()
        wholes = []
        for k, slot in enumerate(slots):
            parts = [self.hvd.allgather(tf.convert_to_tensor(slot)[start:start + n],
                                        name=f"shard.state.{k}.{start}").numpy().reshape(self.world, n)
                     for start, n in self._chunks()]
            wholes.append(np.concatenate(parts, axis=1).reshape(-1)[:self.numel])
        out = []
        for entry in self.layout:
            if entry[0] == "scalar":
                out.append(np.asarray(scalars[entry[1]].numpy()))
            else:
                i, k = entry[1], entry[2]
                off = self.offsets[i]
                out.append(wholes[k][off:off + self.numels[i]].reshape(self.shapes[i]))
        return out

    def state_shapes(self) -> list[tuple]:
        """The shapes of :meth:`gathered_state`'s arrays (a checkpoint's, checked on load)."""
        scalars, _ = self._slots()
        return [tuple(scalars[e[1]].shape) if e[0] == "scalar" else self.shapes[e[1]]
                for e in self.layout]

    def load_state(self, arrays: list[np.ndarray]) -> None:
        """Rank 0 (which alone reads the checkpoint): keep the whole state, in
        :meth:`gathered_state`'s order, for :meth:`scatter_state`."""
        self.pending = list(arrays)

    def _plain_comm(self) -> Collectives:
        """The broadcast of NumPy arrays that :func:`broadcast_plain` sends its JSON in, from
        this optimizer's Horovod (a fake in the tests)."""
        hvd = self.hvd

        def broadcast(array: np.ndarray, name: str) -> np.ndarray:
            return np.asarray(hvd.broadcast(tf.constant(array), root_rank=0, name=name))

        return Collectives(sum=None, broadcast=broadcast, allgather=None)

    def scatter_state(self) -> None:
        """On every rank, after the weights' broadcast: rank 0's restored state (if any), each
        rank keeping its slice; every rank keeps its fresh state when nothing was restored."""
        hvd, whole = self.hvd, self.pending
        self.pending = None
        scalars, slots = self._slots()
        values = None if whole is None else [
            None if whole[j] is None else np.asarray(whole[j]).tolist()
            for j, e in enumerate(self.layout) if e[0] == "scalar"]
        # Plain data (ringtrain.training.wire's JSON through Horovod's broadcast), never a pickle:
        # None where rank 0 restored nothing.
        values = broadcast_plain(self._plain_comm(), self.rank == 0, values, "shard.state.scalars")
        if values is None:
            return
        for var, value in zip(scalars, values, strict=True):
            if value is not None:  # None: a learning rate the file did not hold
                var.assign(value)
        for k, slot in enumerate(slots):
            flat = None
            if whole is not None:
                flat = np.zeros(self.padded, self.dtype_)
                for j, e in enumerate(self.layout):
                    if e[0] == "slot" and e[2] == k:
                        off = self.offsets[e[1]]
                        flat[off:off + self.numels[e[1]]] = np.asarray(whole[j]).reshape(-1)
            mine = np.zeros(self.shard_len, self.dtype_)
            for r in range(self.world):
                for start, n in self._chunks():
                    lo = r * self.shard_len + start
                    piece = flat[lo:lo + n] if flat is not None else np.zeros(n, self.dtype_)
                    got = hvd.broadcast(tf.constant(piece), root_rank=0,
                                        name=f"shard.state.{k}.{r}.{start}")
                    if r == self.rank:
                        mine[start:start + n] = np.asarray(got)
            slot.assign(mine)
