"""The parameter servers' engine (``ringtrain/strategies/ps/engine.py``) on a fake transport: servers and
workers as threads of one process exchanging numpy arrays through in-process queues, a model in
NumPy.  No MPI, no framework: the whole file runs in seconds.

What is proven here for the engine, the multi-process tests prove for the real trainers
(tests/test_correctness.py, the ``ps`` group): staleness 0 is the ring's math (the mean gradient
of each step, one momentum update, summed in worker order) exactly; one worker at any staleness is
single-process SGD exactly; every pushed gradient is applied exactly once, also at staleness inf
with 3 workers in any interleaving (the final weights are the order-free sum of every update);
a server answers a pull only once the slowest worker is within K steps; the epoch's tail goes to
whoever is free, each batch trained once; a dead or frozen worker is gone on without at any
staleness (each batch still trained once, the LR following the workers left), a dropped worker
that comes back is told to leave and changes nothing, and where the launcher cannot outlive a rank
the job ends.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import random
import struct
import threading
import time
import zipfile
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from fake_run import Problem, loss_and_grad

from ringtrain.errors import UserError
from ringtrain.strategies.ps import engine as ps
from ringtrain.strategies.ps import snapshot

TIMEOUT = 30.0


# --- the fake transport ---------------------------------------------------------------------------

class Request:
    def __init__(self, peer: int, tag: int, buf: np.ndarray | None) -> None:
        self.peer, self.tag, self.buf = peer, tag, buf
        self.count: int | None = None if buf is not None else 0  # a send completes at once
        self.taken = False


class Net:
    """Every rank's mailboxes: one FIFO per (source, destination, tag), as MPI orders them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.queues: dict[tuple[int, int, int], deque] = defaultdict(deque)

    def link(self, rank: int) -> FakeLink:
        return FakeLink(self, rank)


class FakeLink:
    """:class:`ringtrain.strategies.ps.engine.Link` in one process: a send copies its buffer into the
    destination's queue; a receive takes the oldest message of its (source, tag) when waited on."""

    def __init__(self, net: Net, rank: int) -> None:
        self.net, self.rank = net, rank

    def isend(self, dest: int, tag: int, buf: np.ndarray) -> Request:
        with self.net.cond:
            self.net.queues[(self.rank, dest, tag)].append(np.array(buf, copy=True))
            self.net.cond.notify_all()
        return Request(dest, tag, None)

    def irecv(self, source: int, tag: int, buf: np.ndarray) -> Request:
        return Request(source, tag, buf)

    def _poll(self, req: Request) -> bool:
        if req.count is None:
            queue = self.net.queues[(req.peer, self.rank, req.tag)]
            if queue:
                msg = queue.popleft()
                assert len(msg) <= len(req.buf), "a message longer than its receive buffer"
                req.buf[:len(msg)] = msg
                req.count = len(msg)
        return req.count is not None

    def wait_any(self, requests, timeout: float):
        deadline = time.monotonic() + timeout
        with self.net.cond:
            while True:
                for i, req in enumerate(requests):
                    if req is not None and not req.taken and self._poll(req):
                        req.taken = True
                        return i, req.count
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.net.cond.wait(left)

    def wait(self, request, timeout: float):
        got = self.wait_any([request], timeout)
        return None if got is None else got[1]


# --- a job of threads ------------------------------------------------------------------------------

def batch_key(epoch: int, owner: int, t: int) -> tuple[int, int, int]:
    return epoch, owner, t


class Job:
    """P servers and N workers as threads running ``epochs`` epochs of ``steps`` batches per
    worker; a batch is its key (epoch, owner, t) and ``grad(weights, key)`` its gradient."""

    def __init__(self, servers: int, workers: int, staleness: int | None, *, size: int,
                 steps: int, epochs: int = 1, momentum: float = 0.0, rule: str = "torch",
                 lr: Callable[[int, int], float] = lambda epoch, t: 0.1,
                 grad: Callable[[np.ndarray, tuple], np.ndarray] | None = None,
                 w0: np.ndarray | None = None, delay: Callable[[int], None] = lambda w: None,
                 silent: Callable[[], dict[int, float]] = dict,
                 on_dead: Callable[[int, float], bool] = lambda rank, quiet: False,
                 dies: dict[int, int] | None = None, deadline: float = TIMEOUT,
                 live_lr: Callable[[int, int, int], float] | None = None,
                 snapshots: Path | None = None, every: int = 4, first_epoch: int = 1,
                 stop_at: int | None = None, v0: np.ndarray | None = None,
                 optimizer: str = "sgd", weight_decay: float = 0.0,
                 clip: float | None = None, state0: list | None = None) -> None:
        self.roles = ps.Roles(servers, servers + workers)
        self.cfg = ps.Config(self.roles, size, staleness, momentum, rule, steps, lr,
                             deadline=deadline, tick=0.02, live_lr=live_lr, optimizer=optimizer,
                             weight_decay=weight_decay, clip=clip)
        self.net = Net()
        self.epochs, self.grad, self.delay = epochs, grad, delay
        self.first_epoch = first_epoch
        self.w0 = np.zeros(size, np.float32) if w0 is None else w0.astype(np.float32)
        # snapshots: each server's Store in that folder (its update mark started), every N updates
        self.stores = [snapshot.Store(snapshots, layout(self.cfg, s), every)
                       for s in range(servers)] if snapshots is not None else [None] * servers
        # state0: each server's (optimizer state, step count) to start from (v0: SGD's velocity)
        self.servers = [ps.Server(self.cfg, self.net.link(s), s, self.w0[self.cfg.slice(s)],
                                  None if v0 is None else v0[self.cfg.slice(s)].copy(),
                                  state=None if state0 is None else state0[s][0],
                                  steps=0 if state0 is None else state0[s][1],
                                  silent=silent, on_dead=on_dead, store=self.stores[s])
                        for s in range(servers)]
        self.states: dict[tuple[int, int], tuple[dict, int]] = {}  # (server, epoch) -> its end's
        self.workers = [ps.Worker(self.cfg, self.net.link(self.roles.worker_rank(w)), w)
                        for w in range(workers)]
        self.trained: list[tuple] = []  # every batch a gradient was computed on
        self.trained_by: list[int] = []  # ... and by which worker
        self.lock = threading.Lock()
        self.dies = dies or {}  # worker -> its gradients before it dies (stops, silently)
        self.stop_at = stop_at  # every worker stops once the job has computed this many gradients
        self.ends: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = {}  # (rank, epoch)
        self.gone = {w: threading.Event() for w in range(workers)}
        self.verdicts: dict[int, list[int]] = {}
        self.full: dict[int, np.ndarray] = {}
        self.errors: dict[int, BaseException] = {}

    def _serve(self, s: int) -> None:
        server = self.servers[s]
        for epoch in range(self.first_epoch, self.epochs + 1):
            server.serve_epoch(epoch)
            self.verdicts[s] = server.verdict()
            full = np.empty(self.cfg.size, np.float32)
            server.exchange(full, None)
            self.full[s] = full
            v = server.velocity
            self.ends[(s, epoch)] = (full.copy(), None if v is None else v.copy())
            self.states[(s, epoch)] = ({k: a.copy() for k, a in server.opt.state().items()},
                                       server.opt.steps)

    def _work(self, w: int) -> None:
        worker, rank = self.workers[w], self.roles.worker_rank(w)

        class Died(Exception):
            pass

        def gradient(key: tuple) -> tuple[np.ndarray, float]:
            if w in self.dies and worker.books.pushed >= self.dies[w]:
                raise Died
            self.delay(w)
            with self.lock:
                if self.stop_at is not None and len(self.trained) >= self.stop_at:
                    raise Died
                self.trained.append(key)
                self.trained_by.append(w)
            return self.grad(self.weights, key).astype(np.float32), 0.5

        try:
            for epoch in range(self.first_epoch, self.epochs + 1):
                own = (batch_key(epoch, w, t) for t in range(self.cfg.steps))
                worker.work_epoch(epoch, own, lambda o, t, e=epoch: batch_key(e, o, t),
                                  lambda weights: setattr(self, "weights", weights.copy()),
                                  gradient)
                self.verdicts[rank] = worker.verdict()
                self.full[rank] = worker.weights.copy()
        except Died:
            self.gone[w].set()

    def run(self) -> Job:
        for store in self.stores:
            if store is not None:
                store.start()
        threads = {}
        for s in range(self.roles.servers):
            threads[s] = threading.Thread(target=self._guard, args=(s, self._serve, s), daemon=True)
        for w in range(self.roles.workers):
            rank = self.roles.worker_rank(w)
            threads[rank] = threading.Thread(target=self._guard, args=(rank, self._work, w), daemon=True)
        for t in threads.values():
            t.start()
        for t in threads.values():
            t.join(TIMEOUT * 2)
        assert not any(t.is_alive() for t in threads.values()), "a rank is still running: it hangs"
        return self

    def _guard(self, rank: int, fn, arg) -> None:
        try:
            fn(arg)
        except BaseException as err:  # handed to the test
            self.errors[rank] = err

    def check(self) -> Job:
        if self.errors:
            raise next(iter(self.errors.values()))
        return self


def softmax_grad(problem: Problem, rows: int, workers: int):
    """The gradient of softmax regression (tests/fake_run.py) on batch t of a worker's strided
    shard, in float32 weights (the flat vector is the [features + 1, classes] matrix)."""
    shape = (problem.features + 1, problem.classes)

    def grad(weights: np.ndarray, key: tuple) -> np.ndarray:
        epoch, owner, t = key
        idx = np.arange(owner, len(problem.train_y), workers)[t * rows:(t + 1) * rows]
        _, g = loss_and_grad(weights.reshape(shape).astype(np.float64), problem.train_x[idx],
                             problem.train_y[idx])
        return g.reshape(-1).astype(np.float32)

    return grad


# --- the math ---------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["torch", "keras"])
@pytest.mark.parametrize("servers", [1, 2])
def test_staleness_0_is_the_rings_math(rule, servers):
    """K = 0, 3 workers: each step's gradients averaged in worker order, one momentum update at
    the step's LR: bit for bit what one process computes from the same mean gradients (the
    ring's definition), whatever the slicing over servers."""
    problem, workers, rows, steps = Problem(n_train=96), 3, 4, 8
    grad = softmax_grad(problem, rows, workers)
    lr = lambda epoch, t: 0.05 + 0.01 * t  # noqa: E731  (a schedule: the update must use step t's)
    size = (problem.features + 1) * problem.classes
    w0 = np.random.default_rng(1).normal(0, 0.1, size).astype(np.float32)
    job = Job(servers, workers, 0, size=size, steps=steps, epochs=2, momentum=0.9, rule=rule,
              lr=lr, grad=grad, w0=w0).run().check()
    want = w0.copy()
    opt = ps.SliceSGD(want, 0.9, rule)
    for epoch in (1, 2):
        for t in range(steps):
            grads = [grad(want, (epoch, w, t)) for w in range(workers)]
            mean = grads[0].copy()
            for g in grads[1:]:
                mean += g
            mean /= np.float32(workers)
            opt.apply(mean, lr(epoch, t))
    for full in job.full.values():
        assert np.array_equal(full, want)  # every rank ends with the servers' weights
    assert not np.allclose(want, w0)
    histogram = job.servers[0].books.staleness
    assert set(histogram) == {0} and histogram[0] == 2 * steps * workers


@pytest.mark.parametrize("staleness", [0, 1, 4, None])
def test_one_worker_at_any_staleness_is_single_process_sgd(staleness):
    problem, rows, steps = Problem(n_train=64), 8, 8
    grad = softmax_grad(problem, rows, 1)
    size = (problem.features + 1) * problem.classes
    w0 = np.random.default_rng(2).normal(0, 0.1, size).astype(np.float32)
    job = Job(2, 1, staleness, size=size, steps=steps, epochs=2, momentum=0.9, grad=grad,
              w0=w0).run().check()
    want = w0.copy()
    opt = ps.SliceSGD(want, 0.9, "torch")
    for epoch in (1, 2):
        for t in range(steps):
            opt.apply(grad(want, (epoch, 0, t)), 0.1)
    assert np.array_equal(job.full[2], want)
    assert set(job.servers[0].books.staleness) == {0}  # nobody else moves the weights


def test_every_gradient_is_applied_exactly_once_at_staleness_inf():
    """3 workers, random delays, staleness inf: the counters agree (pushed = received = applied
    at every server), every batch of every epoch was trained once, and the weights are exactly
    w0 - LR/N x the sum of all gradients (gradients independent of the weights, momentum 0,
    LR/N = 1/16 and integer gradients: every update exact in float32, so any lost or repeated
    one would show)."""
    workers, steps, epochs, size = 3, 12, 2, 10
    rng = random.Random(0)

    def grad(weights: np.ndarray, key: tuple) -> np.ndarray:
        epoch, owner, t = key
        return np.arange(size, dtype=np.float32) % 7 + 100 * epoch + 10 * owner + t

    job = Job(2, workers, None, size=size, steps=steps, epochs=epochs, lr=lambda e, t: 3 / 16,
              grad=grad, delay=lambda w: time.sleep(rng.random() * 0.003)).run().check()
    everything = [(e, o, t) for e in range(1, epochs + 1) for o in range(workers) for t in range(steps)]
    assert sorted(job.trained) == everything
    pushed = [w.books.pushed for w in job.workers]
    assert sum(pushed) == len(everything)
    for server in job.servers:
        assert server.books.applied == server.books.received == pushed
    want = np.zeros(size, np.float32)
    for key in everything:
        want -= grad(want, key) / np.float32(16)
    for full in job.full.values():
        assert np.array_equal(full, want)


@pytest.mark.parametrize("staleness", [1, 2])
def test_no_gradient_is_more_than_the_bound_behind(staleness):
    """Between a worker's pull at clock c (the slowest at >= c - K) and its next push, each other
    worker can go from c - K to c + K + 1: at most (2K + 1)(N - 1) updates land in between,
    whatever the interleaving (random delays, one worker 5x slower)."""
    workers, rng = 3, random.Random(staleness)

    def delay(w: int) -> None:
        time.sleep(rng.random() * 0.002 * (5 if w == 2 else 1))

    job = Job(1, workers, staleness, size=4, steps=30, grad=lambda w, k: np.ones(4),
              delay=delay).run().check()
    histogram = job.servers[0].books.staleness
    assert sum(histogram.values()) == workers * 30
    assert max(histogram) <= (2 * staleness + 1) * (workers - 1), sorted(histogram.items())


def test_a_free_worker_takes_the_epochs_tail_from_a_blocked_one():
    """Worker 2 is stuck on its first batch until the others have trained their own: at
    staleness inf they go on and take its 7 remaining batches; each batch is trained once."""
    workers, steps = 3, 8
    holds_its_first, released = threading.Event(), threading.Event()
    seen: defaultdict[int, int] = defaultdict(int)

    def delay(w: int) -> None:
        seen[w] += 1
        if w == 2:
            holds_its_first.set()
            released.wait(TIMEOUT)
            return
        # the others start once worker 2 holds its first batch: else its first pull may reach
        # the server after they have taken all of its batches (a race the test would lose)
        holds_its_first.wait(TIMEOUT)
        if seen[0] + seen[1] >= 2 * steps + (steps - 1):
            released.set()

    job = Job(1, workers, None, size=6, steps=steps, grad=lambda w, k: np.ones(6), delay=delay)
    job.run().check()
    assert sorted(job.trained) == [(1, o, t) for o in range(workers) for t in range(steps)]
    assert [(w.books.own, w.books.taken) for w in job.workers][2] == (1, 0)
    by = dict(zip(job.trained, job.trained_by, strict=True))
    assert {by[(1, 2, t)] for t in range(1, steps)} <= {0, 1}  # its tail went to the free ones
    # ... and, where one of them was scheduled late enough (a loaded machine), some of the other's
    # too: the books count every batch handed to another worker
    taken = sum(w.books.taken for w in job.workers)
    assert taken >= steps - 1 and job.servers[0].books.stolen == taken


# --- the staleness bound, message by message --------------------------------------------------------

def deliver(server: ps.Server, w: int, kind: int, clock: int = 0, t: int = 0, version: int = 0) -> None:
    """Worker ``w``'s message arrives at ``server`` (written into its receive buffer)."""
    buf = server.inbox[w]
    h = ps.header(buf)
    h[ps.KIND], h[ps.EPOCH], h[ps.CLOCK], h[ps.OWNER], h[ps.T], h[ps.VERSION] = \
        kind, server.epoch, clock, w, t, version
    buf[ps.HEADER:] = 1.0
    server.handle(w, len(buf) if kind == ps.PUSH else ps.HEADER)


def replied(net: Net, server: ps.Server) -> list[int]:
    """The workers the server has answered since the last call, in order."""
    roles, out = server.cfg.roles, []
    for w in range(roles.workers):
        queue = net.queues[(server.index, roles.worker_rank(w), ps.TAG_DOWN)]
        out += [w] * len(queue)
        queue.clear()
    return out


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_pull_is_answered_once_the_slowest_is_within_k_steps(staleness):
    net = Net()
    cfg = ps.Config(ps.Roles(1, 3), 4, staleness, 0.0, "torch", 10, lambda e, t: 0.1)
    server = ps.Server(cfg, net.link(0), 0, np.zeros(4, np.float32))
    server.begin_epoch(1)
    deliver(server, 0, ps.PULL)
    deliver(server, 1, ps.PULL)
    assert replied(net, server) == [0, 1]
    for clock in range(1, staleness + 1):  # worker 0 runs K steps ahead of worker 1: answered
        deliver(server, 0, ps.PUSH, clock, t=clock - 1)
        assert replied(net, server) == [0]
    deliver(server, 0, ps.PUSH, staleness + 1, t=staleness)  # K + 1 ahead: it waits
    assert replied(net, server) == []
    deliver(server, 1, ps.PUSH, 1)  # the slowest moves: both answered
    assert sorted(replied(net, server)) == [0, 1]
    assert server.books.applied == [staleness + 1, 1]


def test_staleness_inf_never_waits_and_staleness_0_waits_for_the_whole_step():
    net = Net()
    inf = ps.Server(ps.Config(ps.Roles(1, 3), 4, None, 0.0, "torch", 50, lambda e, t: 0.1),
                    net.link(0), 0, np.zeros(4, np.float32))
    inf.begin_epoch(1)
    for clock in range(1, 21):
        deliver(inf, 0, ps.PUSH, clock, t=clock - 1)
        assert replied(net, inf) == [0]
    assert inf.books.staleness[0] == 1 and inf.books.staleness[19] == 1  # computed on version 0
    net = Net()
    sync = ps.Server(ps.Config(ps.Roles(1, 3), 4, 0, 0.0, "torch", 5, lambda e, t: 0.1),
                     net.link(0), 0, np.zeros(4, np.float32))
    sync.begin_epoch(1)
    deliver(sync, 0, ps.PUSH, 1)
    assert replied(net, sync) == [] and sync.books.updates == 0  # held until the step is complete
    deliver(sync, 1, ps.PUSH, 1)
    assert replied(net, sync) == [0, 1] and sync.books.updates == 1
    np.testing.assert_array_equal(sync.weights, np.full(4, -0.1, np.float32))  # mean of 1s at 0.1


# --- the pieces -----------------------------------------------------------------------------------

def test_slices_balance_the_bytes():
    assert ps.split(184_586, 3) == [0, 61_528, 123_057, 184_586]
    for size, parts in [(10, 3), (7, 7), (184_586, 4), (5, 1)]:
        bounds = ps.split(size, parts)
        lengths = [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
        assert bounds[0] == 0 and bounds[-1] == size and max(lengths) - min(lengths) <= 1


def test_the_assigner_hands_every_batch_out_once():
    a = ps.Assigner(3, 4)
    taken = [a.take(0) for _ in range(6)]  # its own 4, then the others' tails
    assert taken == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (2, 3)]
    rest = [a.take(1), a.take(1), a.take(1), a.take(2), a.take(2), a.take(2), a.take(2)]
    assert rest == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), None]
    assert a.stolen == 2


def test_a_histogram_line_groups_by_powers_of_two():
    assert ps.histogram_line({"0": 5, "1": 4, "2": 1, "3": 2, "9": 1, "40": 3}) == \
        "0: 5, 1: 4, 2-3: 3, 8-15: 1, 16+: 3"
    assert ps.histogram_line({}) == "none"


# --- failures ---------------------------------------------------------------------------------

def counted_grad(size: int):
    """Gradients independent of the weights, whole numbers: at K > 0 each is applied at the
    constant LR / N (1/16 here), every update exact in float32, so the final weights are the
    order-free sum and any lost or repeated gradient would show."""
    def grad(weights: np.ndarray, key: tuple) -> np.ndarray:
        epoch, owner, t = key
        return np.arange(size, dtype=np.float32) % 7 + 100 * epoch + 10 * owner + t

    return grad


@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("staleness", [0, 1, 4, None])
def test_a_dead_worker_is_dropped_at_any_staleness_and_every_batch_is_trained_once(staleness,
                                                                                   servers):
    """Worker 1 of 3 dies with its 4th batch in hand; server 0 hears it is silent (the
    watchdog's heartbeats, here an event) and drops it: at a finite staleness the others, who may
    not run more than K steps ahead of it, go on; every survivor learns it is dead; the batch it
    held and its batches not yet handed out go to the others, so every batch of both epochs is
    trained exactly once and its 3 gradients are applied, at every server."""
    workers, steps, epochs, size = 3, 6, 2, 6
    dead_rank = servers + 1

    def silent() -> dict[int, float]:
        return {dead_rank: 99.0} if job.gone[1].is_set() else {}

    job = Job(servers, workers, staleness, size=size, steps=steps, epochs=epochs,
              lr=lambda e, t: 3 / 16, grad=counted_grad(size), silent=silent,
              on_dead=lambda rank, quiet: True, dies={1: 3}, delay=lambda w: time.sleep(0.002))
    job.run().check()
    survivors = [r for r in range(servers + workers) if r != dead_rank]
    assert job.verdicts == {r: [1] for r in survivors}
    everything = [(e, o, t) for e in range(1, epochs + 1) for o in range(workers) for t in range(steps)]
    assert sorted(job.trained) == everything  # exact coverage: none lost, none twice
    assert job.trained_by.count(1) == 3
    pushed = [w.books.pushed for w in job.workers]
    for server in job.servers:
        assert server.books.applied == server.books.received == pushed
        assert server.dead == {1} and server.clock.keys() <= {0, 2}
    if staleness != 0:  # each gradient once at LR / N = 1/16: the order-free sum
        want = np.zeros(size, np.float32)
        for key in everything:
            want -= counted_grad(size)(want, key) / np.float32(16)
        for r in survivors:
            assert np.array_equal(job.full[r], want), r
    (lost,) = job.servers[0].books.lost
    assert lost["rank"] == dead_rank and lost["epoch"] == 1 and lost["silent_seconds"] == 99.0


def test_a_frozen_worker_is_dropped_and_told_to_leave_when_it_wakes_up():
    """Worker 1 freezes in its 3rd gradient (its heartbeat stops; the thread is alive): at
    staleness 1 the others would wait for it, so server 0 drops it, hands its batch to another,
    and when it wakes up and pushes, both servers answer DROPPED: it leaves (Dropped), nothing of
    its late gradient is applied, and every batch is still applied exactly once."""
    workers, steps, size = 3, 6, 6
    frozen = threading.Event()

    def delay(w: int) -> None:
        if w == 1 and job.workers[1].books.pushed == 2:
            frozen.set()
            while not all(1 in s.dead for s in job.servers):  # frozen until both dropped it
                time.sleep(0.001)
        else:
            time.sleep(0.005)

    job = Job(2, workers, 1, size=size, steps=steps, epochs=2, lr=lambda e, t: 3 / 16,
              grad=counted_grad(size), silent=lambda: {3: 12.0} if frozen.is_set() else {},
              on_dead=lambda rank, quiet: True, delay=delay)
    job.run()
    assert set(job.errors) == {3} and isinstance(job.errors[3], ps.Dropped), job.errors
    assert "worker rank 3 was dropped by the servers" in str(job.errors[3])
    applied = [(k, w) for k, w in zip(job.trained, job.trained_by, strict=True)]
    late = applied.pop(max(i for i, (_, w) in enumerate(applied) if w == 1))  # computed, refused
    everything = [(e, o, t) for e in (1, 2) for o in range(workers) for t in range(steps)]
    assert sorted(k for k, _ in applied) == everything and late[0][0] == 1
    for server in job.servers:
        assert server.books.applied == server.books.received
        assert server.books.applied[1] == 2 and sum(server.books.applied) == len(everything)
    assert job.verdicts[0] == [1]


def test_a_dropped_worker_that_comes_back_changes_nothing_and_gets_a_notice():
    """Server-side, message by message: worker 0 is dropped while its reply waits for the bound
    (it gets the DROPPED notice at once, a header alone, which a worker reads as Dropped in any
    epoch); a PUSH that it sends later lands in its tomb and is answered with another notice: no
    weight, clock or counter moves."""
    net = Net()
    cfg = ps.Config(ps.Roles(1, 4), 4, 1, 0.0, "torch", 10, lambda e, t: 0.3)
    server = ps.Server(cfg, net.link(0), 0, np.zeros(4, np.float32))
    server.begin_epoch(1)
    for w in range(3):
        deliver(server, w, ps.PULL)
    replied(net, server)
    deliver(server, 2, ps.PUSH, 1)
    deliver(server, 2, ps.PUSH, 2, t=1)  # 2 ahead of 0 and 1: waits
    deliver(server, 0, ps.PUSH, 1)
    deliver(server, 0, ps.PUSH, 2, t=1)  # 2 ahead of 1: waits
    assert replied(net, server) == [0, 2]
    deliver(server, 1, ps.PUSH, 1)  # the slowest at 1: both answered
    assert sorted(replied(net, server)) == [0, 1, 2]
    deliver(server, 0, ps.PUSH, 3, t=2)  # waits for worker 1 (clock 1)
    assert replied(net, server) == []
    server.drop(0)  # silent now: its owed reply is the notice
    notice = net.queues[(0, 1, ps.TAG_DOWN)].popleft()
    h = ps.header(notice)
    assert len(notice) == ps.HEADER and h[ps.KIND] == ps.WEIGHTS and h[ps.FLAGS] == ps.DROPPED
    before = (server.weights.copy(), list(server.books.applied), dict(server.clock))
    assert 0 not in server.clock and server.tombs[0] is not None and server.recvs[0] is None
    msg = server.inbox[0]
    ps.header(msg)[ps.KIND] = ps.PUSH
    server.handle(cfg.roles.workers + 1 + 0, len(msg))  # its late PUSH, in the tomb
    assert (server.weights.tolist(), server.books.applied, server.clock) == \
        (before[0].tolist(), before[1], before[2])
    assert len(net.queues[(0, 1, ps.TAG_DOWN)]) == 1 and server.tombs[0] is None
    worker = ps.Worker(cfg, net.link(1), 0)
    worker.inbox[0][:ps.HEADER] = notice
    with pytest.raises(ps.Dropped):  # what it makes of the notice, in any epoch
        worker.check_reply(0, ps.HEADER, 7)


def test_the_lr_follows_the_workers_left():
    """3 workers, LR 0.6 for 3 (0.2 per gradient at K > 0) and, by the run's rule, 0.2 for 2:
    once worker 2 is dropped, a gradient moves the weights by 0.2 / 2 at K = 1, and a step of
    the 2 left by 0.2 at K = 0 (the step in which it was lost, its gradient already in, averages
    3 gradients at 0.6)."""
    live_lr = lambda e, t, n: {2: 0.2}[n]  # noqa: E731
    net = Net()
    cfg = ps.Config(ps.Roles(1, 4), 4, 1, 0.0, "torch", 10, lambda e, t: 0.6, live_lr=live_lr)
    server = ps.Server(cfg, net.link(0), 0, np.zeros(4, np.float32))
    server.begin_epoch(1)
    deliver(server, 0, ps.PUSH, 1)
    np.testing.assert_allclose(server.weights, -0.2)
    server.drop(2)
    deliver(server, 0, ps.PUSH, 2, t=1)
    np.testing.assert_allclose(server.weights, -0.3)
    net = Net()
    sync = ps.Server(dataclasses.replace(cfg, staleness=0), net.link(0), 0, np.zeros(4, np.float32))
    sync.begin_epoch(1)
    for w in range(3):
        deliver(sync, w, ps.PUSH, 1)
    np.testing.assert_allclose(sync.weights, -0.6)
    deliver(sync, 2, ps.PUSH, 2, t=1)  # held in its step; then it is lost
    deliver(sync, 0, ps.PUSH, 2, t=1)
    sync.drop(2)
    assert sync.books.updates == 1  # the step still waits for worker 1
    deliver(sync, 1, ps.PUSH, 2, t=1)
    assert sync.books.updates == 2 and sync.books.applied == [2, 2, 2]
    np.testing.assert_allclose(sync.weights, -1.2)
    deliver(sync, 0, ps.PUSH, 3, t=2)
    deliver(sync, 1, ps.PUSH, 3, t=2)
    assert sync.books.updates == 3 and sync.books.applied == [3, 3, 2]
    np.testing.assert_allclose(sync.weights, -1.4, rtol=1e-6)


def test_the_runs_lr_for_fewer_workers_is_the_rings_rule_for_them():
    """The run's Config: the LR for all workers is FixedLoop's own; for n left it is the same
    rule (warm-up from the base LR, scaling, decay) with the target scaled for n."""
    from types import SimpleNamespace

    from ringtrain.lr import scaled_lr
    from ringtrain.strategies.ps import run as ps_run
    from ringtrain.training.fixed_loop import FixedLoop

    args = SimpleNamespace(base_lr=0.01, lr_scaling="linear", adasum=False, warmup_epochs=1,
                           epochs=4, lr_decay="cosine", stall_timeout=10.0, momentum=0.9,
                           staleness="4")
    loops = {n: SimpleNamespace(args=args, steps=10, target_lr=scaled_lr(0.01, n)) for n in (2, 3)}
    fixed = SimpleNamespace(steps=10, lr=lambda e, s: FixedLoop.lr(loops[3], e, s))
    stub = type("Stub", (ps_run.ParameterServerRun,), {"momentum_rule": "torch"})
    stub.__abstractmethods__ = frozenset()
    run = object.__new__(stub)
    run.args, run._roles, run.size = args, ps.Roles(1, 4), 6
    cfg = run.config(fixed)
    for epoch, step in [(1, 0), (1, 5), (2, 3), (4, 9)]:
        assert cfg.lr_for(epoch, step, 3) == FixedLoop.lr(loops[3], epoch, step)
        assert cfg.lr_for(epoch, step, 2) == pytest.approx(FixedLoop.lr(loops[2], epoch, step))
    assert cfg.lr_for(2, 0, 2) == pytest.approx(0.02) and cfg.lr_for(2, 0, 3) == pytest.approx(0.03)


@pytest.mark.parametrize("staleness", ["4", "0", "inf"])
def test_the_run_trains_on_without_a_worker_only_where_the_launcher_survives(monkeypatch,
                                                                            staleness):
    """At any staleness: under mpirun --enable-recovery a warning line and the job goes on;
    without it one line saying what the launcher needs (python -m launch.horovodrun passes it)."""
    from types import SimpleNamespace

    from ringtrain.faults import watchdog
    from ringtrain.strategies.ps import run as ps_run

    class Ended(Exception):
        pass

    def end_job(line: str) -> None:
        raise Ended(line)

    monkeypatch.setattr(watchdog, "end_job", end_job)
    stub = type("Stub", (ps_run.ParameterServerRun,), {})
    stub.__abstractmethods__ = frozenset()
    run = object.__new__(stub)
    run.args, run._roles = SimpleNamespace(staleness=staleness), ps.Roles(1, 4)
    run.server = SimpleNamespace(dead=set())
    monkeypatch.setattr(ps_run.ps_mpi, "recovery_enabled", lambda: False)
    with pytest.raises(Ended) as err:
        run._on_dead(3, 6.0)
    line = str(err.value)
    assert line.startswith("worker rank 3 is dead, frozen or cut off (no heartbeat for 6 s)")
    assert "--enable-recovery" in line and "python -m launch.horovodrun passes it" in line
    monkeypatch.setattr(ps_run.ps_mpi, "recovery_enabled", lambda: True)
    assert run._on_dead(3, 6.0) is True


def test_a_dead_worker_ends_the_job_where_the_launcher_cannot_go_on():
    """``on_dead`` False (the run's answer without --enable-recovery): the job ends, naming it."""
    def silent() -> dict[int, float]:
        return {3: 42.0} if job.gone[1].is_set() else {}

    job = Job(1, 3, 4, size=4, steps=20, grad=lambda w, k: np.ones(4), silent=silent,
              dies={1: 2}, deadline=3.0, delay=lambda w: time.sleep(0.002))
    job.run()
    assert isinstance(job.errors.get(0), ps.PeerSilent) and str(job.errors[0]) == "worker rank 3"


def test_the_summary_names_the_lost_worker_and_when():
    from ringtrain.strategies.ps.run import report_lines, summary_record

    cfg = ps.Config(ps.Roles(1, 4), 6, 4, 0.0, "torch", 10, lambda e, t: 0.1)
    lost = {"rank": 3, "epoch": 2, "updates": 412, "seconds": 18.4, "silent_seconds": 6.0}
    books = [{"server": 0, **ps.ServerBooks(applied=[10, 10, 4], received=[10, 10, 4],
                                            seconds=2.0, epoch_seconds=[1.0, 1.0],
                                            lost=[lost]).record()},
             *({"worker": w, **ps.WorkerBooks(pushed=10, seconds=2.0).record()} for w in (0, 1))]
    record = summary_record(books, cfg, 10, [2])
    assert record["lost_workers"] == [3] and record["lost"] == [lost]
    assert record["exactly_once"]
    assert report_lines(record)[-1] == ("ps: lost worker rank 3 in epoch 2: dropped 18 s into "
                                        "training, after 412 updates, its heartbeat silent for "
                                        "6 s; trained on with 2 worker(s)")
    assert "20 gradients pushed (and 4 by the lost worker(s)), 24 applied" in report_lines(record)[0]


def test_non_finite_weights_stop_every_worker_at_that_step():
    def grad(weights: np.ndarray, key: tuple) -> np.ndarray:
        epoch, owner, t = key
        return np.full(4, np.nan if (owner, t) == (1, 2) else 1.0)

    job = Job(1, 2, 0, size=4, steps=10, grad=grad).run().check()
    assert job.servers[0].diverged[:2] == (1, 3)  # epoch 1, step 3 (from 1)
    assert max(t for _, _, t in job.trained) == 2  # nobody trained past the step


# --- peers' messages are checked before use ----------------------------------------------------------

def arrive(server: ps.Server, w: int, count: int, kind: int = ps.PUSH, clock: int = 1,
           owner: int | None = None, t: int = 0, version: int = 0, epoch: int | None = None,
           payload: float = 1.0) -> None:
    """A message of ``count`` values from worker ``w`` completes the server's receive: the
    transport wrote ``count`` values into its buffer, the rest is what the last message left."""
    msg = np.zeros(ps.HEADER, np.float32)
    h = ps.header(msg)
    h[ps.KIND], h[ps.EPOCH], h[ps.CLOCK], h[ps.T], h[ps.VERSION] = \
        kind, server.epoch if epoch is None else epoch, clock, t, version
    h[ps.OWNER] = w if owner is None else owner
    msg = np.concatenate([msg, np.full(len(server.inbox[w]) - ps.HEADER, payload, np.float32)])
    server.inbox[w][:count] = msg[:count]
    server.handle(w, count)


def one_line_naming(err: BaseException, peer: str) -> str:
    line = str(err)
    assert "\n" not in line and peer in line and "the job ends" in line, line
    return line


def a_server(staleness: int | None, servers: int = 1, index: int = 0, workers: int = 2,
             steps: int = 4) -> tuple[Net, ps.Server]:
    net = Net()
    cfg = ps.Config(ps.Roles(servers, servers + workers), 6, staleness, 0.0, "torch", steps,
                    lambda e, t: 0.5 if t >= 0 else 100.0)
    server = ps.Server(cfg, net.link(index), index, np.zeros(cfg.length(index), np.float32))
    server.begin_epoch(1)
    return net, server


@pytest.mark.parametrize("staleness", [0, None])
def test_a_push_of_only_the_header_is_refused_not_applied_again(staleness):
    """Issue 5: a PUSH of the 8-value header alone was accepted and the previous gradient, still
    in the buffer, applied a second time."""
    net, server = a_server(staleness, workers=1)
    arrive(server, 0, len(server.inbox[0]), clock=1, t=0)
    after_one = server.weights.copy()
    assert server.books.applied == [1] and after_one.any()
    replied(net, server)
    with pytest.raises(ps.BadMessage) as err:
        arrive(server, 0, ps.HEADER, clock=2, t=1, version=1)
    line = one_line_naming(err.value, "worker rank 1")
    assert "a PUSH of 8 values" in line and "expected 14" in line
    assert np.array_equal(server.weights, after_one) and server.books.applied == [1]
    assert replied(net, server) == []


@pytest.mark.parametrize("owner", [-1, 7])
def test_a_dead_notice_naming_no_worker_is_refused(owner):
    """Issue 5: server 0's DEAD notice naming worker -1 dropped worker 1's receive (Python's
    negative index); naming worker 7 of 2 raised IndexError."""
    _, server = a_server(None, servers=2, index=1)
    h = ps.header(server.ctrl_buf)
    h[ps.KIND], h[ps.EPOCH], h[ps.OWNER] = ps.DEAD, 1, owner
    posted = list(server.recvs)
    with pytest.raises(ps.BadMessage) as err:
        server.handle(server.cfg.roles.workers, ps.HEADER)
    line = one_line_naming(err.value, "server rank 0")
    assert f"naming worker {owner}" in line and "a worker 0..1" in line
    assert server.dead == set() and server.recvs == posted and all(r is not None for r in posted)


@pytest.mark.parametrize("owner,t", [(0, -1), (1, -3), (0, 4), (2, 0), (-1, 0)])
def test_a_push_naming_a_batch_out_of_range_is_refused(owner, t):
    """Issue 5: a negative step index picked another step's LR (and, on a worker, another batch)."""
    _, server = a_server(None)
    with pytest.raises(ps.BadMessage) as err:
        arrive(server, 1, len(server.inbox[1]), clock=1, owner=owner, t=t)
    line = one_line_naming(err.value, "worker rank 2")
    assert f"batch {t} of worker {owner}" in line
    assert not server.weights.any() and server.books.applied == [0, 0]


@pytest.mark.parametrize("fields,says", [
    ({"kind": 9}, "kind 9"), ({"epoch": 2}, "epoch 2"), ({"clock": 3}, "clock 3"),
    ({"version": 5}, "version 5"), ({"version": -1}, "version -1"), ({"count": 3}, "3 values"),
    ({"count": -1}, "no whole number"), ({"kind": ps.PULL, "count": 14}, "a PULL of 14 values"),
    ({"kind": ps.FINAL, "count": 8, "clock": 2}, "a FINAL at clock 2")])
def test_every_other_header_field_of_a_workers_message_is_checked(fields, says):
    _, server = a_server(1)
    count = fields.pop("count", len(server.inbox[0]))
    with pytest.raises(ps.BadMessage) as err:
        arrive(server, 0, count, **fields)
    assert says in one_line_naming(err.value, "worker rank 1")
    assert not server.weights.any() and server.books.applied == [0, 0]


def replies(net: Net, worker_rank: int, *messages: tuple[int, np.ndarray]) -> None:
    """Messages already on their way to a worker, from the given servers."""
    for s, msg in messages:
        net.queues[(s, worker_rank, ps.TAG_DOWN)].append(msg)


def reply(cfg: ps.Config, s: int, owner: int, t: int, epoch: int = 1, length: int | None = None,
          kind: int = ps.WEIGHTS) -> np.ndarray:
    msg = np.zeros(ps.HEADER + cfg.length(s), np.float32)
    h = ps.header(msg)
    h[ps.KIND], h[ps.EPOCH], h[ps.OWNER], h[ps.T] = kind, epoch, owner, t
    return msg if length is None else msg[:length]


@pytest.mark.parametrize("owner,t,length,says", [
    (1, -1, None, "batch -1 of worker 1"), (7, 0, None, "batch 0 of worker 7"),
    (1, 4, None, "batch 4 of worker 1"), (0, 0, ps.HEADER, "a reply of 8 values")])
def test_a_worker_refuses_a_reply_that_hands_it_no_batch_of_the_epoch(owner, t, length, says):
    """Server 0's reply names the batch a worker trains next: a negative step index picked another
    batch (Python's negative index), a worker out of range another shard; a short reply left the
    last weights in the buffer.  Refused before any batch is fetched or any weight used."""
    net = Net()
    cfg = ps.Config(ps.Roles(2, 4), 6, None, 0.0, "torch", 4, lambda e, t: 0.1, deadline=0.5,
                    tick=0.02)
    worker = ps.Worker(cfg, net.link(2), 0)
    replies(net, 2, (0, reply(cfg, 0, owner, t, length=length)), (1, reply(cfg, 1, ps.NONE, ps.NONE)))
    used = []
    with pytest.raises(ps.BadMessage) as err:
        worker.work_epoch(1, iter(["own"] * 4), lambda o, b: used.append(("fetch", o, b)),
                          lambda weights: used.append("use"), lambda batch: (np.zeros(6), 0.0))
    assert says in one_line_naming(err.value, "server rank 0")
    assert used == [] and worker.books.pushed == 0


def test_a_worker_takes_a_later_own_batch_handed_back_once_and_refuses_it_again():
    """Its own batch 2 first (a batch of its shard's tail given back by a worker that died): read
    through fetch, not its in-order reader; the same batch again is refused before anything of
    it is used, as is any own batch before the next in order."""
    net = Net()
    cfg = ps.Config(ps.Roles(2, 4), 6, None, 0.0, "torch", 4, lambda e, t: 0.1, deadline=0.5,
                    tick=0.02)
    worker = ps.Worker(cfg, net.link(2), 0)
    for _ in range(2):
        replies(net, 2, (0, reply(cfg, 0, 0, 2)), (1, reply(cfg, 1, ps.NONE, ps.NONE)))
    used = []
    with pytest.raises(ps.BadMessage) as err:
        worker.work_epoch(1, iter(["own"] * 4), lambda o, b: used.append(("fetch", o, b)),
                          lambda weights: None, lambda batch: (np.zeros(6), 0.0))
    assert "its own batch 2 again" in one_line_naming(err.value, "server rank 0")
    assert used == [("fetch", 0, 2)] and worker.books.pushed == 1 and worker.books.own == 1


def test_a_reply_of_another_kind_or_epoch_from_any_server_is_refused():
    net = Net()
    cfg = ps.Config(ps.Roles(2, 3), 6, None, 0.0, "torch", 4, lambda e, t: 0.1, deadline=0.5)
    worker = ps.Worker(cfg, net.link(2), 0)
    replies(net, 2, (0, reply(cfg, 0, 0, 0)), (1, reply(cfg, 1, ps.NONE, ps.NONE, epoch=3)))
    with pytest.raises(ps.BadMessage) as err:
        worker.work_epoch(1, iter([]), None, None, None)
    assert "epoch 3" in one_line_naming(err.value, "server rank 1")
    assert not worker.weights.any()


@pytest.mark.parametrize("dead,says", [([-1.0], "workers [-1.0]"), ([2.0], "workers [2.0]"),
                                      ([0.5], "workers [0.5]")])
def test_a_verdict_naming_no_worker_is_refused(dead, says):
    net = Net()
    cfg = ps.Config(ps.Roles(1, 3), 6, None, 0.0, "torch", 4, lambda e, t: 0.1, deadline=0.5)
    msg = np.zeros(ps.HEADER + 2, np.float32)
    ps.header(msg)[ps.CLOCK] = len(dead)
    msg[ps.HEADER:ps.HEADER + len(dead)] = dead
    net.queues[(0, 1, ps.TAG_VERDICT)].append(msg)
    with pytest.raises(ps.BadMessage) as err:
        ps.Worker(cfg, net.link(1), 0).verdict()
    assert says in one_line_naming(err.value, "server rank 0")


class FakeMPI:
    """What :class:`ringtrain.strategies.ps.transport.MpiLink` uses of mpi4py's ``MPI``, with
    one receive that completes as ``outcome`` says."""

    UNDEFINED, ERR_TRUNCATE, FLOAT = -32766, 15, "float"

    class Exception(Exception):  # noqa: N818 - mpi4py's name
        def __init__(self, error_class: int) -> None:
            self.error_class = error_class

        def Get_error_class(self) -> int:  # noqa: N802 - mpi4py's name
            return self.error_class

    def __init__(self, outcome) -> None:
        mpi, self.outcome = self, outcome

        class Status:
            def Get_count(self, datatype):  # noqa: N802
                return mpi.outcome

            def Get_source(self):  # noqa: N802
                return 3

            def Get_tag(self):  # noqa: N802
                return ps.TAG_UP

        class Request:
            @staticmethod
            def Testany(requests, status):  # noqa: N802
                if isinstance(mpi.outcome, BaseException):
                    raise mpi.outcome
                return 0, True

        self.Status, self.Request = Status, Request


class FakeComm:
    def Get_rank(self) -> int:  # noqa: N802
        return 0


@pytest.mark.parametrize("outcome,want", [(14, 14), (FakeMPI.UNDEFINED, -1),
                                          (FakeMPI.Exception(FakeMPI.ERR_TRUNCATE), None)])
def test_the_mpi_link_reports_what_a_receive_got_and_refuses_a_truncated_one(outcome, want):
    """The count comes from the completed request's MPI.Status; a message that is no whole
    number of float32 values is -1 (refused by the engine), one longer than its receive is
    refused here, naming its sender."""
    from ringtrain.strategies.ps.transport import MpiLink

    link = MpiLink(FakeComm(), FakeMPI(outcome))
    if want is not None:
        assert link.wait_any([object()], 1.0) == (0, want)
        return
    with pytest.raises(ps.BadMessage) as err:
        link.wait_any([object()], 1.0)
    assert "MPI_ERR_TRUNCATE" in one_line_naming(err.value, "rank 3")


def test_a_refused_message_is_the_runs_one_line():
    """The run ends the job with the refusal's own line (watchdog.end_job, exit 3), where a
    silent peer gets the silent peer's line."""
    from ringtrain.strategies.ps.run import ParameterServerRun

    line = "server rank 0 refused a message from worker rank 2: x, expected y; ... the job ends"
    assert ParameterServerRun._silent_line(None, ps.BadMessage(line)) == line


class SliceComm:
    """A communicator whose one receive gets ``sent`` (``FakeMPI``'s Status says how many values
    arrived; longer than the receive, mpi4py raises ``MPI_ERR_TRUNCATE``), for
    :meth:`ParameterServerRun.open_servers`."""

    def __init__(self, sent: np.ndarray) -> None:
        self.sent = sent

    def Dup(self):  # noqa: N802 - mpi4py's names
        return self

    def Bcast(self, buf, root: int) -> None:  # noqa: N802
        pass

    def Recv(self, spec, source: int, tag: int, status=None) -> None:  # noqa: N802
        buf = spec[0]
        n = min(len(buf), len(self.sent))
        buf[:n] = self.sent[:n]
        if len(self.sent) > len(buf):
            raise FakeMPI.Exception(FakeMPI.ERR_TRUNCATE)


@pytest.mark.parametrize("sent,count,says", [
    (3, 3, "its momentum slice of 3 values, expected 10 values"),
    (10, FakeMPI.UNDEFINED, "a length that is no whole number of float32 values"),
    (12, None, "MPI_ERR_TRUNCATE"),
    (10, 10, None)])
def test_a_servers_momentum_slice_of_the_wrong_length_ends_the_job_in_one_line(monkeypatch, sent,
                                                                               count, says):
    """Server 0 hands server 1 the momentum of its slice with one blocking Recv: the received
    count is checked against the slice (a short message left np.empty's garbage as momentum), and
    a mismatch ends the job in one line naming the peer, the message and what was expected."""
    from types import SimpleNamespace

    from ringtrain.faults import watchdog
    from ringtrain.strategies.ps import run as ps_run

    class Ended(Exception):
        pass

    lines: list[str] = []

    def end_job(line: str) -> None:
        lines.append(line)
        raise Ended(line)

    monkeypatch.setattr(watchdog, "end_job", end_job)
    monkeypatch.setattr(ps_run.ps_mpi, "world", lambda comm: None)
    monkeypatch.setattr(ps_run.ps_mpi, "MpiLink", lambda comm: None)
    stub = type("Stub", (ps_run.ParameterServerRun,), {})
    stub.__abstractmethods__ = frozenset()
    run = object.__new__(stub)
    run.args, run._rank, run._roles = SimpleNamespace(momentum=0.9), 1, ps.Roles(2, 4)
    run.get_flat = lambda: np.zeros(20, np.float32)
    run.set_flat = lambda flat: None
    mpi = FakeMPI(count)
    mpi.COMM_WORLD = SliceComm(np.arange(1, sent + 1, dtype=np.float32))
    if says is None:
        run.open_servers(mpi)
        np.testing.assert_array_equal(run.velocity0, np.arange(1, 11, dtype=np.float32))
        assert not lines
        return
    with pytest.raises(Ended):
        run.open_servers(mpi)
    (line,) = lines
    assert says in one_line_naming(Ended(line), "server rank 0"), line
    assert line.startswith("server rank 1 refused a message from server rank 0: its momentum slice")
    assert "10 values, the length of this server's slice" in line


# --- snapshots and --resume ---------------------------------------------------------------------

def layout(cfg: ps.Config, index: int, **changes) -> snapshot.Layout:
    """A test job's snapshot layout: the run's (ParameterServerRun._store), for the fake model."""
    fields = dict(framework="fake", model="softmax-v1", param_count=cfg.size, size=cfg.size,
                  server=index, servers=cfg.roles.servers, rule=cfg.rule,
                  state=ps.state_names(cfg.momentum, cfg.optimizer), optimizer=cfg.optimizer,
                  batches={"workers": cfg.roles.workers, "steps": cfg.steps, "rows": 4, "seed": 42,
                           "shuffle": True, "train_size": 96})
    fields.update(changes)
    return snapshot.Layout(**fields)


def npz_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".npz"))


def test_each_server_snapshots_its_slice_every_n_updates_and_keeps_the_newest(tmp_path):
    """2 servers, 3 workers x 8 batches, staleness inf, --commit-every 5: each server wrote a
    snapshot after updates 5, 10, 15 and 20 of both epochs (8), each replacing the one before
    (its newest alone is left, no temporary file); that one holds exactly the server's slice after
    its 20th update of epoch 2: w0 minus 1/16 of every gradient of epoch 1 and of the 20 batches
    its ``done`` names (integer gradients: exact, whatever order they came in); its update mark
    says 24 updates of epoch 2."""
    workers, steps, size = 3, 8, 10
    grad = counted_grad(size)
    job = Job(2, workers, None, size=size, steps=steps, epochs=2, lr=lambda e, t: 3 / 16,
              grad=grad, snapshots=tmp_path, every=5, delay=lambda w: time.sleep(0.001))
    job.run().check()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file is left"
    assert npz_names(tmp_path) == [f"{job.stores[s].layout.stem()}-epoch0002-update000020.npz"
                                   for s in (0, 1)]
    assert job.stores[0].layout.stem() == "ps-server0of2-values0to5"
    for s, (server, store) in enumerate(zip(job.servers, job.stores, strict=True)):
        assert server.books.snapshots == 8 and server.books.snapshot_max_seconds > 0
        snap = store.newest(2)
        assert (snap.epoch, snap.updates, int(snap.done.sum())) == (2, 20, 20)
        want = np.zeros(size, np.float32)
        for key in [(1, o, t) for o in range(workers) for t in range(steps)] + \
                [(2, o, t) for o, t in zip(*np.nonzero(snap.done), strict=True)]:
            want -= grad(want, key) / np.float32(16)
        assert np.array_equal(snap.weights, want[job.cfg.slice(s)]) and snap.state == {}
        assert store.read_mark() == (2, 24)


def test_a_snapshot_that_cannot_be_written_leaves_the_last_one_whole(tmp_path, monkeypatch, capsys):
    """The write is a temporary file renamed over the name once complete: a failure at the rename
    (a full disk would fail earlier, the same way) leaves the previous snapshot whole and no
    temporary file, says so in one warning line, once, and training goes on (None)."""
    cfg = ps.Config(ps.Roles(1, 3), 6, None, 0.9, "torch", 4, lambda e, t: 0.1)
    store = snapshot.Store(tmp_path, layout(cfg, 0), 4)
    w, v, done = np.arange(6, dtype=np.float32), np.ones(6, np.float32), np.zeros((2, 4), bool)
    assert store.write(1, 4, w, {"velocity": v}, done) is not None

    def full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert store.write(1, 8, w + 1, {"velocity": v}, done) is None
    assert store.write(1, 12, w + 2, {"velocity": v}, done) is None
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ps-server0of1-values0to6-epoch0001-update000004.npz"]
    snap = store.newest(1)
    assert snap.updates == 4 and np.array_equal(snap.weights, w)
    assert np.array_equal(snap.state["velocity"], v)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: server rank 0 could not write its "
                                                   "snapshot ps-server0of1-values0to6-epoch0001-"
                                                   "update000008.npz (No space left on device)")


def resume_from_snapshots(job: Job, epoch: int) -> tuple[list, list]:
    """What ParameterServerRun._open_snapshots does, for a job of threads: each server's newest
    snapshot of ``epoch`` and its last session's mark, the batches every server holds; every
    server resumed.  Returns (snapshots, marks)."""
    snaps = [store.newest(epoch) for store in job.stores]
    marks = [store.read_mark() for store in job.stores]
    masks, everyone = snapshot.held([None if x is None else x.done for x in snaps],
                                    job.roles.workers, job.cfg.steps)
    for s, server in enumerate(job.servers):
        snap = snaps[s]
        server.resume(epoch, snap.updates if snap else 0, masks[s], everyone,
                      snap.weights if snap else None, snap.state if snap else None,
                      snap.steps if snap else None)
    return snaps, marks


@pytest.mark.parametrize("staleness,servers,lacking,optimizer", [
    (0, 2, False, "sgd"), (4, 1, False, "sgd"), (None, 2, False, "sgd"), (None, 2, True, "sgd"),
    (0, 2, False, "adamw")])
def test_a_job_resumed_from_its_servers_snapshots_ends_as_if_never_stopped(tmp_path, staleness,
                                                                          servers, lacking,
                                                                          optimizer):
    """3 workers x 8 batches, 2 epochs.  The job stops for good once 10 gradients of epoch 2 are
    computed (every rank: the servers time out), its servers having written a snapshot every
    --commit-every updates; a new job resumes epoch 2 from the epoch-1 weights (the checkpoint)
    and each server's newest snapshot, and ends with the weights of a job that never stopped:
    bit for bit at staleness 0 (the ring's math, momentum 0.9, gradients of the weights: the
    snapshot's weights and momentum are exactly the step's) and, at K > 0, the order-free sum of
    every batch applied once by every server (integer gradients).  The resumed job trains exactly
    the batches no snapshot held, each once; each server lost the updates after its snapshot,
    counted from its update mark: at most --commit-every.  ``lacking``: server 1's snapshot is
    gone, so it restarts the epoch from the checkpoint while server 0 keeps its 8 updates: the
    batches server 0 holds are trained again and server 0 receives them without applying them.
    ``adamw`` (with weight decay and --clip-grad-norm): the snapshots' and the checkpoint's Adam
    moments and step counts resume it bit for bit too."""
    workers, steps, epochs, every = 3, 8, 2, 2 if staleness == 0 else 4
    if staleness == 0:
        problem = Problem(n_train=96)
        grad, momentum = softmax_grad(problem, 4, workers), 0.9
        size = (problem.features + 1) * problem.classes
        w0 = np.random.default_rng(3).normal(0, 0.1, size).astype(np.float32)
        lr = lambda e, t: 0.05 + 0.01 * t  # noqa: E731
    else:
        size, momentum, w0 = 10, 0.0, None
        grad, lr = counted_grad(10), lambda e, t: 3 / 16
    same = dict(size=size, steps=steps, epochs=epochs, momentum=momentum, lr=lr, grad=grad)
    if optimizer == "adamw":
        same.update(momentum=None, optimizer="adamw", weight_decay=0.01, clip=0.05)
    whole = Job(servers, workers, staleness, w0=w0, **same).run().check()
    stopped = Job(servers, workers, staleness, w0=w0, snapshots=tmp_path, every=every,
                  stop_at=workers * steps + 10, deadline=3.0, **same).run()
    assert all(isinstance(stopped.errors.get(s), ps.PeerSilent) for s in range(servers))
    at_loss = [server.epoch_updates for server in stopped.servers]
    assert at_loss == ([3] * servers if staleness == 0 else [10] * servers)
    if lacking:
        for p in tmp_path.glob("ps-server1of2-*.npz"):
            p.unlink()
    weights = stopped.ends[(0, 1)][0]  # the epoch-1 checkpoint: weights and momentum
    v0 = (np.concatenate([stopped.ends[(s, 1)][1] for s in range(servers)])
          if same["momentum"] else None)
    state0 = ([stopped.states[(s, 1)] for s in range(servers)] if optimizer != "sgd" else None)
    resumed = Job(servers, workers, staleness, w0=weights, v0=v0, snapshots=tmp_path, every=every,
                  first_epoch=2, state0=state0, **same)
    snaps, marks = resume_from_snapshots(resumed, 2)
    resumed.run().check()
    for full in resumed.full.values():
        assert np.array_equal(full, whole.full[0])
    since = [snap.updates if snap else 0 for snap in snaps]
    assert since == ([2] * servers if staleness == 0 else [8, 0] if lacking else [8] * servers)
    lost = [snapshot.lost_updates(mark, 2, n) for mark, n in zip(marks, since, strict=True)]
    assert lost == [u - n for u, n in zip(at_loss, since, strict=True)]
    assert lacking or max(lost) <= every
    everyone = snapshot.held([None if x is None else x.done for x in snaps], workers, steps)[1]
    left = [(2, o, t) for o in range(workers) for t in range(steps) if not everyone[o, t]]
    assert sorted(resumed.trained) == left  # each batch no snapshot held, once
    pushed = [w.books.pushed for w in resumed.workers]
    for s, server in enumerate(resumed.servers):
        books = server.books
        assert [a + k for a, k in zip(books.applied, books.skipped, strict=True)] == \
            books.received == pushed
        assert server.epoch_updates == (steps if staleness == 0 else workers * steps)
        if staleness != 0:  # one update per gradient: each batch applied once over both jobs
            assert sum(books.applied) + since[s] == workers * steps
            assert sum(books.skipped) == since[s] - int(everyone.sum())


def a_snapshot(folder: Path, lay: snapshot.Layout, epoch: int = 2, updates: int = 4,
               weights: np.ndarray | None = None) -> Path:
    n = lay.hi - lay.lo
    state = {name: np.ones(n, np.float32) for name in lay.state}
    w = np.arange(n, dtype=np.float32) if weights is None else weights
    assert snapshot.Store(folder, lay, 4).write(epoch, updates, w, state,
                                                np.zeros((lay.workers, lay.steps), bool))
    return folder / lay.file_name(epoch, updates)


def one_line(err: BaseException, *needles: str) -> str:
    line = str(err)
    assert "\n" not in line, line
    for needle in needles:
        assert needle in line, line
    return line


CFG = ps.Config(ps.Roles(1, 3), 10, 4, 0.9, "torch", 4, lambda e, t: 0.1)


@pytest.mark.parametrize("theirs,says", [
    (dict(servers=2), ["holds values 0..4 of server 0 of 2", "this job has 1 server(s) over 10 "
                       "values (server 0: 0..9)", "resume with --ps-servers 2"]),
    (dict(servers=2, server=1), ["holds values 5..9 of server 1 of 2"]),
    (dict(model="other-v1"), ['written with model "other-v1", this job has "softmax-v1"']),
    (dict(framework="tf", rule="keras"), ['written with framework "tf", this job has "fake"']),
    (dict(state=()), ['written with state [], this job has ["velocity"]']),
    (dict(batches={"workers": 3, "steps": 4, "rows": 4, "seed": 42, "shuffle": True,
                   "train_size": 96}), ['written with batches {"workers": 3']),
])
def test_a_snapshot_of_another_layout_is_one_line_naming_both(tmp_path, theirs, says):
    """A snapshot of the resumed epoch written by another layout (server count and slices, model,
    framework, optimizer state, the epoch's batches) is refused in one line naming the file, its
    layout and this job's, and how to resume (its layout, or without the snapshots)."""
    path = a_snapshot(tmp_path, layout(CFG, 0, **theirs))
    with pytest.raises(UserError) as err:
        snapshot.Store(tmp_path, layout(CFG, 0), 4).newest(2)
    one_line(err.value, f"snapshot {path}", *says)
    assert "remove the ps-server*.npz files from" in str(err.value)
    assert snapshot.Store(tmp_path, layout(CFG, 0), 4).newest(3) is None  # another epoch's: unused


class Planted:
    """Unpickling it would create ``marker``: proof that a file was never unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def damage(how: str, path: Path, tmp_path: Path) -> None:
    data = path.read_bytes()
    marker = tmp_path / "ran"
    if how == "truncated":
        path.write_bytes(data[:len(data) // 2])
    elif how == "bit flip":  # one bit of the weights' values: the archive is whole, its CRC fails
        with zipfile.ZipFile(path) as z:
            info = z.getinfo("weights.npy")
        local = struct.unpack("<26xHH", data[info.header_offset:info.header_offset + 30])
        i = info.header_offset + 30 + sum(local) + info.file_size - 4  # its last value
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])
    elif how == "symlink":
        target = tmp_path / "elsewhere.npz"
        path.rename(target)
        path.symlink_to(target)
    elif how == "pickle":
        path.write_bytes(pickle.dumps({"weights": Planted(marker)}))
    elif how == "object array":
        with open(path, "wb") as fh:
            np.savez(fh, meta=np.array("{}"), weights=np.array([Planted(marker)], dtype=object),
                     done=np.zeros(1, bool), **{"state.velocity": np.ones(10, np.float32)})
    elif how == "renamed":
        path.rename(path.with_name(path.name.replace("update000004", "update000008")))
    elif how == "not finite":
        lay = layout(CFG, 0)
        a_snapshot(tmp_path, lay, weights=np.full(10, np.nan, np.float32))


@pytest.mark.parametrize("how,says", [
    ("truncated", "is damaged (not a complete checkpoint archive"),
    ("bit flip", "is damaged (member weights.npy fails its CRC check)"),
    ("symlink", "is a symbolic link (resume follows none)"),
    ("pickle", "is a bare Python pickle, not a checkpoint archive: refused without loading it"),
    ("object array", "cannot be read without running code"),
    ("renamed", "says it holds epoch 2 after 4 updates, its name epoch 2 after 8"),
    ("not finite", "holds weights that are not finite numbers (weights has NaN"),
])
def test_a_damaged_or_planted_snapshot_is_one_line_and_never_unpickled(tmp_path, how, says):
    path = a_snapshot(tmp_path, layout(CFG, 0))
    damage(how, path, tmp_path)
    with pytest.raises(UserError) as err:
        snapshot.Store(tmp_path, layout(CFG, 0), 4).newest(2)
    one_line(err.value, says, "ps-server0of1-values0to10-epoch0002-update00000")
    assert not (tmp_path / "ran").exists(), "the file was unpickled"


def test_an_update_mark_counts_only_what_it_can_prove(tmp_path):
    """The mark is rewritten in place (its file made by this session, renamed over the name);
    ``lost_updates``: the mark's updates of the resumed epoch after the snapshot's; 0 where the
    mark ended in an earlier epoch (the checkpoint holds it); None where no intact mark is there
    or it is behind the snapshot or past the epoch.  A symlink under its name is not followed."""
    store = snapshot.Store(tmp_path, layout(CFG, 0), 4)
    assert store.read_mark() is None
    store.start()
    store.mark(3, 17)
    assert store.read_mark() == (3, 17)
    assert [snapshot.lost_updates(store.read_mark(), 3, n) for n in (0, 16, 17, 18)] == \
        [17, 1, 0, None]
    assert snapshot.lost_updates((2, 40), 3, 0) == 0 and snapshot.lost_updates((4, 1), 3, 0) is None
    store.mark_path.write_bytes(b"short")
    assert store.read_mark() is None
    secret = tmp_path / "secret"
    secret.write_bytes(store.mark_path.read_bytes())
    store.mark_path.unlink()
    store.mark_path.symlink_to(secret)
    assert store.read_mark() is None
    store.start()  # replaces the link itself, never writes through it
    assert not store.mark_path.is_symlink() and secret.read_bytes() == b"short"


def test_a_resumed_epoch_hands_out_only_the_batches_no_server_holds_each_once():
    """Server 0's book of a resumed epoch: worker 0 holds its first 3, worker 1 its first and
    last, worker 2 all of its own; whoever asks gets every batch not held, each once (worker 2
    takes the others' tails), and none held."""
    done = np.zeros((3, 6), bool)
    done[0, :3] = done[1, [0, 5]] = done[2, :] = True
    book = ps.Assigner(3, 6)
    book.resume(done)
    assert [book.left(w) for w in range(3)] == [3, 4, 0]
    got, w = [], 0
    while (batch := book.take(w % 3)) is not None or book.handed:
        if batch is not None:
            got.append(batch)
        book.done(w % 3)
        w += 1
    assert sorted(got) == [(o, t) for o in range(3) for t in range(6) if not done[o, t]]
    assert book.stolen >= 2  # worker 2 trained others' batches


def test_the_summary_counts_the_resumed_snapshots_and_the_updates_lost():
    from ringtrain.strategies.ps.run import report_lines, summary_record

    cfg = ps.Config(ps.Roles(2, 4), 6, None, 0.0, "torch", 10, lambda e, t: 0.1)
    resumed = [{"epoch": 2, "from_update": 8, "updates_lost": 2, "snapshot": "a.npz",
                "batches_done": 0}, {"epoch": 2, "from_update": 0, "updates_lost": None,
                                     "snapshot": None, "batches_done": 0}]
    books = [{"server": s, **ps.ServerBooks(applied=[10, 6], received=[10, 10], skipped=[0, 4 - 4 * s],
                                            seconds=2.0, epoch_seconds=[1.0], snapshots=3,
                                            snapshot_seconds=0.03, snapshot_max_seconds=0.02,
                                            snapshot_every=4, resumed=resumed[s]).record()}
             for s in (0, 1)]
    books[1]["applied"] = [10, 10]
    books += [{"worker": w, **ps.WorkerBooks(pushed=10, seconds=2.0).record()} for w in (0, 1)]
    record = summary_record(books, cfg, 10, [])
    assert record["exactly_once"] and record["skipped"] == [4, 0]
    assert (record["resumed_epoch"], record["resumed_from_update"], record["updates_lost"]) == \
        (2, [8, 0], [2, None])
    assert record["snapshots_written"] == [3, 3] and record["snapshot_seconds"][0] == [0.01, 0.02]
    lines = report_lines(record)
    assert "16, 20 applied by the servers and 4, 0 already in their snapshots" in lines[0]
    assert lines[-1] == ("ps: resumed epoch 2 (--commit-every 4): server 0 from update 8, 2 "
                         "update(s) after it lost; server 1 from the epoch's start (no snapshot), "
                         "updates lost unknown (no intact record of its last one); 0 batches every "
                         "server held were not trained again")
    books[0]["skipped"] = [0, 0]
    assert not summary_record(books, cfg, 10, [])["exactly_once"]


def test_the_runs_snapshots_fresh_run_clears_them_resume_takes_them_a_bad_one_ends_every_rank(
        tmp_path):
    """ParameterServerRun._open_snapshots, rank by rank around one allgather (faked): a fresh run's
    server 1 removes its own snapshots and server 0 every one and every mark in the folder
    (another run's must never be resumed as this one's), nothing else; under --resume a server
    resumes its own newest snapshot of the epoch and counts the updates its mark shows after it;
    a server whose snapshot is refused puts the line into the allgather (so no rank waits for it)
    and raises it, and so does every other rank that reads it there."""
    from types import SimpleNamespace

    from ringtrain.strategies.ps import run as ps_run

    stub = type("Stub", (ps_run.ParameterServerRun,), {"momentum_rule": "torch"})
    stub.__abstractmethods__ = frozenset()
    fixed = SimpleNamespace(start_epoch=1, steps=4, n_train=96)

    def a_run(rank: int, resume: bool, others: list | None = None):
        run = object.__new__(stub)
        run.args = SimpleNamespace(checkpoint_dir=str(tmp_path), resume=resume, commit_every=4,
                                   batch_size=4, backward_passes_per_step=1, seed=42,
                                   no_shuffle=False, momentum=0.9)
        run.identity = SimpleNamespace(framework="fake", model_name="softmax-v1", param_count=10)
        run.size, run._rank, run._roles = 10, rank, ps.Roles(2, 4)
        run.sent = []

        def gather(obj, name):
            run.sent.append(obj)
            return [obj if r == rank else (others or {}).get(r, {"problem": None, "done": None})
                    for r in range(4)]

        run.world = SimpleNamespace(gather=gather)
        cfg = ps.Config(run._roles, 10, 4, 0.9, "torch", 4, lambda e, t: 0.1)
        run.server = ps.Server(cfg, Net().link(rank), rank, np.zeros(cfg.length(rank), np.float32)) \
            if rank < 2 else None
        return run, (run._store(fixed) if rank < 2 else None)

    run, store = a_run(1, resume=False)  # server 1 clears its own (its host's folder may be its own)
    mine, theirs = a_snapshot(tmp_path, store.layout), a_snapshot(tmp_path, layout(CFG, 0))
    run._open_snapshots(fixed, store)
    assert not mine.exists() and theirs.exists()
    assert sorted(os.listdir(tmp_path)) == [theirs.name, "ps-server1of2-values5to10.updates"]
    run, store = a_run(0, resume=False)
    old = a_snapshot(tmp_path, store.layout)
    (tmp_path / "ckpt-epoch0001.pt").write_bytes(b"kept")
    run._open_snapshots(fixed, store)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-epoch0001.pt", "ps-server0of2-values0to5.updates"]
    assert run.sent == [{"problem": None, "done": None}]
    assert not old.exists()
    # --resume: server 0 from its snapshot of epoch 2 after 4 updates, its mark at 7
    path = a_snapshot(tmp_path, store.layout, weights=np.full(5, 3.0, np.float32))
    store.start()
    store.mark(2, 7)
    run, store = a_run(0, resume=True)
    run._open_snapshots(fixed, store)
    assert np.array_equal(run.server.weights, np.full(5, 3.0, np.float32))
    assert np.array_equal(run.server.velocity, np.ones(5, np.float32))
    assert run.server.books.resumed == {"epoch": 2, "from_update": 4, "updates_lost": 3,
                                        "snapshot": path.name, "batches_done": 0}
    # server 1's snapshot is refused: its line, on it and on every rank that reads it
    run, store = a_run(1, resume=True)
    bad = a_snapshot(tmp_path, store.layout)
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(UserError) as err:
        run._open_snapshots(fixed, store)
    line = one_line(err.value, f"snapshot {bad} is damaged")
    assert run.sent == [{"problem": line, "done": None}]
    worker, _ = a_run(3, resume=True, others={1: {"problem": line, "done": None}})
    with pytest.raises(UserError) as err:
        worker._open_snapshots(fixed, None)
    assert str(err.value) == line


# --- the servers' optimizers, clipping (issue #54) ------------------------------------------------

def framework_optimizer(rule: str, name: str, w0: np.ndarray, momentum: float | None, wd: float,
                        clip: float | None):
    """The ring's optimizer over the whole vector ``w0``, built by the ring's own builders
    (``torch_models.optimizers.build``, clipped by ``clip_grad_norm_`` as ``TorchRun.step`` does;
    ``tf_models.optimizers.build``, Keras' ``global_clipnorm`` and ``RingUpdate``'s L2 term):
    ``(step(grad, lr), weights(), state())``, its state under the servers' names."""
    args = argparse.Namespace(optimizer=name, weight_decay=wd, momentum=momentum,
                              clip_grad_norm=clip)
    if rule == "torch":
        import torch

        from torch_models import optimizers as torch_optimizers

        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.from_numpy(w0.copy()))
        opt = torch_optimizers.build(args, model, 0.1, None)

        def step(grad: np.ndarray, lr: float) -> None:
            model.w.grad = torch.from_numpy(grad.copy())
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()

        keys = {"velocity": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq",
                "square_avg": "square_avg"}

        def torch_state() -> dict[str, np.ndarray]:
            held = opt.state[model.w]
            return {name: held[key].numpy().copy() for name, key in keys.items()
                    if held.get(key) is not None}

        return step, lambda: model.w.detach().numpy().copy(), torch_state
    keras = pytest.importorskip("keras")
    from tf_models import optimizers as keras_optimizers

    var = keras.Variable(w0.copy())
    opt = keras_optimizers.build(args, 0.1, 1)
    opt.build([var])

    def keras_step(grad: np.ndarray, lr: float) -> None:
        opt.learning_rate = lr
        opt.apply_gradients([(keras.ops.convert_to_tensor(grad), var)])

    def keras_state() -> dict[str, np.ndarray]:
        slots = {"velocity": getattr(opt, "momentums", None) or getattr(opt, "_momentums", []),
                 "exp_avg": getattr(opt, "_momentums", []) if name.startswith("adam") else [],
                 ("square_avg" if name == "rmsprop" else "exp_avg_sq"): getattr(opt, "_velocities", [])}
        if name.startswith("adam"):
            slots["velocity"] = []
        return {k: np.asarray(v[0].numpy(), np.float32).copy() for k, v in slots.items() if v}

    return keras_step, lambda: np.asarray(var.numpy(), np.float32).copy(), keras_state


OPTIMIZER_CASES = [("sgd", 0.9, 0.0), ("sgd", 0.9, 0.01), ("sgd", 0.0, 0.01), ("adam", None, 0.0),
                   ("adam", None, 0.01), ("adamw", None, 0.01), ("rmsprop", 0.0, 0.01),
                   ("rmsprop", 0.5, 0.0)]


@pytest.mark.parametrize("rule", ["torch", "keras"])
@pytest.mark.parametrize("name,momentum,wd", OPTIMIZER_CASES)
def test_each_servers_optimizer_on_its_slices_is_the_frameworks_on_the_whole(rule, name, momentum,
                                                                               wd):
    """Each built-in optimizer, applied by two servers to their slices of one vector, equals the
    ring's optimizer of that framework (torch.optim, or the Keras classes with the ring's L2
    term) on the whole vector, step after step at a changing LR, to float32 rounding."""
    rng = np.random.default_rng(5)
    w0 = rng.normal(0, 1, 50).astype(np.float32)
    step, weights, state = framework_optimizer(rule, name, w0, momentum, wd, None)
    w = w0.copy()
    slices = (slice(0, 20), slice(20, 50))
    opts = [ps.slice_optimizer(name, w[sl], rule, momentum or 0.0, wd) for sl in slices]
    scale = (10.0 ** rng.integers(-5, 1, 50)).astype(np.float32)  # small ones: where epsilon counts
    for i in range(6):
        g = rng.normal(0, 1, 50).astype(np.float32) * scale
        lr = 0.01 * (1 + i)
        step(g, lr)
        for opt, sl in zip(opts, slices, strict=True):
            opt.apply(g[sl], lr)
    np.testing.assert_allclose(w, weights(), rtol=2e-5, atol=2e-6)
    assert not np.allclose(w, w0)
    theirs = state()  # the state too, closer: Adam's moments feel a constant off by 1e-5
    assert sorted(theirs) == sorted(opts[0].state())
    for key, array in theirs.items():
        mine = np.concatenate([opt.state()[key] for opt in opts])
        # (an element where the L2 term cancels the gradient is rounding's: atol by the scale)
        np.testing.assert_allclose(mine, array, rtol=2e-6, atol=1e-6 * float(np.abs(array).max()))
    assert opts[0].steps == 6 and list(opts[0].state()) == list(ps.state_names(momentum or 0.0, name))


@pytest.mark.parametrize("rule", ["torch", "keras"])
@pytest.mark.parametrize("servers", [1, 2])
def test_staleness_0_with_adamw_decay_and_clipping_is_the_rings_math(rule, servers):
    """K = 0, 3 workers, AdamW with weight decay and --clip-grad-norm: each step's mean gradient
    clipped by its global norm over every server's slice (the servers exchange their sums of
    squares), then one AdamW update: the ring's optimizer (torch.optim.AdamW after
    clip_grad_norm_, Keras' AdamW with global_clipnorm) on the whole vector fed the same mean
    gradients, to float32 rounding, whatever the slicing."""
    problem, workers, rows, steps, clip = Problem(n_train=96), 3, 4, 8, 0.05
    grad = softmax_grad(problem, rows, workers)
    lr = lambda epoch, t: 0.01 + 0.002 * t  # noqa: E731
    size = (problem.features + 1) * problem.classes
    w0 = np.random.default_rng(1).normal(0, 0.1, size).astype(np.float32)
    job = Job(servers, workers, 0, size=size, steps=steps, epochs=2, rule=rule, lr=lr, grad=grad,
              w0=w0, optimizer="adamw", weight_decay=0.01, clip=clip).run().check()
    step, weights, _ = framework_optimizer(rule, "adamw", w0, None, 0.01, clip)
    norms = []
    for epoch in (1, 2):
        for t in range(steps):
            want = weights()
            grads = [grad(want, (epoch, w, t)) for w in range(workers)]
            mean = grads[0].copy()
            for g in grads[1:]:
                mean += g
            mean /= np.float32(workers)
            norms.append(float(np.linalg.norm(mean.astype(np.float64))))
            step(mean, lr(epoch, t))
    assert max(norms) > clip  # the clip did clip
    for full in job.full.values():
        np.testing.assert_allclose(full, weights(), rtol=1e-5, atol=1e-6)
    assert not np.allclose(weights(), w0)
    assert [server.opt.steps for server in job.servers] == [2 * steps] * servers


@pytest.mark.parametrize("rule", ["torch", "keras"])
def test_above_staleness_0_each_gradient_is_clipped_by_its_own_norm(rule):
    """K > 0: each pushed gradient is applied alone, clipped by its own global norm (the worker
    clips it, holding all of it): one worker at K = 2 over two servers is the framework's Adam
    fed each gradient, clipped, at the LR."""
    problem, rows, steps, clip = Problem(n_train=64), 8, 8, 0.05
    grad = softmax_grad(problem, rows, 1)
    size = (problem.features + 1) * problem.classes
    w0 = np.random.default_rng(2).normal(0, 0.1, size).astype(np.float32)
    job = Job(2, 1, 2, size=size, steps=steps, rule=rule, grad=grad, w0=w0, optimizer="adam",
              clip=clip, lr=lambda e, t: 0.01).run().check()
    step, weights, _ = framework_optimizer(rule, "adam", w0, None, 0.0, clip)
    for t in range(steps):
        step(grad(weights(), (1, 0, t)), 0.01)
    np.testing.assert_allclose(job.full[2], weights(), rtol=1e-5, atol=1e-6)


def test_a_snapshot_round_trips_adams_state_and_step_count_and_refuses_another_optimizer(tmp_path):
    """A server's snapshot holds Adam's moments (``state.exp_avg``, ``state.exp_avg_sq``) and its
    step count exactly (a JSON integer: 2^53 + 1 is no float64, let alone float32); a server
    resumed from it holds the same state and steps on alike.  A job of another optimizer refuses
    it in one line naming both."""
    cfg = dataclasses.replace(CFG, optimizer="adamw", momentum=None, weight_decay=0.01)
    lay = layout(cfg, 0)
    assert lay.state == ("exp_avg", "exp_avg_sq")
    first = ps.Server(cfg, Net().link(0), 0, np.arange(10, dtype=np.float32))
    for i in range(3):
        first.opt.apply(np.linspace(-1, 1 + i, 10, dtype=np.float32), 0.1)
    first.opt.steps = 2**53 + 1
    done = np.zeros((cfg.roles.workers, cfg.steps), bool)
    assert snapshot.Store(tmp_path, lay, 4).write(2, 4, first.opt.w, first.opt.state(), done,
                                                  first.opt.steps)
    snap = snapshot.Store(tmp_path, lay, 4).newest(2)
    assert snap.steps == 2**53 + 1 and type(snap.steps) is int
    assert sorted(snap.state) == ["exp_avg", "exp_avg_sq"]
    second = ps.Server(cfg, Net().link(0), 0, np.zeros(10, np.float32))
    second.resume(2, 4, done, done, snap.weights, snap.state, snap.steps)
    assert second.opt.steps == first.opt.steps
    for name, array in first.opt.state().items():
        assert np.array_equal(second.opt.state()[name], array)
    first.opt.steps = second.opt.steps = 7  # (a count Adam's bias correction can read)
    g = np.full(10, 0.25, np.float32)
    first.opt.apply(g, 0.1)
    second.opt.apply(g, 0.1)
    assert np.array_equal(first.weights, second.weights)
    with pytest.raises(UserError) as err:
        snapshot.Store(tmp_path, layout(CFG, 0), 4).newest(2)
    one_line(err.value, f"snapshot {tmp_path / lay.file_name(2, 4)}",
             "holds the state of --optimizer adamw, this job runs --optimizer sgd",
             "resume with --optimizer adamw")


def test_the_servers_apply_a_builtin_optimizer_and_refuse_a_factory_in_one_line():
    """The servers' flags: --optimizer adamw, --weight-decay, --clip-grad-norm and --precision
    bf16 pass; a factory's optimizer (the servers apply their own element-wise arithmetic) and
    --shard-optimizer are one line each."""
    from ringtrain import optimizer_spec

    def args(**given):
        base = dict(optimizer="sgd", weight_decay=0.0, clip_grad_norm=None, precision="fp32",
                    shard_optimizer=False)
        return argparse.Namespace(**{**base, **given})

    optimizer_spec.check_servers(args(optimizer="adamw", weight_decay=0.01, clip_grad_norm=1.0,
                                      precision="bf16"), "--strategy ps")
    with pytest.raises(UserError) as err:
        optimizer_spec.check_servers(args(optimizer="mypkg.opt:make"), "--strategy ps")
    one_line(err.value, "--optimizer mypkg.opt:make with --strategy ps", "built-in optimizer")
    with pytest.raises(UserError) as err:
        optimizer_spec.check_servers(args(shard_optimizer=True), "--strategy ps")
    one_line(err.value, "the servers already hold each slice's optimizer state once")
