"""``python -m launch.horovodrun [horovodrun flags] COMMAND``: horovodrun, minus the silent start.

horovodrun's own start-up failures reach the user late and noisily: a host in ``-H`` that does
not answer costs a long ssh timeout (53 s here) and ends in a Python traceback ("RuntimeError:
could not connect to some hosts via ssh"); a missing slot (``-np 3 -H localhost:2``) ends in
Open MPI's 20-line "not enough slots" help text.  This wrapper checks both first, in seconds,
and says what is wrong in one line (exit status 2); then it runs horovodrun with the same
arguments, passing its output through, and turns a traceback of horovodrun's own (not a rank's:
those carry a ``[rank]`` tag) into its last line.

Where ``-H``/``--hostfile`` names more than one host and no controller is chosen (``--gloo``,
``--mpi``, ``--jsrun``), it runs ``horovodrun --gloo``: across hosts Horovod's Gloo controller and
collectives trained faster than its MPI ones on the emulated cluster (docs/clusters.md).  A
``--strategy ps`` job stays on MPI, which it needs.

A ``--strategy ps`` job trains on without a dead or frozen worker, which Open MPI 4's mpirun
allows only with ``--enable-recovery`` (without it, mpirun ends every rank once one dies): the
wrapper passes it (``--mpi-args=--enable-recovery``, added to the user's own ``--mpi-args``).
Under it, mpirun's exit status is 0 whatever the ranks' (measured with 4.1.4: a rank's
``MPI_Abort(3)``, every rank exiting 2 or 3, a rank killed: all 0), so the wrapper takes the job's
status from rank 0 instead (server 0, which survives or ends every such job): rank 0 writes it
on a line of its own, keyed by a token in the environment (``launch.cli.STATUS_ENV``), which the
wrapper keeps out of the output.  No such line (rank 0 ended through the watchdog, or was
killed): 3, the watchdog's status, where a rank wrote an ``error:`` line, else 1
(:func:`job_status`).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from launch.cli import STATUS_ENV, STATUS_LINE, run_cli
from ringtrain.errors import UserError

SSH_ANSWER_SECONDS = 5.0
RECOVERY = "--enable-recovery"  # Open MPI 4's mpirun: a rank's death does not end the others
STALL_EXIT_CODE = 3  # ringtrain.faults.watchdog's: a rank ended the job with its one line
_LOCAL = {"localhost", "127.0.0.1", "::1", socket.gethostname()}


# horovodrun's flags that take no value (from its parser); every other flag takes one.
_NO_VALUE = frozenset((
    "--autotune", "--no-autotune", "--disable-cache", "--gloo", "--mpi", "--jsrun", "--tcp",
    "--verbose", "--hierarchical-allgather", "--no-hierarchical-allgather",
    "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--log-with-timestamp",
    "--log-without-timestamp", "--mpi-threads-disable", "--no-mpi-threads-disable",
    "--stall-check", "--no-stall-check", "--timeline-mark-cycles", "--no-timeline-mark-cycles",
    "--torus-allreduce", "--no-torus-allreduce", "--prefix-output-with-timestamp",
    "-prefix-timestamp", "-cb", "--check-build", "-h", "--help", "-v", "--version",
    "--ssh-accept-new-hosts"))  # ringtrain's Horovod (ssh-host-key-checking.patch)


def own_flags(argv: list[str]) -> list[str]:
    """horovodrun's own arguments: those before the command (the first word that is neither a
    flag nor a flag's value); the command's flags are not horovodrun's."""
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if "=" in argv[i] or argv[i] in _NO_VALUE else 2
    return argv[:i]


def _value(argv: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` among horovodrun's own flags (``-H a:1``, ``-H=a:1``)."""
    flags = own_flags(argv)
    for i, arg in enumerate(flags):
        for name in names:
            if arg == name and i + 1 < len(flags):
                return flags[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def hosts_and_slots(argv: list[str]) -> list[tuple[str, int]]:
    """``[(host, slots)]`` from ``-H``/``--hosts`` or ``--hostfile``; empty when neither is given
    (horovodrun then runs everything on this host)."""
    spec = _value(argv, "-H", "--hosts")
    if spec:
        pairs = [item.rsplit(":", 1) if ":" in item else (item, "1") for item in spec.split(",") if item]
    else:
        path = _value(argv, "-hostfile", "--hostfile")
        if not path:
            return []
        try:
            text = Path(path).read_text()
        except OSError as err:
            raise UserError(f"cannot read the host file {path} ({err.strerror})") from None
        pairs = []
        for line in text.splitlines():
            words = line.split("#")[0].split()
            if words:
                slots = next((w.split("=")[1] for w in words[1:] if w.startswith("slots=")), "1")
                pairs.append((words[0], slots))
    try:
        return [(host, int(slots)) for host, slots in pairs]
    except ValueError:
        raise UserError(f"cannot read the slots in {spec or path!r}: expected host:N") from None


def ssh_answers(host: str, port: int, timeout: float = SSH_ANSWER_SECONDS) -> str | None:
    """None if an ssh server on ``host:port`` sends its banner within ``timeout``, else why not.
    (A bare TCP connect is not enough: here a connect to an absent address succeeded through the
    sandbox's network and only ssh's banner exchange timed out.)"""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.settimeout(timeout)
            banner = conn.recv(64)
    except socket.gaierror:
        return "its name does not resolve"
    except TimeoutError:
        return f"no answer on port {port} within {timeout:g} s"
    except OSError as err:
        return f"port {port}: {err.strerror or err}"
    if not banner.startswith(b"SSH-"):
        return f"port {port} answers, but not with ssh"
    return None


def preflight(argv: list[str]) -> None:
    """Refuse, in one line, what horovodrun would fail on slowly: missing slots, silent hosts."""
    if _value(argv, "--host-discovery-script"):
        return  # elastic: hosts come and go by design
    hosts = hosts_and_slots(argv)
    np_text = _value(argv, "-np", "--num-proc")
    if hosts and np_text and np_text.isdigit():
        offered = sum(slots for _, slots in hosts)
        if int(np_text) > offered:
            listed = ",".join(f"{h}:{s}" for h, s in hosts)
            raise UserError(f"-np {np_text} needs {np_text} slots but the hosts offer {offered} "
                            f"({listed}); give a host more slots (host:N) or lower -np")
    port = int(_value(argv, "-p", "--ssh-port") or 22)
    remote = [h for h, _ in hosts if h not in _LOCAL]
    results: dict[str, str | None] = {}
    threads = [threading.Thread(target=lambda h=h: results.__setitem__(h, ssh_answers(h, port)))
               for h in remote]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    silent = [f"{h} ({results[h]})" for h in remote if results.get(h)]
    if silent:
        raise UserError(f"host {', '.join(silent)} cannot be reached over ssh; fix -H or the "
                        f"network, or leave the host out")


def hosts_in(argv: list[str]) -> int:
    """How many machines ``-H``/``--hostfile`` names (this host's own names count once)."""
    names = {"localhost" if h in _LOCAL else h for h, _ in hosts_and_slots(argv)}
    return len(names)


def parameter_servers(argv: list[str]) -> bool:
    """Whether the command (what follows horovodrun's own flags) runs ``--strategy ps``."""
    command = argv[len(own_flags(argv)):]
    return "--strategy=ps" in command or any(
        a == "--strategy" and b == "ps" for a, b in zip(command, command[1:], strict=False))


def with_recovery(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` with mpirun's ``--enable-recovery`` where the job is ``--strategy ps`` on MPI
    (added to ``--mpi-args``, the user's value kept), and whether the job runs with it (added
    here or given already).  Any other job as it is: a ring job cannot outlive a rank anyway,
    and recovery would only cost it its exit status."""
    own = own_flags(argv)
    if not parameter_servers(argv) or {"--gloo", "--jsrun"} & set(own):
        return argv, False
    given = _value(argv, "--mpi-args")
    if given is not None and (RECOVERY in given.split() or "orte_enable_recovery" in given):
        return argv, True
    kept, i = [], 0
    while i < len(own):  # the user's --mpi-args out: one --mpi-args with theirs and recovery in
        if own[i] == "--mpi-args":
            i += 2
            continue
        if not own[i].startswith("--mpi-args="):
            kept.append(own[i])
        i += 1
    merged = f"{given} {RECOVERY}" if given else RECOVERY
    return [f"--mpi-args={merged}", *kept, *argv[len(own):]], True


def job_status(code: int, recovering: bool, state: dict) -> int:
    """The wrapper's exit status: horovodrun's; but where mpirun ran with recovery (its status
    then says nothing: 0 whatever the ranks did, or 1 where a rank's guardian had to interrupt
    it), rank 0's own, once it has finished with its outputs written; else 3 after a rank's
    ``error:`` line (the watchdog's end, which writes no status), else horovodrun's, at least 1
    (rank 0 gone without a word)."""
    if not recovering:
        return code
    if state.get("status") is not None:
        return state["status"]
    return STALL_EXIT_CODE if state["rank_error"] else code or 1


def with_controller(argv: list[str]) -> tuple[list[str], str | None]:
    """``argv`` with ``--gloo`` put first where the job spans hosts and names no controller, and
    the note that says so; else ``argv`` as it is and None.  Elastic jobs
    (``--host-discovery-script``) run on Gloo anyway; a ``--strategy ps`` job needs MPI."""
    own = own_flags(argv)
    chosen = {"--gloo", "--mpi", "--jsrun"} & set(own)
    hosts = hosts_in(argv)
    if chosen or hosts < 2 or _value(argv, "--host-discovery-script") or parameter_servers(argv):
        return argv, None
    return ["--gloo", *argv], (f"note: the job spans {hosts} hosts: running horovodrun --gloo "
                               f"(faster than MPI across hosts, docs/clusters.md); --mpi keeps MPI")


def _pass_through(stream, sink, state: dict, hold: bool) -> None:
    """Copy lines; with ``hold``, keep back a traceback that starts at column 0 (horovodrun's
    own: a rank's lines carry a tag) and everything after it.  Rank 0's status line (its
    ``token``) is kept out and read."""
    token = state.get("token")
    for line in stream:
        if token and token in line:
            # the number alone: mpirun's tagging may glue the next write to it, a bare tag
            # ("0[1,0]<stderr>:") or more, which goes through
            after = line.split(token, 1)[1]
            code = re.match(r" (-?\d+)", after)
            if code:
                state["status"] = int(code.group(1))
            rest = after[code.end():] if code else after
            if re.sub(r"\[\d+,\d+\]<\w+>:", "", rest).strip():
                sink.write(rest if rest.endswith("\n") else rest + "\n")
                sink.flush()
            continue
        if hold and (state["held"] or line.startswith("Traceback (most recent call last):")):
            state["held"].append(line)
            continue
        if "error: " in line:
            state["rank_error"] = True
        sink.write(line)
        sink.flush()


def exception_line(traceback: list[str]) -> str:
    """The exception of a printed traceback as one line (its message may span several)."""
    lines = [ln.strip() for ln in traceback if ln.strip()]
    starts = [i for i, ln in enumerate(lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt|Exit)\b", ln)]
    return " ".join(lines[starts[-1]:] if starts else lines[-1:])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    preflight(argv)
    argv, note = with_controller(argv)
    if note:
        print(note, file=sys.stderr, flush=True)
    argv, recovering = with_recovery(argv)
    state = {"held": [], "rank_error": False, "status": None, "token": None}
    env = dict(os.environ)
    if recovering:
        state["token"] = f"{STATUS_LINE} {secrets.token_hex(8)}"
        env[STATUS_ENV] = state["token"]
    exe = shutil.which("horovodrun", path=f"{Path(sys.executable).parent}{os.pathsep}"
                                          f"{os.environ.get('PATH', '')}")
    if exe is None:
        raise UserError("horovodrun is not installed; run 'make setup'")
    proc = subprocess.Popen([exe, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1, env=env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches horovodrun itself; wait for it
    copiers = [threading.Thread(target=_pass_through, args=(proc.stdout, sys.stdout, state, False)),
               threading.Thread(target=_pass_through, args=(proc.stderr, sys.stderr, state, True))]
    for t in copiers:
        t.start()
    code = proc.wait()
    for t in copiers:
        t.join()
    if state["held"]:
        last = exception_line(state["held"])
        prefix = "" if state["rank_error"] else "error: "
        sys.stderr.write(f"{prefix}horovodrun: {last}\n")
    return job_status(code, recovering, state)


if __name__ == "__main__":
    run_cli(main)
