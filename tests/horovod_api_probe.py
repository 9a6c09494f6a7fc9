"""Exercise Horovod's own API (the patched horovod 0.28.1) in ONE launched job, for
tests/test_horovod_api.py.

    horovodrun -np 2 python tests/horovod_api_probe.py tf OUT.json
    horovodrun -np 2 python tests/horovod_api_probe.py torch OUT.json

Launching a job and importing TensorFlow costs far more than the checks, so each framework's
checks run one after another in the same two processes.  Every check computes what it measured on
every rank (gathered where ranks must agree) and, where a closed form exists, what it should be;
rank 0 writes ``{check: {...}}`` to OUT.json and the tests compare.  A check that raises records
its error instead, so one broken piece does not hide the others.  Only one framework's Horovod
module is imported per process.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np


def tf_checks() -> dict:
    import horovod.tensorflow as hvd_tf
    import horovod.tensorflow.keras as hvd
    import keras
    import tensorflow as tf

    hvd.init()
    rank, size = hvd.rank(), hvd.size()

    def gathered(values) -> np.ndarray:
        """Every rank's flat float64 copy of ``values``, stacked: row r is rank r's."""
        flat = np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in values])
        return hvd_tf.allgather(tf.constant(flat[None])).numpy()

    def spread(values) -> float:
        """How far the ranks' copies of ``values`` are apart (0.0 = identical)."""
        rows = gathered(values)
        return float(np.abs(rows - rows[0]).max())

    def model(seed: int) -> keras.Model:
        keras.utils.set_random_seed(seed)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"),
                                 keras.layers.Dense(1)])

    data = np.random.default_rng(0)
    x_all = data.normal(size=(size, 32, 4)).astype("float32")  # rank r trains on x_all[r]
    y_all = data.normal(size=(size, 32, 1)).astype("float32")

    def fit_data_parallel(loss_scale: bool = False) -> dict:
        """Different data per rank, same initial weights, no broadcast: only the gradient
        average keeps the ranks together.  Plain SGD over equal batches: the result must equal one
        process training on both ranks' batches at once (batch 2 x 8).  With ``loss_scale``, the
        optimizer wrapped is a LossScaleOptimizer (power-of-two scales: exact)."""
        m = model(seed=1)
        sgd = keras.optimizers.SGD(0.1)
        m.compile(loss="mse", optimizer=hvd.DistributedOptimizer(
            keras.optimizers.LossScaleOptimizer(sgd) if loss_scale else sgd))
        m.fit(x_all[rank], y_all[rank], batch_size=8, epochs=2, shuffle=False, verbose=0)
        ref = model(seed=1)
        ref.compile(loss="mse", optimizer=keras.optimizers.SGD(0.1))
        # batch k of the big run = batch k of every rank
        x_big = x_all.reshape(size, 4, 8, 4).transpose(1, 0, 2, 3).reshape(-1, 4)
        y_big = y_all.reshape(size, 4, 8, 1).transpose(1, 0, 2, 3).reshape(-1, 1)
        ref.fit(x_big, y_big, batch_size=8 * size, epochs=2, shuffle=False, verbose=0)
        weights = [w.numpy() for w in m.weights]
        return {"spread": spread(weights),
                "vs_big_batch": max(float(np.abs(a - b.numpy()).max())
                                    for a, b in zip(weights, ref.weights, strict=True)),
                "moved": max(float(np.abs(a - b.numpy()).max())
                             for a, b in zip(weights, model(seed=1).weights, strict=True))}

    def fit_loss_scale_optimizer() -> dict:
        return fit_data_parallel(loss_scale=True)

    def apply_closed_forms() -> dict:
        """``apply_gradients`` on known per-rank gradients: Average, fp16 compression, Adasum,
        and backward_passes_per_step with and without average_aggregated_gradients (Keras 3
        counterparts of Horovod's Keras-2-only ``test_gradient_aggregation``)."""
        g = np.array([rank + 1.0, 1.0 - 3.0 * rank, 0.5], dtype=np.float32)  # rank-dependent
        rows = gathered([g])
        out = {}

        def run(steps: int, local: bool = False, **kwargs) -> tuple[list, list]:
            var = keras.Variable(np.zeros(3, np.float32))
            opt = hvd.DistributedOptimizer(keras.optimizers.SGD(1.0), **kwargs)
            if local:
                opt.register_local_var(var)

            @tf.function
            def step():
                opt.apply_gradients([(tf.constant(g), var)])

            values, iterations = [], []
            for _ in range(steps):
                step()
                values.append(var.numpy().tolist())
                iterations.append(int(opt.iterations.numpy()))
            return values, iterations

        mean = rows.mean(axis=0)
        out["average"] = {"got": run(1)[0][0], "want": (-mean).tolist()}
        # a local variable keeps this rank's gradient, divided by size (scale_local_gradients)
        out["local"] = {"got": run(1, local=True)[0][0], "want": (-g / size).tolist()}
        half = rows.astype(np.float16).astype(np.float64).mean(axis=0)
        out["fp16"] = {"got": run(1, compression=hvd.Compression.fp16)[0][0], "want": (-half).tolist()}
        a, b = rows[0], rows[-1]
        adasum = (1 - a @ b / (2 * a @ a)) * a + (1 - a @ b / (2 * b @ b)) * b  # np=2 closed form
        out["adasum"] = {"got": run(1, op=hvd.Adasum)[0][0], "want": (-adasum).tolist()}
        for averaged in (False, True):
            n, steps = 3, 7
            values, iterations = run(steps, backward_passes_per_step=n,
                                     average_aggregated_gradients=averaged)
            update = mean * (1 if averaged else n)  # summed over n passes, averaged over ranks
            want = [(-(k // n) * update).tolist() for k in range(1, steps + 1)]
            out[f"bpps_average_{averaged}"] = {"got": values, "want": want,
                                               "iterations": iterations}
        return out

    def sparse_gradients() -> dict:
        """An Embedding's gradient is sparse (IndexedSlices): allgathered, or made dense with
        sparse_as_dense, also with backward_passes_per_step (Horovod's Keras-2-only
        test_sparse_as_dense*); different data per rank, same start: ranks must stay identical."""
        out = {}
        ids = np.random.default_rng(rank).integers(0, 50, size=(16, 5))
        target = np.random.default_rng(10 + rank).normal(size=(16, 5, 4)).astype("float32")
        for name, kwargs in [("allgather", {}), ("as_dense", {"sparse_as_dense": True}),
                             ("as_dense_bpps2", {"sparse_as_dense": True, "backward_passes_per_step": 2})]:
            keras.utils.set_random_seed(7)
            m = keras.Sequential([keras.Input((5,), dtype="int32"), keras.layers.Embedding(50, 4)])
            m.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.5), **kwargs))
            start = m.weights[0].numpy()
            m.fit(ids, target, batch_size=8, epochs=2, shuffle=False, verbose=0)
            out[name] = {"spread": spread([m.weights[0].numpy()]),
                         "moved": float(np.abs(m.weights[0].numpy() - start).max())}
        return out

    def callbacks() -> dict:
        """The four callbacks in one fit: ranks start apart (different seeds) and train on
        different data; warm-up then schedule set the LR as documented; metrics agree."""
        m = model(seed=100 + rank)
        initial = 0.05 * size
        m.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(initial)))
        seen = []

        class Record(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                seen.append({"lr": float(logs["lr"]), "loss": float(logs["loss"])})

        history = m.fit(x_all[rank], y_all[rank], batch_size=8, epochs=4, shuffle=False, verbose=0,
                        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                                   hvd.callbacks.MetricAverageCallback(),
                                   hvd.callbacks.LearningRateWarmupCallback(initial, warmup_epochs=2),
                                   hvd.callbacks.LearningRateScheduleCallback(
                                       initial, multiplier=0.5, start_epoch=2, end_epoch=4),
                                   Record()])
        steps = 4
        warm = [initial / size * ((e + 1) * (size - 1) / 2 + 1) for e in range(2)]
        want_lr = [*warm, initial * 0.5 ** 0, initial * 0.5 ** 1]
        return {"spread": spread([w.numpy() for w in m.weights]), "lr": [s["lr"] for s in seen],
                "want_lr": want_lr, "steps": steps,
                "loss_spread": spread([history.history["loss"]])}

    def momentum_correction_refused() -> dict:
        m = model(seed=1)
        m.compile(loss="mse", optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)))
        before = [w.numpy() for w in m.weights]
        try:
            m.fit(x_all[rank], y_all[rank], batch_size=8, epochs=1, verbose=0,
                  callbacks=[hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1)])
        except ValueError as err:
            return {"error": str(err), "untouched": same(before, m.weights)}
        return {"error": None}

    def tapes() -> dict:
        """DistributedGradientTape averages; PartialDistributedGradientTape keeps the local
        layer's gradient (scaled by 1/size, Horovod's default) and averages the rest."""
        m = model(seed=1)
        x, y = tf.constant(x_all[rank]), tf.constant(y_all[rank])

        def grads(wrap):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((m(x) - y) ** 2)
            return [t.numpy() for t in wrap(tape).gradient(loss, m.trainable_variables)]

        local = grads(lambda t: t)
        full = grads(hvd_tf.DistributedGradientTape)
        partial = grads(lambda t: hvd_tf.PartialDistributedGradientTape(t, local_layers=[m.layers[0]]))
        mean = [gathered([g]).mean(axis=0).reshape(g.shape) for g in local]
        n_local = len(m.layers[0].trainable_variables)
        return {
            "full_vs_mean": max(float(np.abs(a - b).max()) for a, b in zip(full, mean, strict=True)),
            "partial_local_vs_own": max(float(np.abs(a - b / size).max())
                                        for a, b in zip(partial[:n_local], local[:n_local], strict=True)),
            "partial_global_vs_mean": max(float(np.abs(a - b).max())
                                          for a, b in zip(partial[n_local:], mean[n_local:], strict=True)),
            "local_differs": spread(local) > 0,
        }

    def broadcast_variables() -> dict:
        m = model(seed=200 + rank)
        opt = keras.optimizers.SGD(0.1, momentum=0.9)
        opt.build(m.trainable_variables)
        for slot in opt.variables:
            slot.assign(tf.fill(slot.shape, tf.cast(rank + 1, slot.dtype)))
        differed = spread([w.numpy() for w in m.weights]) > 0
        hvd_tf.broadcast_variables(m.weights, root_rank=0)
        hvd_tf.broadcast_variables(opt.variables, root_rank=0)
        return {"differed": differed, "spread": spread([v.numpy() for v in m.weights + opt.variables]),
                "optimizer_value": float(opt.variables[-1].numpy().ravel()[0])}

    def same(a, b) -> bool:
        return all(np.array_equal(x, y.numpy()) for x, y in zip(a, b, strict=True))

    def elastic_state() -> dict:
        """Keras 3 counterpart of Horovod's test_elastic_state: sync, restore, commit."""
        m = model(seed=300 + rank)
        opt = keras.optimizers.Adam(0.01)
        opt.build(m.trainable_variables)
        state = hvd.elastic.KerasState(m, opt, batch=20 + rank, epoch=10 + rank)
        state.sync()
        synced = [w.numpy() for w in m.weights]
        out = {"sync_spread": spread(synced), "sync_batch": state.batch, "sync_epoch": state.epoch}
        other = [w + 1.0 for w in synced]
        m.set_weights(other)
        state.batch = 21
        state.restore()
        out["restore_back"] = same(synced, m.weights)
        out["restore_batch"] = state.batch
        m.set_weights(other)
        state.batch = 22
        state.commit()
        state.restore()
        out["commit_kept"] = same(other, m.weights)
        out["commit_batch"] = state.batch
        return out

    def sync_batch_norm() -> dict:
        """Keras 3 counterpart of Horovod's test_horovod_syncbn_cpu: on its slice, each rank's
        SyncBatchNormalization equals a plain BatchNormalization over the whole batch."""
        xs = np.stack([np.array([[r, r + 1], [r * 2, r * 2 + 1], [r * 3, r * 3 + 1], [r * 4, r * 4 + 1]],
                                dtype=np.float32) for r in range(size)])
        bn = keras.layers.BatchNormalization(axis=1)
        sync_bn = hvd_tf.SyncBatchNormalization(axis=1)
        plain = bn(tf.constant(xs), training=True).numpy()
        mine = sync_bn(tf.constant(xs[rank:rank + 1]), training=True).numpy()
        return {"output": float(np.abs(mine - plain[rank:rank + 1]).max()),
                "moving_mean": float(np.abs(sync_bn.moving_mean.numpy() - bn.moving_mean.numpy()).max()),
                "moving_variance": float(np.abs(sync_bn.moving_variance.numpy()
                                                - bn.moving_variance.numpy()).max())}

    return run_all([fit_data_parallel, fit_loss_scale_optimizer, apply_closed_forms, sparse_gradients,
                    callbacks,
                    momentum_correction_refused, tapes, broadcast_variables, elastic_state,
                    sync_batch_norm]), rank


def torch_checks() -> dict:
    import horovod.torch as hvd
    import torch

    hvd.init()
    rank = hvd.rank()

    def zero_grad_set_to_none() -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))
        kinds = {}
        for set_to_none in (False, True):
            opt.zero_grad(set_to_none=set_to_none)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            kinds[str(set_to_none)] = ["none" if p.grad is None else float(p.grad.abs().max())
                                       for p in model.parameters()]
        flat = torch.cat([p.detach().ravel() for p in model.parameters()])
        rows = hvd.allgather(flat[None])
        return {"grads_after": kinds, "spread": float((rows - rows[0]).abs().max())}

    return run_all([zero_grad_set_to_none]), rank


def run_all(checks) -> dict:
    results = {}
    for check in checks:
        try:
            results[check.__name__] = check()
        except Exception as err:  # recorded; the test names it
            results[check.__name__] = {"error": f"{type(err).__name__}: {err}",
                                       "traceback": traceback.format_exc()[-2000:]}
    return results


if __name__ == "__main__":
    framework, out = sys.argv[1], sys.argv[2]
    results, rank = {"tf": tf_checks, "torch": torch_checks}[framework]()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
