"""What one TCP connection gets between two emulated hosts: ``python -m bench.workers.linkprobe server
ADDR PORT`` on one, ``python -m bench.workers.linkprobe client ADDR PORT`` on the other (prints JSON).

Round trip: median of 200 exchanges of 8 bytes each way (TCP_NODELAY).  Stream: 64 MiB sent, the
receiver's one-byte acknowledgement ends the clock; best of 3.  Plain sockets, no MPI, so this is
the link (and the kernel's TCP over veth and the bridge) without any library on top.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time

CHUNK = 1 << 20


def _recv_exact(conn: socket.socket, n: int, buf: bytearray) -> None:
    view, got = memoryview(buf), 0
    while got < n:
        r = conn.recv_into(view[:min(len(buf), n - got)])
        if r == 0:
            raise ConnectionError("peer closed")
        got += r


def server(addr: str, port: int) -> None:
    with socket.create_server((addr, port)) as srv:
        conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(CHUNK)
    with conn:
        while True:
            hdr = bytearray(8)
            try:
                _recv_exact(conn, 8, hdr)
            except ConnectionError:
                return
            n = int.from_bytes(hdr, "little")
            for off in range(0, n, CHUNK):
                _recv_exact(conn, min(CHUNK, n - off), buf)
            conn.sendall(b"k" * 8 if n == 0 else b"k")


def client(addr: str, port: int, stream_bytes: int = 64 << 20) -> dict:
    end = time.monotonic() + 30
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > end:
                raise
            time.sleep(0.1)
    conn.settimeout(120)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    zero, eight = (0).to_bytes(8, "little"), bytearray(8)
    rtts = []
    with conn:
        for _ in range(200):
            t0 = time.perf_counter()
            conn.sendall(zero)
            _recv_exact(conn, 8, eight)
            rtts.append(time.perf_counter() - t0)
        payload, one = bytes(stream_bytes), bytearray(1)
        streams = []
        for _ in range(3):
            t0 = time.perf_counter()
            conn.sendall(stream_bytes.to_bytes(8, "little"))
            conn.sendall(payload)
            _recv_exact(conn, 1, one)
            streams.append(stream_bytes / (time.perf_counter() - t0))
    return {"rtt_s": statistics.median(rtts), "stream_bytes": stream_bytes,
            "stream_bytes_per_s": max(streams), "streams_bytes_per_s": streams}


def main() -> None:
    role, addr, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if role == "server":
        server(addr, port)
    else:
        print(json.dumps(client(addr, port)))


if __name__ == "__main__":
    main()
