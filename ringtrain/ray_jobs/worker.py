"""In each Ray worker (an actor of Horovod's ``RayExecutor``): the trainer, then its outcome."""

from __future__ import annotations

import argparse
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from ringtrain.errors import UserError, launcher_rank
from ringtrain.faults import watchdog
from ringtrain.ray_jobs.output import done_marker


def worker_main(run_trainer: Callable[[str, argparse.Namespace], int], framework: str,
                args: argparse.Namespace, token: str) -> dict[str, Any]:
    """A worker's whole job, in its Ray actor: ``run_trainer(framework, args)`` (the command's:
    what ``python -m launch`` runs), then its outcome for the driver.

    ``UserError`` and failed collectives are returned (the driver says them once, in one line)
    rather than raised: a raised exception would reach the driver as a traceback.  A worker of an
    elastic job raises on any other failure, so that Horovod's elastic driver counts it as failed
    (and carries on without it), as horovodrun's does with a rank's non-zero exit.  Last, a marker
    line on stdout and stderr tells the driver that all of this worker's output has reached it.
    """
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
