"""The gateway when things break, against real processes: a worker killed with SIGKILL mid-request (each caller gets
exactly one answer, or a 504 with its id and the result later), and Redis going away (503, then back)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import redis

from faults import FAULTY, wait_log
from gateways import GatewayProcess, request
from producer.gateway.config import GatewayConfig
from producer.gateway.routes import create_app
from producer.local.server import RedisServer
from producer.plumbing.connection import Deployment, aconnect
from producer.wire.keys import Keys

SLOW = {"entry": FAULTY, "env": {"DQ_FAULT_SLOW_S": "4"}}  # every pack sleeps 4 s first: time to kill the worker


@contextmanager
def own_redis(tmp_path) -> Iterator[tuple[RedisServer, GatewayProcess, httpx.Client]]:
    """A Redis of the test's own (it is stopped and started), a gateway process in front of it and a client."""
    server = RedisServer().start()
    gateway = GatewayProcess(server.url, tmp_path / "gateway.log").wait_up()
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            yield server, gateway, http
    finally:
        gateway.stop()
        server.__exit__()


def test_a_worker_killed_mid_request_leaves_each_caller_one_answer_or_a_504_with_its_id(stack, start_worker,
                                                                                        tiny_dir):
    """In namespace kill: the only worker takes the requests into a slow pack and is killed; a new one reclaims
    them. The caller that waits long gets the answer, once; the one that waits 2 s gets a 504 with its id and reads
    the result later; a streamed batch gets one line per id."""
    victim = start_worker(tiny_dir, stack.server.url, namespace="kill", claim_idle_ms=1000, **SLOW)
    replies: dict[str, httpx.Response] = {}

    def call(name: str, path: str, body: dict, timeout: float) -> None:
        with stack.gateway.client("kilo", timeout=120) as http:
            replies[name] = http.post(path, params={"timeout": timeout}, json=body)

    calls = [threading.Thread(target=call, args=args) for args in (
        ("long", "/v1/decide", request("gw-kill-long"), 90), ("short", "/v1/decide", request("gw-kill-short"), 2),
        ("batch", "/v1/decide/batch", {"requests": [request(f"gw-kill-b{i}") for i in range(3)]}, 90))]
    for thread in calls:
        thread.start()
    wait_log(victim, "fault: slow pack", timeout=30)
    victim.process.kill()
    victim.wait(10)
    assert not replies.get("long") and not replies.get("batch")  # nothing answered before the kill
    start_worker(tiny_dir, stack.server.url, namespace="kill", claim_idle_ms=1000)  # reclaims after 1 s idle
    for thread in calls:
        thread.join(120)
    long, short, batch = replies["long"], replies["short"], replies["batch"]
    assert long.status_code == 200 and long.json()["id"] == "gw-kill-long" and long.json()["status"] == "ok"
    assert short.status_code == 504 and short.json()["id"] == "gw-kill-short"
    with stack.gateway.client("kilo") as http:
        later = http.get(short.headers["location"], params={"wait": 60})
    assert later.status_code == 200 and later.json()["id"] == "gw-kill-short"
    lines = [json.loads(line) for line in batch.text.splitlines()]
    assert sorted(line["id"] for line in lines) == [f"gw-kill-b{i}" for i in range(3)]
    assert all(line["status"] == "ok" for line in lines)
    server, keys = redis.Redis.from_url(stack.server.url), Keys("kill")
    for request_id in ["gw-kill-long", "gw-kill-short", *(f"gw-kill-b{i}" for i in range(3))]:
        assert server.xlen(keys.result(request_id)) == 1  # exactly one result each


def test_redis_unreachable_is_503_and_the_gateway_recovers_when_it_is_back(server_binary, tmp_path):
    with own_redis(tmp_path) as (server, _, http):
        assert http.post("/v1/requests", json=request("gw-down-1")).status_code == 202
        server.stop(kill=True)
        for method, path, body in (("POST", "/v1/decide", request("gw-down-2")),
                                   ("POST", "/v1/requests", request("gw-down-3")),
                                   ("POST", "/v1/decide/batch", {"requests": [request("gw-down-4")]}),
                                   ("GET", "/v1/results/gw-down-1", None)):
            started = time.monotonic()
            reply = http.request(method, path, json=body)
            assert reply.status_code == 503, (path, reply.text)
            assert reply.json()["error"]["code"] == "unavailable" and reply.headers["retry-after"] == "1"
            assert time.monotonic() - started < 5  # said at once, not after the client's long retries
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["redis"].startswith("unreachable")
        assert http.get("/health").status_code == 200  # the process itself is fine: no restart wanted
        server.start()
        assert http.post("/v1/requests", json=request("gw-down-5")).status_code == 202
        assert redis.Redis.from_url(server.url).xlen(Keys().requests) == 2  # gw-down-1 (kept on disk) and 5


def test_an_outage_is_logged_once_each_failed_call_counted_and_its_end_logged_once(server_binary, tmp_path):
    """Under load, a Redis outage wrote a WARNING for every failed call: the first one is logged, each counted
    (dq_gateway_redis_errors_total, the alert's), and once Redis answers again one line says how many failed."""
    with own_redis(tmp_path) as (server, gateway, http):
        assert http.post("/v1/requests", json=request("gw-once-0")).status_code == 202
        server.stop(kill=True)
        for number in range(1, 11):
            assert http.post("/v1/requests", json=request(f"gw-once-{number}")).status_code == 503
        assert 'dq_gateway_redis_errors_total{kind="unreachable"} 10.0' in http.get("/metrics").text
        log = gateway.log.read_text()
        assert log.count("Redis cannot be reached") == 1 and "ConnectionError" in log, log[-3000:]
        assert "Redis: ConnectionError" not in log  # the line each call wrote
        server.start()
        wait_log(gateway, "Redis answers again after 10 failed calls", timeout=30)
        assert http.post("/v1/requests", json=request("gw-once-11")).status_code == 202
        server.stop(kill=True)  # a second outage is logged again
        assert http.post("/v1/requests", json=request("gw-once-12")).status_code == 503
        assert gateway.log.read_text().count("Redis cannot be reached") == 2
        assert 'dq_gateway_redis_errors_total{kind="unreachable"} 11.0' in http.get("/metrics").text


def test_a_full_pool_is_503_saying_so_and_counted_apart_from_redis_failures(redis_server):
    """Every connection of the gateway's pool held by its own calls: the call that waited in vain was a plain
    503 "unavailable: ConnectionError", counted as Redis down. It says the gateway is too busy, with the pool's
    size, and is counted in dq_gateway_redis_pool_timeouts_total (Redis answers: no Redis failure)."""
    async def run() -> tuple[httpx.Response, str]:
        connection = aconnect(redis_server.url, max_connections=2, timeout=0.2)
        app = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url)), connection)
        async with app.app.router.lifespan_context(app.app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as http:
                assert (await http.post("/v1/requests", json=request("gw-pool-1"))).status_code == 202
                pool = connection.connection_pool
                held = [await pool.get_connection() for _ in range(2)]
                try:
                    reply = await http.post("/v1/requests", json=request("gw-pool-2"))
                finally:
                    for each in held:
                        await pool.release(each)
                assert (await http.post("/v1/requests", json=request("gw-pool-3"))).status_code == 202
                return reply, (await http.get("/metrics")).text

    reply, metrics = asyncio.run(run())
    assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
    message = reply.json()["error"]["message"]
    assert "too busy: all 2 of its Redis connections" in message and reply.json()["id"] == "gw-pool-2", message
    assert "dq_gateway_redis_pool_timeouts_total 1.0" in metrics
    assert 'dq_gateway_redis_errors_total{kind="unreachable"} 0.0' in metrics


def test_a_full_redis_is_503_with_retry_after_not_a_500(server_binary, tmp_path):
    """Redis at maxmemory refuses writes (OOM): that was a 500 internal_error, as if the gateway had a bug; it is
    Redis's state, which passes when memory is freed: 503 with Retry-After, naming the id."""
    with RedisServer() as server:
        gateway = GatewayProcess(server.url, tmp_path / "gateway.log").wait_up()
        admin = redis.Redis.from_url(server.url)
        try:
            with httpx.Client(base_url=gateway.url, timeout=30) as http:
                assert http.post("/v1/requests", json=request("gw-oom-1")).status_code == 202
                admin.config_set("maxmemory", 1)
                reply = http.post("/v1/requests", json=request("gw-oom-2"))
                assert reply.status_code == 503 and reply.headers["retry-after"] == "1", reply.text
                assert reply.json()["error"]["code"] == "unavailable" and reply.json()["id"] == "gw-oom-2"
                assert "OutOfMemoryError" in reply.json()["error"]["message"]
                admin.config_set("maxmemory", 0)
                assert http.post("/v1/requests", json=request("gw-oom-2")).status_code == 202
        finally:
            admin.config_set("maxmemory", 0)
            gateway.stop()

def test_durable_mode_returns_no_result_the_replicas_did_not_confirm_and_names_the_id(stack, tmp_path):
    """--wait-replicas 1 on a server without replicas: a result there on the primary is not returned, with or
    without a wait (503 not_durable naming the id; before, a wait returned it unconfirmed), and a decide whose
    enqueue no replica confirmed is 503 not_durable naming the id the gateway gave it (before: 500 "Redis refused a
    command" with id null), though it is queued and answered."""
    gateway = GatewayProcess(stack.server.url, tmp_path / "gateway.log", wait_replicas=1).wait_up()
    server = redis.Redis.from_url(stack.server.url)
    body = json.dumps({"id": "gw-dur-1", "status": "ok", "answers": {"refund": {"type": "noul", "noul": 0.5}}})
    server.xadd(Keys().result("gw-dur-1"), {"body": body})
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            for params in ({}, {"wait": 3}):
                reply = http.get("/v1/results/gw-dur-1", params=params)
                assert reply.status_code == 503, (params, reply.text)
                assert reply.json()["id"] == "gw-dur-1" and reply.json()["error"]["code"] == "not_durable"
                assert reply.headers["retry-after"] == "1"
            reply = http.post("/v1/decide", json=request(state="durable, but no replica"))
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "not_durable", reply.text
            request_id = reply.json()["id"]
            assert request_id and reply.json()["ids"] == [request_id]
            assert "same id" in reply.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while not server.exists(Keys().result(request_id)):  # it was queued: the worker answers it
            assert time.monotonic() < deadline, "the request the 503 named was not queued"
            time.sleep(0.1)
    finally:
        gateway.stop()


def test_a_frozen_redis_is_503_within_the_socket_timeout_naming_the_id_it_may_have_queued(server_binary, tmp_path):
    """Redis frozen (SIGSTOP): each call is 503 within the 5 s socket timeout (before: 15 s and more, a timed-out
    command retried twice), and a decide's answer names the id the gateway gave its request, saying it may have
    been queued (before: id null): after Redis resumes, the request is there under that id, once."""
    server = RedisServer().start()
    gateway = GatewayProcess(server.url, tmp_path / "gateway.log").wait_up()
    try:
        with httpx.Client(base_url=gateway.url, timeout=60) as http:
            assert http.post("/v1/requests", json=request("gw-frozen-0")).status_code == 202
            server.pause()
            try:
                for method, path, body, named in (("POST", "/v1/decide", request(state="frozen"), None),
                                                  ("GET", "/v1/results/gw-frozen-0", None, "gw-frozen-0")):
                    started = time.monotonic()
                    reply = http.request(method, path, json=body, params={"wait": 1} if method == "GET" else {})
                    assert reply.status_code == 503 and reply.json()["error"]["code"] == "unavailable", reply.text
                    assert time.monotonic() - started < 7.5, path
                    assert reply.json()["id"] and reply.json()["id"] == (named or reply.json()["id"])
                    if method == "POST":
                        sent = reply.json()["id"]
                        assert "may have been queued" in reply.json()["error"]["message"]
                        digest = reply.json()["digests"][0]  # its own result is read with it
                        assert reply.headers["location"] == f"/v1/results/{sent}?digest={digest}"
            finally:
                server.resume()
        bodies = [json.loads(fields[b"body"]) for _, fields in redis.Redis.from_url(server.url).xrange(
            Keys().requests)]
        assert [b["id"] for b in bodies if b["state"] == "frozen"] in ([], [sent])  # never twice, never another id
    finally:
        gateway.stop()
        server.__exit__()


def test_through_sentinel_in_durable_mode_it_queues_and_returns_confirmed_results(tmp_path):
    """A redis+sentinel:// URL (a primary, its replica, three sentinels) with --wait-replicas 1: the replica
    confirms, so an enqueue is 202 and a result is returned, with or without a wait (docs/GATEWAY.md, "Settings")."""
    from ops.failover_deployments import Replicated

    cluster = Replicated().start()
    gateway = GatewayProcess(cluster.url, tmp_path / "gateway.log", wait_replicas=1).wait_up()
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
            assert http.post("/v1/requests", json=request("gw-sentinel-1")).status_code == 202
            body = json.dumps({"id": "gw-sentinel-1", "status": "ok", "answers": {}})
            threading.Timer(0.5, lambda: cluster.client().xadd(Keys().result("gw-sentinel-1"),
                                                                {"body": body})).start()
            later = http.get("/v1/results/gw-sentinel-1", params={"wait": 10})
            assert later.status_code == 200 and later.json()["id"] == "gw-sentinel-1", later.text
            assert http.get("/v1/results/gw-sentinel-1").status_code == 200
    finally:
        gateway.stop()
        cluster.close()
