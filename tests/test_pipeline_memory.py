"""A pipeline stage's memory, by the per-rank formula, against its rank's limit: checked before
the stage is built (ringtrain/strategies/pipeline/memory.py).  No process started."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest
from conftest import REPO

from ringtrain.errors import UserError
from ringtrain.strategies.pipeline import memory

MB = memory.MB


def test_the_formula_counts_weights_gradients_state_and_the_schedules_activations():
    sgd = memory.needs(1, 100 * MB, 1, activation_bytes_per_example=4096,
                       rows_per_microbatch=16, held=3)
    assert (sgd.weights, sgd.gradients, sgd.optimizer_state) == (100 * MB, 100 * MB, 100 * MB)
    assert sgd.activations == 3 * 16 * 4096
    assert sgd.total == 300 * MB + 3 * 16 * 4096
    assert memory.needs(0, MB, 0, 0, 1, 1).optimizer_state == 0  # plain SGD: no state
    assert memory.needs(0, MB, 2, 0, 1, 1).optimizer_state == 2 * MB  # Adam's two moments


@pytest.mark.parametrize("flags,slots", [
    (["--momentum", "0"], 0), ([], 1), (["--optimizer", "adamw"], 2), (["--optimizer", "adam"], 2),
    (["--optimizer", "rmsprop"], 1), (["--optimizer", "rmsprop", "--momentum", "0.9"], 2),
])
def test_the_optimizers_state_is_counted_in_weights_sizes(flags, slots):
    from launch import cli
    from ringtrain import optimizer_spec

    assert optimizer_spec.state_slots(cli.parse("torch", flags)) == slots


def test_the_tightest_limit_wins_and_counts_what_the_process_already_uses():
    status = "VmSize:\t 4000000 kB\nVmData:\t  300000 kB\n"
    unlimited = all(resource.getrlimit(r)[0] == resource.RLIM_INFINITY
                    for r in (resource.RLIMIT_DATA, resource.RLIMIT_AS))
    if unlimited:  # no cap and no cgroup: nothing to check against
        assert memory.rank_limit(status=status, cgroup=None) is None
    box = memory.rank_limit(local_size=4, status=status, cgroup=(4000 * MB, 2000 * MB))
    assert box.source == "the cgroup's memory.max" and box.left == 500 * MB  # 2000 MB over 4 ranks


def test_a_stage_too_big_for_its_rank_is_one_line_naming_it():
    stage = memory.needs(2, 600 * MB, 1, 1000, 8, 2)
    memory.check_fits(stage, memory.Limit(2000 * MB, 3000 * MB, "RLIMIT_DATA"), 4)  # fits
    memory.check_fits(stage, None, 4)  # no limit known: nothing to say
    with pytest.raises(UserError) as err:
        memory.check_fits(stage, memory.Limit(1000 * MB, 1450 * MB, "RLIMIT_DATA"), 4)
    line = str(err.value)
    assert "\n" not in line
    assert "pipeline stage 2 of 4 needs 1,800 MB" in line
    assert "weights 600 + gradients 600 + optimizer state 600" in line
    assert "1,000 MB left under RLIMIT_DATA of 1,450 MB" in line and "more --pipeline-stages" in line


def test_rlimit_data_is_read_from_the_process_itself():
    """In a child with RLIMIT_DATA set (as bench/workers/memlimit.py sets it), the limit found is
    that cap, less what the child already uses."""
    code = (
        f"import resource, sys; sys.path.insert(0, {str(REPO)!r})\n"
        "resource.setrlimit(resource.RLIMIT_DATA, (1 << 31, resource.getrlimit(resource.RLIMIT_DATA)[1]))\n"
        "from ringtrain.strategies.pipeline import memory\n"
        "lim = memory.rank_limit(cgroup=None)\n"
        "print(lim.source, lim.cap, 0 < lim.left < lim.cap)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["RLIMIT_DATA", str(1 << 31), "True"], out.stderr


class ResourceExhaustedError(Exception):  # TensorFlow's, by name
    pass


@pytest.mark.parametrize("err,oom", [
    (MemoryError(), True),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:119] DefaultCPUAllocator: can't allocate memory: "
                  "you tried to allocate 67108864 bytes"), True),
    (ResourceExhaustedError("OOM when allocating tensor with shape[4096,4096]"), True),
    (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
    (ValueError("out of memory"), False),
])
def test_an_allocation_failure_is_recognised_in_every_framework(err, oom):
    assert memory.out_of_memory(err) is oom


def test_a_stage_that_runs_out_is_one_line_with_what_it_holds_never_diverged():
    stage = memory.needs(3, 201 * MB, 1, 4096 * 4, 8, 5)
    line = str(memory.ran_out(3, 8, stage, memory.Limit(0, 1450 * MB, "RLIMIT_DATA"),
                              "a training step"))
    assert "\n" not in line and "diverged" not in line
    assert line.startswith("pipeline stage 3 of 8 ran out of memory during a training step: it "
                           "holds 604 MB by the per-rank formula (weights 201")
    assert "RLIMIT_DATA of 1,450 MB" in line
