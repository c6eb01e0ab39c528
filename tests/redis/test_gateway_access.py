"""API keys, tenants and limits of the gateway, against real processes (tests/redis/gateways.py): a key is needed
and checked before the body is read; a key reaches its namespace and lanes only, whatever a path, header or field
says; body, batch and in-flight limits are refused each with its status."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import redis

from gateways import ROOT, TOKENS, GatewayProcess, auth, request
from producer.local.server import RedisServer
from producer.wire.keys import Keys


def test_a_valid_key_is_needed_and_checked_before_the_body_is_read(stack):
    url = stack.gateway.url
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKENS["acme"]},  # no scheme
                    {"Authorization": f"Basic {TOKENS['acme']}"}, {"Authorization": "Bearer"},
                    {"Authorization": f"Bearer {TOKENS['acme'][:-1]}"},  # a prefix of a key is no key
                    {"Authorization": f"Bearer {TOKENS['acme']}x"}):
        for method, path in (("POST", "/v1/decide"), ("POST", "/v1/decide/batch"), ("POST", "/v1/requests"),
                             ("GET", "/v1/results/gw-any")):
            reply = httpx.request(method, url + path, json=request("gw-401"), headers=headers)
            assert reply.status_code == 401, (headers, path, reply.text)
            assert reply.headers["www-authenticate"].startswith("Bearer") and reply.json()["error"]["code"] == \
                "unauthorized"
    # A body over the limit without a key: 401, not 413 (nothing of it was read).
    assert httpx.post(url + "/v1/decide", content=b"x" * 200_000).status_code == 401
    assert httpx.post(url + "/v1/decide", json=request("gw-auth-ok"), headers=auth("acme"),
                      timeout=30).status_code == 200
    assert stack.gateway.metric("dq_gateway_requests_total", route="decide", status="401") >= 7


def test_a_key_sends_only_to_its_lanes(stack):
    with stack.gateway.client("acme-normal") as http:
        reply = http.post("/v1/decide", json=request("gw-lane-1", priority="high"))
        assert reply.status_code == 403 and reply.json()["error"] == {
            "code": "lane_forbidden", "message": "this API key may not send to the high lane", "field": "priority"}
        reply = http.post("/v1/requests", json={"requests": [request("gw-lane-2"), request("gw-lane-3",
                                                                                           priority="high")]})
        assert reply.status_code == 403 and reply.json()["error"]["field"] == "requests.1.priority"
        assert http.post("/v1/decide", json=request("gw-lane-4")).json()["status"] == "ok"  # normal: allowed
        assert http.get("/v1/results/gw-lane-2").status_code == 404  # the refused call sent nothing


def test_no_path_header_or_field_reaches_another_tenants_results(stack):
    """acme (namespace dq) answers gw-secret; globex (namespace globex) cannot read it by any means, nor have its
    own request answered with it."""
    with stack.gateway.client("acme") as acme, stack.gateway.client("globex") as globex:
        secret = acme.post("/v1/decide", json=request("gw-secret", metadata={"card": "4111"})).json()
        assert secret["status"] == "ok"
        assert acme.get("/v1/results/gw-secret").json() == secret  # its own tenant reads it
        hostile = ["gw-secret", "dq:v1:result:{gw-secret}", "{gw-secret}", "..%2Fgw-secret", "gw-secret%00",
                   "%7Bgw-secret%7D", "dq%3Av1%3Aresult%3A%7Bgw-secret%7D", "*", "gw-secret%0A", "%20gw-secret"]
        for path in hostile:
            for headers in ({}, {"X-Namespace": "dq", "Host": "dq", "Forwarded": "for=dq"}):
                reply = globex.get(f"/v1/results/{path}", headers=headers, params={"namespace": "dq"})
                assert reply.status_code in (404, 422), (path, reply.text)
                assert "4111" not in reply.text
        # Fields naming another namespace are refused, not followed.
        for body in (request("gw-secret", namespace="dq"), request("gw-secret", reply_to="dq:v1:reply:steal"),
                     {"requests": [request("gw-secret")], "namespace": "dq"}):
            reply = globex.post("/v1/decide", json=body)
            assert reply.status_code == 422 and "4111" not in reply.text
        # The same id sent by globex is globex's own request: it waits for globex's worker (there is none).
        reply = globex.post("/v1/decide", params={"timeout": 0.3}, json=request("gw-secret"))
        assert reply.status_code == 504 and "4111" not in reply.text
        batch = globex.post("/v1/decide/batch", params={"timeout": 0.3}, json={"requests": [request("gw-secret")]})
        assert "4111" not in batch.text and json.loads(batch.text)["error"]["code"] == "timeout"
    server = redis.Redis.from_url(stack.server.url)
    assert server.exists(Keys("globex").result("gw-secret")) == 0  # nothing of acme's copied over


def test_body_batch_and_in_flight_limits_each_with_its_status(stack):
    with stack.gateway.client("acme") as http:
        big = request("gw-big", state="x" * 70_000)  # over the stack's --max-body-bytes 65536
        reply = http.post("/v1/decide", json=big)
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"

        def chunks():  # no Content-Length: refused once the bytes read pass the limit
            yield json.dumps(big).encode()

        reply = http.post("/v1/decide", content=chunks(), headers={"content-type": "application/json"})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "body_too_large"
        reply = http.post("/v1/decide/batch", json={"requests": [request(f"gw-b-{i}") for i in range(21)]})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "batch_too_large"
        assert http.post("/v1/requests", json={"requests": [request() for _ in range(21)]}).status_code == 413
    with stack.gateway.client("acme-normal") as http:  # 2 requests in flight at most
        for path in ("/v1/decide/batch", "/v1/requests"):  # more than the key ever allows: waiting would not help
            reply = http.post(path, json={"requests": [request(f"gw-if-{i}") for i in range(3)]})
            assert reply.status_code == 413 and "retry-after" not in reply.headers, reply.text
            assert reply.json()["error"]["code"] == "batch_too_large" and "never" in reply.json()["error"]["message"]
        # One slot of two held for 3 s by a long-poll on an id never sent (a decide the worker answers would hold
        # it only as long as the answer takes, a window a loaded machine can miss): a batch of two waits for it.
        # A long-poll that reaches the gateway while a batch holds both slots is itself refused: it holds again.
        polls: list[httpx.Response] = []

        def hold() -> threading.Thread:
            poll = threading.Thread(target=lambda: polls.append(
                http.get("/v1/results/gw-never-sent", params={"wait": 3})))
            poll.start()
            return poll

        held = hold()
        deadline = time.monotonic() + 10
        while (reply := http.post("/v1/decide/batch", params={"timeout": 0.2},
                                  json={"requests": [request(), request()]})).status_code != 429:
            assert time.monotonic() < deadline, "the long-poll did not hold its slot"
            if not held.is_alive() and polls and polls[-1].status_code == 429:
                held = hold()
        assert reply.json()["error"]["code"] == "too_many_in_flight" and reply.headers["retry-after"] == "1"
        held.join()
        for _ in range(3):  # the slots come back when each call ends
            got = http.post("/v1/decide/batch", json={"requests": [request(), request()]})
            assert got.status_code == 200 and len(got.text.splitlines()) == 2


def test_in_flight_slots_are_held_while_a_call_waits_and_given_back_when_its_caller_leaves(stack):
    """initech may have 4 requests in flight (namespace globex: nothing answers them). A batch of 4 holds them while
    it waits; its caller goes away; the slots come back (front.py), so the key is not locked out."""
    queued = stack.gateway.metric("dq_gateway_queued_requests_total")
    with stack.gateway.client("initech", timeout=3.0) as http:
        waiting = threading.Thread(target=lambda: _give_up(http, [request(f"gw-hold-{i}") for i in range(4)]))
        waiting.start()
        deadline = time.monotonic() + 10
        while stack.gateway.metric("dq_gateway_queued_requests_total") < queued + 4:  # admitted: its slots held
            assert time.monotonic() < deadline, "the batch was not queued"
            time.sleep(0.05)
        with stack.gateway.client("initech") as other:
            reply = other.post("/v1/decide", params={"timeout": 0.2}, json=request("gw-hold-x"))
            assert reply.status_code == 429 and reply.json()["error"]["code"] == "too_many_in_flight"
        waiting.join()
    with stack.gateway.client("initech") as http:
        deadline = time.monotonic() + 10
        while (reply := http.post("/v1/decide", params={"timeout": 0.2}, json=request())).status_code == 429:
            assert time.monotonic() < deadline, "the slots of a caller that went away were not given back"
            time.sleep(0.1)
        assert reply.status_code == 504  # admitted: it waited (no worker in globex)


def test_a_decide_whose_caller_left_gives_its_slot_back_at_once(stack):
    """initech: 4 in flight, namespace globex (nothing answers). Four decides that would wait 30 s, whose callers
    leave after half a second: their slots come back when they leave, not when their waits would have ended."""
    with stack.gateway.client("initech", timeout=0.5) as http:
        for _ in range(4):
            try:
                http.post("/v1/decide", params={"timeout": 30}, json=request())
            except httpx.ReadTimeout:
                continue
            raise AssertionError("answered: nothing can answer it in globex")
    left = time.monotonic()
    with stack.gateway.client("initech") as http:
        while (reply := http.post("/v1/requests", json=request())).status_code == 429:
            assert time.monotonic() - left < 5, "the slots of decides whose callers left were held"
            time.sleep(0.1)
        assert reply.status_code == 202


def test_a_long_poll_counts_against_its_keys_in_flight_limit(stack):
    """GET /v1/results/{id}?wait= holds a Redis connection while it waits, as a decide does: acme-normal (2 in
    flight) holds two, the third is 429 (before, any number: each one more Redis connection)."""
    with stack.gateway.client("acme-normal") as http:
        answers: list[int] = []
        polls = [threading.Thread(target=lambda: answers.append(
            http.get("/v1/results/gw-poll-none", params={"wait": 6}).status_code)) for _ in range(2)]
        for poll in polls:
            poll.start()
        time.sleep(1.5)  # both in flight (a call made meanwhile would take a slot and race them for it)
        reply = http.get("/v1/results/gw-poll-none")
        assert reply.status_code == 429 and reply.json()["error"]["code"] == "too_many_in_flight", reply.text
        for poll in polls:
            poll.join()
        assert answers == [404, 404]  # the two polls held the slots, and waited their time out
        assert http.get("/v1/results/gw-poll-none").status_code == 404  # given back


def test_one_tenants_waits_do_not_take_the_other_tenants_connections(stack, tmp_path):
    """Each waiting call holds a Redis connection: with redis-py's default pool (100), 110 long-polls of one tenant
    made every call of every tenant 503. The pool has a connection for each in-flight slot of every key now."""
    import asyncio

    keys = [{"name": "slow", "token": TOKENS["globex"], "namespace": "nowork", "max_inflight": 110},
            {"name": "fast", "token": TOKENS["acme"]}]
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", keys).wait_up()

    async def run() -> tuple[httpx.Response, httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gateway.url, timeout=60,
                                     limits=httpx.Limits(max_connections=130)) as http:
            polls = [asyncio.create_task(http.get(f"/v1/results/gw-pool-{i}", params={"wait": 8},
                                                  headers=auth("globex"))) for i in range(110)]
            await asyncio.sleep(3)
            decide = await http.post("/v1/decide", params={"timeout": 4}, json=request("gw-pool-fast"),
                                     headers=auth("acme"))
            queued = await http.post("/v1/requests", json=request("gw-pool-queued"), headers=auth("globex"))
            return decide, queued, await asyncio.gather(*polls)

    try:
        decide, queued, polls = asyncio.run(run())
    finally:
        gateway.stop()
    assert decide.status_code == 200 and decide.json()["status"] == "ok", decide.text
    assert queued.status_code == 429 and queued.json()["error"]["code"] == "too_many_in_flight"  # its own limit
    assert {poll.status_code for poll in polls} == {404}


def _give_up(http: httpx.Client, requests: list[dict]) -> None:
    try:
        http.post("/v1/decide/batch", params={"timeout": 30}, json={"requests": requests})
    except httpx.ReadTimeout:  # the caller leaves mid-batch
        return
    raise AssertionError("the batch was answered: nothing can answer it in globex")


def test_without_keys_it_listens_on_loopback_only_and_says_so(stack, tmp_path):
    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "producer.gateway", "--redis-url", stack.server.url, *args],
                              capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)

    done = run("--host", "0.0.0.0")
    assert done.returncode == 2 and "loopback" in done.stderr and "--api-keys-file" in done.stderr
    assert "no API keys" in stack.open.log.read_text() and "loopback" in stack.open.log.read_text()
    with socket.create_connection(("127.0.0.1", stack.open.port), timeout=2):
        pass
    # Keys files that would open it, or that are broken: refused before it listens, no token echoed.
    weak = tmp_path / "weak.json"
    weak.write_text(json.dumps([{"name": "a", "token": "short-secret"}]))
    done = run("--api-keys-file", str(weak))
    assert done.returncode == 2 and "short-secret" not in done.stderr and "token" in done.stderr
    for text in ("[]", "{not json", json.dumps([{"name": "a", "token": TOKENS["acme"], "namespace": "a{b}"}]),
                 json.dumps([{"name": "a", "token": TOKENS["acme"]}, {"name": "b", "token": TOKENS["acme"]}])):
        weak.write_text(text)
        done = run("--api-keys-file", str(weak))
        assert done.returncode == 2 and TOKENS["acme"] not in done.stderr, done.stderr
    assert run("--port", "0").returncode == 2 and run("--max-batch", "501").returncode == 2
    assert run("--redis-url", "redis://127.0.0.1:1/0").returncode == 4  # unreachable: said at start


def test_a_gateway_started_with_keys_from_a_file_serves_them(stack, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps([{"name": "solo", "token": TOKENS["acme"] + "-solo"}]))
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", host="127.0.0.1",
                             api_keys_file=str(keys)).wait_up()
    try:
        headers = {"Authorization": f"Bearer {TOKENS['acme']}-solo"}
        assert httpx.post(gateway.url + "/v1/decide", json=request("gw-file-1"), headers=headers,
                          timeout=30).json()["status"] == "ok"
        assert httpx.post(gateway.url + "/v1/decide", json=request("gw-file-2"), headers=auth("acme"),
                          timeout=30).status_code == 401
    finally:
        gateway.stop()


def test_as_the_producer_acl_user_it_queues_reads_and_is_ready_without_workers(tmp_path):
    """Compose's set-up: the gateway holds only the producer role of ops/redis_acl.py (submit, read results, read the
    workers' heartbeats): it queues and reads, and is ready with no worker at all (its own ability to serve: the
    requests wait in the queue)."""
    from ops.redis_acl import ROLES, render
    from producer.plumbing import library_loader

    passwords = {role: f"test-{role}-password" for role in ROLES}
    (tmp_path / "users.acl").write_text(render(passwords))
    with RedisServer("--aclfile", str(tmp_path / "users.acl")) as server:
        def as_role(role: str) -> str:
            return f"redis://{role}:{passwords[role]}@127.0.0.1:{server.port}/0"

        library_loader.ensure(redis.Redis.from_url(as_role("admin")))
        gateway = GatewayProcess(as_role("producer"), tmp_path / "gateway.log").wait_up()
        try:
            with gateway.client() as http:
                ready = http.get("/ready")
                assert ready.status_code == 200 and ready.json()["redis"] == "ok" and "workers" not in ready.json()
                queued = http.post("/v1/requests", json=request("gw-acl-1"))
                assert queued.status_code == 202
                assert http.get("/v1/results/gw-acl-1").status_code == 404
                body = json.dumps({"id": "gw-acl-1", "status": "ok", "answers": {}, "digest": queued.json()[
                    "digests"][0]})
                redis.Redis.from_url(as_role("admin")).xadd(Keys().result("gw-acl-1"), {"body": body})
                assert http.get("/v1/results/gw-acl-1").json()["status"] == "ok"
                assert http.post("/v1/decide", params={"timeout": 0.3}, json=request("gw-acl-2")).status_code == 504
        finally:
            gateway.stop()
