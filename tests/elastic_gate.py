"""Test-only entry point: the real trainer, held at its first elastic commit until the event a test
is about has reached it.

    python tests/elastic_gate.py GATE_DIR host-update|release MODULE [trainer flags]

runs ``python -m MODULE [trainer flags]`` unchanged, except that in the job's first world rank 0
stops inside its first commit, after the state is saved and before Horovod checks for host
updates (``horovod.common.elastic.State.check_host_updates``, the check every commit ends with),
and writes ``GATE_DIR/held``.  It goes on once

* ``host-update``: Horovod's worker has received the driver's host-update notification (the
  driver notifies rank 0 alone; the message waits in the state's queue), so the check that
  follows raises ``HostsUpdatedInterrupt`` on every rank at this very commit;
* ``release``: the test has created ``GATE_DIR/release`` (after killing a worker).

The other ranks run into the check's broadcast and wait there for rank 0, as they would for a
slow rank 0.  A rank 0 that holds writes ``GATE_DIR/released`` when it lets go; the gate holds
once per job, so a worker that joins later, or a survivor that becomes rank 0, is never held.
Nothing in the trainer changes: the gate wraps Horovod's class from outside.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from horovod.common.elastic import State

HOLD_AT_CHECK = 1  # the first commit: in epoch 1, after --commit-every steps
GIVE_UP_AFTER = 240.0  # seconds: a test that never sends the event fails instead of hanging


def install(gate: Path, until: str) -> None:
    check_host_updates = State.check_host_updates
    checks = 0

    def gated_check_host_updates(state: State) -> None:
        nonlocal checks
        checks += 1
        if checks == HOLD_AT_CHECK and state._rank() == 0 and not (gate / "released").exists():
            hold(state, gate, until)
        check_host_updates(state)

    State.check_host_updates = gated_check_host_updates


def arrived(state: State, gate: Path, until: str) -> bool:
    if until == "host-update":
        return not state._host_messages.empty()
    return (gate / "release").exists()


def hold(state: State, gate: Path, until: str) -> None:
    (gate / "held").write_text(f"{os.getpid()}\n")
    print(f"[gate] rank 0 held at its first commit until {until}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + GIVE_UP_AFTER
    while not arrived(state, gate, until):  # a few ms after the event: polled, not slept through
        if time.monotonic() > deadline:
            raise RuntimeError(f"[gate] no {until} within {GIVE_UP_AFTER:.0f} s")
        time.sleep(0.05)
    (gate / "released").write_text(f"{os.getpid()}\n")
    print(f"[gate] {until} arrived: rank 0 goes on", file=sys.stderr, flush=True)


def main() -> None:
    gate, until, module, *flags = sys.argv[1:]
    if until not in ("host-update", "release"):
        raise SystemExit(f"usage: {sys.argv[0]} GATE_DIR host-update|release MODULE [flags]")
    Path(gate).mkdir(parents=True, exist_ok=True)
    install(Path(gate), until)
    sys.argv = [module, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
