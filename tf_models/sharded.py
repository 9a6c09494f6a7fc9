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
3. the chosen built-in optimizer (:func:`tf_models.optimizers.build`, ``RingUpdate`` and weight
   decay as unsharded) updates one flat variable of this rank's S weights, its state (momentum,
   velocity...) S elements per slot: 1/R of the unsharded state.  The built-in rules are
   element-wise, so the slice's update is the unsharded one's;
4. allgather the updated slices, in the same chunks, written back into every rank's model
   variables by rectangular slice assignments (:func:`flat_pieces`).

Collective names depend on the chunk's offset only, and every rank issues the same ones.  Each
chunk waits for the one before it (control dependencies), so that a traced step never holds more
than a chunk's transient buffers.  ``--backward-passes-per-step K``: the gradients are summed
locally over K calls (as Horovod's wrapper does) and the K-th call updates; the optimizer's
``iterations`` counts every call, as unsharded.

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

from ringtrain.training.world import Collectives, broadcast_plain

# The least elements per collective call and rank: a slice of S elements goes in S // CHUNK
# equal chunks (one if S < CHUNK), each of CHUNK to 2 x CHUNK elements, the transient buffer of a
# reduce-scatter or allgather (R times that for the reduce-scatter's input).  32 MiB of float32:
# glibc's largest mmap threshold, so each buffer is mapped and unmapped, not left in its heap
# (16 MiB chunks, as PyTorch's, kept a rank's resident memory 1.5 x the weights higher).
CHUNK = 1 << 23


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
        if len(dtypes) != 1:
            raise ValueError(f"--shard-optimizer needs trainable variables of one type, the model "
                             f"has {sorted(dtypes)}")
        self.dtype_ = dtypes.pop()
        self.shapes = [tuple(int(d) for d in v.shape) for v in var_list]
        self.numels = [math.prod(s) for s in self.shapes]
        self.offsets = list(np.cumsum([0, *self.numels[:-1]]).tolist())
        self.numel = sum(self.numels)
        self.padded, self.shard_len = layout(self.numel, self.world)
        self.lo = self.rank * self.shard_len
        # This rank's S weights, which the inner optimizer updates (its state: S per slot).
        self.shard = keras.Variable(np.zeros(self.shard_len, self.dtype_), name="shard",
                                    trainable=False)
        self.accumulators = [] if self.micro_steps == 1 else [
            keras.Variable(np.zeros(s, self.dtype_), name=f"accumulator_{i}", trainable=False)
            for i, s in enumerate(self.shapes)]
        self.inner.build([self.shard])
        self.layout = state_layout(self.inner, len(var_list))
        super().build(var_list)
        self.sync_shard()

    @property
    def variables(self) -> list:
        """This rank's state: the inner optimizer's (step count, learning rate, slots of S)."""
        return self.inner.variables

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
        grads = [tf.zeros(s, self.dtype_) if g is None else tf.convert_to_tensor(g)
                 for g, s in zip(grads, self.shapes, strict=True)]
        if self.micro_steps == 1:
            self._step(grads, variables)
            return
        # K micro-batch steps: sum locally, update on the K-th (every call counted, as unsharded)
        for acc, g in zip(self.accumulators, grads, strict=True):
            acc.assign_add(tf.cast(g, self.dtype_))
        steps = self.inner._iterations

        def update():
            self._step([tf.convert_to_tensor(a) for a in self.accumulators], variables)
            for acc in self.accumulators:
                acc.assign(tf.zeros_like(acc))

        def count():
            steps.assign_add(1)

        tf.cond(tf.equal((steps + 1) % self.micro_steps, 0), update, count)

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*grads_and_vars, strict=True)
        self.apply(list(grads), list(variables))
        return self.inner._iterations

    def _step(self, grads, variables) -> None:
        """Reduce-scatter the averaged gradient, clip its global norm, update this rank's slice,
        allgather the slices into every rank's model variables."""
        hvd, S, R = self.hvd, self.shard_len, self.world
        extra = {} if self.compression is None else {"compression": self.compression}
        outs, after = [], []
        for start, n in self._chunks():
            with tf.control_dependencies(after):  # one chunk's transients at a time
                # Each rank's piece [start, start+n) of its slice, in rank order: rank r gets the
                # average of piece r.
                pieces = tf.concat([self._read(grads, r * S + start, r * S + start + n)
                                    for r in range(R)], 0) if R > 1 else \
                    self._read(grads, start, start + n)
                out = tf.ensure_shape(hvd.reducescatter(  # (Horovod's output shape is unknown)
                    pieces, name=f"shard.grad.{start}", op=hvd.Average, **extra, **self.scale), [n])
            outs.append(out)
            after = [out]
        mine = outs[0] if len(outs) == 1 else tf.concat(outs, 0)
        if self.clip is not None:
            # Keras' clip_by_global_norm, the norm from every slice's squared sum (in the
            # gradient's type, as Keras sums: a float64 copy of the slice would cost 2 x its size)
            sq = hvd.allreduce(tf.cast(tf.reduce_sum(tf.square(mine)), tf.float64),
                               name="shard.grad_norm", op=hvd.Sum)
            norm = tf.cast(tf.sqrt(sq), mine.dtype)
            scale = self.clip * tf.minimum(1.0 / norm, 1.0 / self.clip) + (norm - norm)
            mine = mine * scale
        # self.shard holds this rank's weights: the last step wrote them from it (see sync_shard)
        self.inner.apply([mine], [self.shard])
        after = []
        for start, n in self._chunks():
            with tf.control_dependencies(after):
                gathered = tf.ensure_shape(hvd.allgather(
                    tf.convert_to_tensor(self.shard)[start:start + n], name=f"shard.weights.{start}"),
                    [R * n])
                after = []
                for r in range(R):
                    after += self._write(variables, gathered[r * n:(r + 1) * n], r * S + start, n)

    def sync_shard(self) -> None:
        """This rank's slice of the model's weights into the flat variable the inner optimizer
        updates: after anything but a step wrote the weights (built, restored, broadcast).  Each
        step then writes the weights from it, so no step reads them back."""
        variables = self._trainable_variables
        self.shard.assign(self._read([tf.convert_to_tensor(v) for v in variables], self.lo,
                                     self.lo + self.shard_len))

    # --- checkpoints: the whole state, in the unsharded optimizer's format -----------------------

    def _slots(self) -> tuple[list, list]:
        """The inner optimizer's scalar variables and its slot variables (of S), in order."""
        scalars, slots = [], []
        for var in self.inner.variables:
            (scalars if len(var.shape) == 0 else slots).append(var)
        return scalars, slots

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
        rank keeping its slice; every rank keeps its fresh state when nothing was restored.
        Then :meth:`sync_shard`: the weights were broadcast before."""
        self.sync_shard()
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
