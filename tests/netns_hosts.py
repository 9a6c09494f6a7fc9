"""Two throwaway "hosts" on this machine: Linux network namespaces joined by a veth pair, each
running its own sshd on its own address.  For testing the multi-host launch path as root.

Layout (names carry this process's pid so parallel or stale runs never collide)::

    netns rt-a-<pid>                          netns rt-b-<pid>
      lo, rtveth0 10.251.0.1/24  <--veth-->     lo, rtveth0 10.251.0.2/24
      sshd on 10.251.0.1:22                     sshd on 10.251.0.2:22
      /etc/hosts: rt-hosta, rt-hostb,           /etc/hosts: rt-hosta, rt-hostb,
                  $(hostname) = 10.251.0.1                  $(hostname) = 10.251.0.2

The veth pair exists only between the two namespaces (neither end is in the machine's own
namespace and nothing routes out), so no packet leaves the machine.  Both veth ends are called
``rtveth0``: Horovod's Gloo controller names one interface for every rank, and interface discovery
keeps only names common to all hosts.

ssh needs no changes to root's ~/.ssh: a throwaway key pair, host key, sshd config and client
config live in a temporary folder, and a two-line ``ssh`` wrapper that adds ``-F <client config>``
is put first on PATH, so horovodrun's own ssh checks, its task launchers and Open MPI's rsh agent
all use it.  :meth:`TwoHosts.env` returns that environment.

Everything is undone on exit, also after errors: every process left in either namespace (sshd,
ssh sessions, ranks) is killed, the namespaces (and with them the veth pair) are deleted, and
``/etc/netns/<ns>`` and the temporary folder are removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"  # sshd refuses to start from a relative path
IFACE = "rtveth0"
PREFIX = "rt-"
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")


class Unavailable(Exception):
    """The hosts cannot be made here (not root, no namespaces, no sshd...): a reason to skip."""


@dataclass
class Host:
    name: str       # resolves to ``addr`` inside both namespaces
    netns: str
    addr: str
    sshd: subprocess.Popen | None = None

    def netns_inode(self) -> int:
        """The namespace's id, as a process inside sees it in ``/proc/self/ns/net`` (``net:[id]``)."""
        return (NETNS_RUN / self.netns).stat().st_ino


@dataclass
class TwoHosts:
    a: Host
    b: Host
    workdir: Path
    identity_file: Path
    ssh_config: Path
    bin_dir: Path   # holds the ``ssh`` wrapper
    iface: str = IFACE

    @property
    def hosts(self) -> tuple[Host, Host]:
        return self.a, self.b

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: os.environ) with the ssh wrapper first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def cmd_in(self, host: Host, cmd: list[str]) -> list[str]:
        """``cmd`` run inside ``host``'s namespace (with its /etc/hosts)."""
        return ["ip", "netns", "exec", host.netns, *cmd]

    def run_in(self, host: Host, cmd: list[str], timeout: float, env: dict[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host``'s namespace with os.environ + ``env`` + the ssh wrapper on PATH;
        on timeout, kill what it left in both namespaces."""
        try:
            return subprocess.run(self.cmd_in(host, cmd), capture_output=True, text=True,
                                  timeout=timeout, env=self.env({**os.environ, **(env or {})}), cwd=cwd,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        except subprocess.TimeoutExpired:
            self.kill_strays()
            raise

    def kill_strays(self) -> None:
        """Kill every process in the two namespaces except the sshd daemons."""
        keep = {h.sshd.pid for h in self.hosts if h.sshd is not None and h.sshd.poll() is None}
        for host in self.hosts:
            _kill_netns_processes(host.netns, keep)


def _sh(cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _must(cmd: list[str], what: str) -> None:
    proc = _sh(cmd)
    if proc.returncode != 0:
        raise Unavailable(f"{what} failed: `{' '.join(cmd)}`: {(proc.stderr or proc.stdout).strip()}")


def _netns_pids(netns: str) -> set[int]:
    proc = _sh(["ip", "netns", "pids", netns])
    return {int(p) for p in proc.stdout.split()} if proc.returncode == 0 else set()


def _kill_netns_processes(netns: str, keep: set[int] = frozenset(), deadline_s: float = 10) -> None:
    end = time.monotonic() + deadline_s
    while True:
        pids = _netns_pids(netns) - set(keep) - {os.getpid()}
        if not pids or time.monotonic() > end:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_netns(netns: str) -> None:
    _kill_netns_processes(netns)
    if (NETNS_RUN / netns).exists():
        _sh(["ip", "netns", "delete", netns])
    shutil.rmtree(NETNS_ETC / netns, ignore_errors=True)


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete namespaces a killed earlier run left behind: ours (``rt-a-<pid>``) whose pid is gone."""
    removed = []
    for path in list(NETNS_RUN.glob(f"{prefix}[ab]-*")) + list(NETNS_ETC.glob(f"{prefix}[ab]-*")):
        m = re.fullmatch(rf"{re.escape(prefix)}[ab]-(\d+)", path.name)
        if m and not _pid_alive(int(m.group(1))) and path.name not in removed:
            _delete_netns(path.name)
            removed.append(path.name)
    return removed


def why_unavailable() -> str | None:
    """A reason the hosts cannot be made here, or None if it is worth trying."""
    if not hasattr(os, "geteuid") or not Path("/proc/self/ns/net").exists():
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (creates network namespaces and runs sshd)"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 openssh-client)"
    if not os.access(SSHD, os.X_OK):
        return f"{SSHD} is not installed (apt-get install openssh-server; .ci/setup does this as root)"
    return None


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.write_text(text)
    path.chmod(mode)


def _hosts_file(hosts: tuple[Host, ...], me: Host) -> str:
    """/etc/hosts for ``me``: every host by name, and the machine's own hostname (which the
    namespaces share) as ``me``'s address, as on a real host.  Gloo needs the latter: Horovod
    0.28.1 makes process-set devices from gethostname(), not from HOROVOD_GLOO_IFACE."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{h.addr}\t{h.name}" + (f" {socket.gethostname()}" if h is me else "") for h in hosts]
    return "\n".join(lines) + "\n"


def _sshd_config(host: Host, workdir: Path) -> str:
    return "\n".join([
        f"ListenAddress {host.addr}:22",
        f"HostKey {workdir / 'host_key'}",
        f"PidFile {workdir / f'sshd-{host.netns}.pid'}",
        f"AuthorizedKeysFile {workdir / 'authorized_keys'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "X11Forwarding no",
        "PrintMotd no",
        "MaxStartups 64",
        "MaxSessions 64",
        "LogLevel ERROR",
    ]) + "\n"


def _ssh_config(identity: Path) -> str:
    return "\n".join([
        "Host *",
        f"  IdentityFile {identity}",
        "  IdentitiesOnly yes",
        "  BatchMode yes",
        "  StrictHostKeyChecking no",
        "  UserKnownHostsFile /dev/null",
        "  GlobalKnownHostsFile /dev/null",
        "  ConnectTimeout 10",
        "  LogLevel ERROR",
    ]) + "\n"


def _start_sshd(hosts: TwoHosts, host: Host) -> None:
    config = hosts.workdir / f"sshd-{host.netns}.conf"
    _write(config, _sshd_config(host, hosts.workdir))
    with open(hosts.workdir / f"sshd-{host.netns}.log", "w") as log:  # sshd keeps its own copy
        host.sshd = subprocess.Popen(hosts.cmd_in(host, [SSHD, "-D", "-e", "-f", str(config)]),
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)


def _wait_for_ssh(hosts: TwoHosts, timeout_s: float = 20) -> None:
    """Every host can ssh into every host (by name); raise Unavailable with the logs otherwise."""
    end = time.monotonic() + timeout_s
    pending = [(src, dst) for src in hosts.hosts for dst in hosts.hosts]
    last = ""
    while pending:
        src, dst = pending[0]
        for h in hosts.hosts:
            if h.sshd.poll() is not None:
                raise Unavailable(f"sshd in {h.netns} exited with {h.sshd.returncode}: "
                                  f"{_read(hosts.workdir / f'sshd-{h.netns}.log')}")
        proc = hosts.run_in(src, ["ssh", dst.name, "readlink /proc/self/ns/net"], timeout=30)
        if proc.returncode == 0:
            if f"net:[{dst.netns_inode()}]" not in proc.stdout:
                raise Unavailable(f"ssh {dst.name} from {src.netns} did not land in {dst.netns}: "
                                  f"{proc.stdout.strip()}")
            pending.pop(0)
            continue
        last = (proc.stderr or proc.stdout).strip()
        if time.monotonic() > end:
            logs = "; ".join(f"{h.netns}: {_read(hosts.workdir / f'sshd-{h.netns}.log')}"
                             for h in hosts.hosts)
            raise Unavailable(f"cannot ssh from {src.netns} to {dst.name}: {last} (sshd logs: {logs})")
        time.sleep(0.3)


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()[-2000:] or "(empty)"
    except OSError:
        return "(none)"


@contextlib.contextmanager
def two_hosts(names: tuple[str, str] = ("rt-hosta", "rt-hostb"),
              subnet: str = "10.251.0") -> Iterator[TwoHosts]:
    """Make the two hosts, yield them, and tear everything down.  Raises :class:`Unavailable`."""
    reason = why_unavailable()
    if reason:
        raise Unavailable(reason)
    remove_stale()
    pid = os.getpid()
    a = Host(names[0], f"{PREFIX}a-{pid}", f"{subnet}.1")
    b = Host(names[1], f"{PREFIX}b-{pid}", f"{subnet}.2")
    workdir = Path(tempfile.mkdtemp(prefix="rt-hosts-"))
    made_run_sshd = False
    made_netns_etc = not NETNS_ETC.exists()
    hosts = TwoHosts(a, b, workdir, workdir / "id_ed25519", workdir / "ssh_config", workdir / "bin")
    created: list[Host] = []
    try:
        for h in (a, b):
            if (NETNS_RUN / h.netns).exists():  # a leftover of ours with this very pid
                _delete_netns(h.netns)
            _must(["ip", "netns", "add", h.netns], "creating a network namespace")
            created.append(h)
        _must(["ip", "link", "add", IFACE, "netns", a.netns, "type", "veth", "peer", "name", IFACE,
               "netns", b.netns], "creating a veth pair")
        for h in (a, b):
            _must(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", IFACE], "addressing veth")
            _must(["ip", "-n", h.netns, "link", "set", "lo", "up"], "bringing up lo")
            _must(["ip", "-n", h.netns, "link", "set", IFACE, "up"], "bringing up veth")
            etc = NETNS_ETC / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            _write(etc / "hosts", _hosts_file((a, b), h))

        for key, comment in ((hosts.identity_file, "ringtrain-test-client"), (workdir / "host_key", "")):
            _must(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
                  "ssh-keygen")
        shutil.copy(f"{hosts.identity_file}.pub", workdir / "authorized_keys")
        _write(hosts.ssh_config, _ssh_config(hosts.identity_file))
        hosts.bin_dir.mkdir()
        ssh = shutil.which("ssh")
        _write(hosts.bin_dir / "ssh", f'#!/bin/sh\nexec {ssh} -F {hosts.ssh_config} "$@"\n', 0o755)

        # sshd insists on its privilege-separation folder (systemd makes it at boot, containers don't).
        if not Path("/run/sshd").is_dir():
            Path("/run/sshd").mkdir(mode=0o755, parents=True)
            made_run_sshd = True
        for h in (a, b):
            _start_sshd(hosts, h)
        _wait_for_ssh(hosts)
        yield hosts
    finally:
        for h in (a, b):
            if h.sshd is not None and h.sshd.poll() is None:
                h.sshd.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.sshd.wait(timeout=10)
        for h in created:
            _delete_netns(h.netns)
        for h in (a, b):
            shutil.rmtree(NETNS_ETC / h.netns, ignore_errors=True)
        for made, folder in ((made_run_sshd, Path("/run/sshd")), (made_netns_etc, NETNS_ETC)):
            if made:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only if empty: someone else may have started using it
        shutil.rmtree(workdir, ignore_errors=True)
