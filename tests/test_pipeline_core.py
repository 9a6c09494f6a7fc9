"""The pipeline's framework-free parts, without processes or frameworks (milliseconds): where
ranks sit, how a chain of layers splits, the two schedules and their bubble, and one step of S
stages as threads (a NumPy MLP over an in-process wire) equal to one process's full-batch
gradient, in float64.  The multi-process runs are in tests/test_pipeline.py."""

from __future__ import annotations

import argparse
import itertools
import queue
import threading
import time
import weakref
from collections import defaultdict, deque

import numpy as np
import pytest

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline import timing
from ringtrain.strategies.pipeline.engine import Boundary, EvalRelay, run_step
from ringtrain.strategies.pipeline.partition import Stage, balanced_split, timed_stages
from ringtrain.strategies.pipeline.placement import Placement, check_world
from ringtrain.strategies.pipeline.run import micro_rows
from ringtrain.strategies.pipeline.schedule import (
    BACKWARD,
    FORWARD,
    bubble_formula,
    in_flight,
    simulate,
    stage_ops,
)

# --- placement ---------------------------------------------------------------------------------


def test_ranks_of_a_replica_are_contiguous_and_a_stage_set_holds_one_rank_per_replica():
    places = [Placement(3, 6, r) for r in range(6)]
    assert [(p.stage, p.replica) for p in places] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert places[4].stage_ranks(1) == [1, 4] and places[4].stage_root == 1
    assert (places[3].previous, places[3].next) == (None, 4)
    assert (places[5].previous, places[5].next) == (4, None)
    sets = [places[0].stage_ranks(s) for s in range(3)]
    assert sorted(itertools.chain(*sets)) == list(range(6)), "the sets partition the world"


def test_stages_must_divide_the_world():
    check_world(2, 4)
    check_world(1, 3)
    with pytest.raises(UserError, match="--pipeline-stages 2 must divide the number of processes, not 3"):
        check_world(2, 3)


# --- the split ---------------------------------------------------------------------------------

# The built-in CNN's layers: conv1 relu pool conv2 relu pool flatten fc1 relu dropout fc2.
CNN_PARAMS = [832, 0, 0, 51264, 0, 0, 0, 131200, 0, 0, 1290]
CNN_CUTS = [18432, 18432, 4608, 4096, 4096, 1024, 1024, 128, 128, 128, 10]


def test_the_cnn_splits_before_its_large_dense_layer_at_the_smallest_cut():
    # fc1 alone holds 131,200 of 184,586 weights, so stage 1 starts at or before it; of the
    # cuts that keep it there, after the second pool and after flatten carry 1024 values (the
    # earliest wins), after conv2 4096.
    assert balanced_split(CNN_PARAMS, CNN_CUTS, 2, "cnn") == [range(0, 6), range(6, 11)]
    four = balanced_split(CNN_PARAMS, CNN_CUTS, 4, "cnn")
    assert [sum(CNN_PARAMS[i] for i in r) for r in four] == [832, 51264, 131200, 1290]


def brute_force_max(params, stages):
    n, best = len(params), None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        parts = [params[a:b] for a, b in itertools.pairwise(bounds)]
        if all(any(p > 0 for p in part) for part in parts):
            worst = max(sum(part) for part in parts)
            best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_the_split_minimises_the_largest_stage_and_gives_every_stage_weights(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    params = [int(p) if rng.random() < 0.7 else 0 for p in rng.integers(1, 100, n)]
    if sum(p > 0 for p in params) < 2:
        params[0] = params[-1] = 5
    cuts = [int(c) for c in rng.integers(1, 50, n)]
    for stages in range(2, sum(p > 0 for p in params) + 1):
        ranges = balanced_split(params, cuts, stages, "m")
        assert [i for r in ranges for i in r] == list(range(n)), "contiguous, covering, in order"
        assert all(any(params[i] for i in r) for r in ranges)
        assert max(sum(params[i] for i in r) for r in ranges) == brute_force_max(params, stages)


def brute_force_splits(costs, params, stages):
    """Every split of ``len(costs)`` layers into contiguous stages each holding weights: (its
    slowest stage's cost, the values crossing its cuts, its cuts)."""
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts, n]
        if all(any(params[a:b]) for a, b in itertools.pairwise(bounds)):
            yield max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds)), cuts


@pytest.mark.parametrize("seed", range(20))
def test_the_split_by_costs_minimises_the_slowest_stage_and_gives_every_stage_weights(seed):
    """--partition time: the same search on each layer's seconds.  Weights still decide which
    layers may form a stage (a layer without weights may cost the most); the slowest stage is the
    smallest possible, or, with a slack, within it of the smallest, the cut tie-break choosing
    among those."""
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(3, 9))
    params = [int(p) if rng.random() < 0.6 else 0 for p in rng.integers(1, 100, n)]
    if sum(p > 0 for p in params) < 2:
        params[0] = params[-1] = 5
    costs = [float(c) for c in rng.uniform(1e-4, 5e-2, n)]  # seconds: no tie by accident
    cut_sizes = [int(c) for c in rng.integers(1, 50, n)]
    for stages in range(2, sum(p > 0 for p in params) + 1):
        options = list(brute_force_splits(costs, params, stages))
        best = min(worst for worst, _ in options)
        ranges = balanced_split(params, cut_sizes, stages, "m", costs)
        assert [i for r in ranges for i in r] == list(range(n))
        assert all(any(params[i] for i in r) for r in ranges)
        assert max(sum(costs[i] for i in r) for r in ranges) == best
        slack = 0.3
        loose = balanced_split(params, cut_sizes, stages, "m", costs, slack)
        assert max(sum(costs[i] for i in r) for r in loose) <= best * (1 + slack)
        fewest = min(sum(cut_sizes[c - 1] for c in cuts) for worst, cuts in options
                     if worst <= best * (1 + slack))
        assert sum(cut_sizes[r.start - 1] for r in loose[1:]) == fewest


def test_costs_move_the_cut_that_parameter_counts_place():
    """A wide cheap layer then costly narrow ones: by parameters the wide layer is a stage of its
    own, by costs it shares stage 0 with the first costly layer; costs equal to the parameter
    counts give the parameter split exactly."""
    params, cuts = [1000, 0, 10, 10, 10, 10], [50, 50, 50, 50, 50, 10]
    costs = [1.0, 0.01, 3.0, 3.0, 3.0, 3.0]
    assert balanced_split(params, cuts, 2, "m") == [range(0, 1), range(1, 6)]
    assert balanced_split(params, cuts, 2, "m", costs) == [range(0, 4), range(4, 6)]
    for stages in (2, 3, 4):
        assert balanced_split(params, cuts, stages, "m", params) == balanced_split(params, cuts, stages, "m")
        assert balanced_split(CNN_PARAMS, CNN_CUTS, stages, "cnn", CNN_PARAMS) == \
            balanced_split(CNN_PARAMS, CNN_CUTS, stages, "cnn")


def test_each_stage_records_its_share_of_the_timed_seconds():
    stages = [Stage(0, ("a", "b"), 10, 40, (4,), (3,)), Stage(1, ("c",), 5, 20, (3,), (2,))]
    timed = timed_stages(stages, [0.5, 1.5, 2.0])
    assert [(s.seconds, s.time_share) for s in timed] == [(2.0, 0.5), (2.0, 0.5)]
    assert timed[0].record()["time_share"] == 0.5 and "50% of the timed compute" in timed[0].line()
    assert timed_stages(stages, None) == stages
    assert "seconds" not in stages[0].record() and "timed" not in stages[0].line()


def timing_ranks(measure_on, size: int = 3):
    """Each rank of a fake world (threads, Horovod's collectives checked to match) asks for the
    layers' seconds as a pipeline rank does (:func:`timing.for_run`); ``measure_on(rank)`` is the
    rank's own measurement.  Each rank's outcome (its seconds, or its UserError's text) and the
    ranks that measured."""
    from fake_run import Bus, fake_world

    bus, measured = Bus(size), []
    args = argparse.Namespace(partition="time", checkpoint_activations=False)

    def rank(r):
        plan = timing.for_run(fake_world(bus, r), args, 8)

        def measure():
            measured.append(r)
            return measure_on(r)

        try:
            return plan.agree(measure)
        except UserError as err:
            return str(err)

    return on_threads(size, rank), measured, bus.calls


def test_rank_0_times_and_every_rank_splits_on_its_seconds():
    """Timings differ from rank to rank: only rank 0 measures, and every rank gets its figures
    (one broadcast, the same collectives on every rank)."""
    got, measured, calls = timing_ranks(lambda r: [0.1 * (r + 1), 0.2, 0.3])
    assert got == [[0.1, 0.2, 0.3]] * 3 and measured == [0]
    assert calls[0] == calls[1] == calls[2] and calls[0]
    assert timing.for_run(None, argparse.Namespace(partition="params"), 8) is None


@pytest.mark.parametrize("failure,says", [
    (RuntimeError("not enough memory\nsecond line"), "--partition time: timing the model's layers "
                                                     "on rank 0 failed (RuntimeError: not enough "
                                                     "memory); use --partition params"),
    (UserError("--model m: bad"), "--model m: bad"),
])
def test_a_failure_while_timing_on_rank_0_ends_every_rank_in_one_line(failure, says):
    def measure(r):
        raise failure

    got, measured, _ = timing_ranks(measure)
    assert got == [says] * 3 and measured == [0] and "\n" not in says


def test_more_stages_than_layers_with_weights_is_one_line():
    with pytest.raises(UserError, match="--pipeline-stages 5 is more than the 4 layers with weights "
                                        "of --model cnn"):
        balanced_split(CNN_PARAMS, CNN_CUTS, 5, "--model cnn")


# --- the schedules -----------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8)])
def test_every_micro_batch_runs_forward_then_backward_once(schedule, stages, micro):
    for s in range(stages):
        ops = stage_ops(schedule, stages, s, micro)
        assert sorted(ops) == sorted([(FORWARD, m) for m in range(micro)]
                                     + [(BACKWARD, m) for m in range(micro)])
        assert [m for k, m in ops if k == FORWARD] == list(range(micro))
        for m in range(micro):
            assert ops.index((FORWARD, m)) < ops.index((BACKWARD, m))


def test_the_orders_are_gpipe_and_1f1b():
    assert stage_ops("gpipe", 2, 0, 3) == [("F", 0), ("F", 1), ("F", 2), ("B", 2), ("B", 1), ("B", 0)]
    # Stage 0 of 3 warms up with S - 1 = 2 forwards, the last stage alternates from the start.
    assert stage_ops("1f1b", 3, 0, 4) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3),
                                          ("B", 1), ("B", 2), ("B", 3)]
    assert stage_ops("1f1b", 3, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2),
                                          ("B", 2), ("F", 3), ("B", 3)]


@pytest.mark.parametrize("stages,micro", [(2, 8), (4, 8), (4, 2)])
def test_1f1b_holds_at_most_s_minus_stage_micro_batches_gpipe_all(stages, micro):
    for s in range(stages):
        assert in_flight(stage_ops("gpipe", stages, s, micro)) == micro
        assert in_flight(stage_ops("1f1b", stages, s, micro)) == min(stages - s, micro)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro", [1, 2, 4, 8])
@pytest.mark.parametrize("backward", [1.0, 2.0])
def test_the_bubble_of_a_balanced_pipeline_is_s_minus_1_over_m_plus_s_minus_1(schedule, stages, micro,
                                                                              backward):
    timeline = simulate(schedule, stages, micro, forward=1.0, backward=backward)
    assert timeline.makespan == pytest.approx((micro + stages - 1) * (1.0 + backward))
    assert timeline.bubble() == pytest.approx(bubble_formula(stages, micro))


def test_an_unbalanced_pipeline_idles_more_than_the_formula():
    # One stage twice as slow as the other (the CNN split by parameters is like that): the
    # formula is the floor a balanced split reaches, not what this one gets.
    for schedule in ("gpipe", "1f1b"):
        slow = simulate(schedule, 2, 4, forward=[2.0, 1.0], backward=[4.0, 2.0])
        assert slow.bubble() > bubble_formula(2, 4) + 0.05  # 0.33 (gpipe), 0.28 (1f1b) vs 0.2


def test_micro_batches_of_a_short_step():
    assert micro_rows(32, 8) == [8, 8, 8, 8]
    assert micro_rows(20, 8) == [8, 8, 4]


# --- one step of S stages as threads, against one process ---------------------------------------

class Wire:
    """In-process point-to-point messages between ranks that are threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.boxes: dict[tuple[int, int, int], queue.Queue] = {}

    def box(self, src: int, dst: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault((src, dst, tag), queue.Queue())


class FakeLink:
    """:class:`ringtrain.strategies.pipeline.transport.Link`'s point-to-point half over a :class:`Wire`; it
    records the most receives posted and not yet taken."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self.rank = wire, rank
        self.open = self.most_open = 0

    def post(self, shape, dtype, source, tag, what):
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        return shape, np.dtype(dtype), source, tag

    def wait(self, incoming):
        shape, dtype, source, tag = incoming
        array = self.wire.box(source, self.rank, tag).get(timeout=10)
        assert array.shape == shape and array.dtype == dtype
        self.open -= 1
        return array

    def send(self, array, dest, tag):
        self.wire.box(self.rank, dest, tag).put(np.array(array))
        return 0  # a copy went: nothing outstanding

    def release(self):
        return 0

    def finish_sends(self, what, keep=0):
        pass


def mlp_weights(sizes, rng):
    return [(rng.standard_normal((a, b)) / np.sqrt(a), rng.standard_normal(b) * 0.1)
            for a, b in itertools.pairwise(sizes)]


def forward_layers(layers, x, last):
    """tanh MLP; the model's final layer returns logits.  Returns the output and the cache."""
    cache, h = [], x
    for i, (w, b) in enumerate(layers):
        z = h @ w + b
        cache.append((h, z))
        h = z if last and i == len(layers) - 1 else np.tanh(z)
    return h, cache


def backward_layers(layers, cache, grad, last, grads):
    for i in reversed(range(len(layers))):
        w, _ = layers[i]
        h, z = cache[i]
        if not (last and i == len(layers) - 1):
            grad = grad * (1 - np.tanh(z) ** 2)
        grads[i][0] += h.T @ grad
        grads[i][1] += grad.sum(0)
        grad = grad @ w.T
    return grad


def softmax_grad(logits, y, total_rows):
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    loss = -np.log(p[np.arange(len(y)), y]).sum()
    p[np.arange(len(y)), y] -= 1
    return loss, p / total_rows


class NumpyStage:
    """A stage of the MLP as :class:`ringtrain.strategies.pipeline.engine.StageWork`."""

    def __init__(self, layers, first, last, x, y, rows):
        self.layers, self.first, self.last = layers, first, last
        self.grads = [[np.zeros_like(w), np.zeros_like(b)] for w, b in layers]
        bounds = np.cumsum([0, *rows])
        self.x = [x[a:b] for a, b in itertools.pairwise(bounds)]
        self.y = [y[a:b] for a, b in itertools.pairwise(bounds)]
        self.total, self.cache, self.loss, self.log = int(bounds[-1]), {}, 0.0, []
        self.probe = lambda: None  # called at every op (a test's own measure)

    def held(self):
        return len(self.cache)

    def forward(self, m, x):
        self.probe()
        self.log.append((FORWARD, m))
        out, cache = forward_layers(self.layers, self.x[m] if self.first else x, self.last)
        self.cache[m] = (cache, out)
        return None if self.last else out

    def backward(self, m, grad):
        self.probe()
        self.log.append((BACKWARD, m))
        cache, out = self.cache.pop(m)
        if self.last:
            loss, grad = softmax_grad(out, self.y[m], self.total)
            self.loss += loss
        back = backward_layers(self.layers, cache, grad, self.last, self.grads)
        return None if self.first else back


def on_threads(ranks: int, body, timeout: float = 60):
    """``body(rank)`` on one thread per rank; their results."""
    out, errors = [None] * ranks, []

    def run(rank):
        try:
            out[rank] = body(rank)
        except BaseException as err:  # noqa: BLE001 - the test thread reports it
            errors.append(err)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("rows", [[4], [4, 4], [4, 4, 4, 4], [4, 4, 2], [1] * 10])
def test_s_stages_as_threads_give_one_process_full_batch_gradient(schedule, rows):
    rng = np.random.default_rng(7)
    sizes = [5, 8, 7, 6, 4]  # three stages: layers [0], [1, 2], [3]
    layers = mlp_weights(sizes, rng)
    split = [layers[:1], layers[1:3], layers[3:]]
    x = rng.standard_normal((sum(rows), sizes[0]))
    y = rng.integers(0, sizes[-1], sum(rows))
    cuts = [Boundary((sizes[1],), np.float64), Boundary((sizes[3],), np.float64)]
    wire, stages = Wire(), len(split)
    works = [NumpyStage(split[s], s == 0, s == stages - 1, x, y, rows) for s in range(stages)]
    links = [FakeLink(wire, s) for s in range(stages)]
    def stage(s):
        place = Placement(stages, stages, s)
        run_step(place, links[s], works[s], stage_ops(schedule, stages, s, len(rows)), rows,
                 cuts[s - 1] if s else None, cuts[s] if s < stages - 1 else None)

    on_threads(stages, stage, timeout=20)
    for s in range(stages):
        assert works[s].log == stage_ops(schedule, stages, s, len(rows)), "ran its schedule in order"
        # S + 1 ahead for each of activations and gradients; posting all would be 2M.
        assert links[s].most_open <= 2 * (stages + 1), "receives are posted a window ahead"
    # One process, the whole batch at once, mean loss over the rows.
    grads = [[np.zeros_like(w), np.zeros_like(b)] for w, b in layers]
    logits, cache = forward_layers(layers, x, True)
    loss, grad = softmax_grad(logits, y, len(y))
    backward_layers(layers, cache, grad, True, grads)
    got = [g for work in works for g in work.grads]
    for (gw, gb), (ww, wb) in zip(got, grads, strict=True):
        np.testing.assert_allclose(gw, ww, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(gb, wb, rtol=1e-12, atol=1e-14)
    assert works[-1].loss == pytest.approx(loss, rel=1e-12)


def test_evaluation_relays_batches_through_the_stages():
    wire, stages = Wire(), 3
    cut = Boundary((2,), np.float64)
    links = [FakeLink(wire, s) for s in range(stages)]
    relays = [EvalRelay(Placement(stages, stages, s), links[s], cut if s else None,
                        cut if s < stages - 1 else None) for s in range(stages)]
    batches = [np.full((n, 2), float(n)) for n in (3, 1, 2)]
    results: dict[int, list] = {s: [] for s in range(stages)}

    def stage(s):
        for b in batches:  # every stage walks the same batches; only stage 0 reads them
            results[s].append(relays[s](lambda v: np.asarray(v) + 1, b if s == 0 else None, len(b),
                                        np.asarray))
        relays[s].finish()

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(stages)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert results[0] == [None] * 3 and results[1] == [None] * 3
    for out, b in zip(results[2], batches, strict=True):
        np.testing.assert_array_equal(out, b + 3)  # one +1 per stage


# --- resume: every stage from the same epoch ---------------------------------------------------

def resume_on_ranks(newest: dict[int, int], resume: bool = True):
    """S = 2 x R = 2 as threads over the fake bus (tests/fake_run.py); stage s's writer has
    intact files up to epoch ``newest[s]`` (0: none).  Returns each rank's epoch and its loads."""
    from fake_run import Bus, args, fake_world, run_ranks

    from ringtrain.strategies.pipeline.run import resume_epoch

    bus = Bus(4)

    def work(rank):
        place = Placement(2, 4, rank)
        loads = []

        def find(at_most):
            best = newest[place.stage] if at_most is None else min(newest[place.stage], at_most)
            return (best, f"stage{place.stage}@{best}") if best else None

        epoch = resume_epoch(fake_world(bus, rank), place, args(resume=resume, checkpoint_dir="ck"),
                             find, loads.append)
        return epoch, loads

    return run_ranks(4, work)


def test_every_stage_resumes_from_the_oldest_newest_checkpoint(capsys):
    got = resume_on_ranks({0: 3, 1: 2})
    assert [epoch for epoch, _ in got] == [2, 2, 2, 2]
    # only the stages' first replicas (ranks 0 and 1) read files, each its own stage's of epoch 2
    assert [loads for _, loads in got] == [["stage0@2"], ["stage1@2"], [], []]
    assert "newest intact checkpoints are of epochs [3, 2]" in capsys.readouterr().err


def test_a_stage_without_checkpoints_starts_every_stage_afresh():
    got = resume_on_ranks({0: 2, 1: 0})
    assert [epoch for epoch, _ in got] == [0] * 4 and all(loads == [] for _, loads in got)
    assert [epoch for epoch, _ in resume_on_ranks({0: 2, 1: 2}, resume=False)] == [0] * 4


# --- what crosses a cut is checked against its boundary ---------------------------------------------

class Ended(Exception):
    """watchdog.end_job's line, raised where the job would have ended (exit 3)."""


@pytest.fixture
def ended(monkeypatch):
    from ringtrain.faults import watchdog

    def end_job(line):
        assert "\n" not in line, line
        raise Ended(line)

    monkeypatch.setattr(watchdog, "end_job", end_job)


class FakeMPI:
    """What the pipeline's transport uses of mpi4py's ``MPI``: a receive completes with
    ``got`` bytes (an exception: with that MPI error)."""

    BYTE, ERR_TRUNCATE, ERR_OTHER = "byte", 15, 16

    class Exception(Exception):  # noqa: N818 - mpi4py's name
        def __init__(self, error_class):
            self.error_class = error_class

        def Get_error_class(self):  # noqa: N802
            return self.error_class

    def __init__(self, got):
        mpi = self

        class Status:
            def __init__(self):
                self.count = None

            def Get_count(self, datatype):  # noqa: N802
                assert datatype == mpi.BYTE
                return self.count

        class Request:
            def Test(self, status=None):  # noqa: N802
                if isinstance(got, BaseException):
                    raise got
                if status is not None:
                    status.count = got
                return True

        self.Status, self.request = Status, Request()


class FakeComm:
    def __init__(self, mpi):
        self.mpi, self.posted = mpi, []

    def Irecv(self, buffer, source, tag):  # noqa: N802
        self.posted.append(buffer)
        return self.mpi.request


def short_message(monkeypatch, got):
    from ringtrain.strategies.pipeline import transport

    mpi = FakeMPI(got)
    monkeypatch.setattr(transport, "mpi", lambda: mpi)
    link = transport.Link(FakeComm(mpi), rank=1, timeout=5.0)
    return link, link.post((32, 128), np.float32, 0, 4, "stage 0's activations of micro-batch 3")


def test_a_short_pipeline_message_does_not_fill_its_buffer(monkeypatch, ended):
    """Issue 6: a 512-byte message completed a 16 KiB receive whose tail was leftover heap
    memory, used as activations."""
    link, incoming = short_message(monkeypatch, 512)
    with pytest.raises(Ended) as line:
        link.wait(incoming)
    assert ("rank 1 refused stage 0's activations of micro-batch 3 from rank 0: 512 bytes, "
            "expected 16384 bytes (shape (32, 128) of float32") in str(line.value)


def test_a_pipeline_message_longer_than_its_buffer_is_refused(monkeypatch, ended):
    link, incoming = short_message(monkeypatch, FakeMPI.Exception(FakeMPI.ERR_TRUNCATE))
    with pytest.raises(Ended) as line:
        link.wait(incoming)
    assert "from rank 0: longer than its buffer (MPI_ERR_TRUNCATE)" in str(line.value)
    link, incoming = short_message(monkeypatch, FakeMPI.Exception(FakeMPI.ERR_OTHER))
    with pytest.raises(FakeMPI.Exception):  # any other MPI error is MPI's to report
        link.wait(incoming)


def test_a_whole_pipeline_message_is_the_received_array(monkeypatch, ended):
    link, incoming = short_message(monkeypatch, 32 * 128 * 4)
    assert link.wait(incoming) is incoming.buffer


class Outbox(FakeLink):
    """A :class:`FakeLink` whose waits return ``inputs`` and whose sends are recorded."""

    def __init__(self, inputs):
        super().__init__(Wire(), 0)
        self.inputs, self.sent = inputs, []

    def wait(self, incoming):
        shape, dtype, _, _ = incoming
        return self.inputs.pop(0) if self.inputs else np.zeros(shape, dtype)

    def send(self, array, dest, tag):
        self.sent.append((array, dest, tag))
        return len(self.sent)


class Returns:
    """A stage whose forward and backward return the given arrays."""

    def __init__(self, forward=None, backward=None):
        self.out = {FORWARD: forward, BACKWARD: backward}

    def forward(self, m, x):
        return self.out[FORWARD]

    def backward(self, m, grad):
        return self.out[BACKWARD]


@pytest.mark.parametrize("wrong,says", [
    (np.zeros((2, 5), np.float32), "shape (2, 5) of float32"),
    (np.zeros((2, 4), np.float64), "shape (2, 4) of float64"),
    (np.zeros((4, 2), np.float32), "shape (4, 2) of float32"),
    ([[0.0] * 4] * 2, "a list")])
def test_a_stage_output_of_the_wrong_shape_or_dtype_is_not_sent(wrong, says, ended):
    """Issue 6: outputs were sent without being checked against the boundary's shape and dtype."""
    cut = Boundary((4,), np.float32)
    link = Outbox([])
    with pytest.raises(Ended) as line:
        run_step(Placement(3, 3, 0), link, Returns(forward=wrong), [(FORWARD, 0)], [2], None, cut)
    assert (f"stage 0 (rank 0) computed the activations of micro-batch 0 as {says}, expected "
            f"shape (2, 4) of float32 (the boundary to stage 1, rank 1)") in str(line.value)
    assert link.sent == []


def test_a_gradient_of_the_wrong_dtype_is_not_sent_back(ended):
    cut = Boundary((3,), np.float32)
    link = Outbox([])
    work = Returns(backward=np.zeros((2, 3), np.float16))
    with pytest.raises(Ended) as line:
        run_step(Placement(3, 3, 2), link, work, [(FORWARD, 0), (BACKWARD, 0)], [2], cut, None)
    assert ("stage 2 (rank 2) computed the input's gradients of micro-batch 0 as shape (2, 3) of "
            "float16, expected shape (2, 3) of float32 (the boundary to stage 1, rank 1)") in str(line.value)
    assert link.sent == []


def test_test_activations_of_the_wrong_shape_are_not_sent(ended):
    cut = Boundary((2,), np.float64)
    link = Outbox([])
    relay = EvalRelay(Placement(2, 2, 0), link, None, cut)
    with pytest.raises(Ended) as line:
        relay(lambda x: np.zeros((3, 3)), np.zeros((3, 2)), 3, np.asarray)
    assert "computed test activations as shape (3, 3) of float64, expected shape (3, 2)" in str(line.value)
    assert link.sent == []


# --- memory: what a stage holds, measured from its buffers --------------------------------------

class ThreadMPI:
    """What the transport uses of mpi4py's ``MPI``, for ranks that are threads: a message is
    copied when a send meets the receive posted for it (per sender, receiver and tag, in the
    order each side posted), and both requests complete then, as MPI's synchronous sends do (the
    latest a send may complete; an eager one completes sooner).  ``holding(rank)``: the send
    requests of ``rank`` still alive, i.e. the send buffers its transport still keeps."""

    BYTE, ERR_TRUNCATE = "byte", 15

    class Exception(Exception):  # noqa: N818 - mpi4py's name
        def Get_error_class(self):  # noqa: N802
            return -1

    class Status:
        count = None

        def Get_count(self, datatype):  # noqa: N802
            return self.count

    class Request:
        done, count = False, None

        def Test(self, status=None):  # noqa: N802
            if self.done and status is not None:
                status.count = self.count
            return self.done

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.unmatched: dict[tuple, deque] = defaultdict(deque)  # sends no receive met yet
        self.posted: dict[tuple, deque] = defaultdict(deque)  # receives no send met yet
        self.sends: dict[int, weakref.WeakSet] = defaultdict(weakref.WeakSet)

    def holding(self, rank: int) -> int:
        with self.lock:
            return len(self.sends[rank])

    def meet(self, buffer, received, array, sent) -> None:
        np.copyto(buffer, array.reshape(buffer.shape))
        received.count, received.done, sent.done = array.nbytes, True, True

    def comm(self, rank: int):
        mpi = self

        class Comm:
            def Isend(self, array, dest, tag):  # noqa: N802
                request = mpi.Request()
                with mpi.lock:
                    mpi.sends[rank].add(request)
                    key = (rank, dest, tag)
                    if mpi.posted[key]:
                        mpi.meet(*mpi.posted[key].popleft(), array, request)
                    else:
                        mpi.unmatched[key].append((array, request))
                return request

            def Irecv(self, buffer, source, tag):  # noqa: N802
                request = mpi.Request()
                with mpi.lock:
                    key = (source, rank, tag)
                    if mpi.unmatched[key]:
                        mpi.meet(buffer, request, *mpi.unmatched[key].popleft())
                    else:
                        mpi.posted[key].append((buffer, request))
                return request

        return Comm()


@pytest.fixture
def thread_mpi(monkeypatch):
    from ringtrain.strategies.pipeline import transport

    mpi = ThreadMPI()
    monkeypatch.setattr(transport, "mpi", lambda: mpi)
    return mpi


def links_over(mpi: ThreadMPI, ranks: int):
    from ringtrain.strategies.pipeline.transport import Link

    return [Link(mpi.comm(r), r, timeout=30.0) for r in range(ranks)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_stage_holds_what_its_schedule_bounds_measured_from_its_buffers(thread_mpi, schedule):
    """Issue (model parallelism, item 2): sent buffers were kept until the step ended, so at S =
    4, M = 16 the stages held 16, 32, 32 and 16 of them; what a stage held was derived from the
    op list, not measured.  Here S = 4 stages are threads over the real transport."""
    stages, micro = 4, 16
    rng = np.random.default_rng(3)
    sizes = [5, 8, 7, 6, 4]
    layers = mlp_weights(sizes, rng)
    rows = [2] * micro
    x = rng.standard_normal((sum(rows), sizes[0]))
    y = rng.integers(0, sizes[-1], sum(rows))
    cuts = [Boundary((sizes[s + 1],), np.float64) for s in range(stages - 1)]
    works = [NumpyStage(layers[s:s + 1], s == 0, s == stages - 1, x, y, rows) for s in range(stages)]
    links = links_over(thread_mpi, stages)
    seen = [0] * stages  # the most send buffers a stage's transport kept at any op, seen from MPI
    for s, work in enumerate(works):
        work.probe = lambda s=s: seen.__setitem__(s, max(seen[s], thread_mpi.holding(s)))

    took = on_threads(stages, lambda s: run_step(
        Placement(stages, stages, s), links[s], works[s], stage_ops(schedule, stages, s, micro),
        rows, cuts[s - 1] if s else None, cuts[s] if s < stages - 1 else None))

    grads = [[np.zeros_like(w), np.zeros_like(b)] for w, b in layers]
    logits, cache = forward_layers(layers, x, True)
    backward_layers(layers, cache, softmax_grad(logits, y, len(y))[1], True, grads)
    for (gw, _), (ww, _) in zip([g for work in works for g in work.grads], grads, strict=True):
        np.testing.assert_allclose(gw, ww, rtol=1e-12, atol=1e-14)
    assert [thread_mpi.holding(s) for s in range(stages)] == [0] * stages, "all released"
    if schedule == "1f1b":
        # An unfinished send is of a micro-batch the stage still holds (its activations) or the
        # previous stage still holds (the input's gradient): at most what stage s - 1 holds.
        bound = [stages - s + (s > 0) for s in range(stages)]
        assert all(seen[s] <= bound[s] for s in range(stages)), (seen, bound)
        assert [t.held for t in took] == [stages - s for s in range(stages)]  # 4, 3, 2, 1
        assert all(t.sends <= b for t, b in zip(took, bound, strict=True)), [t.sends for t in took]
    else:  # the measure sees what GPipe holds: every micro-batch
        assert [t.held for t in took] == [micro] * stages


def test_a_send_buffer_goes_as_soon_as_its_send_completes(monkeypatch):
    from ringtrain.strategies.pipeline import transport

    monkeypatch.setattr(transport, "mpi", lambda: ThreadMPI)
    refs = []

    class Comm:
        def Isend(self, array, dest, tag):  # noqa: N802
            request = ThreadMPI.Request()
            refs.append(weakref.ref(request))
            return request

    link = transport.Link(Comm(), rank=0, timeout=5.0)
    for m in range(3):
        link.send(np.full(4, m, np.float32), 1, m)
    refs[0]().done = refs[1]().done = True
    assert link.send(np.zeros(4, np.float32), 1, 3) == 2, "the two completed went first"
    assert [r() is None for r in refs] == [True, True, False, False]

    class Later(ThreadMPI.Request):  # a receive that completes on its 4th poll
        polls = 0

        def Test(self, status=None):  # noqa: N802
            self.polls += 1
            if self.polls == 2:
                refs[2]().done = True  # a send completes while the rank waits
            if self.polls == 4:
                self.done, self.count = True, 16
            return super().Test(status)

    Comm.Irecv = lambda self, buffer, source, tag: Later()
    link.wait(link.post((4,), np.float32, 1, 9, "a gradient"))
    assert [r() is None for r in refs] == [True, True, True, False], "released while waiting"
    refs[3]().done = True
    link.finish_sends("the rest")
    assert all(r() is None for r in refs)


def test_evaluation_streams_with_a_bounded_number_of_test_batches_in_flight(thread_mpi):
    """Issue (model parallelism, item 2): evaluation sent every test batch before waiting for
    any.  The last stage is slow here: unbounded, the first would run ahead by every batch."""
    from ringtrain.strategies.pipeline import engine

    stages = 3
    cut = Boundary((2,), np.float64)
    links = links_over(thread_mpi, stages)
    relays = [EvalRelay(Placement(stages, stages, s), links[s], cut if s else None,
                        cut if s < stages - 1 else None) for s in range(stages)]
    batches = [np.full((n, 2), float(n)) for n in [3, 1, 2] * 4]
    seen = [0] * stages  # the most test batches a stage had sent and not yet released

    def walk(s):
        def stage(v):
            seen[s] = max(seen[s], thread_mpi.holding(s))
            if s == stages - 1:
                time.sleep(0.005)
            return np.asarray(v) + 1

        out = [relays[s](stage, b if s == 0 else None, len(b), np.asarray) for b in batches]
        relays[s].finish()
        return out

    results = on_threads(stages, walk)
    for out, b in zip(results[-1], batches, strict=True):
        np.testing.assert_array_equal(out, b + stages)  # one +1 per stage
    window = engine.EVAL_WINDOW
    assert all(n <= window - 1 for n in seen), seen  # room made before computing the next
    assert all(r.peak <= window for r in relays) and relays[0].peak >= 1
    assert [thread_mpi.holding(s) for s in range(stages)] == [0] * stages
