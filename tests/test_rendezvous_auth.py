"""horovodrun's HTTP rendezvous / KV store serves only the job's own processes (issue 24).

Horovod 0.28.1's server answered anyone who could reach it, and its elastic handler unpickled the
body of ``PUT /worker_addresses/<host>:<slot>``: one request from another shell made the driver
run a command.  The patch signs every request and answer with the job's secret key
(horovod/runner/http/auth.py; Gloo's C++ store in horovod/common/gloo/http_store.cc), refuses
anything else with 403 before it reads the path or unpickles the body, and binds the server to the
one address the workers are given.  docs/security.md says what is defended and what is not.

The forged bodies here unpickle into ``os.system("touch MARKER")``: the marker file exists exactly
when someone unpickled one (``test_the_forged_body_is_a_real_exploit`` is the positive control).
A holder of the job's key gets no further: the bodies and messages of horovodrun's own processes
are JSON (.ci/horovod-patches/rendezvous-plain-worker-addresses.patch, services-plain-messages.patch),
and a signed pickle is refused unread.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import http.server
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
from conftest import REPO, requires_horovod
from test_elastic import ElasticJob, check_trained, world_sizes

pytestmark = requires_horovod
KEY_VAR = "_HOROVOD_SECRET_KEY_HEX"


class RunsCommand:
    """Unpickles into os.system(command)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def forged_body(marker: Path) -> bytes:
    """What horovod's codec.loads_base64 would turn into ``touch marker``."""
    return base64.b64encode(pickle.dumps(RunsCommand(f"touch {marker}")))


def request(port: int, method: str, path: str, body: bytes = b"", headers: dict | None = None,
            host: str = "127.0.0.1") -> tuple[int | None, dict, bytes]:
    """(status, headers, body) of one raw request; status None when the server dropped it or did
    not answer within 20 s (0.28.1's server, unpickling a forged body, dropped the connection)."""
    conn = http.client.HTTPConnection(host, port, timeout=20)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    except (OSError, http.client.HTTPException):  # reset, refused, timed out
        return None, {}, b""
    finally:
        conn.close()


def sign(key: bytes, method: str, path: str, body: bytes = b"") -> dict:
    """The header a job member sends (auth.py's scheme, spelled out independently here)."""
    msg = b"horovod-request\n" + method.encode() + b"\n" + path.encode() + b"\n" + body
    return {"Horovod-Signature": hmac.new(key, msg, hashlib.sha256).hexdigest()}


class StubDriver:
    """What the elastic rendezvous handler calls on horovodrun's ElasticDriver."""

    def __init__(self):
        self.registered: list[tuple] = []
        self.ready: list[tuple] = []

    def register_worker_server(self, host, slot, addresses, secret_key):
        self.registered.append((host, slot, addresses, secret_key))

    def record_ready(self, host, slot):
        self.ready.append((host, slot))

    def get_slot_info(self, host, slot):
        from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
        return get_host_assignments(parse_hosts("localhost:1"), 1)[0]


@pytest.fixture
def elastic_server():
    """An elastic RendezvousServer on loopback with a fresh job key, as horovodrun starts it."""
    from horovod.runner.common.util import secret
    from horovod.runner.elastic.rendezvous import create_rendezvous_handler
    from horovod.runner.http.http_server import RendezvousServer

    key = secret.make_secret_key()
    driver = StubDriver()
    server = RendezvousServer(key=key)
    port = server.start(create_rendezvous_handler(driver), address="127.0.0.1")
    yield server, port, key, driver
    server.stop()


def test_unsigned_badly_signed_and_wrongly_keyed_requests_never_reach_unpickling(elastic_server, tmp_path):
    """Every request without the job key's signature over its own method, path and body gets 403,
    and neither the elastic handler (which unpickles PUT bodies) nor the driver ever sees it."""
    server, port, key, driver = elastic_server
    marker = tmp_path / "ran"
    body = forged_body(marker)
    put = "/worker_addresses/localhost:0"
    other_key = os.urandom(32)
    attempts = {
        "unsigned": {},
        "garbage": {"Horovod-Signature": "0" * 64},
        "not hex": {"Horovod-Signature": "\u00e9" * 64},
        "another job's key": sign(other_key, "PUT", put, body),
        "signed for another path": sign(key, "PUT", "/worker_addresses/localhost:1", body),
        "signed for another body": sign(key, "PUT", put, b"harmless"),
        "signed for another method": sign(key, "GET", put, body),
    }
    for what, headers in attempts.items():
        status, answer_headers, _ = request(port, "PUT", put, body, headers)
        assert status == 403, what
        assert "Horovod-Signature" not in answer_headers, what
    # GETs and DELETEs too: rank_and_size would register a worker as ready with the driver
    for method, path in [("GET", "/rank_and_size/localhost:0"), ("GET", "/global/0"),
                         ("DELETE", "/global/0"), ("HEAD", "/etc/passwd")]:
        assert request(port, method, path)[0] == 403, (method, path)
        assert request(port, method, path, headers=sign(other_key, method, path))[0] == 403
    assert not marker.exists(), "a forged body was unpickled"
    assert driver.registered == [] and driver.ready == []
    assert server._httpd.refused == len(attempts) + 8


def test_the_forged_body_is_a_real_exploit(tmp_path):
    """The positive control for every marker below: unpickled as Horovod 0.28.1's codec did it,
    the forged body runs its command."""
    marker = tmp_path / "ran"
    pickle.loads(base64.b64decode(forged_body(marker)))  # the exploit, on purpose
    assert marker.exists()


def test_signed_requests_work_and_the_answers_are_signed(elastic_server):
    """A job member's signed requests are served, each answer signed for that request."""
    server, port, key, driver = elastic_server
    put = "/worker_addresses/localhost:0"
    value = json.dumps({"addresses": {"lo": [["127.0.0.1", 1234]]}}).encode()
    headers = sign(key, "PUT", put, value)
    status, answer, _ = request(port, "PUT", put, value, headers)
    assert status == 200
    expected = hmac.new(key, b"horovod-response\n" + headers["Horovod-Signature"].encode() + b"\n200\n",
                        hashlib.sha256).hexdigest()
    assert answer["Horovod-Signature"] == expected
    # the driver signs its notifications to that worker with a key derived from the job's, as the
    # worker does, never with one from the (clear-text) body
    derived = hmac.new(key, b"horovod-worker-notification\nlocalhost:0", hashlib.sha256).digest()
    assert driver.registered == [("localhost", 0, {"lo": [("127.0.0.1", 1234)]}, derived)]

    path = "/rank_and_size/localhost:0"
    status, answer, body = request(port, "GET", path, headers=sign(key, "GET", path))
    assert status == 200 and driver.ready == [("localhost", 0)]
    assert body.decode().split(",")[:2] == ["0", "1"]  # rank 0 of 1


NOT_WORKER_ADDRESSES = {
    "empty": b"",
    "not UTF-8": b"\xff\xfe",
    "not JSON": b"{addresses",
    "a list": b"[]",
    "no addresses": b"{}",
    "another key too": b'{"addresses": {"lo": [["127.0.0.1", 1]]}, "key": "x"}',
    "no interface": b'{"addresses": {}}',
    "an interface without addresses": b'{"addresses": {"lo": []}}',
    "an address that is no pair": b'{"addresses": {"lo": [["127.0.0.1"]]}}',
    "port 0": b'{"addresses": {"lo": [["127.0.0.1", 0]]}}',
    "port 65536": b'{"addresses": {"lo": [["127.0.0.1", 65536]]}}',
    "a boolean port": b'{"addresses": {"lo": [["127.0.0.1", true]]}}',
    "a port as text": b'{"addresses": {"lo": [["127.0.0.1", "22"]]}}',
    "a host name": b'{"addresses": {"lo": [["localhost", 22]]}}',
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
}


def test_a_signed_worker_addresses_body_that_is_not_plain_json_is_refused_unread(elastic_server, tmp_path):
    """Holding the job's key is not enough to run code in the elastic driver: the body of PUT
    /worker_addresses is JSON that the driver parses, never a pickle.  A signed pickle, and every
    body that is not exactly {"addresses": {INTERFACE: [[IPv4, PORT], ...]}}, gets 400 (signed)
    and registers nothing; the server then serves the job as before.  (Horovod 0.28.1 and the
    signing patch alone unpickled it: the marker appeared.)"""
    server, port, key, driver = elastic_server
    marker = tmp_path / "ran"
    put = "/worker_addresses/localhost:0"
    bodies = {"a signed pickle": forged_body(marker), **NOT_WORKER_ADDRESSES}
    for what, body in bodies.items():
        headers = sign(key, "PUT", put, body)
        status, answer, _ = request(port, "PUT", put, body, headers)
        assert status == 400, what
        expected = hmac.new(key, b"horovod-response\n" + headers["Horovod-Signature"].encode() + b"\n400\n",
                            hashlib.sha256).hexdigest()
        assert answer.get("Horovod-Signature") == expected, what
    assert not marker.exists(), "a signed body was unpickled by the elastic handler"
    assert driver.registered == []
    for path in ["/worker_addresses/localhost", "/worker_addresses/localhost:zero"]:  # not HOST:SLOT
        body = json.dumps({"addresses": {"lo": [["127.0.0.1", 1234]]}}).encode()
        assert request(port, "PUT", path, body, sign(key, "PUT", path, body))[0] == 400, path
    assert driver.registered == []
    body = json.dumps({"addresses": {"lo": [["127.0.0.1", 1234]], "eth0": [["10.0.0.5", 1234]]}}).encode()
    assert request(port, "PUT", put, body, sign(key, "PUT", put, body))[0] == 200
    assert [r[:3] for r in driver.registered] == [
        ("localhost", 0, {"lo": [("127.0.0.1", 1234)], "eth0": [("10.0.0.5", 1234)]})]


def service_exchange(address: tuple, key: bytes, body: bytes) -> bytes | None:
    """One message to a Horovod BasicService (HMAC-SHA256 of the body under ``key``, its length,
    the body) and the body of its answer; None when it closes without one."""
    with socket.create_connection(address, timeout=20) as conn:
        conn.sendall(hmac.new(key, body, hashlib.sha256).digest() + struct.pack("i", len(body)) + body)
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    if len(data) < 36:
        return None
    digest, (length,), answer = data[:32], struct.unpack("i", data[32:36]), data[36:]
    assert len(answer) == length
    assert hmac.compare_digest(digest, hmac.new(key, answer, hashlib.sha256).digest())
    return answer


def test_horovodruns_services_exchange_json_and_refuse_a_signed_pickle(tmp_path):
    """horovodrun's other channels: the elastic workers' notification service (the driver tells
    each worker that hosts changed) and the interface probe's driver service.  They check an HMAC
    of the (derived) job key; 0.28.1 then unpickled the message.  Now requests and answers are
    JSON of the service's message classes: a ping is answered in JSON, a notification reaches the
    worker's listener with its values, and a correctly signed pickle is refused, never run."""
    from horovod.runner.common.util import secret
    from horovod.runner.driver.driver_service import HorovodRunDriverClient, HorovodRunDriverService
    from horovod.runner.elastic.worker import (
        HostUpdateResult,
        WorkerNotificationClient,
        WorkerNotificationManager,
        WorkerNotificationService,
    )

    class Listener:
        def __init__(self):
            self.heard = []

        def on_hosts_updated(self, timestamp, update_res):
            self.heard.append((timestamp, update_res))

    marker = tmp_path / "ran"
    forged = pickle.dumps(RunsCommand(f"touch {marker}"))
    key = secret.worker_notification_key(secret.make_secret_key(), "localhost:0")
    manager, listener = WorkerNotificationManager(), Listener()
    manager.register_listener(listener)
    worker = WorkerNotificationService(key, "lo", manager)
    driver = HorovodRunDriverService(1, key, {"lo"})
    try:
        WorkerNotificationClient(worker.addresses(), key, verbose=0).notify_hosts_updated(
            1700000000, HostUpdateResult.added | HostUpdateResult.removed)
        assert listener.heard == [(1700000000, HostUpdateResult.mixed)]
        client = HorovodRunDriverClient(driver.addresses(), key, verbose=0)
        client.register_task(0, {"lo": [("127.0.0.1", 4321)]}, "host-hash")
        assert client.all_task_addresses(0) == {"lo": [("127.0.0.1", 4321)]}
        assert driver.task_host_hash_indices() == {"host-hash": [0]}

        ping = json.dumps({"message": "PingRequest", "fields": {}}).encode()
        for service in (worker, driver):
            address = service.addresses()["lo"][0]
            answer = json.loads(service_exchange(address, key, ping))
            assert answer["message"] == "PingResponse" and answer["fields"]["source_address"] == "127.0.0.1"
            assert service_exchange(address, key, forged) is None
            # a message of another service, or JSON that is no message, is refused alike
            other = json.dumps({"message": "RunCommandRequest",
                                "fields": {"command": f"touch {marker}", "env": {"dict": []}}}).encode()
            assert service_exchange(address, key, other) is None
        assert not marker.exists(), "a signed pickle was unpickled by a service"
        assert listener.heard == [(1700000000, HostUpdateResult.mixed)]
    finally:
        worker.shutdown()
        driver.shutdown()


def test_kv_store_and_its_python_clients(tmp_path, monkeypatch):
    """run-func's KV store: the clients sign with the job key (given, or from the environment, as
    horovodrun hands it to workers); an unsigned PUT is not stored; a client without a key or with
    another job's key fails with a clear error instead of unpickling anything."""
    from horovod.runner.common.util import secret
    from horovod.runner.http.http_client import put_data_into_kvstore, read_data_from_kvstore
    from horovod.runner.http.http_server import KVStoreServer

    key = secret.make_secret_key()
    server = KVStoreServer(verbose=0, key=key)
    port = server.start_server(address="127.0.0.1")
    try:
        put_data_into_kvstore("127.0.0.1", port, "runfunc", "func", {"answer": 42}, secret_key=key)
        monkeypatch.setenv(KEY_VAR, key.hex())
        assert read_data_from_kvstore("127.0.0.1", port, "runfunc", "func") == {"answer": 42}

        marker = tmp_path / "ran"
        body = forged_body(marker)
        assert request(port, "PUT", "/runfunc_result/0", body)[0] == 403
        with pytest.raises(RuntimeError, match="failed"):  # 404: nothing was stored
            read_data_from_kvstore("127.0.0.1", port, "runfunc_result", "0")

        monkeypatch.setenv(KEY_VAR, os.urandom(32).hex())
        with pytest.raises(RuntimeError, match="failed"):
            read_data_from_kvstore("127.0.0.1", port, "runfunc", "func")
        monkeypatch.delenv(KEY_VAR)
        with pytest.raises(RuntimeError, match=KEY_VAR):
            read_data_from_kvstore("127.0.0.1", port, "runfunc", "func")
        assert not marker.exists()
    finally:
        server.shutdown_server()


def test_a_client_refuses_an_answer_not_signed_by_the_server(tmp_path):
    """Whoever answers in the server's place (a process that took its port after it ended) cannot
    make a worker or the driver unpickle its body: the answer's signature is checked first."""
    from horovod.runner.http.http_client import read_data_from_kvstore

    marker = tmp_path / "ran"
    body = forged_body(marker)

    class Impostor(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Horovod-Signature", "0" * 64)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    impostor = http.server.HTTPServer(("127.0.0.1", 0), Impostor)
    thread = threading.Thread(target=impostor.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(RuntimeError, match="not signed with the job key"):
            read_data_from_kvstore("127.0.0.1", impostor.server_address[1], "runfunc", "func",
                                   secret_key=os.urandom(32))
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert not marker.exists()


HMAC_PROBE = """
import ctypes, json, sys
import torch
import horovod.torch.mpi_lib_v2 as lib
fn = ctypes.CDLL(lib.__file__).horovod_rendezvous_hmac_sha256_hex
fn.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_longlong, ctypes.c_char_p]
out = []
for key, msg in json.load(sys.stdin):
    key, msg = bytes.fromhex(key), bytes.fromhex(msg)
    buf = ctypes.create_string_buffer(65)
    fn(key, len(key), msg, len(msg), buf)
    out.append(buf.value.decode())
print(json.dumps(out))
"""


def test_cpp_hmac_sha256_agrees_with_python():
    """The C++ HMAC-SHA256 that Gloo's store signs with (no crypto library: Horovod links none),
    against Python's hmac at every padding boundary of SHA-256's 64-byte blocks and for keys
    shorter than, equal to and longer than a block."""
    rng = __import__("random").Random(24)
    cases = [(bytes(rng.getrandbits(8) for _ in range(k)), bytes(rng.getrandbits(8) for _ in range(m)))
             for k in (0, 1, 32, 63, 64, 65, 200)
             for m in (0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 128, 1000, 70000)]
    proc = subprocess.run([sys.executable, "-c", HMAC_PROBE], capture_output=True, text=True, timeout=300,
                          input=json.dumps([[k.hex(), m.hex()] for k, m in cases]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    want = [hmac.new(k, m, hashlib.sha256).hexdigest() for k, m in cases]
    assert got == want


GLOO_INIT = """
import torch
import horovod.torch as hvd
hvd.init()
print("rank", hvd.rank(), "of", hvd.size(), "gloo", hvd.gloo_enabled(), flush=True)
hvd.shutdown()
"""


def gloo_init(port: int, key_hex: str | None) -> subprocess.CompletedProcess:
    """hvd.init() of a one-process Gloo world whose store is the server on ``port``: the C++
    HTTP store talks to it (``global``, ``local_localhost`` and ``cross_0`` scopes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HOROVOD_", KEY_VAR))}
    env.update(HOROVOD_RANK="0", HOROVOD_SIZE="1", HOROVOD_LOCAL_RANK="0", HOROVOD_LOCAL_SIZE="1",
               HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1", HOROVOD_HOSTNAME="localhost",
               HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1", HOROVOD_GLOO_RENDEZVOUS_PORT=str(port),
               HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo", HOROVOD_GLOO_IFACE="lo",
               HOROVOD_GLOO_TIMEOUT_SECONDS="60", PYTHONPATH=str(REPO))
    if key_hex is not None:
        env[KEY_VAR] = key_hex
    return subprocess.run([sys.executable, "-c", GLOO_INIT], capture_output=True, text=True,
                          timeout=300, env=env)


@pytest.fixture
def gloo_server():
    from horovod.runner.common.util import secret
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousServer

    class MisSigningHandler(RendezvousHandler):
        """Serves like the real server but signs its answers with another key."""

        def _respond(self, status_code, body=b""):
            key, self.server.key = self.server.key, os.urandom(32)
            try:
                super()._respond(status_code, body)
            finally:
                self.server.key = key

    servers = []

    def start(handler=RendezvousHandler):
        key = secret.make_secret_key()
        server = RendezvousServer(key=key)
        port = server.start(handler, address="127.0.0.1")
        server.init(get_host_assignments(parse_hosts("localhost:1"), 1))
        servers.append(server)
        return server, port, key

    start.mis_signing = MisSigningHandler
    yield start
    for server in servers:
        server.stop()


def test_cpp_gloo_store_signs_and_checks_answers(gloo_server):
    """Gloo's C++ store: with the job's key hvd.init() completes; without it, or with another
    job's key, the server refuses it (403) and the process ends with one clear line; and an
    answer not signed with the job's key is not believed."""
    server, port, key = gloo_server()
    ok = gloo_init(port, key.hex())
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "rank 0 of 1 gloo True" in ok.stdout
    assert server._httpd.refused == 0

    for key_hex, why in [(None, "has no job key"), (os.urandom(32).hex(), "another job's key")]:
        server, port, _ = gloo_server()
        bad = gloo_init(port, key_hex)
        assert bad.returncode != 0
        assert "refused" in bad.stderr and "(403)" in bad.stderr and why in bad.stderr, bad.stderr[-3000:]
        assert server._httpd.refused >= 1

    server, port, key = gloo_server(gloo_server.mis_signing)
    forged = gloo_init(port, key.hex())
    assert forged.returncode != 0, forged.stdout
    assert "rank 0 of 1" not in forged.stdout
    assert "is not signed with the job's key" in forged.stderr, forged.stderr[-3000:]


def test_elastic_job_refuses_forged_requests_and_finishes(tmp_path):
    """End to end, Horovod 0.28.1's hole: a running elastic job of the trainer on loopback (rank 0
    held at its first commit), another process finds the rendezvous port in a worker's environment
    and sends a forged PUT /worker_addresses/<host>:<slot> whose body would run a command, and a
    forged GET.  Both get 403; the same PUT signed with the job's key (read from the worker's
    environment) gets 400; nothing runs, the server listens on loopback only, the key is on no
    command line, and the job finishes normally with both ranks identical.  (On the unpatched
    build the PUT is unpickled: the marker appears and the server answers no 403.)"""
    marker = tmp_path / "ran"
    job = ElasticJob(tmp_path, "launch.torch_mnist", ["localhost:1", "127.0.0.1:1"], np=2, max_np=2,
                     epochs=3, gate_until="release")
    try:
        job.wait_until_held()
        workers = job.workers("localhost") + job.workers("127.0.0.1")
        assert len(workers) == 2
        env = workers[0].environ()
        addr, port = env["HOROVOD_GLOO_RENDEZVOUS_ADDR"], int(env["HOROVOD_GLOO_RENDEZVOUS_PORT"])

        body = forged_body(marker)
        put = request(port, "PUT", "/worker_addresses/localhost:0", body, host=addr)
        get = request(port, "GET", "/rank_and_size/localhost:0", host=addr)
        bad_key = request(port, "PUT", "/worker_addresses/localhost:0", body,
                          sign(os.urandom(32), "PUT", "/worker_addresses/localhost:0", body), host=addr)
        # and with the job's key (a process that read a worker's environment): refused unread
        job_key = bytes.fromhex(env[KEY_VAR])
        signed = request(port, "PUT", "/worker_addresses/localhost:0", body,
                         sign(job_key, "PUT", "/worker_addresses/localhost:0", body), host=addr)
        assert (put[0], get[0], bad_key[0], signed[0]) == (403, 403, 403, 400), \
            f"marker exists: {marker.exists()}"

        listening = {c.laddr.ip for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port}
        assert listening == {"127.0.0.1"}, "bound to the job's interface (lo) only"

        key_hex = env.get(KEY_VAR, "")
        assert len(key_hex) == 64, "the worker has the job's key in its environment"
        for proc in psutil.process_iter(["cmdline"]):
            assert key_hex not in " ".join(proc.info["cmdline"] or []), proc.info
        job.release()
        summary = job.finish()
    finally:
        job.kill()
    assert not marker.exists(), "the forged body was unpickled by the driver"
    assert world_sizes(summary) == [2], "the forged requests changed nothing in the job"
    assert len(summary["param_checksums"]) == 2
    check_trained(summary, 3)

