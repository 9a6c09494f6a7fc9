"""The multi-host path for real: ``horovodrun -np 2 -H rt-hosta:1,rt-hostb:1`` over ssh between two
network namespaces on this machine (see bench/netns_hosts.py), under both controllers.

Runs as root where namespaces and sshd can be made (CI: .ci/setup installs openssh-server);
elsewhere the whole module is skipped with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BIN, REPO, requires_horovod

from bench import netns_hosts

pytestmark = requires_horovod
TIMEOUT = 240
CONTROLLERS = ["mpi", "gloo"]

# Each rank reports where it runs: its network namespace is the proof that it is on its own host.
PROBE = '''
import json, os, sys
import torch
import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="probe").item()
me = {"rank": hvd.rank(), "size": hvd.size(), "local_size": hvd.local_size(),
      "cross_size": hvd.cross_size(), "netns": os.readlink("/proc/self/ns/net"), "sum": total,
      "controller": "mpi" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "?"}
everyone = hvd.allgather_object(me, name="where")
if hvd.rank() == 0:
    with open(sys.argv[1], "w") as fh:
        json.dump(everyone, fh)
hvd.shutdown()
'''


def horovodrun(hosts: netns_hosts.TwoHosts, controller: str, command: list[str], tmp_path: Path,
               options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``command`` on both hosts with horovodrun started on host A, as a user would.

    --disable-cache: horovodrun otherwise keeps its ssh and interface checks in ~/.horovod for an
    hour, keyed by -H, and a later run would trust checks made against hosts that are gone.
    """
    a, b = hosts.hosts
    cmd = [str(BIN / "horovodrun"), f"--{controller}", "-np", "2", "-H", f"{a.name}:1,{b.name}:1",
           "--ssh-identity-file", str(hosts.identity_file), "--disable-cache", "--start-timeout", "60",
           *options, *command]
    env = {"PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        proc = hosts.run_in(a, cmd, timeout=TIMEOUT, cwd=REPO, env=env)
    except subprocess.TimeoutExpired:  # run_in has killed everything it started on both hosts
        pytest.fail(f"horovodrun --{controller} across two hosts did not finish in {TIMEOUT}s: "
                    f"{' '.join(cmd)}")
    (tmp_path / "horovodrun.log").write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}")
    if proc.returncode != 0:
        pytest.fail(f"horovodrun --{controller} across two hosts failed (rc={proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    hosts.kill_strays()  # a clean run leaves nothing; make sure of it for the next test
    return proc


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_ranks_run_on_both_hosts(hosts, controller, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    # No --network-interfaces: horovodrun probes the hosts and must settle on the veth pair.
    proc = horovodrun(hosts, controller, [sys.executable, str(probe), str(tmp_path / "where.json")],
                      tmp_path, options=("--verbose",))
    assert f"Common interface found: {hosts.iface}" in proc.stdout, proc.stdout[-3000:]
    ranks = json.loads((tmp_path / "where.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert {r["controller"] for r in ranks} == {controller}
    assert all(r["size"] == 2 and r["sum"] == 3.0 for r in ranks), ranks
    # Horovod sees two hosts with one rank each ...
    assert all(r["cross_size"] == 2 and r["local_size"] == 1 for r in ranks), ranks
    # ... and they really are the two namespaces, in -H order.
    assert [r["netns"] for r in ranks] == [f"net:[{h.netns_inode()}]" for h in hosts.hosts], ranks


@pytest.mark.parametrize("controller", CONTROLLERS)
def test_trainer_across_hosts_ends_identical(hosts, controller, tmp_path):
    out = tmp_path / "m.json"
    horovodrun(hosts, controller, [sys.executable, "-m", "launch.torch_mnist", "--train-samples", "512",
                                   "--test-samples", "200", "--epochs", "1", "--batch-size", "32",
                                   "--no-progress", "--metrics-out", str(out)], tmp_path,
               options=("--network-interfaces", hosts.iface))
    m = json.loads(out.read_text())
    assert m["world_size"] == 2
    assert m["controller"] == controller
    assert len(m["param_checksums"]) == 2
    assert len(set(m["param_checksums"])) == 1, m["param_checksums"]
