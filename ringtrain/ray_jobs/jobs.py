"""The two kinds of job on Ray: a fixed-size one (``num_workers`` ranks; any worker lost ends it,
in one line saying which and why) and an elastic one (Horovod's elastic driver with Ray's live
node list as host discovery)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

from ringtrain.errors import UserError
from ringtrain.ray_jobs.cluster import NodeWatch, elastic_interfaces, node_table, raylet_answers, worker_env
from ringtrain.ray_jobs.output import say, wait_for_output
from ringtrain.ray_jobs.worker import where_am_i

# After the first failed worker of a fixed-size job: how long to wait for the others' outcomes
# (a peer's failed collective, Ray's verdict on a node) before saying what happened.
FAILURE_GRACE = 10.0


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
