"""The multi-host path for real: ``horovodrun -np 2 -H rt-hosta:1,rt-hostb:1`` over ssh between two
network namespaces on this machine (see bench/common/netns_hosts.py), under both controllers.

Runs as root where namespaces and sshd can be made (CI: .ci/setup installs openssh-server);
elsewhere the whole module is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BIN, REPO, requires_horovod

from bench.common import netns_hosts

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


def launch(hosts: netns_hosts.TwoHosts, controller: str, command: list[str], tmp_path: Path,
           options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``command`` on both hosts with horovodrun started on host A, as a user would; return
    how it ended, whatever that was.

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
    with open(tmp_path / "horovodrun.log", "a") as log:
        log.write(f"$ {' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}\n")
    hosts.kill_strays()  # a clean run leaves nothing; make sure of it for the next one
    return proc


def horovodrun(hosts: netns_hosts.TwoHosts, controller: str, command: list[str], tmp_path: Path,
               options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """:func:`launch`, which must succeed."""
    proc = launch(hosts, controller, command, tmp_path, options)
    if proc.returncode != 0:
        pytest.fail(f"horovodrun --{controller} across two hosts failed (rc={proc.returncode}):\n"
                    f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
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


# Each rank writes down the namespace it ran in (no Horovod needed: horovodrun started it).
WHERE = ('import os, sys; '
         'open(sys.argv[1] + os.environ["HOROVOD_RANK"], "w").write(os.readlink("/proc/self/ns/net"))')


@contextlib.contextmanager
def known_hosts(hosts: netns_hosts.TwoHosts, text: str) -> Iterator[Path]:
    """The hosts' known_hosts file (what every ssh here reads) holding ``text`` for a while."""
    saved = hosts.known_hosts.read_text()
    hosts.known_hosts.write_text(text)
    try:
        yield hosts.known_hosts
    finally:
        hosts.known_hosts.write_text(saved)


def test_horovodrun_checks_ssh_host_keys(hosts, tmp_path):
    """horovodrun writes the job's key on the standard input of the ssh sessions that start its
    workers, so it must reach only the hosts it means: host B missing from known_hosts is refused
    before anything runs anywhere, with what to do; --ssh-accept-new-hosts trusts it on first use
    (ssh's accept-new) and records its key; a key that changed is refused even then.  (Horovod
    0.28.1 ran ssh with StrictHostKeyChecking=no: the first launch ran on both hosts.)"""
    a, b = hosts.hosts
    ran = tmp_path / "ran-"
    where = [sys.executable, "-c", WHERE, str(ran)]

    def ran_on() -> list[str]:
        found = sorted(tmp_path.glob("ran-*"))
        texts = [p.read_text() for p in found]
        for p in found:
            p.unlink()
        return texts

    with known_hosts(hosts, ""):
        refused = launch(hosts, "gloo", where, tmp_path)
    out = refused.stdout + refused.stderr
    assert refused.returncode != 0, out[-3000:]
    assert "Host key verification failed" in out and f"add {b.name} to ~/.ssh/known_hosts" in out, out[-3000:]
    assert "--ssh-accept-new-hosts" in out
    assert ran_on() == [], "a worker started although host B's key is unknown"

    with known_hosts(hosts, "") as recorded:
        accepted = launch(hosts, "gloo", where, tmp_path, options=("--ssh-accept-new-hosts",))
        learned = subprocess.run(["ssh-keygen", "-F", b.name, "-f", str(recorded)], capture_output=True,
                                 text=True, timeout=30).stdout
    assert accepted.returncode == 0, (accepted.stdout + accepted.stderr)[-3000:]
    assert ran_on() == [f"net:[{h.netns_inode()}]" for h in hosts.hosts]
    key_type, key = (hosts.workdir / "host_key.pub").read_text().split()[:2]
    assert f"{key_type} {key}" in learned, "accept-new records host B's key in known_hosts"

    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True,
                   timeout=30)
    changed = " ".join(Path(f"{other}.pub").read_text().split()[:2])
    with known_hosts(hosts, f"{b.name},{b.addr} {changed}\n"):
        refused = launch(hosts, "gloo", where, tmp_path, options=("--ssh-accept-new-hosts",))
    assert refused.returncode != 0
    assert "Host key verification failed" in refused.stdout + refused.stderr
    assert ran_on() == [], "a worker started on a host whose key changed"


def test_horovodruns_ssh_checks_host_keys_unless_told(monkeypatch):
    """Every ssh command horovodrun builds (its check, the interface probes, Gloo and elastic
    workers) asks ssh to check host keys; the flag and its variable turn on accept-new only."""
    from horovod.runner.launch import parse_args
    from horovod.runner.util.remote import SSH_ACCEPT_NEW_HOSTS, get_remote_command

    monkeypatch.delenv(SSH_ACCEPT_NEW_HOSTS, raising=False)
    assert "-o StrictHostKeyChecking=yes " in get_remote_command("true", "h")
    monkeypatch.setenv(SSH_ACCEPT_NEW_HOSTS, "1")
    assert "-o StrictHostKeyChecking=accept-new " in get_remote_command("true", "h")
    monkeypatch.setattr(sys, "argv", ["horovodrun", "-np", "2", "--ssh-accept-new-hosts", "true"])
    assert parse_args().ssh_accept_new_hosts
