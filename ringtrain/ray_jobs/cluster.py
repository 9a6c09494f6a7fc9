"""The Ray cluster a job runs on: Ray and Horovod's executor imported (or one line saying what to
install), joined or started for the job, its capacity checked before a wait, its nodes watched,
and what the workers get from the driver's environment."""

from __future__ import annotations

import argparse
import logging
import os
import re
import secrets
import socket
import threading

from ringtrain.errors import UserError
from ringtrain.ray_jobs.output import say

INSTALL_HINT = ("install it with: pip install -c constraints.txt -e '.[ray]' (or RINGTRAIN_RAY=1 make "
                "setup)")
CONNECT_SECONDS = 5.0  # --address must answer within this (Ray itself retries for minutes)
LOCAL_OBJECT_STORE_MB = 100  # the trainers pass nothing through Ray's object store
NODE_POLL_SECONDS = 1.0
# Environment the workers get from this process, as horovodrun forwards its environment to its
# ranks; variables the launcher sets for each rank itself are not passed on.
FORWARD_NAMES = ("MNIST_DIR", "TF_CPP_MIN_LOG_LEVEL", "OMP_NUM_THREADS")
FORWARD_PREFIXES = ("HOROVOD_", "NCCL_")
LAUNCHER_OWNED = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                  "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME", "HOROVOD_ELASTIC",
                  "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", "HOROVOD_GLOO_RENDEZVOUS_ADDR",
                  "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE")


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
