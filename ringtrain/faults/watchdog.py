"""No hang, ever: a progress watchdog in every rank, a heartbeat side channel, a guardian process.

A rank that is frozen (SIGSTOP, a swap storm, a hung node) or cut off from its peers does not
fail: its peers wait in their next collective forever.  Horovod's stall check cannot help under
MPI, because its coordinator thread is itself blocked in MPI waiting for the frozen rank (measured:
``kill -STOP`` of rank 1 of a ``--stall-timeout 30`` job, still running 150 s later).  Three
pieces (the third in :mod:`ringtrain.faults.guardian`) end such a job within ``--stall-timeout``
seconds and say why:

* **Progress clock** (every rank, a daemon thread).  The trainers call :func:`progress` after each
  optimizer step and each epoch's evaluation (a completed collective).  No progress for
  ``--stall-timeout`` seconds (plus :data:`STARTUP_GRACE` before the first step) aborts the
  job: ``MPI_Abort`` under MPI (Open MPI then kills
  every rank, stopped ones included), and under Gloo an exit with status 3, which horovodrun's own
  teardown turns into the end of the job.  A Python thread keeps running while the main thread
  waits in a Horovod collective (checked under MPI and Gloo, both frameworks: the wait releases
  the GIL).
* **Heartbeats** (fixed-size jobs).  To *name* the culprit, rank 0 needs what the blocked ranks
  cannot tell it through Horovod.  Every rank sends a small UDP datagram to rank 0 every second
  (rank, steps done, its address) and rank 0 answers each one.  UDP, not TCP: a heartbeat is
  worth something only while it is fresh, a lost one is simply replaced by the next (so a lossy
  link costs nothing but a few of them), and there is no connection to hang on a dead peer.
  Rank 0's address is shared once, by the one allgather at start-up (JSON, never a pickle:
  :mod:`ringtrain.training.wire`), together with a random job key.  Rank 0 listens on the
  address the job uses (loopback when every rank is on its host, else the launcher's interface),
  the others on a socket connected to it.  Every datagram carries an HMAC of its body under the
  key (the key itself never crosses the channel) and a counter that must grow, and rank 0 checks
  each one's shape and types: anything else is counted and dropped (:meth:`Watchdog.accept`), and
  text from a peer is printed without its control characters.  Rank 0 owns the user-facing line; when rank
  0 itself is silent, the rank that notices says so instead, and any other rank steps in only
  :data:`GRACE` seconds after rank 0 should have.
* **Guardian** (every rank, a tiny child process running :mod:`ringtrain.faults.guardian`).  The
  watchdog thread feeds it a byte every tick; a rank whose thread has not run for its limit is frozen as a
  whole, and the guardian SIGKILLs it.  That is what lets a launcher notice a frozen worker:
  an elastic job (where nothing else can end a stopped worker, and Horovod's driver waits for
  every worker to report before it re-forms) then carries on without it, and a fixed job whose
  frozen rank sits on another host (which horovodrun --gloo cannot reach to kill) leaves no rank
  behind.  After its rank called ``MPI_Abort``, the guardian also sees that the MPI launcher
  ends: mpirun waits for ever for the daemon of a host cut off by a partition, so the guardian
  interrupts it twice (Open MPI's forced exit) if it is still there :data:`GRACE` s later.

Elastic jobs (``--elastic``) issue no collective outside the elastic loop and change ranks as
workers come and go, so they run without heartbeats: the guardian handles a frozen worker after
``--stall-timeout`` seconds, and a worker that makes no progress for ``--stall-timeout`` (or
Gloo's timeout, if longer: that is what releases a collective whose peer was cut off) +
:data:`ELASTIC_GRACE` seconds (long enough for the others to re-form without a lost worker)
leaves the job with one line.

Finally, a collective that fails (Horovod shut down by its stall check, a Gloo timeout, a peer
gone) used to end in a Python traceback on every rank; with the watchdog running, it ends in one
line that adds what the heartbeats know about the peers.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import hmac
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

from ringtrain.errors import printable
from ringtrain.faults.guardian import GRACE
from ringtrain.faults.guardian import now as _now
from ringtrain.faults.guardian import say as _say

STALL_EXIT_CODE = 3
ELASTIC_GRACE = 30.0  # s an elastic worker allows its peers for a re-form beyond the timeout
# Before the first step: importing, loading data and TF's first trace took 11 s (torch, 2 ranks)
# with 8 other jobs on the 2 cores here, and a 10 s test timeout fired before training began.
STARTUP_GRACE = 60.0
GUARD_FIXED_EXTRA = 2 * GRACE  # fixed jobs: the guardian is the last resort, after the ranks
MAC_BYTES = 16  # a heartbeat's HMAC-SHA256 of its body, truncated
MAX_DATAGRAM = 512  # the longest heartbeat: 16 bytes of MAC and a JSON body of ~50 + "o"'s text


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def local_host() -> str:
    """This rank's host as the launcher named it (horovodrun's -H name), else the hostname."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def _preferred_iface() -> str | None:
    for name in ("HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME"):
        value = os.environ.get(name, "").split(",")[0].strip()
        if value and not value.startswith("^"):
            return value
    return None


def local_addresses() -> list[str]:
    """This host's IPv4 addresses: the interface the launcher picked first, loopback last."""
    try:
        import psutil  # a dependency of Horovod itself

        by_iface = {name: [a.address for a in addrs if a.family == socket.AF_INET]
                    for name, addrs in psutil.net_if_addrs().items()}
    except Exception:  # no psutil: whatever the hostname resolves to, and loopback
        by_iface = {"host": [socket.gethostbyname(socket.gethostname())], "lo": ["127.0.0.1"]}
    first = _preferred_iface()
    ordered = by_iface.pop(first, []) if first else []
    loopback = [a for addrs in by_iface.values() for a in addrs if a.startswith("127.")]
    ordered += [a for addrs in by_iface.values() for a in addrs if not a.startswith("127.")]
    return list(dict.fromkeys(ordered + loopback + ["127.0.0.1"]))


_FRAMEWORK_PATHS = (f"{os.sep}horovod{os.sep}", f"{os.sep}tensorflow{os.sep}",
                    f"{os.sep}keras{os.sep}", f"{os.sep}torch{os.sep}")


def main_thread_outside_frameworks() -> str | None:
    """Where the main thread is (``file:line in function``) if its innermost Python frame is not
    in Horovod, TensorFlow, Keras or PyTorch: a rank alive but stuck in its own code (input
    pipeline, a lock, a sleep) rather than computing or waiting for its peers.  None otherwise."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None or any(part in frame.f_code.co_filename for part in _FRAMEWORK_PATHS):
        return None
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def describe(info: dict) -> str:
    """``rank 1 (rt-hostb, 10.251.0.2, pid 4242)`` from a rank's start-up record."""
    where = [printable(info.get("host", "?"), 80)]
    addr = printable(info.get("addr") or "", 80)
    if addr and not addr.startswith("127.") and addr not in where:
        where.append(addr)
    where.append(f"pid {printable(info.get('pid', '?'), 20)}")
    return f"rank {printable(info.get('rank', '?'), 20)} ({', '.join(where)})"


class Watchdog:
    """The per-rank watchdog; use the module functions (:func:`start`, :func:`progress`)."""

    def __init__(self, stall_timeout: float, rank: int, size: int, controller: str,
                 elastic: bool) -> None:
        self.timeout = float(stall_timeout)
        self.rank, self.size = rank, size
        self.controller, self.elastic = controller, elastic
        self.tick = min(1.0, max(0.2, self.timeout / 10))
        self.steps = 0
        self.last = _now()
        self.armed = True
        self.fired = False
        self.peers: dict[int, dict] = {}        # rank -> start-up record (host, addr, pid)
        self.seen: dict[int, float] = {}        # rank -> when its last heartbeat arrived
        self.peer_steps: dict[int, int] = {}
        self.outside: dict[int, str | None] = {}  # rank -> where its main thread is, if not in
        #                                            Horovod or the framework (None: it is)
        self.channel: dict | None = None        # rank 0's record: its key, port and address
        self.key = b""
        self.waiting: str | None = None         # what the main thread waits for from a peer,
        #                                         outside Horovod (a pipeline's message)
        self.sock: socket.socket | None = None
        self.sent = 0                           # heartbeats this rank signed (their counter)
        self.counters: dict[int, int] = {}      # rank -> the counter of its last heartbeat
        self.dropped = 0                        # datagrams refused by accept()
        self.sources: dict[int, tuple] = {}     # rank 0: the address each rank's beats come from
        self.ended = False                      # rank 0 said the job ends (end_job)
        self.guard: subprocess.Popen | None = None
        self.lock = threading.Lock()

    # --- set-up -----------------------------------------------------------------------------

    def open_channel(self, gather, everyone_here: bool = False) -> None:
        """One collective at start-up (``gather``: the world's allgather of plain data): every
        rank learns every rank's record and rank 0's heartbeat address and key.  Fixed-size jobs
        only (see the module doc).  ``everyone_here``: every rank runs on this host."""
        addrs = local_addresses()
        me = {"rank": self.rank, "host": local_host(), "addr": addrs[0], "pid": os.getpid()}
        if self.rank == 0:
            listen = "127.0.0.1" if everyone_here else addrs[0]
            self.sock = self._socket(bind=(listen, 0))
            if self.sock is not None:
                me.update(key=secrets.token_hex(32), port=self.sock.getsockname()[1], hb=listen)
        records = gather(me, "watchdog.ranks")
        self.peers = {int(r["rank"]): r for r in records}
        channel = self.peers[0]
        if "key" in channel:
            self.channel = channel
            self.key = bytes.fromhex(channel["key"])
            if self.rank != 0:  # a connected socket: only rank 0's address and port get through
                self.sock = self._socket(connect=(channel["hb"], channel["port"]))
        now = _now()
        self.seen = {r: now for r in self.peers}

    def _socket(self, bind=None, connect=None) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            if bind is not None:
                sock.bind(bind)
            if connect is not None:
                sock.connect(connect)
        except OSError:  # no heartbeats for this rank: the clocks still end a stuck job
            sock.close()
            return None
        sock.settimeout(self.tick)
        return sock

    def start_guardian(self) -> None:
        limit = self.timeout + (0 if self.elastic else GUARD_FIXED_EXTRA)
        try:
            self.guard = subprocess.Popen(
                [sys.executable, "-m", "ringtrain.faults.guardian", str(os.getpid()),
                 f"{limit:g}", local_host()],
                # its own session: a launcher that kills the rank's process group must not take
                # the guardian with it before it has seen the launcher end (see guard())
                # Unbuffered: a line that cannot be written fails in write() and nothing stays
                # behind.  Buffered, a guardian that had already gone (seen under Open MPI 5 and
                # Python 3.13 as the job ended) left bytes that the pipe's finaliser tried again
                # at exit: a BrokenPipeError traceback on every rank after its one error line.
                stdin=subprocess.PIPE, bufsize=0, close_fds=True, start_new_session=True)
        except OSError:  # no guardian: the ranks' own clocks still end the job
            self.guard = None

    # --- the thread ---------------------------------------------------------------------------

    def run(self) -> None:
        previous = _now()
        while True:
            try:
                self.exchange()
            except Exception:  # never expected (accept() checks every datagram), never fatal:
                self.dropped += 1  # this thread is what keeps the guardian from killing the rank
                time.sleep(self.tick)
            self.feed_guardian()
            now = _now()
            if now - previous > max(5.0, 6 * self.tick):
                # This thread did not run for a while: this process was frozen itself (and has
                # just been continued, maybe to be killed).  What it knew about the others is
                # stale, and the silence was its own: start over rather than blame a peer.
                self.seen = dict.fromkeys(self.seen, now)
                self.last = max(self.last, now)
            previous = now
            with self.lock:
                if not self.armed or self.fired:
                    continue
                verdict = self.check()
                if verdict is not None:
                    self.fired = True
            if verdict is not None:
                self.abort(verdict)

    def exchange(self) -> None:
        """Send/answer heartbeats for one tick (or just sleep one tick without a channel)."""
        if self.sock is None or self.channel is None:
            time.sleep(self.tick)
            return
        # A wait for a peer's message (a pipeline's activations) is a wait for peers, as a
        # collective is, not a rank stuck in its own code.
        where = None if self.waiting else main_thread_outside_frameworks()
        self.outside[self.rank] = None if where is None else printable(where, 60)  # one datagram
        if self.rank != 0:
            self._send()
        deadline = _now() + self.tick
        while (left := deadline - _now()) > 0:
            self.sock.settimeout(left)
            try:
                data, source = self.sock.recvfrom(MAX_DATAGRAM + 1)
            except TimeoutError:
                break
            except OSError:
                continue
            rank = self.accept(data)
            if rank is not None and self.rank == 0:
                self.sources[rank] = source
                self._send(source)  # the answer that tells the rank rank 0 is alive
            if self.ended:
                # Rank 0 ends the job and has said why (end_job): leave without a second line,
                # also where its MPI_Abort reaches no one else (mpirun --enable-recovery).
                with self.lock:
                    self.armed = False
                os._exit(STALL_EXIT_CODE)

    def _send(self, to=None, end: bool = False) -> None:
        self.sent += 1
        beat = {"r": self.rank, "n": self.sent, "s": self.steps, "o": self.outside.get(self.rank)}
        if end:
            beat["e"] = 1
        body = json.dumps(beat).encode()
        try:
            if to is None:
                self.sock.send(self._mac(body) + body)
            else:
                self.sock.sendto(self._mac(body) + body, to)
        except OSError:
            pass

    def _mac(self, body: bytes) -> bytes:
        return hmac.new(self.key, body, hashlib.sha256).digest()[:MAC_BYTES]

    def accept(self, data: bytes) -> int | None:
        """The rank whose heartbeat ``data`` is, recorded; or None, and the datagram counted in
        :attr:`dropped`: too long, not signed with the job's key, a replay (its counter does not
        grow), or not ``{"r": rank, "n": counter, "s": steps, "o": where or null}`` of the right
        types from a rank that may send to this one (rank 0 hears the others, they hear it).
        Rank 0's may add ``"e": 1``: it ends the job (:func:`end_job`), and this rank leaves."""
        beat = None
        if MAC_BYTES < len(data) <= MAX_DATAGRAM and hmac.compare_digest(
                data[:MAC_BYTES], self._mac(data[MAC_BYTES:])):
            try:
                beat = json.loads(data[MAC_BYTES:])
            except (ValueError, RecursionError):
                beat = None
        rank = beat.get("r") if isinstance(beat, dict) else None
        end = isinstance(beat, dict) and beat.get("e") == 1 and rank == 0  # rank 0: the job ends
        if isinstance(beat, dict) and end:
            beat = {k: v for k, v in beat.items() if k != "e"}
        if not (isinstance(beat, dict) and set(beat) == {"r", "n", "s", "o"}
                and _whole(rank) and rank in self.peers and (rank == 0) != (self.rank == 0)
                and _whole(beat["n"]) and beat["n"] > self.counters.get(rank, 0)
                and _whole(beat["s"]) and (beat["o"] is None or isinstance(beat["o"], str))):
            self.dropped += 1
            return None
        self.counters[rank] = beat["n"]
        self.ended = self.ended or end
        self.seen[rank] = _now()
        self.peer_steps[rank] = beat["s"]
        self.outside[rank] = None if beat["o"] is None else printable(beat["o"], 200)
        return rank

    def tell_the_end(self) -> None:
        """Rank 0: every rank whose heartbeats it has heard leaves at once, without a line of its
        own (three signed datagrams each: a lost one costs only the line it would have saved)."""
        if self.rank != 0 or self.sock is None or self.channel is None:
            return
        for _ in range(3):
            for source in list(self.sources.values()):
                self._send(source, end=True)

    def feed_guardian(self, what: str | None = None) -> None:
        guard = self.guard  # the watchdog thread and the rank's exit path both feed it
        if guard is None or guard.stdin is None:
            return
        try:
            guard.stdin.write(f"{what or self.rank}\n".encode())
        except (OSError, ValueError):  # the guardian is gone (or its pipe already closed)
            self.guard = None
            with contextlib.suppress(OSError, ValueError):
                guard.stdin.close()

    def silent(self, rank: int, now: float) -> float | None:
        """Seconds since ``rank``'s last heartbeat, if long enough to call it silent."""
        quiet = now - self.seen.get(rank, now)
        return quiet if quiet > max(3 * self.tick, self.timeout / 2) else None

    def check(self) -> str | None:
        """The line to end the job with, or None while it makes progress."""
        now = _now()
        stalled = now - self.last
        if stalled <= self.timeout + (STARTUP_GRACE if self.steps == 0 else 0):
            return None
        what = (f"no training step or collective completed on rank {self.rank} for "
                f"{stalled:.0f} s (--stall-timeout {self.timeout:g})")
        if self.waiting:
            what += f"; it waits for {self.waiting}"
        if self.elastic:
            if stalled <= max(self.timeout, gloo_timeout()) + ELASTIC_GRACE:
                # A frozen peer's guardian acts first, then the job re-forms.  A peer cut off by a
                # partition is not reset: Gloo's timeout releases this worker's collective, then it
                # re-forms (measured: 30.2 s after the cut with Gloo's default 30 s; with
                # --gloo-timeout-seconds 180, leaving at --stall-timeout 10 + 30 s ended the job:
                # exit 1 after 40.7 s, before Gloo could release the worker).
                return None
            return (f"rank {self.rank} ({local_host()}, pid {os.getpid()}): {what}; this worker "
                    f"leaves the elastic job")
        if self.rank != 0:
            quiet = self.silent(0, now)
            if quiet is None and stalled <= self.timeout + GRACE:
                return None  # rank 0 hears everyone and will name the culprit
            if quiet is not None:
                return (f"{describe(self.peers[0])} is frozen, dead or cut off from "
                        f"{describe(self.peers[self.rank])}: no heartbeat answer for "
                        f"{quiet:.0f} s and {what}; aborting the job")
        dropped = (f" ({self.dropped} heartbeat datagram(s) not from this job dropped)"
                   if self.dropped else "")
        return f"{self.diagnose(now)}; {what}{dropped}; aborting the job"

    def diagnose(self, now: float) -> str:
        """Who is to blame, from the heartbeats (rank 0 hears from everyone)."""
        if not self.peers:
            return "the job is stuck"
        quiet = {r: q for r in self.peers if r != self.rank and (q := self.silent(r, now))}
        if quiet:
            return " and ".join(f"{describe(self.peers[r])} is frozen, dead or unreachable (no "
                                f"heartbeat for {q:.0f} s)" for r, q in sorted(quiet.items()))
        stuck = {r: where for r, where in self.outside.items() if where and r in self.peers}
        if stuck:
            return " and ".join(f"{describe(self.peers[r])} is alive but stuck outside Horovod "
                                f"(its main thread is in {where})" for r, where in sorted(stuck.items()))
        return ("every rank's heartbeat arrives (the processes live and reach rank 0) and every "
                "rank waits in Horovod or its framework, but a collective does not complete: "
                "the network between hosts carries heartbeats but not the training traffic?")

    def abort(self, line: str) -> None:
        _say(line)
        if self.controller == "mpi":
            self.feed_guardian("abort")
            # MPI_Abort should end every rank through the launcher at once; if it cannot (its
            # launcher is out of reach), end this process anyway.
            threading.Timer(GRACE, os._exit, args=(STALL_EXIT_CODE,)).start()
            try:
                import mpi4py

                mpi4py.rc.initialize = mpi4py.rc.finalize = False
                from mpi4py import MPI

                MPI.COMM_WORLD.Abort(STALL_EXIT_CODE)
            except Exception:
                pass
        os._exit(STALL_EXIT_CODE)

    # --- failed collectives ---------------------------------------------------------------------

    def explain_failure(self, err: BaseException) -> str:
        text = str(err).strip().splitlines()
        first = text[-1] if text else type(err).__name__
        first = printable(first.split(". ")[0], 300)
        peers = ""
        if self.peers and self.rank == 0:
            peers = f"; {self.diagnose(_now())}"
        elif self.peers and self.silent(0, _now()) is not None:
            peers = f"; {describe(self.peers[0])} is silent"
        return (f"rank {self.rank} ({local_host()}): a Horovod collective failed ({first}){peers}; "
                f"the log above may say more")


_dog: Watchdog | None = None


def progress(step: bool = False) -> None:
    """A training step (``step``) or a collective completed: the job is alive.  Cheap; call it
    freely.  Only a step ends :data:`STARTUP_GRACE`: the first step traces the model (TensorFlow)
    and can take longer than the timeout after the start-up collectives on a busy host (an
    11 s stall after the data check's collective ended a test job at --stall-timeout 10 here
    with 12 jobs' load on 2 cores)."""
    dog = _dog
    if dog is not None:
        dog.steps += step
        dog.last = _now()


def silent_ranks() -> dict[int, float]:
    """Rank 0, which hears every rank's heartbeat: the ranks silent for longer than half the stall
    timeout (dead, frozen or cut off), with the seconds since their last heartbeat.  Empty on
    other ranks and without a watchdog.  (The parameter servers judge their workers by this.)"""
    dog = _dog
    if dog is None or dog.rank != 0 or not dog.peers:
        return {}
    now = _now()
    return {r: quiet for r in dog.peers if r != dog.rank and (quiet := dog.silent(r, now))}


def describe_rank(rank: int) -> str:
    """``rank 3 (host, 10.0.0.3, pid 4242)`` from the start-up records, or ``rank 3``."""
    dog = _dog
    info = dog.peers.get(rank) if dog is not None else None
    return describe(info) if info else f"rank {rank}"


def gloo_timeout() -> float:
    """Horovod's Gloo timeout in this worker (horovodrun's --gloo-timeout-seconds; 30 s default)."""
    try:
        return float(os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS", "30"))
    except ValueError:
        return 30.0


def start(stall_timeout: float, hvd, gather, elastic: bool = False) -> Watchdog | None:
    """Start this rank's watchdog; call right after ``hvd.init()`` on every rank.

    Fixed-size jobs issue one allgather here (``gather``, the world's: the heartbeat addresses),
    so every rank must call it at the same point.  ``stall_timeout`` 0 turns everything off.
    """
    global _dog
    if stall_timeout <= 0 or _dog is not None or (hvd.size() == 1 and not elastic):
        return _dog  # a single process has no peer to wait for
    from ringtrain.runtime import controller

    dog = Watchdog(stall_timeout, hvd.rank(), hvd.size(), controller(hvd), elastic)
    if elastic:
        dog.peers = {dog.rank: {"rank": dog.rank, "host": local_host(), "pid": os.getpid()}}
    else:
        dog.open_channel(gather, everyone_here=hvd.local_size() == hvd.size())
    dog.start_guardian()
    _dog = dog
    threading.Thread(target=dog.run, name="ringtrain-watchdog", daemon=True).start()
    atexit.register(disarm)
    _install_excepthook()
    return dog


@contextlib.contextmanager
def waiting(what: str):
    """The main thread waits for a peer's message outside Horovod (``what``, e.g. "stage 0's
    activations of micro-batch 3 from rank 0"): heartbeats then report the rank as waiting for
    its peers, not stuck in its own code, and the stall line names what it waited for."""
    dog = _dog
    if dog is None:
        yield
        return
    dog.waiting = what
    try:
        yield
    finally:
        dog.waiting = None


def end_job(line: str) -> None:
    """End every rank now with one line (this rank's), for a verdict reached outside the
    watchdog (a parameter server's worker that went silent, a pipeline peer that outlived its
    own deadline): rank 0 tells the ranks it hears from to leave quietly, and the watchdog's
    abort ends the job through the launcher, unless it has fired already (its own abort is then
    under way).  Without a watchdog: MPI's abort, else this process alone."""
    dog = _dog
    if dog is not None:
        with dog.lock:
            fired, dog.fired = dog.fired, True  # its own verdict would be a second line
        if not fired:
            dog.tell_the_end()
            dog.abort(line)  # does not return
        time.sleep(2 * GRACE)
    _say(line)
    try:
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(STALL_EXIT_CODE)
    except Exception:
        pass
    os._exit(STALL_EXIT_CODE)


def new_world(rank: int, size: int) -> None:
    """An elastic job re-formed: new rank and size, and the clock restarts."""
    dog = _dog
    if dog is not None:
        dog.rank, dog.size = rank, size
        progress()


def disarm() -> None:
    """At exit (atexit runs before Python stops daemon threads): no more verdicts, and the
    guardian leaves now.  Measured: a finished elastic rank still ran its teardown 10 s after its
    watchdog thread had stopped, and its guardian killed it as frozen (exit 137, job failed)."""
    dog = _dog
    if dog is not None:
        with dog.lock:
            dog.armed = False
        dog.feed_guardian("bye")


def is_collective_failure(err: BaseException) -> bool:
    """Horovod's own error type, or a TensorFlow op error raised by a Horovod op."""
    if type(err).__name__ == "HorovodInternalError":
        return True
    text = str(err)
    return (type(err).__module__.startswith("tensorflow")
            and ("Horovod has been shut down" in text or "gloo" in text))


def _install_excepthook() -> None:
    previous = sys.excepthook

    def hook(kind, err, tb):
        dog = _dog
        if dog is None or not is_collective_failure(err):
            return previous(kind, err, tb)
        with dog.lock:
            dog.armed = False  # the job is ending anyway; one line, not two
        if dog.rank == 0 or not dog.peers or dog.silent(0, _now()) is not None or dog.elastic:
            _say(dog.explain_failure(err))

    sys.excepthook = hook
