"""The pipeline's row of the fault matrix (docs/fault-tolerance.md): a stage's rank frozen,
killed, cut off from the other host, or its disk full while it saves.  The fixed-size pipeline
(its MPI transport and process sets; the elastic one, --elastic, is tests/test_pipeline_elastic.py's):
every fault but the full disk ends the job in one line
or the launcher's, within --stall-timeout + 30 s, no rank left, every stage's newest checkpoint
loadable; a full disk warns and trains on, as the ring does.

The machinery (the job, its cleanup, the cells' tiers, the two namespace hosts) is
tests/test_faults.py's; CI runs the cells marked "ci", ``RINGTRAIN_FAULTS=all`` the rest.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from conftest import launch_cmd, requires_horovod
from test_faults import (
    BOUND,
    EXT,
    LONG,
    MODULES,
    STALL,
    Job,
    assert_nothing_left,
    assert_one_line,
    cells,
    cross_host_job,
    error_lines,
    jobs,
    partition,
    record,
)

pytestmark = requires_horovod
_ = jobs  # the fixture, used by name

PIPE = ["--pipeline-stages", "2"]


def assert_stages_load(ckpt: Path, framework: str, stages: int = 2) -> int:
    """Every stage's file of the newest complete epoch parses (no code run) and says which stage
    it is; no temp file is left.  Returns that epoch."""
    assert not list(ckpt.glob(".*.tmp")), "a half-written checkpoint was left behind"
    epochs = sorted({int(p.name[len("ckpt-epoch"):][:4]) for p in ckpt.glob(f"ckpt-epoch*.{EXT[framework]}")})
    assert epochs, f"no checkpoint in {ckpt}"
    for epoch in reversed(epochs):
        files = sorted(ckpt.glob(f"ckpt-epoch{epoch:04d}-stage*of{stages}.{EXT[framework]}"))
        if len(files) == stages:
            break
    else:
        pytest.fail(f"no epoch with all {stages} stages' files in {ckpt}")
    for s, path in enumerate(files):
        if framework == "torch":
            import torch

            meta = torch.load(path, map_location="cpu", weights_only=True)["meta"]
        else:
            with np.load(path, allow_pickle=False) as npz:
                meta = json.loads(str(npz["meta"]))
        assert meta["pipeline"]["stage"] == s and meta["pipeline"]["stages"] == stages, meta
    return epoch


def pipeline_job(framework: str, tmp_path: Path, jobs: list) -> tuple[Job, Path]:
    """A long S = 2 pipeline at -np 2 on this host, once its first checkpoint exists."""
    module, ckpt = MODULES[framework], tmp_path / "ckpt"
    job = Job(launch_cmd(module, [*LONG, *PIPE, "--checkpoint-dir", str(ckpt)], np=2), str(tmp_path),
              module)
    jobs.append(job)
    job.wait_for_file(ckpt, f"ckpt-epoch*-stage1of2.{EXT[framework]}")
    return job, ckpt


@pytest.mark.parametrize("framework,victim,tier", cells(
    ("torch", 1, "ci"), ("tf", 1, "full"), ("torch", 0, "full")))
def test_a_frozen_stage_ends_the_pipeline_in_one_line(framework, victim, tier, tmp_path, jobs):
    """SIGSTOP a stage's rank mid-training: its neighbour's bounded wait for an activation (or
    the watchdog's heartbeat) names it within --stall-timeout; the job ends, nothing left."""
    job, ckpt = pipeline_job(framework, tmp_path, jobs)
    job.rank(victim).send_signal(signal.SIGSTOP)
    t0 = time.monotonic()
    rc, took = job.wait_exit(BOUND + 30)
    record(f"frozen stage rank {victim}/{framework}/mpi/pipeline", f"exit {rc}", took,
           job.first_error_after(t0))
    assert rc != 0
    assert took <= BOUND, f"{took:.0f} s from SIGSTOP to the end of the job"
    assert_one_line(job, rf"rank {victim}\b")
    assert_nothing_left(job)
    assert_stages_load(ckpt, framework)


@pytest.mark.parametrize("framework,tier", cells(("torch", "full"), ("tf", "full")))
def test_a_killed_stage_ends_the_pipeline(framework, tier, tmp_path, jobs):
    """SIGKILL stage 1's rank: mpirun ends the job at once and names it; at most one line."""
    job, ckpt = pipeline_job(framework, tmp_path, jobs)
    job.rank(1).send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    rc, took = job.wait_exit(BOUND + 30)
    record(f"killed stage rank 1/{framework}/mpi/pipeline", f"exit {rc}", took,
           job.first_error_after(t0))
    out = job.output()
    assert rc != 0 and took <= BOUND
    assert re.search(r"rank 1 .*exited on signal 9", out.replace("\n", " ")), out[-3000:]
    assert len(error_lines(out)) <= 1, out[-3000:]
    assert_nothing_left(job)
    assert_stages_load(ckpt, framework)


@pytest.mark.parametrize("framework,tier", cells(("torch", "full"), ("tf", "full")))
def test_a_stage_cut_off_on_another_host_ends_the_pipeline(hosts, framework, tier, tmp_path, jobs):
    """Stage 1 on host B, its veth taken down mid-epoch: rank 0 names rank 1 as unreachable and
    ends the job; rank 1, which can reach no one, ends itself."""
    module, ckpt = MODULES[framework], tmp_path / "ckpt"
    job = cross_host_job(hosts, "mpi", module, [*LONG, *PIPE, "--checkpoint-dir", str(ckpt)],
                         str(tmp_path))
    jobs.append(job)
    job.wait_for_file(ckpt, f"ckpt-epoch*-stage0of2.{EXT[framework]}")
    rank1 = job.rank(1)
    with partition(hosts, "link-down"):
        t0 = time.monotonic()
        rc, took = job.wait_exit(BOUND + 30)
        record(f"partition (link-down)/{framework}/mpi/pipeline", f"exit {rc}", took,
               job.first_error_after(t0))
        with contextlib.suppress(psutil.Error):
            rank1.wait(timeout=max(1, BOUND - (time.monotonic() - t0)))
        assert not rank1.is_running() or rank1.status() == psutil.STATUS_ZOMBIE
        assert_nothing_left(job)
    assert rc != 0 and took <= BOUND, f"{took:.0f} s from the partition to the end of the job"
    assert_one_line(job, r"rank 1\b")


@pytest.fixture
def small_disk(tmp_path):
    from conftest import mounted_tmpfs

    # room for one epoch's two stage files of the CNN (1.5 MB in all) but not the next one's
    with mounted_tmpfs(tmp_path / "ckpt", "2m") as folder:
        yield folder


@pytest.mark.parametrize("framework,tier", cells(("torch", "full"), ("tf", "full")))
def test_a_full_disk_warns_and_the_pipeline_trains_on(framework, tier, small_disk, tmp_path, jobs):
    """The disk fills during epoch 2's save: a warning naming what is intact, the pipeline
    trains on to the end, and epoch 1's stage files still load."""
    args = ["--train-samples", "512", "--test-samples", "200", "--batch-size", "32", "--epochs", "3",
            "--no-progress", "--stall-timeout", str(STALL), *PIPE, "--checkpoint-dir",
            str(small_disk)]
    job = Job(launch_cmd(MODULES[framework], args, np=2), str(tmp_path), MODULES[framework])
    jobs.append(job)
    rc, _ = job.wait_exit(400)
    out = job.output()
    assert rc == 0, out[-3000:]
    warnings = [ln for ln in out.splitlines() if "warning: checkpoint" in ln]
    assert warnings and "No space left on device" in warnings[0], out[-3000:]
    assert not error_lines(out), out[-3000:]
    assert re.search(r"epoch 3/3: ", out), out[-3000:]
    assert assert_stages_load(small_disk, framework) == 1
    record(f"full disk/{framework}/mpi/pipeline", "warned at the failed save, trained on", None)
