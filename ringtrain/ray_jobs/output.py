"""What the driver prints while Ray forwards the workers' output through it: their lines as they
wrote them, less the workers' done markers (counted, so the driver knows a worker's last line
has arrived) and Ray's own ``(raylet)`` notices (the driver says what happened, in one line)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time

# After the job: how long to wait for the workers' last lines, which Ray forwards asynchronously.
OUTPUT_GRACE = 20.0


def done_marker(token: str) -> str:
    return f"ringtrain.ray.done:{token}:"


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
