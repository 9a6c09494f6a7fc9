"""Throwaway "hosts" on this machine: Linux network namespaces, each with its own address and
its own sshd, joined by a veth pair (two hosts) or through a bridge (N hosts), with optional tc
shaping of every host's link.  For testing the multi-host launch path as root
(``tests/conftest.py: hosts``, ``tests/test_multihost.py``), and for the emulated cluster of
``bench/parts/emulated_cluster.py`` and ``bench/parts/cluster_cells.py``; all of them import it as
``bench.common.netns_hosts``.

Two hosts (:func:`two_hosts`, what ``tests/test_multihost.py`` uses).  Names carry this
process's pid so parallel or stale runs never collide::

    netns rt-a-<pid>                          netns rt-b-<pid>
      lo, rtveth0 10.251.0.1/24  <--veth-->     lo, rtveth0 10.251.0.2/24
      sshd on 10.251.0.1:22                     sshd on 10.251.0.2:22
      /etc/hosts: rt-hosta, rt-hostb,           /etc/hosts: rt-hosta, rt-hostb,
                  $(hostname) = 10.251.0.1                  $(hostname) = 10.251.0.2

N hosts (:func:`make_hosts` with ``topology="bridge"``): host i lives in netns
``<prefix>h<i>-<pid>``; its veth ``<iface>`` is paired with port ``p<i>`` of the bridge ``br0``
in a switch namespace ``<prefix>sw-<pid>``, like N machines on one switch::

    <prefix>h1-<pid>: <iface> 10.x.y.1 --veth-- p1 \\
    <prefix>h2-<pid>: <iface> 10.x.y.2 --veth-- p2  > br0 in <prefix>sw-<pid>
    ...                                          ... /

Neither end of any veth is in the machine's own namespace and nothing routes out, so no packet
leaves the machine.  Every host's interface has the same name: Horovod's Gloo controller names
one interface for every rank, and interface discovery keeps only names common to all hosts.

Shaping (:meth:`Hosts.shape`) puts an HTB rate limit on both directions of every host's link: on
the host's egress (uplink) and on the egress of the other end, the switch port (downlink), or the
peer's veth for a pair.  Delay and loss need ``sch_netem`` in the kernel; where it is missing,
:meth:`Hosts.shape` raises :class:`Unavailable` instead of silently leaving them out
(:func:`netem_missing` says so beforehand).

ssh needs no changes to root's ~/.ssh: a throwaway key pair, host key, sshd config, client
config and ``known_hosts`` live in a temporary folder, and a two-line ``ssh`` wrapper that adds
``-F <client config>`` is put first on PATH, so horovodrun's own ssh checks, its task launchers
and Open MPI's rsh agent all use it.  :meth:`Hosts.env` returns that environment.  Host keys are
checked, as on a cluster whose administrator distributes them: ``known_hosts``
(:attr:`Hosts.known_hosts`) lists every host by name and address with the hosts' key, and
horovodrun's ssh refuses a host missing from it (its ``--ssh-accept-new-hosts`` adds one).

Everything is undone on exit, also after errors and Ctrl-C: every process left in the namespaces
(sshd, ssh sessions, ranks) is killed, the namespaces (and with them the veths, the bridge and
every tc rule on them) are deleted, and ``/etc/netns/<ns>`` and the temporary folder are removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import util

SSHD = "/usr/sbin/sshd"  # sshd refuses to start from a relative path
IFACE = "rtveth0"
PREFIX = "rt-"
NETNS_RUN = Path("/run/netns")
NETNS_ETC = Path("/etc/netns")
BRIDGE = "br0"
# Namespace names: <prefix><role>-<pid>; roles a/b (two_hosts), h<i> (N hosts), sw (the switch).
ROLE = r"(?:a|b|sw|h\d+|probe)"


class Unavailable(Exception):
    """The hosts cannot be made here (not root, no namespaces, no sshd...): a reason to skip."""


@dataclass
class Host:
    name: str       # resolves to ``addr`` inside every host's namespace
    netns: str
    addr: str
    sshd: subprocess.Popen | None = None
    port: str | None = None  # the other end of this host's veth: a bridge port in the switch

    def netns_inode(self) -> int:
        """The namespace's id, as a process inside sees it in ``/proc/self/ns/net`` (``net:[id]``)."""
        return (NETNS_RUN / self.netns).stat().st_ino


@dataclass(frozen=True)
class LinkShape:
    """One host's link, the same each way: a rate, and optionally a one-way delay and a loss rate
    (both on the host's egress).  ``burst_s``: the HTB bucket, as time at line rate (200 us keeps
    64 KiB messages near line rate instead of letting them through in one burst, and still let a
    single TCP stream reach 94-96% of a 1 Gbit/s rate here)."""

    rate_bit: float
    delay_s: float = 0.0
    loss: float = 0.0
    burst_s: float = 200e-6

    @property
    def burst_bytes(self) -> int:
        return max(3000, int(self.rate_bit / 8 * self.burst_s))

    def describe(self) -> str:
        giga = self.rate_bit >= 1e9
        rate = f"{self.rate_bit / 1e9:g} Gbit/s" if giga else f"{self.rate_bit / 1e6:g} Mbit/s"
        parts = [rate] + ([f"{self.delay_s * 1e3:g} ms"] if self.delay_s else []) + (
            [f"{self.loss:.2%} loss"] if self.loss else [])
        return " + ".join(parts)


@dataclass
class Hosts:
    hosts: tuple[Host, ...]
    workdir: Path
    identity_file: Path
    ssh_config: Path
    bin_dir: Path   # holds the ``ssh`` wrapper
    known_hosts: Path  # every host's name and address with its key (the client config's file)
    iface: str = IFACE
    switch: str | None = None  # the bridge's namespace (N hosts); None for a veth pair
    shaped: LinkShape | None = field(default=None)
    hostnames: bool = False  # each host also has its own UTS namespace, hostname = its name

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: os.environ) with the ssh wrapper first on PATH."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        return env

    def cmd_in(self, host: Host, cmd: list[str]) -> list[str]:
        """``cmd`` run inside ``host``'s namespace (with its /etc/hosts, and its own hostname
        where the hosts have them)."""
        inside = ["ip", "netns", "exec", host.netns, *cmd]
        if not self.hostnames:
            return inside
        return ["unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host.name, *inside]

    def run_in(self, host: Host, cmd: list[str], timeout: float, env: dict[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
        """Run ``cmd`` inside ``host``'s namespace with os.environ + ``env`` + the ssh wrapper on PATH;
        on timeout, kill what it left in every namespace."""
        try:
            return subprocess.run(self.cmd_in(host, cmd), capture_output=True, text=True,
                                  timeout=timeout, env=self.env({**os.environ, **(env or {})}), cwd=cwd,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        except subprocess.TimeoutExpired:
            self.kill_strays()
            raise

    def kill_strays(self) -> None:
        """Kill every process in the hosts' namespaces except the sshd daemons."""
        for host in self.hosts:
            self.kill_host(host)

    def kill_host(self, host: Host) -> None:
        """SIGKILL every process in ``host``'s namespace but its sshd, all at once (what losing
        the machine does to them); returns when none is left."""
        keep = {host.sshd.pid} if host.sshd is not None and host.sshd.poll() is None else set()
        _kill_netns_processes(host.netns, keep)

    # -- links ---------------------------------------------------------------------------------

    def link_queues(self, host: Host) -> list[tuple[str, str]]:
        """(namespace, device) of the two egress queues that carry ``host``'s traffic: its own
        interface (uplink) and the far end of its veth (downlink)."""
        if self.switch is not None:
            return [(host.netns, self.iface), (self.switch, host.port)]
        peer = next(h for h in self.hosts if h is not host)
        return [(host.netns, self.iface), (peer.netns, self.iface)]

    def queues(self) -> list[tuple[str, str]]:
        """Every link's egress queues, each once (a pair's two ends serve both its hosts)."""
        seen: dict[tuple[str, str], None] = {}
        for host in self.hosts:
            seen.update(dict.fromkeys(self.link_queues(host)))
        return list(seen)

    def shape(self, link: LinkShape) -> None:
        """Rate-limit both directions of every host's link (replacing any earlier shaping);
        delay and loss on each host's egress.  Raises :class:`Unavailable` if the kernel cannot."""
        if (link.delay_s or link.loss) and netem_missing():
            raise Unavailable(f"delay/loss need tc netem: {netem_missing()}")
        self.unshape()
        rate, burst = f"{int(link.rate_bit)}bit", str(link.burst_bytes)
        for netns, dev in self.queues():
            _must(["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb",
                   "default", "1"], "adding an htb qdisc")
            # quantum: one class, so it never decides anything; set to keep tc from warning
            _must(["tc", "-n", netns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1",
                   "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst,
                   "quantum", "60000"], "adding an htb class")
        for host in self.hosts:
            if link.delay_s or link.loss:
                netem = ["delay", f"{link.delay_s * 1e6:.0f}us"] + (
                    ["loss", f"{100 * link.loss:g}%"] if link.loss else [])
                _must(["tc", "-n", host.netns, "qdisc", "add", "dev", self.iface, "parent", "1:1",
                       "handle", "10:", "netem", *netem, "limit", "100000"], "adding netem")
        self.shaped = link

    def unshape(self) -> None:
        for netns, dev in self.queues():
            _sh(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])
        self.shaped = None

    def counters(self, host: Host) -> dict[str, int]:
        """Bytes through ``host``'s interface so far, as the kernel counts them (frames:
        Ethernet + IP + TCP headers included): ``tx`` (uplink) and ``rx`` (downlink)."""
        proc = _sh(["ip", "-n", host.netns, "-s", "-j", "link", "show", "dev", self.iface])
        stats = json.loads(proc.stdout)[0]["stats64"]
        return {"tx": stats["tx"]["bytes"], "rx": stats["rx"]["bytes"]}


class TwoHosts(Hosts):
    """Two hosts joined by one veth pair (no bridge): :func:`two_hosts`."""

    @property
    def a(self) -> Host:
        return self.hosts[0]

    @property
    def b(self) -> Host:
        return self.hosts[1]


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
    """Delete namespaces a killed earlier run left behind: ours (``<prefix><role>-<pid>``) whose
    pid is gone."""
    removed = []
    pattern = re.compile(rf"{re.escape(prefix)}{ROLE}-(\d+)")
    for path in list(NETNS_RUN.glob(f"{prefix}*")) + list(NETNS_ETC.glob(f"{prefix}*")):
        m = pattern.fullmatch(path.name)
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


@functools.cache
def netem_missing() -> str | None:
    """Why tc netem (delay, loss) cannot be used here, or None if it can.  Probed once, on a
    throwaway veth pair in a throwaway namespace."""
    reason = why_unavailable() or (None if shutil.which("tc") else "`tc` is not installed (iproute2)")
    if reason is None:
        ns = f"{PREFIX}probe-{os.getpid()}"
        try:
            _must(["ip", "netns", "add", ns], "creating a network namespace")
            _must(["ip", "-n", ns, "link", "add", "rtprobe0", "type", "veth", "peer", "name", "rtprobe1"],
                  "creating a veth pair")
            proc = _sh(["tc", "-n", ns, "qdisc", "add", "dev", "rtprobe0", "root", "netem", "delay", "1ms"])
            if proc.returncode != 0:
                reason = (f"the kernel has no sch_netem (`tc qdisc add ... netem`: "
                          f"{(proc.stderr or proc.stdout).strip()})")
        except Unavailable as err:
            reason = str(err)
        finally:
            _sh(["ip", "netns", "delete", ns])
    return reason


PRIVSEP_DIR = Path("/run/sshd")


def ensure_privsep_dir() -> None:
    """sshd needs its privilege-separation folder at start *and at every connection* (systemd
    makes it at boot, containers don't).  It is made if missing and never removed: an empty
    /run/sshd looked like ours to remove, and removing it while another set of hosts (a parallel
    test, a benchmark) still ran made every later ssh to them fail with "kex_exchange_identification:
    Connection closed by remote host".  Long runs call this again before each job, in case
    someone else removed it meanwhile."""
    PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    util.write_text(path, text, mode)  # a fresh file renamed into place: never through a symlink


def _hosts_file(hosts: Sequence[Host], me: Host) -> str:
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


def _ssh_config(identity: Path, known_hosts: Path) -> str:
    return "\n".join([
        "Host *",
        f"  IdentityFile {identity}",
        "  IdentitiesOnly yes",
        "  BatchMode yes",
        "  StrictHostKeyChecking yes",
        f"  UserKnownHostsFile {known_hosts}",
        "  GlobalKnownHostsFile /dev/null",
        "  ConnectTimeout 10",
        "  LogLevel ERROR",
    ]) + "\n"


def _known_hosts(hosts: Sequence[Host], host_key_pub: Path) -> str:
    """Every host by name and address with its sshd's key (they all serve one host key)."""
    key_type, key = host_key_pub.read_text().split()[:2]
    return "".join(f"{h.name},{h.addr} {key_type} {key}\n" for h in hosts)


def _start_sshd(hosts: Hosts, host: Host) -> None:
    config = hosts.workdir / f"sshd-{host.netns}.conf"
    _write(config, _sshd_config(host, hosts.workdir))
    # "x": a new file (O_CREAT|O_EXCL), never one planted there; sshd keeps its own copy
    with open(hosts.workdir / f"sshd-{host.netns}.log", "x") as log:
        host.sshd = subprocess.Popen(hosts.cmd_in(host, [SSHD, "-D", "-e", "-f", str(config)]),
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)


def _wait_for_ssh(hosts: Hosts, timeout_s: float = 20) -> None:
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


def _wire(hosts: Hosts) -> None:
    """The links: one veth pair between two hosts, or each host's veth on a port of the bridge."""
    iface = hosts.iface
    if hosts.switch is None:
        a, b = hosts.hosts
        _must(["ip", "link", "add", iface, "netns", a.netns, "type", "veth", "peer", "name", iface,
               "netns", b.netns], "creating a veth pair")
    else:
        sw = hosts.switch
        _must(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"], "creating a bridge")
        _must(["ip", "-n", sw, "link", "set", BRIDGE, "up"], "bringing up the bridge")
        for i, h in enumerate(hosts.hosts, 1):
            h.port = f"p{i}"
            _must(["ip", "link", "add", iface, "netns", h.netns, "type", "veth", "peer", "name", h.port,
                   "netns", sw], "creating a veth pair")
            _must(["ip", "-n", sw, "link", "set", h.port, "master", BRIDGE], "adding a bridge port")
            _must(["ip", "-n", sw, "link", "set", h.port, "up"], "bringing up a bridge port")
    for h in hosts.hosts:
        _must(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", iface], "addressing veth")
        _must(["ip", "-n", h.netns, "link", "set", "lo", "up"], "bringing up lo")
        _must(["ip", "-n", h.netns, "link", "set", iface, "up"], "bringing up veth")
        etc = NETNS_ETC / h.netns
        etc.mkdir(parents=True, exist_ok=True)
        _write(etc / "hosts", _hosts_file(hosts.hosts, h))


@contextlib.contextmanager
def make_hosts(names: Sequence[str], *, prefix: str = PREFIX, subnet: str = "10.251.0",
               iface: str = IFACE, topology: str = "bridge", roles: Sequence[str] | None = None,
               hostnames: bool = False) -> Iterator[Hosts]:
    """Make one host per name, yield them, and tear everything down (also on errors and Ctrl-C).

    ``topology``: ``"pair"`` (exactly two hosts on one veth pair, :class:`TwoHosts`) or
    ``"bridge"`` (any number, on a bridge in a switch namespace).  ``hostnames``: every process
    started on a host (sshd, hence everything ssh starts, and :meth:`Hosts.cmd_in`) also gets
    its own UTS namespace whose hostname is the host's name.  Without it all hosts report this
    machine's hostname, and Open MPI then names two hosts' shared-memory segments alike
    (``vader_segment.<hostname>.<job>.<local rank>``): with two ranks per host, ranks on
    different hosts map the same segment and crash in ``mca_btl_vader_poll_handle_frag``.
    Raises :class:`Unavailable`.
    """
    reason = why_unavailable()
    missing = [tool for tool in ("unshare", "hostname") if hostnames and shutil.which(tool) is None]
    if reason or missing:
        raise Unavailable(reason or f"`{missing[0]}` is not installed (util-linux, hostname)")
    if topology not in ("pair", "bridge") or (topology == "pair" and len(names) != 2):
        raise ValueError(f"topology {topology!r} with {len(names)} hosts")
    remove_stale(prefix)
    pid = os.getpid()
    roles = list(roles or [f"h{i}" for i in range(1, len(names) + 1)])
    made = [Host(name, f"{prefix}{role}-{pid}", f"{subnet}.{i}")
            for i, (name, role) in enumerate(zip(names, roles, strict=True), 1)]
    workdir = Path(tempfile.mkdtemp(prefix=f"{prefix}hosts-"))
    made_netns_etc = not NETNS_ETC.exists()
    cls = TwoHosts if topology == "pair" else Hosts
    hosts = cls(tuple(made), workdir, workdir / "id_ed25519", workdir / "ssh_config", workdir / "bin",
                workdir / "known_hosts", iface=iface,
                switch=f"{prefix}sw-{pid}" if topology == "bridge" else None, hostnames=hostnames)
    namespaces = [h.netns for h in made] + ([hosts.switch] if hosts.switch else [])
    created: list[str] = []
    try:
        for ns in namespaces:
            if (NETNS_RUN / ns).exists():  # a leftover of ours with this very pid
                _delete_netns(ns)
            _must(["ip", "netns", "add", ns], "creating a network namespace")
            created.append(ns)
        _wire(hosts)

        for key, comment in ((hosts.identity_file, "ringtrain-test-client"), (workdir / "host_key", "")):
            _must(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
                  "ssh-keygen")
        util.write_bytes(workdir / "authorized_keys", Path(f"{hosts.identity_file}.pub").read_bytes())
        _write(hosts.known_hosts, _known_hosts(made, workdir / "host_key.pub"))
        _write(hosts.ssh_config, _ssh_config(hosts.identity_file, hosts.known_hosts))
        hosts.bin_dir.mkdir()
        ssh = shutil.which("ssh")
        _write(hosts.bin_dir / "ssh", f'#!/bin/sh\nexec {ssh} -F {hosts.ssh_config} "$@"\n', 0o755)

        ensure_privsep_dir()
        for h in made:
            _start_sshd(hosts, h)
        _wait_for_ssh(hosts)
        yield hosts
    finally:
        for h in made:
            if h.sshd is not None and h.sshd.poll() is None:
                h.sshd.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    h.sshd.wait(timeout=10)
        for ns in created:  # deleting a namespace deletes its veths, bridge and tc rules
            _delete_netns(ns)
        for ns in namespaces:
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        if made_netns_etc:
            with contextlib.suppress(OSError):
                NETNS_ETC.rmdir()  # only if empty: someone else may have started using it
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def two_hosts(names: tuple[str, str] = ("rt-hosta", "rt-hostb"),
              subnet: str = "10.251.0") -> Iterator[TwoHosts]:
    """Make the two hosts (one veth pair), yield them, and tear everything down.  Raises
    :class:`Unavailable`.

    Each host has its own hostname, as real hosts do: with one hostname for both, every MPI job
    across them died at start on Open MPI 5.0.7 (Debian 13) in ``MPI_Comm_split_type``
    (``MPI_ERR_TRUNCATE``), while Open MPI 4.1 and Gloo ran."""
    with make_hosts(names, prefix=PREFIX, subnet=subnet, iface=IFACE, topology="pair",
                    roles=("a", "b"), hostnames=True) as hosts:
        yield hosts
