"""docs/clusters.md's Slurm batch script, as printed there, run by a real Slurm.

``.ci/slurm start DIR`` brings up a private single-node cluster (Debian's slurm-wlm and munge,
installed if missing; root only) and ``stop`` takes it down.  The test copies the batch script out
of docs/clusters.md, so the page and the test cannot drift, submits it with the command-line
overrides the page documents for a smaller job, and checks what the job wrote: 2 tasks under MPI
(srun's PMIx), identical weights, a falling loss.  Where Slurm cannot run (not root, no apt-get,
no package mirror) the test is skipped with the script's reason.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
from conftest import MNIST, REPO, metrics, requires_horovod, run

pytestmark = requires_horovod
SLURM = REPO / ".ci" / "slurm"
CANNOT_RUN_HERE = 3  # .ci/slurm's exit status for "not root / nothing to install Slurm with"
PAGE = REPO / "docs" / "clusters.md"  # README's "Clusters" links there


def documented_batch_script() -> str:
    """The one ```bash block in docs/clusters.md that is a batch script (starts with #!, has
    #SBATCH)."""
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.M | re.S)
    scripts = [b for b in blocks if b.startswith("#!/bin/bash") and "#SBATCH" in b]
    assert len(scripts) == 1, f"{PAGE.name} should hold one Slurm batch script, found {len(scripts)}"
    return scripts[0]


def documented_small_submission() -> list[str]:
    """The page's sbatch line for a short run on one node (``sbatch --nodes=1 ...``), as argv."""
    lines = [ln for ln in PAGE.read_text().splitlines() if ln.startswith("sbatch --nodes=1")]
    assert len(lines) == 1, f"{PAGE.name} should show one 'sbatch --nodes=1' line, found {len(lines)}"
    return shlex.split(lines[0], comments=True)


def processes_under(folder: Path) -> list[str]:
    """Processes whose command line or working folder lies in ``folder`` (daemons, job steps)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd"]):
        cmd, cwd = " ".join(proc.info["cmdline"] or []), proc.info["cwd"] or ""
        if str(folder) in cmd or cwd.startswith(str(folder)):
            found.append(f"{proc.info['pid']}: {cmd}")
    return found


@pytest.fixture
def slurm_cluster(tmp_path):
    """A running single-node cluster; its SLURM_CONF.  Stopped afterwards, with nothing left:
    no daemon, and no job process (those run in the test's folder, ``tmp_path``)."""
    # Short and private: munge's socket lives here (Unix socket paths stop at 107 bytes).
    folder = Path(tempfile.mkdtemp(prefix="ringtrain-slurm-"))
    start = run(["bash", str(SLURM), "start", str(folder)], timeout=300)
    if start.returncode == CANNOT_RUN_HERE:
        shutil.rmtree(folder, ignore_errors=True)
        pytest.skip(start.stderr.strip().splitlines()[-1])
    try:
        assert start.returncode == 0, start.stderr[-3000:]
        yield folder / "slurm.conf"
    finally:
        stop = run(["bash", str(SLURM), "stop", str(folder)], timeout=180)
        left = processes_under(folder) + processes_under(tmp_path)
        logs = {p.name: p.read_text(errors="replace")[-1500:] for p in folder.glob("*.log")}
        shutil.rmtree(folder, ignore_errors=True)
        assert stop.returncode == 0, stop.stderr[-3000:]
        assert not left, f"left running after stop: {left}\n{logs}"


def test_documented_slurm_script_trains_two_tasks(slurm_cluster, tmp_path):
    """The page's script, as printed, submitted with the page's own line for one small node (one
    node, 2 tasks, trainer flags after the script's name), plus --wait and an output file.  The
    job runs from its submission folder, which holds the repository's .venv (here a link to the
    one running this test) and gets the test's MNIST folder through MNIST_DIR."""
    (tmp_path / "ringtrain.sbatch").write_text(documented_batch_script())
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    sbatch, *options = documented_small_submission()
    env = {"SLURM_CONF": str(slurm_cluster), "MNIST_DIR": str(MNIST)}
    proc = run([sbatch, "--wait", "--output=job.out", *options], cwd=tmp_path, env=env, timeout=420)
    out = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}{proc.stderr}\n--- job output:\n{out[-4000:]}"
    job_id = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    m = metrics(tmp_path / f"run-{job_id}.json")
    assert m["world_size"] == 2 and m["controller"] == "mpi", m
    assert len(m["param_checksums"]) == 2 and len(set(m["param_checksums"])) == 1, m["param_checksums"]
    losses = [e["train_loss"] for e in m["epochs"]]
    assert len(losses) == 2 and losses[1] < losses[0], losses
