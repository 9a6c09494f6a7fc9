"""A fake framework for the shared loops: N ranks as threads of one process, a model in NumPy.

* :class:`Bus` stands in for Horovod's collectives: every rank's call waits for every other
  rank's (a barrier, bounded in time) and the bus checks that all of them issued the same
  collective under the same name, in the same order, which is what Horovod needs and what a
  hang looks like when it is not so.  Each rank's sequence of collectives is kept for the tests.
* :class:`FakeRun` is a :class:`ringtrain.training.run.FrameworkRun` around softmax regression in
  float64 NumPy: its step averages the gradients over the ranks through the bus, as Horovod's
  ``DistributedOptimizer`` does, so N ranks equal one process with N times the batch to the
  last bits that float64 summation order allows.
* :func:`run_ranks` runs a function on N such ranks and returns their results (or re-raises the
  first rank's exception), with a bound on the time.

No process is started, no framework imported: each test of the loops takes milliseconds.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ringtrain.data.dataset import DataInfo
from ringtrain.strategies import registry
from ringtrain.training.run import FrameworkRun, RunIdentity, StepTag
from ringtrain.training.world import Collectives, World

TIMEOUT = 20.0  # seconds a rank waits for the others at a collective before the test fails


class Mismatch(AssertionError):
    """Ranks issued different collectives at the same point: a real job would hang there."""


class Bus:
    """The collectives of one world of ``size`` ranks, in one process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=TIMEOUT)
        self.slots: list[Any] = [None] * size
        self.calls: list[list[tuple[str, str]]] = [[] for _ in range(size)]

    def _exchange(self, rank: int, kind: str, name: str, value: Any) -> list[Any]:
        self.calls[rank].append((kind, name))
        self.slots[rank] = (kind, name, value)
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them all
        issued = {(k, n) for k, n, _ in seen}
        if len(issued) != 1:
            self.barrier.abort()
            raise Mismatch(f"ranks issued different collectives at once: {sorted(issued)}")
        return [v for _, _, v in seen]

    def collectives(self, rank: int) -> Collectives:
        def total(values: Sequence[float], name: str) -> list[float]:
            return list(np.sum(np.asarray(self._exchange(rank, "sum", name, list(values)),
                                          np.float64), axis=0))

        def broadcast(array: np.ndarray, name: str) -> np.ndarray:
            return np.array(self._exchange(rank, "broadcast", name, np.array(array))[0])

        def gather(array: np.ndarray, name: str) -> np.ndarray:
            return np.concatenate(self._exchange(rank, "allgather", name, np.array(array)))

        return Collectives(sum=total, broadcast=broadcast, allgather=gather)

    def average(self, rank: int, grads: np.ndarray, name: str) -> np.ndarray:
        """Horovod's gradient allreduce (average) on this bus."""
        return np.mean(np.stack(self._exchange(rank, "allreduce", name, grads)), axis=0)


class FakeHvd:
    """What :class:`World` asks of Horovod's module."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def mpi_enabled(self) -> bool:
        return True

    def gloo_enabled(self) -> bool:
        return False


def fake_world(bus: Bus, rank: int) -> World:
    return World(FakeHvd(rank, bus.size), bus.collectives(rank))


def args(**overrides: Any) -> argparse.Namespace:
    """The trainer's flags as users give them (``launch.cli``'s parser, defaults and checks), with
    ``overrides`` (``batch_size=8``...)."""
    from launch.cli import build_parser

    ns = build_parser("torch").parse_args(["--no-progress"])
    for key, value in overrides.items():
        setattr(ns, key, value)
    return registry.validate(ns)


class Problem:
    """Synthetic 3-class data: ``n_train`` + ``n_test`` points in 4 dimensions."""

    classes, features = 3, 4

    def __init__(self, n_train: int = 96, n_test: int = 30, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        centres = rng.normal(0, 2.0, (self.classes, self.features))
        y = rng.integers(0, self.classes, n_train + n_test)
        x = centres[y] + rng.normal(0, 1.0, (len(y), self.features))
        self.train_x, self.test_x = x[:n_train], x[n_train:]
        self.train_y, self.test_y = y[:n_train], y[n_train:]
        self.info = DataInfo("fake", "fake", (self.features,), self.classes, None, n_train, n_test,
                             None, image=False)


def loss_and_grad(w: np.ndarray, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-example cross-entropy of softmax regression (weights ``[features + 1, classes]``) and
    the gradient of its mean."""
    xb = np.hstack([x, np.ones((len(x), 1))])
    logits = xb @ w
    logits -= logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    losses = -np.log(p[np.arange(len(y)), y])
    p[np.arange(len(y)), y] -= 1.0
    return losses, xb.T @ p / len(y)


class FakeRun(FrameworkRun):
    """One rank's run of softmax regression, SGD with momentum, gradients averaged on the bus.

    ``read`` logs every training index this rank stepped on, per epoch; ``saved`` the epochs it
    checkpointed; ``poison_at`` = (rank, step number) makes that rank's loss and gradient NaN at
    its n-th step (from 1, counted over the run), as a bad input would."""

    def __init__(self, args: argparse.Namespace, bus: Bus, rank: int, problem: Problem,
                 poison_at: tuple[int, int] | None = None) -> None:
        self.args, self.bus, self.rank_id, self.problem_data = args, bus, rank, problem
        self.world = fake_world(bus, rank)
        self.identity = RunIdentity.of(args, "fake", {"numpy": np.__version__}, problem.info,
                                       (problem.features + 1) * problem.classes)
        self.w = np.random.default_rng(rank).normal(0, 0.1, (problem.features + 1, problem.classes))
        self.w = self.world.broadcast(self.w, "initial_weights")  # rank 0's, as Horovod's broadcast
        self.velocity = np.zeros_like(self.w)
        self.loss_sum, self.steps_taken, self.poison_at = 0.0, 0, poison_at
        self.read: list[np.ndarray] = []
        self.saved: list[int] = []
        self.lrs: list[float] = []
        self.data_problem: str | None = None

    def new_world(self, bus: Bus, rank: int) -> World:
        self.bus, self.rank_id = bus, rank
        self.world = fake_world(bus, rank)
        return self.world

    def batches(self, steps):
        for idx in steps:
            self.read.append(np.asarray(idx))
            yield self.problem_data.train_x[idx], self.problem_data.train_y[idx]

    def step(self, batch, lr: float):
        x, y = batch
        self.steps_taken += 1
        losses, grad = loss_and_grad(self.w, x, y)
        if self.poison_at == (self.rank_id, self.steps_taken):
            losses, grad = losses * np.nan, grad * np.nan
            self.data_problem = f"item {int(self.read[-1][0])} is unreadable"
        grad = self.bus.average(self.rank_id, grad, "gradients")
        self.velocity = self.args.momentum * self.velocity + grad
        self.w = self.w - lr * self.velocity
        self.lrs.append(lr)
        self.loss_sum += float(losses.sum())
        return float(losses.mean()), len(y)

    def take_loss_sum(self) -> float:
        total, self.loss_sum = self.loss_sum, 0.0
        return total

    def diverged(self, tag: StepTag) -> StepTag | None:
        return None if np.isfinite(self.w).all() else tag

    @property
    def problem(self) -> str | None:
        return self.data_problem

    def sync_buffers(self) -> None:
        pass

    def eval_sums(self) -> list[float]:
        p = self.problem_data
        idx = np.arange(self.world.rank, len(p.test_y), self.world.size)
        losses, _ = loss_and_grad(self.w, p.test_x[idx], p.test_y[idx])
        xb = np.hstack([p.test_x[idx], np.ones((len(idx), 1))])
        correct = float(((xb @ self.w).argmax(1) == p.test_y[idx]).sum())
        return [float(losses.sum()), correct, float(len(idx)), 0.0]

    def save(self, epoch: int) -> None:
        self.saved.append(epoch)

    def parameters(self) -> list[np.ndarray]:
        return [self.w.astype(np.float32)]


def run_ranks(size: int, work: Callable[[int], Any]) -> list[Any]:
    """``work(rank)`` on ``size`` threads; their results in rank order, or the first rank's
    exception (a Mismatch first: it is the cause of the others' broken barriers)."""
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def main(rank: int) -> None:
        try:
            results[rank] = work(rank)
        except BaseException as err:  # handed to the test below
            errors[rank] = err

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT * 3)
    assert not any(t.is_alive() for t in threads), "a rank is still running: the loop hangs"
    mismatch = [e for e in errors if isinstance(e, Mismatch)]
    first = mismatch[0] if mismatch else next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
