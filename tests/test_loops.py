"""The shared loops (:mod:`ringtrain.training`) on a fake framework: N ranks as threads, a model
in NumPy, Horovod's collectives on an in-process bus (``tests/fake_run.py``).  No process is
started: the whole file runs in well under ten seconds.

What is proven here for any framework that fills the run object's seam, the multi-process tests
prove for the real ones (docs/correctness.md): N ranks equal one process with N times the batch,
every rank issues the same collectives in the same order, a diverged step ends every rank at
that step with one line, a resumed run trains only what is left, an elastic job's re-shard reads
every sample of an epoch exactly once, and rank 0's verdicts reach every rank.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
from fake_run import Bus, FakeRun, Problem, args, fake_world, run_ranks

from ringtrain.errors import UserError
from ringtrain.lr import lr_at, scaled_lr
from ringtrain.training import elastic, startup
from ringtrain.training.fixed_loop import FixedLoop

DETERMINISTIC = dict(momentum=0.0, no_shuffle=True, warmup_epochs=0.0, lr_decay="none",
                     lr_scaling="none", base_lr=0.1)


def fixed_job(size: int, problem: Problem, **flags):
    """A fixed-size job of ``size`` ranks: each rank's (summary, run, bus)."""
    a = args(**flags)
    bus = Bus(size)

    def rank(r: int):
        run = FakeRun(a, bus, r, problem)
        return FixedLoop(a, run, start_epoch=flags.get("start_epoch", 0)).train(), run

    return [(summary, run, bus) for summary, run in run_ranks(size, rank)]


# --- the epoch loop ---------------------------------------------------------------------------------

@pytest.mark.parametrize("size", [2, 3])
def test_n_ranks_equal_one_process_with_n_times_the_batch(size):
    problem = Problem(n_train=96)
    ranks = fixed_job(size, problem, batch_size=4, epochs=2, **DETERMINISTIC)
    one = fixed_job(1, problem, batch_size=4 * size, epochs=2, **DETERMINISTIC)
    weights = [run.w for _, run, _ in ranks]
    for w in weights[1:]:
        assert np.array_equal(w, weights[0])  # identical on every rank, to the bit
    # The same math: the mean of per-rank mean gradients is the global batch's mean gradient.
    np.testing.assert_allclose(weights[0], one[0][1].w, rtol=1e-12, atol=1e-14)
    assert not np.allclose(weights[0], FakeRun(args(), Bus(1), 0, problem).w)  # it trained


def test_every_rank_issues_the_same_collectives_in_the_same_order():
    ranks = fixed_job(3, Problem(), batch_size=4, epochs=2)
    calls = ranks[0][2].calls
    assert calls[0] == calls[1] == calls[2]
    names = [name for _, name in calls[0]]
    assert names.count("train_loss") == 2 and names.count("eval_totals") == 2
    assert names[-2:] == ["checksums.sizes", "checksums.data"]


def test_the_loss_falls_and_the_summary_is_exact():
    problem = Problem(n_train=120, n_test=31)
    summary, run, _ = fixed_job(2, problem, batch_size=6, epochs=3, base_lr=0.2)[0]
    losses = [e.train_loss for e in summary.epochs]
    assert losses[0] > losses[-1]
    assert len(set(summary.param_checksums)) == 1 and len(summary.param_checksums) == 2
    # Exact metrics over uneven test shares (16 and 15 of 31): the sum over ranks, not a mean.
    one = FakeRun(args(), Bus(1), 0, problem)
    one.w = run.w
    loss, correct, count, _ = one.eval_sums()
    assert count == 31 and summary.final_test_loss == pytest.approx(loss / count, rel=1e-12)
    assert summary.final_test_accuracy == correct / count


def test_every_step_gets_the_lr_rule_and_every_epoch_reads_its_shard_once():
    problem = Problem(n_train=100)
    a = dict(batch_size=5, epochs=2, base_lr=0.05, warmup_epochs=1.0, lr_decay="cosine")
    ranks = fixed_job(2, problem, **a)
    run = ranks[0][1]
    steps = 100 // 2 // 5
    target = scaled_lr(0.05, 2, "linear")
    want = [lr_at(e - 1 + s / steps, 0.05, target, 1.0, 2, "cosine") for e in (1, 2) for s in range(steps)]
    assert run.lrs == pytest.approx(want, rel=0, abs=0)
    for epoch in range(2):
        seen = np.concatenate([r.read[epoch * steps + s] for _, r, _ in ranks for s in range(steps)])
        assert sorted(seen.tolist()) == list(range(100))  # disjoint shards, the whole epoch


def test_gradient_accumulation_steps_over_k_batches():
    problem = Problem(n_train=96)
    k2 = fixed_job(2, problem, batch_size=3, backward_passes_per_step=2, epochs=1, **DETERMINISTIC)
    assert all(len(idx) == 6 for idx in k2[0][1].read)  # K x B rows per optimizer step
    assert len(k2[0][1].read) == 96 // 2 // 6


# --- divergence -------------------------------------------------------------------------------------

def test_a_diverged_step_ends_every_rank_at_that_step_naming_the_rank():
    a = args(batch_size=4, epochs=3, checkpoint_dir="/nonexistent-never-written")
    bus, problem = Bus(3), Problem(n_train=96)
    runs: list[FakeRun] = []

    def rank(r: int):
        run = FakeRun(a, bus, r, problem, poison_at=(1, 11))  # rank 1, epoch 2, step 3
        runs.append(run)
        try:
            FixedLoop(a, run, start_epoch=0).train()
        except UserError as err:
            return str(err), run.saved
        return None, run.saved

    outcomes = run_ranks(3, rank)
    lines = {line for line, _ in outcomes}
    assert len(lines) == 1, lines  # every rank, the same one line
    line = lines.pop()
    assert line and "met by rank 1 at epoch 2, step 3" in line and "is unreadable" in line, line
    assert [saved for _, saved in outcomes] == [[1], [], []]  # rank 0's epoch 1, not the NaNs


def test_a_diverged_step_without_a_data_problem_names_the_loss():
    a = args(batch_size=4, epochs=1, base_lr=1e308, warmup_epochs=0.0, lr_scaling="none")
    problem = Problem(n_train=48)
    bus = Bus(2)

    def rank(r: int):
        with pytest.raises(UserError) as err:
            FixedLoop(a, FakeRun(a, bus, r, problem), start_epoch=0).train()
        return str(err.value)

    lines = set(run_ranks(2, rank))
    assert len(lines) == 1 and "training diverged at epoch 1, step" in lines.pop()


# --- resume ------------------------------------------------------------------------------------------

def test_a_resumed_run_trains_only_the_epochs_left():
    problem = Problem(n_train=96)
    summary, run, bus = fixed_job(2, problem, batch_size=4, epochs=3, start_epoch=2)[0]
    assert [e.epoch for e in summary.epochs] == [3] and run.saved == []
    assert len(run.read) == 96 // 2 // 4 and summary.resumed_from_epoch == 2


def test_a_run_resumed_at_its_end_only_evaluates():
    summary, run, bus = fixed_job(2, Problem(), batch_size=4, epochs=2, start_epoch=2)[0]
    assert summary.epochs == [] and run.read == [] and summary.final_test_accuracy is not None
    assert [name for _, name in bus.calls[0]][-3:] == ["eval_totals", "checksums.sizes",
                                                       "checksums.data"]


def test_checkpoints_follow_the_flag_and_rank_0_writes_them():
    ranks = fixed_job(2, Problem(), batch_size=4, epochs=2, checkpoint_dir="/unused")
    assert [run.saved for _, run, _ in ranks] == [[1, 2], []]


# --- elastic re-sharding --------------------------------------------------------------------------------

class State(types.SimpleNamespace):
    """hvd.elastic's state: the plain attributes, and commits counted."""

    def commit(self) -> None:
        self.commits = getattr(self, "commits", 0) + 1
        self.committed = {k: v for k, v in vars(self).items() if k != "committed"}


def test_an_elastic_world_that_shrinks_mid_epoch_reads_every_sample_once():
    """Two ranks train 3 steps of epoch 1 and commit; the job re-forms with 3 ranks from the
    commit; across both worlds epoch 1 reads each of the 120 samples exactly once (bar the
    trimmed remainder), and epoch 2 again."""
    problem = Problem(n_train=120)
    a = args(batch_size=4, epochs=2, commit_every=3, max_steps=None)
    state = State(**elastic.initial_state(0))
    runs2 = {}

    class Stop(Exception):
        pass

    bus2 = Bus(2)

    def first_world(r: int):
        run = FakeRun(a, bus2, r, problem)
        runs2[r] = run
        original = run.step

        def step(batch, lr):  # the re-form strikes after the first commit
            if len(run.read) > 3:
                raise Stop
            return original(batch, lr)

        run.step = step
        try:
            elastic.train_world(state if r == 0 else State(**elastic.initial_state(0)), run)
        except Stop:
            return

    run_ranks(2, first_world)
    assert state.commits == 1 and state.consumed == 3 * 4 * 2
    # Horovod restores the last commit on the survivors and syncs it to the newcomer.
    resumed = State(**{k: v for k, v in state.committed.items() if k not in ("commits",)})
    bus3 = Bus(3)

    def second_world(r: int):
        run = FakeRun(a, bus3, r, problem)
        run.w = runs2[0].w.copy()
        return elastic.train_world(State(**vars(resumed)), run), run

    results = run_ranks(3, second_world)
    first_epoch = [idx for r in runs2.values() for idx in r.read[:3]]
    steps_after = (120 - 24) // 3 // 4
    first_epoch += [idx for _, run in results for idx in run.read[:steps_after]]
    seen = np.concatenate(first_epoch).tolist()
    assert len(seen) == len(set(seen)) and len(seen) >= 120 - 3 * 4  # once each; trim < a step
    summary = results[0][0]
    assert [r["world_size"] for r in summary.elastic_resizes] == [2, 3]
    assert len({s for s in summary.param_checksums}) == 1 and len(summary.param_checksums) == 3


# --- rank 0's verdicts ------------------------------------------------------------------------------------

def test_rank_0s_verdict_reaches_every_rank():
    bus = Bus(3)

    def rank(r: int):
        world = fake_world(bus, r)
        assert world.rank0_verdict(lambda: "opened", None, "data") == "opened"
        with pytest.raises(UserError, match="^the folder is gone$"):
            world.rank0_verdict(lambda: (_ for _ in ()).throw(UserError("the folder is gone")),
                                None, "folders")
        return True

    assert run_ranks(3, rank) == [True] * 3


def test_one_ranks_problem_ends_every_rank_naming_it():
    bus = Bus(3)

    def rank(r: int):
        def work():
            if r == 2:
                raise UserError("item 7 has no label")
            return r

        with pytest.raises(UserError) as err:
            startup.every_rank(fake_world(bus, r), work)
        return str(err.value)

    assert set(run_ranks(3, rank)) == {"item 7 has no label (rank 2)"}


def test_the_bus_sees_ranks_that_would_hang():
    """The fake itself: ranks issuing different collectives fail the test instead of passing."""
    from fake_run import Mismatch

    bus = Bus(2)

    def rank(r: int):
        fake_world(bus, r).sum([1.0], "a" if r == 0 else "b")

    with pytest.raises(Mismatch):
        run_ranks(2, rank)
