"""``python -m launch.ray --framework {torch,tf} --num-workers N [trainer flags]``: the trainers on Ray.

The same job as ``horovodrun -np N python -m launch --framework X``, with Ray placing the workers:
on a local Ray this command starts for the job (the default), or on a running cluster
(``--address HOST:PORT`` of its head, or ``auto`` on one of its nodes: ``ray start``, KubeRay,
Ray's autoscaler).  Horovod's Ray executor (``horovod.ray.RayExecutor``) starts one Ray actor per
worker and its Gloo rendezvous; each actor runs :func:`run_trainer`, the very function
``python -m launch`` runs.  ``--elastic`` (with ``--min-workers``/``--max-workers``) uses the
executor's elastic mode, Horovod's elastic driver with Ray's live node list as host discovery: a
node lost or added mid-run re-forms the job through the trainers' elastic glue (rollback to the
last commit, re-shard, LR rescaled), as under ``horovodrun --min-np/--max-np``.

What the user sees is what horovodrun shows: rank 0's lines (Ray forwards every worker's output to
this process; the ``(pid=...)`` prefix is turned off), the ``--metrics-out`` summary, checkpoints
and TensorBoard files, written by rank 0 on its node.  Failures end in one line, from this
process: a lost node, a dead worker, a failed collective, or the trainers' own ``UserError``
(exit status 2).  Flags are checked before Ray or any framework is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from launch import cli
from launch.cli import run_cli
from ringtrain import flags
from ringtrain.errors import UserError, launcher_rank

PROG = "python -m launch.ray"
INSTALL_HINT = ("install it with: pip install -c constraints.txt -e '.[ray]' (or RINGTRAIN_RAY=1 make "
                "setup)")
CONNECT_SECONDS = 5.0  # --address must answer within this (Ray itself retries for minutes)
LOCAL_OBJECT_STORE_MB = 100  # the trainers pass nothing through Ray's object store
MIN_OBJECT_STORE_MB = 80  # Ray refuses less than 75 MiB
# After the first failed worker of a fixed-size job: how long to wait for the others' outcomes
# (a peer's failed collective, Ray's verdict on a node) before saying what happened.
FAILURE_GRACE = 10.0
# After the job: how long to wait for the workers' last lines, which Ray forwards asynchronously.
OUTPUT_GRACE = 20.0
NODE_POLL_SECONDS = 1.0
PATH_FLAGS = ("data_dir", "checkpoint_dir", "metrics_out", "tensorboard")
# Environment the workers get from this process, as horovodrun forwards its environment to its
# ranks; variables the launcher sets for each rank itself are not passed on.
FORWARD_NAMES = ("MNIST_DIR", "TF_CPP_MIN_LOG_LEVEL", "OMP_NUM_THREADS")
FORWARD_PREFIXES = ("HOROVOD_", "NCCL_")
LAUNCHER_OWNED = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_ELASTIC",
                  "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                  "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE")


# --- the command line --------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = cli.OneLineParser(
        prog=PROG, allow_abbrev=False,
        description="Data-parallel MNIST on PyTorch or TensorFlow/Keras 3 through Horovod, with the "
                    "workers on a Ray cluster (a local one by default). Every trainer flag works as "
                    "under horovodrun.")
    g = parser.add_argument_group("ray")
    g.add_argument("--framework", required=True, choices=flags.FRAMEWORKS,
                   help="torch (PyTorch, horovod.torch) or tf (TensorFlow/Keras 3, horovod.tensorflow)")
    g.add_argument("--address", default=None,
                   help="the Ray cluster to run on: its head's HOST:PORT (ray start --head prints it; "
                        "6379 by default) or 'auto' on a node of the cluster (default: $RAY_ADDRESS, "
                        "else a local Ray started for this job and stopped after it)")
    g.add_argument("--num-workers", type=int, default=None,
                   help="workers (Horovod ranks) of a fixed-size job")
    g.add_argument("--min-workers", type=int, default=None,
                   help="with --elastic: train on while at least this many workers are left (default 1)")
    g.add_argument("--max-workers", type=int, default=None,
                   help="with --elastic: never more workers than this (default: as many as the "
                        "cluster's CPUs hold; on a local Ray: --min-workers)")
    g.add_argument("--cpus-per-worker", type=int, default=1,
                   help="CPUs Ray reserves for each worker (default 1); a worker runs that many threads")
    g.add_argument("--gpus-per-worker", type=int, default=0,
                   help="GPUs Ray reserves for each worker (default 0; needs a Horovod built with "
                        "HOROVOD_GPU_OPERATIONS=NCCL)")
    g.add_argument("--network-interfaces", default=None, metavar="NICS",
                   help="comma-separated interfaces Horovod's Gloo uses between nodes (default: found "
                        "by Horovod's probe across the nodes; an elastic job that starts on one node "
                        "uses the interface that carries that node's Ray address)")
    g.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds to wait for the cluster to make room for the workers before saying "
                        "so (default 120)")
    g.add_argument("--object-store-memory", type=int, default=None, metavar="MB",
                   help=f"object store of the local Ray this command starts, in MB (default "
                        f"{LOCAL_OBJECT_STORE_MB}; the trainers do not use it); a cluster's nodes set "
                        f"theirs with ray start")
    flags.add_trainer_args(parser)
    return parser


def validate(args: argparse.Namespace) -> argparse.Namespace:
    """The trainer flags (:func:`ringtrain.flags.validate`) and the Ray flags; no Ray, no framework."""
    flags.validate(args)
    if args.pipeline_stages > 1:
        raise UserError("--pipeline-stages: Horovod on Ray runs with Gloo, which has no messages "
                        "between two ranks (a pipeline's activations travel over MPI); run the "
                        "pipeline with horovodrun, mpirun or srun")
    if args.elastic:
        if args.num_workers is not None:
            raise UserError("an --elastic job sizes itself: give --min-workers (and --max-workers) "
                            "instead of --num-workers")
        args.min_workers = 1 if args.min_workers is None else args.min_workers
        if args.min_workers < 1:
            raise UserError(f"--min-workers must be at least 1, got {args.min_workers}")
        if args.max_workers is not None and args.max_workers < args.min_workers:
            raise UserError(f"--max-workers {args.max_workers} is smaller than --min-workers "
                            f"{args.min_workers}")
    else:
        if args.min_workers is not None or args.max_workers is not None:
            raise UserError("--min-workers/--max-workers size an elastic job: add --elastic, or give "
                            "--num-workers for a fixed-size one")
        if args.num_workers is None:
            raise UserError("say how many workers: --num-workers N (or --elastic --min-workers A "
                            "--max-workers B)")
        if args.num_workers < 1:
            raise UserError(f"--num-workers must be at least 1, got {args.num_workers}")
    if args.cpus_per_worker < 1:
        raise UserError(f"--cpus-per-worker must be at least 1, got {args.cpus_per_worker}")
    if args.gpus_per_worker < 0:
        raise UserError(f"--gpus-per-worker must be >= 0, got {args.gpus_per_worker}")
    if args.start_timeout <= 0:
        raise UserError(f"--start-timeout must be positive, got {args.start_timeout:g}")
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address is not None:
        if address.startswith("ray://"):
            raise UserError(f"--address {address}: Ray Client addresses are not supported; run this "
                            f"command on a node of the cluster (--address auto), e.g. with ray job "
                            f"submit -- python -m launch.ray ...")
        if address != "auto" and not address.rpartition(":")[2].isdigit():
            raise UserError(f"--address {address}: expected HOST:PORT of the cluster's head (ray "
                            f"start --head prints it; port 6379 by default) or 'auto'")
        if args.object_store_memory is not None:
            raise UserError("--object-store-memory sizes the local Ray this command starts; the nodes "
                            "of a cluster set theirs with ray start --object-store-memory")
    elif args.object_store_memory is not None and args.object_store_memory < MIN_OBJECT_STORE_MB:
        raise UserError(f"--object-store-memory must be at least {MIN_OBJECT_STORE_MB} MB (Ray's "
                        f"minimum), got {args.object_store_memory}")
    args.address = address
    # The workers may run in another folder, on another node: paths are the driver's.
    for name in PATH_FLAGS:
        value = getattr(args, name)
        if value:
            setattr(args, name, os.path.abspath(os.path.expanduser(value)))
    return args


# --- in each Ray worker ------------------------------------------------------------------------

def run_trainer(framework: str, args: argparse.Namespace) -> int:
    """What every worker runs: what ``python -m launch --framework X ARGS`` runs, but the
    process's SIGTERM stays Ray's (the actor is Ray's to stop)."""
    from launch import dispatch

    return dispatch.run(framework, args, own_signals=False)


def done_marker(token: str) -> str:
    return f"ringtrain.ray.done:{token}:"


def worker_main(framework: str, args: argparse.Namespace, token: str) -> dict[str, Any]:
    """A worker's whole job, in its Ray actor: the trainer, then its outcome for the driver.

    ``UserError`` and failed collectives are returned (the driver says them once, in one line)
    rather than raised: a raised exception would reach the driver as a traceback.  A worker of an
    elastic job raises on any other failure, so that Horovod's elastic driver counts it as failed
    (and carries on without it), as horovodrun's does with a rank's non-zero exit.  Last, a marker
    line on stdout and stderr tells the driver that all of this worker's output has reached it.
    """
    from ringtrain.faults import watchdog

    rank = launcher_rank()
    outcome: dict[str, Any] = {"rank": rank, "status": "ok", "message": "", "host": socket.gethostname()}
    try:
        run_trainer(framework, args)
    except UserError as err:
        outcome.update(status="usage", message=str(err))
    except Exception as err:  # noqa: BLE001 - every failure becomes the driver's one line
        first = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
        if watchdog.is_collective_failure(err):
            outcome.update(status="collective", message=f"rank {rank}: a Horovod collective failed "
                                                        f"({first})")
        else:
            traceback.print_exc()
            outcome.update(status="failed", message=f"rank {rank} failed: {type(err).__name__}: {first}")
            if args.elastic:
                raise
    finally:
        # The job is over for this process, which Ray keeps until the driver lets it go: its
        # watchdog must not call that silence a stall (horovodrun's ranks disarm it at exit).
        watchdog.disarm()
        for stream in (sys.stdout, sys.stderr):
            print(f"{done_marker(token)}{rank}", file=stream, flush=True)
    return outcome


def where_am_i(_executable=None) -> dict[str, str]:
    """This worker's Ray node (id and address) and hostname."""
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "host": socket.gethostname()}


# --- the driver's output: the workers' lines as Ray forwards them --------------------------------

class ForwardedOutput:
    """This process's stdout or stderr while Ray forwards the workers' output through it.

    Passes every line on, except the workers' done markers (counted) and Ray's own ``(raylet)``
    notices (a dead worker, a dead node with its raylet's log: this process says what happened,
    in one line; Ray's session logs keep them); counts ``error:`` lines
    so that a worker's own one line is not followed by a second from the driver.
    """

    def __init__(self, stream, token: str, state: dict) -> None:
        self.stream, self.marker, self.state = stream, done_marker(token), state
        self.pending, self.dropping = "", False
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            # Ray prints each notice with one write (its lines joined), then the newline.
            if self.dropping and text == "\n":
                self.dropping = False
                return len(text)
            self.dropping = not self.pending and text.startswith("(raylet) ")
            if self.dropping:
                return len(text)
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if self.marker in line:
            rank = line.split(self.marker, 1)[1].strip()
            self.state.setdefault("done", {}).setdefault(rank, 0)
            self.state["done"][rank] += 1
            return
        if "error: " in line:
            self.state["errors"] = self.state.get("errors", 0) + 1
        self.stream.write(line + "\n")

    def flush(self) -> None:
        with self.lock:
            self.stream.flush()

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def forwarded_output(token: str, state: dict):
    saved = sys.stdout, sys.stderr
    sys.stdout = ForwardedOutput(saved[0], token, state)
    sys.stderr = ForwardedOutput(saved[1], token, state)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if stream.pending:
                stream.write("\n")
        sys.stdout, sys.stderr = saved


def wait_for_output(state: dict, ranks: list[int], timeout: float = OUTPUT_GRACE) -> None:
    """Until every rank in ``ranks`` has its done marker on both streams (or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = state.get("done", {})
        if all(done.get(str(r), 0) >= 2 for r in ranks):
            return
        time.sleep(0.1)


def say(line: str) -> None:
    print(f"ray: {line}", flush=True)


# --- the cluster -------------------------------------------------------------------------------

def import_ray(local: bool):
    """Ray and Horovod's executor, or one line saying what to install.  ``local``: this process
    will start its own Ray."""
    if local and "RAY_AUTH_MODE" not in os.environ and "RAY_AUTH_TOKEN" not in os.environ:
        # Ray's token authentication with a token only this process and its Ray know (Ray would
        # otherwise write one to ~/.ray and warn about it).  Ray reads this when it is imported.
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    # What this process prints for the workers: their lines as they wrote them (no "(pid=...)"
    # prefix, no colour codes, no folding of equal lines from several workers).
    os.environ["RAY_DISABLE_WORKER_LOG_PREFIX"] = "1"
    os.environ["RAY_COLOR_PREFIX"] = "0"
    os.environ["RAY_DEDUP_LOGS"] = "0"
    try:
        import ray
    except ImportError:
        raise UserError(f"Ray is not installed in this environment; {INSTALL_HINT}") from None
    try:
        from horovod.ray import RayExecutor
    except ImportError as err:
        raise UserError(f"horovod.ray cannot be imported ({err}); run 'make setup' to build Horovod, "
                        f"then {INSTALL_HINT}") from None
    # Horovod's Ray driver logs each lost worker of an elastic job as "host[rank]:<Ray's
    # multi-line error>"; say it in one line.
    log = logging.getLogger("horovod.ray")
    log.addHandler(LostWorkerLine())
    log.propagate = False
    return ray, RayExecutor


class LostWorkerLine(logging.Handler):
    """One ``ray:`` line per error Horovod's Ray driver logs: a worker of an elastic job lost
    (``host[rank]:<Ray's error>``), or a new one that did not answer (``host: Ping failed``).
    Ray's own text stays out: the job goes on, and its "RPC error: ..." would read as the job's
    one error line."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage().strip()
        worker, _, why = text.partition(":")
        if "Ping failed" in why:
            say(f"a new worker on {worker} did not answer; the elastic job goes on without it")
        elif re.fullmatch(r"\S+\[\d+\]", worker):
            say(f"lost the worker {worker} (its Ray actor ended); the elastic job goes on without it")
        else:
            say("Horovod's Ray driver: " + text.splitlines()[0].replace("error:", "error -"))


def check_answers(address: str) -> None:
    """``--address`` answers a TCP connection within seconds (Ray's own wait is minutes)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as err:
        why = (f"no answer within {CONNECT_SECONDS:g} s" if isinstance(err, TimeoutError)
               else err.strerror or str(err))
        raise UserError(f"--address {address}: nothing answers there ({why}); start the cluster "
                        f"first (ray start --head on the head node) or correct the address") from None


def connect(ray, args: argparse.Namespace) -> str:
    """Join the cluster, or start a local Ray sized for the job; returns how to name it."""
    if args.address is not None:
        if args.address != "auto":
            check_answers(args.address)
        try:
            ray.init(address=args.address, logging_level=logging.ERROR, log_to_driver=True)
        except Exception as err:  # noqa: BLE001 - ConnectionError, AuthenticationError, ...
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            raise UserError(f"cannot join the Ray cluster at {args.address}: {first}") from None
        return f"the Ray cluster at {args.address}"
    workers = args.num_workers or args.max_workers or args.min_workers
    ray.init(num_cpus=workers * args.cpus_per_worker, include_dashboard=False,
             object_store_memory=(args.object_store_memory or LOCAL_OBJECT_STORE_MB) * 2**20,
             logging_level=logging.ERROR, log_to_driver=True)
    return "a local Ray"


def check_capacity(ray, args: argparse.Namespace, where: str) -> None:
    """The cluster can hold the (minimum) number of workers at all: say so now, not after a wait."""
    workers = args.num_workers or args.min_workers
    total, free = ray.cluster_resources(), ray.available_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    for kind, per_worker, flag in (("CPU", args.cpus_per_worker, "--cpus-per-worker"),
                                   ("GPU", args.gpus_per_worker, "--gpus-per-worker")):
        have = int(total.get(kind, 0))
        if per_worker and have < workers * per_worker:
            fits = have // per_worker
            raise UserError(
                f"{workers} worker(s) x {per_worker} {kind} ({flag}) need {workers * per_worker} "
                f"{kind}s, but {where} has {have} ({int(free.get(kind, 0))} free) on {nodes} node(s): "
                f"run at most {fits} worker(s), or add nodes")


def node_table(ray) -> dict[str, dict]:
    return {n["NodeID"]: n for n in ray.nodes()}


def raylet_answers(node: dict) -> bool:
    try:
        socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])),
                                 timeout=2.0).close()
        return True
    except (OSError, KeyError, ValueError):
        return False


class NodeWatch:
    """Says when a node leaves or joins the cluster while the job runs (a daemon thread)."""

    def __init__(self, ray) -> None:
        self.ray = ray
        self.alive = {nid for nid, n in node_table(ray).items() if n.get("Alive")}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, name="ray-node-watch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stop.wait(NODE_POLL_SECONDS):
            try:
                table = node_table(self.ray)
            except Exception:  # noqa: BLE001 - the driver is shutting down
                return
            alive = {nid for nid, n in table.items() if n.get("Alive")}
            for nid in sorted(self.alive - alive):
                say(f"node {table[nid]['NodeManagerAddress']} left the cluster ({len(alive)} "
                    f"node(s) left)")
            for nid in sorted(alive - self.alive):
                say(f"node {table[nid]['NodeManagerAddress']} joined the cluster ({len(alive)} "
                    f"node(s))")
            self.alive = alive


def elastic_interfaces(ray, args: argparse.Namespace) -> set[str] | None:
    """The NICs for an elastic job: the user's, else Horovod's probe across two or more nodes;
    on a single node (which the probe cannot serve) the interface of the node's Ray address."""
    if args.network_interfaces:
        return set(args.network_interfaces.split(","))
    if sum(1 for n in ray.nodes() if n.get("Alive")) >= 2:
        return None
    import psutil  # a dependency of Horovod and Ray

    ip = ray.util.get_node_ip_address()
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return {name}
    raise UserError(f"no network interface here carries this node's Ray address {ip}; name one "
                    f"with --network-interfaces")


def worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if (k in FORWARD_NAMES or k.startswith(FORWARD_PREFIXES)) and k not in LAUNCHER_OWNED}
    env["PYTHONUNBUFFERED"] = "1"
    return env


# --- the two kinds of job ----------------------------------------------------------------------

def run_fixed(ray, RayExecutor, args, framework: str, token: str, state: dict, worker: Callable) -> int:
    settings = RayExecutor.create_settings(
        timeout_s=int(args.start_timeout), placement_group_timeout_s=int(args.start_timeout),
        nics=set(args.network_interfaces.split(",")) if args.network_interfaces else None)
    executor = RayExecutor(settings, num_workers=args.num_workers, cpus_per_worker=args.cpus_per_worker,
                           use_gpu=args.gpus_per_worker > 0, gpus_per_worker=args.gpus_per_worker or None)
    try:
        executor.start(extra_env_vars=worker_env())
    except TimeoutError:
        free = ray.available_resources()
        raise UserError(f"the cluster did not make room for {args.num_workers} worker(s) x "
                        f"{args.cpus_per_worker} CPU within --start-timeout {args.start_timeout:g} s "
                        f"(free now: {int(free.get('CPU', 0))} CPU, {int(free.get('GPU', 0))} GPU; "
                        f"other jobs hold the rest)") from None
    except Exception as err:  # noqa: BLE001 - NIC detection, the rendezvous: one line
        return start_failed(err)
    try:
        placed = executor.execute(where_am_i)  # rank order
        nodes = {p["node_id"] for p in placed}
        say(f"{args.num_workers} worker(s) on {len(nodes)} node(s): "
            + ", ".join(f"rank {r} on {p['ip']}" for r, p in enumerate(placed)))
        watch = NodeWatch(ray)
        refs = executor.run_remote(worker, args=[framework, args, token])
        try:
            outcomes = wait_fixed(ray, refs)
        finally:
            watch.stop.set()
        code = report_fixed(ray, outcomes, placed, state)
    finally:
        executor.shutdown()
    return code


def start_failed(err: BaseException) -> int:
    first = (str(err).strip().splitlines() or [type(err).__name__])[-1][:300]
    print(f"error: Horovod's Ray executor could not start the workers ({type(err).__name__}: {first}); "
          f"if it could not find a network interface common to the nodes, name one with "
          f"--network-interfaces", file=sys.stderr, flush=True)
    return 1


def wait_fixed(ray, refs: list) -> dict[int, dict]:
    """Every rank's outcome; after the first failure, the others' for up to FAILURE_GRACE s."""
    rank_of = {ref: r for r, ref in enumerate(refs)}
    outcomes: dict[int, dict] = {}
    pending, deadline = list(refs), None
    while pending and (deadline is None or time.monotonic() < deadline):
        ready, pending = ray.wait(pending, num_returns=1, timeout=0.5)
        for ref in ready:
            rank = rank_of[ref]
            try:
                outcomes[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as err:
                outcomes[rank] = {"rank": rank, "status": "died", "message": str(err).splitlines()[0]}
            except ray.exceptions.RayError as err:
                outcomes[rank] = {"rank": rank, "status": "failed",
                                  "message": f"rank {rank}: {str(err).strip().splitlines()[-1][:300]}"}
            if outcomes[rank]["status"] != "ok" and deadline is None:
                deadline = time.monotonic() + FAILURE_GRACE
    for ref in pending:
        outcomes[rank_of[ref]] = {"rank": rank_of[ref], "status": "pending", "message": ""}
    return outcomes


def report_fixed(ray, outcomes: dict[int, dict], placed: list[dict], state: dict) -> int:
    """Exit status, and the one line for a job that did not succeed."""
    ok = [r for r, o in sorted(outcomes.items()) if o["status"] == "ok"]
    finished = [r for r, o in sorted(outcomes.items()) if o["status"] in ("ok", "usage", "collective",
                                                                         "failed")]
    wait_for_output(state, finished)
    if len(ok) == len(outcomes):
        return 0
    usage = [o for _, o in sorted(outcomes.items()) if o["status"] == "usage"]
    if usage:
        raise UserError(usage[0]["message"])
    if state.get("errors"):
        return 1  # a worker said it in its own line (its watchdog, its guardian)
    dead = sorted(r for r, o in outcomes.items() if o["status"] == "died")
    table = node_table(ray)
    gone_nodes: dict[str, list[int]] = {}
    for r in dead:
        node = table.get(placed[r]["node_id"], {})
        if not node.get("Alive") or not raylet_answers(node):
            gone_nodes.setdefault(placed[r]["ip"], []).append(r)
    if gone_nodes:
        what = " and ".join(f"Ray node {ip} (rank {', '.join(map(str, ranks))})"
                            for ip, ranks in gone_nodes.items())
        line = (f"{what} is gone (its raylet does not answer); a fixed-size job cannot go on with "
                f"fewer workers: run it again, or with --elastic to carry on without them")
    elif dead:
        line = (f"the worker process of rank {', '.join(map(str, dead))} died ("
                f"{outcomes[dead[0]]['message']}); the fixed-size job ends")
    else:
        failed = [o for _, o in sorted(outcomes.items()) if o["status"] in ("failed", "collective")]
        line = failed[0]["message"] if failed else "the job did not finish"
    print(f"error: {line}", file=sys.stderr, flush=True)
    return 1


def run_elastic(ray, RayExecutor, args, framework: str, token: str, state: dict,
                worker: Callable) -> int:
    nics = elastic_interfaces(ray, args)
    settings = RayExecutor.create_settings(timeout_s=int(args.start_timeout), nics=nics)
    executor = RayExecutor(settings, min_workers=args.min_workers, max_workers=args.max_workers,
                           cpus_per_worker=args.cpus_per_worker, use_gpu=args.gpus_per_worker > 0,
                           gpus_per_worker=args.gpus_per_worker or None)
    # Horovod's elastic driver sets HOROVOD_ELASTIC=1 in every worker's environment
    # (create_run_env_vars(elastic=True)), which the trainers' check_launcher requires.
    try:
        executor.start(extra_env_vars=worker_env())
    except Exception as err:  # noqa: BLE001 - waiting for slots, NIC detection: one line
        return start_failed(err)
    watch = NodeWatch(ray)
    say(f"elastic job: {args.min_workers} to {args.max_workers or 'as many as fit'} worker(s) on "
        f"{len(watch.alive)} node(s)")
    try:
        outcomes = executor.run(worker, args=[framework, args, token])
    except RuntimeError as err:
        wait_for_output(state, [], timeout=2.0)
        first = (str(err).strip().splitlines() or ["failed"])[0]
        print(f"error: the elastic job failed: {first}", file=sys.stderr, flush=True)
        return 1
    finally:
        watch.stop.set()
        with contextlib.suppress(Exception):
            executor.shutdown()
    wait_for_output(state, [o["rank"] for o in outcomes])
    usage = [o for o in outcomes if o["status"] == "usage"]
    if usage:
        raise UserError(usage[0]["message"])
    failed = [o for o in outcomes if o["status"] != "ok"]
    if failed:
        print(f"error: {failed[0]['message']}", file=sys.stderr, flush=True)
        return 1
    return 0


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    framework = args.__dict__.pop("framework")
    validate(args)
    ray, RayExecutor = import_ray(local=args.address is None)
    # The workers import this module under its own name (cloudpickle sends a function of
    # __main__ by value, with its globals).
    worker = importlib.import_module("launch.ray").worker_main
    token, state = secrets.token_hex(8), {}
    with forwarded_output(token, state):
        try:
            where = connect(ray, args)
            check_capacity(ray, args, where)
            job = run_elastic if args.elastic else run_fixed
            return job(ray, RayExecutor, args, framework, token, state, worker)
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()


def main(argv=None) -> None:
    run_cli(lambda: run(argv))


if __name__ == "__main__":
    main()
