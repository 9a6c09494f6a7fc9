"""A host whose own name does not resolve (containers, cluster nodes, a fresh debootstrap root).

Horovod 0.28.1's Gloo looked that name up and crashed on it: a segfault in
``gloo::transport::tcp::CreateDeviceAttr`` on Debian 13, an abort on Debian 12, for every
``horovodrun --gloo`` and elastic job.  Each test runs in its own UTS namespace (``unshare --uts``)
whose hostname ends in ``.invalid``, which never resolves; the machine's own name is untouched.
Root only (a new UTS namespace needs CAP_SYS_ADMIN); skipped with the reason elsewhere.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from conftest import BIN, SMALL, requires_horovod, run

pytestmark = requires_horovod
HOST = f"rt-unresolvable-{os.getpid()}.invalid"

# Horovod's own API, no ringtrain code: what a user's script does.
PROBE = '''
import torch
import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum, name="probe").item()
print(f"rank {hvd.rank()} of {hvd.size()}: sum {total}", flush=True)
'''


def on_unresolvable_host(cmd: list[str]) -> list[str]:
    return ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', HOST, *cmd]


@pytest.fixture(scope="module", autouse=True)
def unresolvable():
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) to give a process its own hostname")
    resolve = "import socket; socket.getaddrinfo(socket.gethostname(), None)"
    proc = run(on_unresolvable_host([sys.executable, "-c", resolve]), timeout=60)
    if proc.returncode == 0:  # e.g. nss-myhostname resolves any name the host has
        pytest.skip(f"{HOST} resolves here (an NSS module answers for the host's own name)")
    if "gaierror" not in proc.stderr:
        pytest.skip(f"cannot run in a UTS namespace here: {proc.stderr.strip()[-300:]}")


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def test_horovodrun_gloo_runs_without_the_hosts_name(probe):
    # horovodrun names the interface (HOROVOD_GLOO_IFACE); the patched Gloo binds to it everywhere,
    # process sets included, so the job no longer depends on the host's name at all.
    proc = run(on_unresolvable_host([str(BIN / "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2",
                                     sys.executable, probe]), timeout=180)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    for rank in (0, 1):
        assert f"rank {rank} of 2: sum 3.0" in proc.stdout, proc.stdout[-3000:]


GLOO_ALONE = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"}  # no interface named


def test_horovod_api_says_what_to_fix_instead_of_crashing(probe):
    proc = run(on_unresolvable_host([sys.executable, probe]), env=GLOO_ALONE, timeout=120)
    # exit 1 from Horovod's one line: not -11 (segfault) or 134 (abort from an uncaught exception)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if "Horovod: Gloo cannot start" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"cannot resolve this host's name '{HOST}'" in lines[0], lines[0]
    assert "/etc/hosts" in lines[0] and "HOROVOD_GLOO_IFACE" in lines[0], lines[0]


def test_trainer_says_it_in_one_line_before_horovod_starts():
    proc = run(on_unresolvable_host([sys.executable, "-m", "launch.torch_mnist", *SMALL, "--epochs", "1"]),
               env=GLOO_ALONE, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Horovod: Gloo" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"this host's name '{HOST}' does not resolve" in lines[0], lines[0]
    assert f"127.0.1.1 {HOST}" in lines[0], lines[0]
