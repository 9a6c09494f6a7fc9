"""The elastic pipeline's lockstep engine (ringtrain/strategies/pipeline/lockstep.py) on a fake
world: one thread per rank, the collectives met at a barrier, in one process, in a second.

A pipeline of linear stages in float64 (stage s: y = x W_s; the last stage's loss
sum(y * C) / rows) must give every stage the gradient one process computes for the whole
chain on the same rows, at S = 2 and 3, R = 1 and 2, with a spare rank, uneven micro-batches and
a replica with fewer micro-batches than another (an epoch's last step)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline import lockstep
from ringtrain.strategies.pipeline.engine import Boundary


class FakeWorld:
    """``size`` ranks as threads: each collective waits for all of them, checks they called the
    same one, and hands each its share."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=20)
        self.slots: list = [None] * size
        self.calls: list[str] = []

    def meet(self, rank: int, name: str, value, combine):
        self.slots[rank] = (name, value)
        self.barrier.wait()
        names = {n for n, _ in self.slots}
        assert len(names) == 1, names
        if rank == 0:
            self.calls.append(name)
        out = combine([v for _, v in self.slots])
        self.barrier.wait()
        return out


class FakeComm:
    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self.rank = world, rank

    def alltoall(self, data, splits, name):
        def combine(values):
            parts, got = [], []
            for buf, sp in values:
                start = sum(sp[:self.rank])
                parts.append(buf[start:start + sp[self.rank]])
                got.append(sp[self.rank])
            return np.concatenate(parts), got
        assert data.dtype == np.uint8 and data.ndim == 1 and sum(splits) == data.size
        return self.world.meet(self.rank, name, (data.copy(), list(splits)), combine)

    def allreduce_sum(self, array, name):
        return self.world.meet(self.rank, name, array.copy(), lambda vs: np.sum(vs, axis=0))

    def broadcast(self, array, root, name):
        return self.world.meet(self.rank, name, array.copy(), lambda vs: vs[root].copy())

    def allgather(self, array, name):
        return self.world.meet(self.rank, name, array.copy(), lambda vs: np.concatenate(vs))


def run_ranks(size: int, body):
    """``body(rank, comm)`` on every rank at once; their results in rank order."""
    world = FakeWorld(size)
    results, errors = [None] * size, []

    def go(rank):
        try:
            results[rank] = body(rank, FakeComm(world, rank))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)
            world.barrier.abort()

    threads = [threading.Thread(target=go, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results, world


DIMS = [5, 4, 3, 2]  # stage s maps DIMS[s] -> DIMS[s + 1]


class LinearStage:
    def __init__(self, w: np.ndarray, inputs, c, total: int) -> None:
        self.w, self.inputs, self.c, self.total = w, inputs, c, total
        self.grad = np.zeros_like(w)
        self.saved = {}

    def forward(self, m, x):
        x = self.inputs[m] if x is None else x
        self.saved[m] = x
        y = x @ self.w
        return y if self.c is None else None

    def backward(self, m, g):
        x = self.saved.pop(m)
        if g is None:  # the last stage: d(sum(y * C) / rows)/dy
            g = self.c[m] / self.total
        self.grad += x.T @ g
        return g @ self.w.T


def reference(weights, x, c):
    """One process: the whole chain's gradients of sum(y * C) / rows."""
    acts = [x]
    for w in weights:
        acts.append(acts[-1] @ w)
    g = c / len(x)
    grads = []
    for w, a in zip(reversed(weights), reversed(acts[:-1]), strict=True):
        grads.append(a.T @ g)
        g = g @ w.T
    return grads[::-1]


@pytest.mark.parametrize("stages,replicas,spares", [(2, 1, 0), (2, 2, 0), (3, 1, 1), (3, 2, 1)])
def test_lockstep_gpipe_gives_every_stage_one_process_gradient(stages, replicas, spares):
    rng = np.random.default_rng(0)
    weights = [rng.normal(size=(DIMS[s], DIMS[s + 1])) for s in range(stages)]
    cuts = [Boundary((DIMS[s + 1],), np.float64) for s in range(stages - 1)]
    # replica r's step: its rows cut into micro-batches (the last one short; replica 1 has fewer)
    rows = {0: [3, 3, 2], 1: [3, 1]}
    data = {r: (rng.normal(size=(sum(rows[r]), DIMS[0])),
                rng.normal(size=(sum(rows[r]), DIMS[stages]))) for r in range(replicas)}
    micro_max = max(len(rows[r]) for r in range(replicas))
    size = stages * replicas + spares

    def body(rank, comm):
        layout = lockstep.Layout(stages, size, rank)
        if layout.spare:
            lockstep.train_step(layout, comm, None, [], micro_max, None, None)
            return layout, None
        s, r = layout.stage, layout.replica
        x, c = data[r]
        cut = np.cumsum([0, *rows[r]])
        split = [x[cut[i]:cut[i + 1]] for i in range(len(rows[r]))]
        work = LinearStage(weights[s], split if layout.first else None,
                           [c[cut[i]:cut[i + 1]] for i in range(len(rows[r]))]
                           if layout.last else None, sum(rows[r]))
        lockstep.train_step(layout, comm, work, rows[r], micro_max,
                            cuts[s - 1] if s > 0 else None, cuts[s] if s < stages - 1 else None)
        return layout, work.grad

    results, world = run_ranks(size, body)
    assert len(world.calls) == 2 * lockstep.ticks(stages, micro_max)  # one alltoall per tick
    for layout, grad in results:
        if layout.spare:
            assert grad is None
            continue
        want = reference(weights, *data[layout.replica])[layout.stage]
        np.testing.assert_allclose(grad, want, rtol=1e-12, atol=1e-14)


def test_average_stage_means_each_stage_over_its_replicas():
    stages, size, sizes = 2, 5, [3, 2]  # R = 2, one spare

    def body(rank, comm):
        layout = lockstep.Layout(stages, size, rank)
        mine = None if layout.spare else np.full(sizes[layout.stage], float(rank))
        return lockstep.average_stage(comm, layout, sizes, mine, "grads")

    results, _ = run_ranks(size, body)
    np.testing.assert_array_equal(results[0], [1.0] * 3)  # ranks 0 and 2
    np.testing.assert_array_equal(results[1], [2.0] * 2)  # ranks 1 and 3
    assert results[4] is None


def test_a_wrong_length_is_one_error_naming_the_ranks():
    def body(rank, comm):
        out = {1: np.zeros(3)} if rank == 0 else {}
        expected = {0: ((2,), np.float64)} if rank == 1 else {}
        return lockstep.exchange(comm, 2, out, expected, "probe")

    with pytest.raises(lockstep.LockstepError, match=r"probe: received \[24, 0\] bytes per rank, "
                                                     r"expected \[16, 0\]"):
        run_ranks(2, body)


def test_layout_rule_and_spares():
    layout = [lockstep.Layout(2, 5, r) for r in range(5)]
    assert [(p.stage, p.replica) for p in layout] == [(0, 0), (1, 0), (0, 1), (1, 1), (None, None)]
    assert layout[4].spare and layout[2].next == 3 and layout[3].previous == 2
    assert layout[4].previous is None and layout[4].next is None
    with pytest.raises(UserError, match="fewer than its --pipeline-stages 2"):
        lockstep.check_world(2, 1)


def test_sources_take_each_stage_from_its_lowest_holder_at_the_newest_commit():
    # rank 1 was replica 0's stage 1, rank 0 stage 0, rank 3 a newcomer (commit 0)
    assert lockstep.sources([(0, 4), (1, 4), (0, 4), (None, 0)], 2) == (0, [0, 1])
    # the first world's old rank 0 died: its stage 0 comes from the old replica 1's copy
    assert lockstep.sources([(1, 4), (0, 4)], 2) == (0, [1, 0])
    assert lockstep.sources([(None, 0)] * 3, 2) == (0, [0, 0])  # before any commit: all the same
    with pytest.raises(UserError, match="lost every replica of stage 1"):
        lockstep.sources([(0, 4), (0, 4), (None, 0)], 2)


def test_broadcast_plain_and_reports_travel_from_any_root():
    def body(rank, comm):
        value = lockstep.broadcast_plain(comm, 2, rank, {"rank": rank, "x": [1.5]}, "state")
        return value, lockstep.gather_reports(comm, (None if rank == 1 else rank, 10 + rank))

    results, _ = run_ranks(3, body)
    for value, reports in results:
        assert value == {"rank": 2, "x": [1.5]}
        assert reports == [(0, 10), (None, 11), (2, 12)]
