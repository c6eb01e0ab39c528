"""Hostile and careless callers of the gateway, against real processes (tests/redis/gateways.py): raw sockets that
send headers forever or never finish them, floods of keyless calls, bodies sent to a key with no room, callers that
hang up. Each test is one defect of the gateway found by an attacker's pass (docs/RELIABILITY.md, "Hostile callers"):
the gateway bounds what a caller can hold, says what it closed, and keeps answering everyone else.

The gateway here has small limits, so that each is cheap to reach: 1 s for a request's head and between parts of a
body, 40 connections, 1 MiB bodies and 2 MiB of them at once; keys ``acme`` (namespace dq, which has a worker; 4 in
flight), ``tight`` and ``waits`` (namespace globex, which has none; 1 and 4 in flight).
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from gateways import TOKENS, GatewayProcess, request
from producer.client.plans import prepare
from producer.wire.keys import Keys, shard_of

pytestmark = pytest.mark.redis
KEYS = [{"name": "acme", "token": TOKENS["acme"], "max_inflight": 4},
        {"name": "tight", "token": TOKENS["globex"], "namespace": "globex", "max_inflight": 1},
        {"name": "waits", "token": TOKENS["initech"], "namespace": "globex", "max_inflight": 4}]
AUTH = {key["name"]: {"Authorization": f"Bearer {key['token']}"} for key in KEYS}
POOL = 4 + 1 + 4 + 32  # the tenants' Redis pool: the keys' slots and 32 spares (service.pool_size)
LIMITS = dict(header_timeout_s=1, body_timeout_s=1, max_connections=40, max_body_bytes=1 << 20,
              max_body_bytes_in_flight=2 << 20, wait_s=20)


@pytest.fixture(scope="module")
def started():
    gateways: dict = {}
    yield gateways
    for gateway in gateways.values():
        gateway.stop()


@pytest.fixture
def hostile(server_binary, stack, started, tmp_path_factory) -> GatewayProcess:
    """This server's gateway with small limits, in front of the stack's server and worker."""
    if server_binary.label not in started:
        log = tmp_path_factory.mktemp("hostile") / "gateway.log"
        started[server_binary.label] = GatewayProcess(stack.server.url, log, KEYS, **LIMITS).wait_up()
    return started[server_binary.label]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def connect(gateway: GatewayProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gateway.port), timeout=10)


def until_closed(sock: socket.socket, timeout: float = 10.0) -> tuple[bytes, float]:
    """What the gateway sent before it closed the connection (a reset counts as closed), and how long that took."""
    started, got = time.monotonic(), b""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return got, time.monotonic() - started


def head(method: str, path: str, *lines: str) -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{line}\r\n" for line in lines)).encode()


def test_a_head_that_never_ends_is_closed_at_the_header_limit_and_costs_no_memory(hostile):
    """Four connections that send megabytes of header lines and never finish: before, the gateway held them all
    (58 MB to almost 1 GB); now each is answered 431 and closed once past 16 KiB, the rest of its bytes unread."""
    before = rss_mb(hostile.process.pid)
    counted = hostile.metric("dq_gateway_connections_closed_total", reason="header_too_large")
    sent = []
    for _ in range(4):
        sock, pushed = connect(hostile), 0
        sock.sendall(head("GET", "/health"))
        try:
            while pushed < 16 << 20:  # 16 MB of headers, never ended
                sock.sendall(b"X-Pad: " + b"a" * 8000 + b"\r\n")
                pushed += 8009
        except OSError:  # closed under it
            pass
        got, _ = until_closed(sock)
        sent.append(pushed)
        assert got == b"" or got.startswith(b"HTTP/1.1 431"), got[:200]
        sock.close()
    assert max(sent) < 8 << 20, sent  # it stopped reading long before: what got through sat in socket buffers
    assert hostile.metric("dq_gateway_connections_closed_total", reason="header_too_large") == counted + 4
    assert rss_mb(hostile.process.pid) - before < 30
    assert httpx.get(hostile.url + "/health").status_code == 200


def test_half_sent_and_silent_connections_are_closed_within_the_header_timeout(hostile):
    """Slowloris: connections that send a request a byte at a time, or nothing at all, were never closed; now each
    is closed (408) about a second after it opened, however steadily it trickles, counted and logged."""
    counted = hostile.metric("dq_gateway_connections_closed_total", reason="header_timeout")
    silent = [connect(hostile) for _ in range(5)]
    trickling = [connect(hostile) for _ in range(5)]
    closed: dict[int, float] = {}
    started = time.monotonic()

    def trickle(index: int, sock: socket.socket) -> None:
        try:
            for byte in head("GET", "/health", "X-Slow: yes"):  # never the blank line that ends a head
                sock.sendall(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass

    threads = [threading.Thread(target=trickle, args=(i, s)) for i, s in enumerate(trickling)]
    for thread in threads:
        thread.start()
    for index, sock in enumerate(silent + trickling):
        got, _ = until_closed(sock, timeout=10)
        closed[index] = time.monotonic() - started
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
    for thread in threads:
        thread.join()
    assert max(closed.values()) < 5, closed  # 1 s each, measured from the client on a loaded machine
    assert hostile.metric("dq_gateway_connections_closed_total", reason="header_timeout") == counted + 10
    assert "did not finish a request's headers in time" in hostile.log.read_text()


def test_over_the_connection_limit_idle_then_slow_ones_make_room_and_calls_in_progress_are_never_closed(stack,
                                                                                                    tmp_path):
    """At most 8 connections (a gateway of its own, keyless). Before, thousands stayed open and, at the process's
    file limit, everyone was refused in silence. Now a newcomer closes an idle keep-alive connection, else the one
    that has been sending its head longest (over a second: a slowloris connection is the first to go), else is
    answered 503; a call in progress is never closed for another."""
    gateway = GatewayProcess(stack.server.url, tmp_path / "open.log", max_connections=8, header_timeout_s=30)
    try:
        gateway.wait_up()
        idle = []
        for _ in range(8):  # each sends one whole request, then idles (keep-alive)
            sock = connect(gateway)
            sock.sendall(head("GET", "/health") + b"\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            idle.append(sock)
        assert httpx.get(gateway.url + "/health").status_code == 200  # room made by closing an idle one
        for sock in idle:
            sock.close()
        slow = [connect(gateway) for _ in range(8)]  # half-sent heads: none of them idle
        for sock in slow:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(1.5)  # slower than any caller's head, far within the 30 s header timeout
        assert httpx.get(gateway.url + "/health").status_code == 200  # room made by closing the slowest
        for sock in slow:
            sock.close()
        polls = [threading.Thread(target=lambda: httpx.get(gateway.url + "/v1/results/gw-never", params={"wait": 5},
                                                           timeout=15)) for _ in range(8)]
        for poll in polls:
            poll.start()
        deadline = time.monotonic() + 10
        while True:  # until every poll holds its connection: a newcomer then finds none to close
            newcomer = connect(gateway)
            newcomer.sendall(head("GET", "/health", "Connection: close") + b"\r\n")
            got, _ = until_closed(newcomer)
            if got.startswith(b"HTTP/1.1 503"):
                break
            assert got.startswith(b"HTTP/1.1 200") and time.monotonic() < deadline, got[:200]
            time.sleep(0.1)
        assert b'"too_many_connections"' in got
        for poll in polls:
            poll.join()
        closed = {reason: gateway.metric("dq_gateway_connections_closed_total", reason=reason)
                  for reason in ("idle_evicted", "slow_evicted", "over_limit")}
        assert all(count >= 1 for count in closed.values()), closed
        assert "still sending a request's head" in gateway.log.read_text()
    finally:
        gateway.stop()


def test_at_the_open_file_limit_the_connection_cap_is_lowered_and_the_flood_is_refused_not_everyone(stack, tmp_path):
    """With an open-file limit of 200 (a container's ulimit) and the default of 1024 connections, the gateway lowers
    its cap to fit and says so at start; a flood of 300 half-sent connections is refused past the cap (counted,
    logged), and once it passes a keyed call is answered."""
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", KEYS, files=200, header_timeout_s=2)
    try:
        gateway.wait_up()
        log = gateway.log.read_text()
        cap = int(re.search(r"--max-connections 1024 lowered to (\d+)", log).group(1))
        assert 0 < cap < 200 - POOL, log  # the Redis pool and the rest fit beside it
        flood = []
        for _ in range(300):
            try:
                sock = connect(gateway)
                sock.sendall(b"GET /health HTTP/1.1\r\n")
                flood.append(sock)
            except OSError:
                break
        time.sleep(0.5)
        assert gateway.process.poll() is None and len(flood) == 300
        for sock in flood:
            sock.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                reply = httpx.post(gateway.url + "/v1/requests", json=request("gw-files-1"), headers=AUTH["acme"],
                                   timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "nobody answered after the flood"
                time.sleep(0.2)
        assert reply.status_code == 202
        closed = sum(gateway.metric("dq_gateway_connections_closed_total", reason=reason)
                     for reason in ("over_limit", "slow_evicted"))  # refused, or the slowest closed for them
        assert closed >= 300 - cap - 5
        assert "came over the connection limit" in gateway.log.read_text() or "still sending" in gateway.log.read_text()
    finally:
        gateway.stop()


def test_a_ready_flood_never_touches_the_tenants_pool(stack, tmp_path):
    """Hundreds of keyless /ready at once: before, each took a connection of the tenants' pool (41 here: the keys'
    9 slots and 32 spares), tenants' calls failed 503 and /ready said Redis was unreachable. Now /ready asks Redis on
    its own connection, at most once a second, and the tenant's decides all answer."""
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", KEYS).wait_up()  # 1024 connections
    server = redis.Redis.from_url(stack.server.url)
    pings = server.info("commandstats").get("cmdstat_ping", {}).get("calls", 0)

    async def flood() -> tuple[list[int], list[int]]:
        limits = httpx.Limits(max_connections=400, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=gateway.url, limits=limits, timeout=30) as http:
            readies = [http.get("/ready") for _ in range(300)]
            decides = [http.post("/v1/decide", json=request(f"gw-flood-{i}"), headers=AUTH["acme"])
                       for i in range(4)]
            answers = await asyncio.gather(*readies, *decides, return_exceptions=True)
        codes = [a.status_code if isinstance(a, httpx.Response) else 0 for a in answers]
        return codes[:300], codes[300:]

    try:
        readies, decides = asyncio.run(flood())
    finally:
        gateway.stop()
    assert decides == [200] * 4 and readies == [200] * 300, (decides, sorted(set(readies)))
    assert server.info("commandstats")["cmdstat_ping"]["calls"] - pings < 15  # not one PING per call


def test_readiness_is_the_gateways_own_and_says_nothing_of_tenants(hostile, stack):
    """/ready was 503 for every tenant when one namespace (globex) had no worker, and listed every namespace to
    anyone. Now it is 200 whatever the workers (a missing worker is an alert: DecisionQueueLagWithoutWorkers), and
    names no namespace."""
    reply = httpx.get(hostile.url + "/ready")
    assert reply.status_code == 200 and reply.json()["ready"] is True and reply.json()["redis"] == "ok"
    assert not {"dq", "globex", "workers"} & set(re.findall(r"\w+", reply.text))
    assert httpx.get(hostile.url + "/health").json() == {"status": "ok"}


def test_a_shard_without_workers_leaves_the_gateway_ready_and_shows_in_the_exporter(stack, tmp_path):
    """--shards 2 with workers on shard 0 only: the gateway is ready (it can queue), and what the operator sees is
    the queue exporter's lag on shard 1 with no consumers there, which DecisionQueueLagWithoutWorkers pages on
    (ops/prometheus/alerts.test.yml)."""
    import subprocess
    import sys

    from gateways import ROOT
    from producer.local.ports import free_port
    from prometheus_client.parser import text_string_to_metric_families

    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", KEYS, shards=2).wait_up()
    port = free_port()
    exporter = subprocess.Popen([sys.executable, "-m", "producer", "exporter", "--redis-url", stack.server.url,
                                 "--shards", "2", "--port", str(port), "--host", "127.0.0.1"], cwd=ROOT,
                                stdout=open(tmp_path / "exporter.log", "wb"), stderr=subprocess.STDOUT)
    try:
        assert httpx.get(gateway.url + "/ready").status_code == 200
        ids = [i for i in (f"gw-shard-{n}" for n in range(40)) if shard_of(i, 2) == 1][:3]
        assert httpx.post(gateway.url + "/v1/requests", json={"requests": [request(i) for i in ids]},
                          headers=AUTH["acme"]).status_code == 202
        samples: dict = {}
        deadline = time.monotonic() + 30
        while not samples.get(("dq_stream_lag", "1", "requests", "normal")):
            assert time.monotonic() < deadline, samples
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            samples = {(s.name, s.labels.get("shard"), s.labels.get("stream"), s.labels.get("lane")): s.value
                       for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples[("dq_stream_lag", "1", "requests", "normal")] >= 3
        assert samples[("dq_stream_consumers", "1", "requests", "normal")] == 0
        assert samples[("dq_stream_consumers", "0", "requests", "normal")] >= 1
        assert httpx.get(gateway.url + "/ready").status_code == 200
    finally:
        exporter.terminate()
        exporter.wait(10)
        gateway.stop()
        redis.Redis.from_url(stack.server.url).delete(Keys("dq", 1).requests)


def held_slot(gateway: GatewayProcess, key: str, seconds: float) -> threading.Thread:
    """A long-poll holding one of ``key``'s slots for ``seconds``."""
    thread = threading.Thread(target=lambda: httpx.get(gateway.url + "/v1/results/gw-never", headers=AUTH[key],
                                                       params={"wait": seconds}, timeout=seconds + 10))
    thread.start()
    return thread


def test_a_key_with_no_room_is_refused_before_a_byte_of_its_body_is_read(hostile):
    """tight may have one call in flight; while a long-poll holds it, a POST declaring a body near the limit is
    answered 429 at once, with nothing of its body sent (before, every body was read and parsed first: forty 7 MB
    bodies of one key took the gateway to 800 MB though 24 were then refused)."""
    poll = held_slot(hostile, "tight", 5)
    deadline = time.monotonic() + 10
    while hostile.metric("dq_gateway_in_flight", route="results") < 1:  # the long-poll holds the slot
        assert time.monotonic() < deadline, "the long-poll did not start"
        time.sleep(0.05)
    sock = connect(hostile)
    sock.sendall(head("POST", "/v1/decide", f"Authorization: Bearer {TOKENS['globex']}",
                      "Content-Type: application/json", f"Content-Length: {(1 << 20) - 10}") + b"\r\n")
    got, took = until_closed(sock, timeout=5)
    assert got.startswith(b"HTTP/1.1 429") and b'"too_many_in_flight"' in got, got[:300]
    assert b"connection: close" in got.lower() and took < 2
    poll.join()


def test_the_gateways_body_budget_refuses_bodies_beyond_it_unread_and_a_stalled_body_is_408(hostile):
    """2 MiB of bodies at once over every caller: two calls that declare 1 MiB and then stall hold it; a third is
    503 busy at once, unread; the stalled two are 408 after the body timeout (1 s), their connections closed, and
    the budget is free again."""
    stalled = []
    for _ in range(2):
        sock = connect(hostile)
        sock.sendall(head("POST", "/v1/requests", f"Authorization: Bearer {TOKENS['acme']}",
                          "Content-Type: application/json", f"Content-Length: {1 << 20}") + b"\r\n" + b'{"st')
        stalled.append(sock)
    time.sleep(0.3)
    third = connect(hostile)
    third.sendall(head("POST", "/v1/requests", f"Authorization: Bearer {TOKENS['acme']}",
                       f"Content-Length: {1 << 19}") + b"\r\n")
    got, took = until_closed(third, timeout=5)
    assert got.startswith(b"HTTP/1.1 503") and b'"busy"' in got and b"retry-after: 1" in got.lower(), got[:300]
    for sock in stalled:
        got, took = until_closed(sock, timeout=10)
        assert got.startswith(b"HTTP/1.1 408") and b'"body_timeout"' in got, got[:300]
    reply = httpx.post(hostile.url + "/v1/requests", json=request("gw-budget-1"), headers=AUTH["acme"])
    assert reply.status_code == 202, reply.text


def test_a_caller_that_hangs_up_is_499_without_a_traceback(hostile):
    """A decide (namespace globex: nothing answers) and a streamed batch whose callers leave: each counted 499,
    never a 500 with an InvalidStateError traceback in the log."""
    before = {code: hostile.metric("dq_gateway_requests_total", route=route, status=code)
              for route in ("decide",) for code in ("499", "500")}
    batch_before = hostile.metric("dq_gateway_requests_total", route="decide_batch", status="499")
    with httpx.Client(base_url=hostile.url, headers=AUTH["tight"], timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/decide", params={"timeout": 30}, json=request("gw-gone-1"))
    with httpx.Client(base_url=hostile.url, headers=AUTH["tight"], timeout=30) as http:
        with http.stream("POST", "/v1/decide/batch", params={"timeout": 30}, json={"requests": [
                request("gw-gone-2")]}) as reply:
            assert reply.status_code == 200  # then the caller leaves before its one line
    deadline = time.monotonic() + 10
    while hostile.metric("dq_gateway_requests_total", route="decide", status="499") < before["499"] + 1 or \
            hostile.metric("dq_gateway_requests_total", route="decide_batch", status="499") < batch_before + 1:
        assert time.monotonic() < deadline, hostile.log.read_text()[-3000:]
        time.sleep(0.1)
    assert hostile.metric("dq_gateway_requests_total", route="decide", status="500") == before["500"]
    log = hostile.log.read_text()
    assert "InvalidStateError" not in log and "Traceback" not in log


def test_a_reused_id_over_http_is_answered_only_for_its_own_request(hostile):
    """POST /v1/requests then GET /v1/results/{id}: the 202 gives each id's digest, and GET with it answers 409
    id_conflict for another request's result under the id; before, an HTTP caller got the other answer as 200."""
    first = httpx.post(hostile.url + "/v1/requests", json=request("gw-http-reuse", state="First ticket."),
                       headers=AUTH["acme"]).json()
    got = httpx.get(hostile.url + "/v1/results/gw-http-reuse", params={"wait": 30, "digest": first["digests"][0]},
                    headers=AUTH["acme"], timeout=40)
    assert got.status_code == 200 and got.json()["digest"] == first["digests"][0], got.text
    second = httpx.post(hostile.url + "/v1/requests", json=request("gw-http-reuse", state="Another ticket."),
                        headers=AUTH["acme"]).json()
    assert second["digests"][0] != first["digests"][0]
    other = httpx.get(hostile.url + "/v1/results/gw-http-reuse", params={"digest": second["digests"][0]},
                      headers=AUTH["acme"])
    assert other.status_code == 409 and other.json()["error"]["code"] == "id_conflict", other.text
    assert "answers" not in other.json() and other.json()["digest"] == second["digests"][0]
    assert httpx.get(hostile.url + "/v1/results/gw-http-reuse", params={"digest": "x" * 32},
                     headers=AUTH["acme"]).status_code == 422  # not a digest


def test_one_late_request_in_a_batch_does_not_cut_the_others_wait(hostile):
    """A request whose deadline has passed shortened the whole batch's wait to 2 s; now only its own line: it times
    out at 2 s (its worker would answer deadline_exceeded by then), the others wait the call's 4 s."""
    late = request("gw-late-one", deadline_ms=int(time.time() * 1000))
    arrivals = {}
    started = time.monotonic()
    with httpx.Client(base_url=hostile.url, headers=AUTH["waits"], timeout=30) as http:
        with http.stream("POST", "/v1/decide/batch", params={"timeout": 4}, json={"requests": [
                late, request("gw-late-two"), request("gw-late-three")]}) as reply:
            for line in reply.iter_lines():
                arrivals[json.loads(line)["id"]] = time.monotonic() - started
    assert set(arrivals) == {"gw-late-one", "gw-late-two", "gw-late-three"}
    assert arrivals["gw-late-one"] < 3.5 and min(arrivals["gw-late-two"], arrivals["gw-late-three"]) >= 4


def test_a_keyless_gateway_takes_json_from_a_loopback_host_only(stack):
    """A web page on the same machine could submit to the open gateway (a form's text/plain body) and read it
    through a DNS name pointed at 127.0.0.1 (any Host was taken): now 415 and 400. A body that is not JSON is
    taken with an Authorization header, which no form can send (the SDKs' multipart calls carry one)."""
    url = stack.open.url
    body = json.dumps(request("gw-csrf-1"))
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        reply = httpx.post(url + "/v1/requests", content=body, headers={"content-type": kind} if kind else {})
        assert reply.status_code == 415 and reply.json()["error"]["code"] == "unsupported_media_type", kind
        assert "Authorization" in reply.json()["error"]["message"]  # what to do
        reply = httpx.post(url + "/v1/requests", content=body, headers={
            **({"content-type": kind} if kind else {}), "Authorization": "Bearer anything"})
        assert reply.status_code != 415, (kind, reply.text)  # past the front layer: the route reads the body
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "10.0.0.1"):
        for method, path in (("GET", "/ready"), ("GET", "/metrics"), ("POST", "/v1/requests")):
            reply = httpx.request(method, url + path, content=body, headers={"Host": host,
                                                                             "content-type": "application/json"})
            assert reply.status_code == 400 and reply.json()["error"]["code"] == "host_not_allowed", (host, path)
    for host in (f"127.0.0.1:{stack.open.port}", f"localhost:{stack.open.port}", "localhost", "[::1]:80"):
        assert httpx.post(url + "/v1/requests", content=body, headers={
            "Host": host, "content-type": "application/json; charset=utf-8"}).status_code == 202, host


def test_two_authorization_headers_are_no_key(hostile):
    """With two Authorization headers the last one won: a proxy adding its own after the caller's could be taken
    for the caller. Now two headers are 401, whatever they hold."""
    for pair in ((TOKENS["acme"], "nope"), ("nope", TOKENS["acme"]), (TOKENS["acme"], TOKENS["acme"])):
        sock = connect(hostile)
        sock.sendall(head("GET", "/v1/results/gw-any", *(f"Authorization: Bearer {t}" for t in pair)) + b"\r\n")
        got, _ = until_closed(sock)
        assert got.startswith(b"HTTP/1.1 401"), got[:200]


def test_sigterm_stops_the_gateway_with_exit_0(stack, tmp_path):
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", KEYS).wait_up()
    gateway.process.send_signal(signal.SIGTERM)
    assert gateway.process.wait(30) == 0, gateway.log.read_text()[-2000:]


def test_every_refusal_names_a_digest_that_the_gateway_computes_as_the_client_does(hostile):
    """The 504 of a decide says where to read the result later, with the request's digest (the client's own)."""
    body = request("gw-digest-504")
    reply = httpx.post(hostile.url + "/v1/decide", params={"timeout": 0.3}, json=body, headers=AUTH["tight"])
    digest = prepare(body).digest
    assert reply.status_code == 504 and reply.json()["digest"] == digest
    assert reply.headers["location"] == f"/v1/results/gw-digest-504?digest={digest}"


def test_an_unreadable_stored_result_is_a_409_never_a_bare_500_or_a_batch_without_its_line(hostile, stack):
    """A result stream holding what no worker wrote: the gateway answered a bare 500, reset the connection, or ended
    a streamed batch with no line for it. Now a decide and a GET are 409 id_conflict saying why, and the batch has
    its line (the others theirs)."""
    server = redis.Redis.from_url(stack.server.url)
    for request_id in ("gw-garbled-1", "gw-garbled-2", "gw-garbled-3"):
        server.xadd(Keys().result(request_id), {"body": b"\xff{ not a result"})
    with httpx.Client(base_url=hostile.url, headers=AUTH["acme"], timeout=60) as http:
        reply = http.post("/v1/decide", json=request("gw-garbled-1"))
        assert reply.status_code == 409 and reply.json()["error"]["code"] == "id_conflict", reply.text
        assert "no readable result" in reply.json()["error"]["message"]
        got = http.get("/v1/results/gw-garbled-2")
        assert got.status_code == 409 and got.json()["error"]["code"] == "id_conflict", got.text
        lines = [json.loads(line) for line in http.post("/v1/decide/batch", json={"requests": [
            request("gw-garbled-3"), request("gw-garbled-ok")]}).text.splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert set(by_id) == {"gw-garbled-3", "gw-garbled-ok"}
    assert by_id["gw-garbled-3"]["error"]["code"] == "id_conflict" and by_id["gw-garbled-ok"]["status"] == "ok"
    assert "Traceback" not in hostile.log.read_text()


def test_what_is_not_http_is_counted_and_logged_once_not_once_per_request(hostile):
    """uvicorn answers 400 to bytes that are not HTTP, and logged a warning for each: a flood of them was a flood of
    log lines. Now each is counted, and the log says so at most once a minute."""
    counted = hostile.metric("dq_gateway_connections_closed_total", reason="invalid_request")
    for _ in range(20):
        sock = connect(hostile)
        sock.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
        got, _ = until_closed(sock)
        assert got == b"" or got.startswith(b"HTTP/1.1 400"), got[:100]
    assert hostile.metric("dq_gateway_connections_closed_total", reason="invalid_request") == counted + 20
    log = hostile.log.read_text()
    assert "Invalid HTTP request received" not in log and log.count("sent what is not HTTP") <= 1
