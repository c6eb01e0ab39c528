"""The gateway when things break, against real processes: a worker killed with SIGKILL mid-request (each caller gets
exactly one answer, or a 504 with its id and the result later), and Redis going away (503, then back)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import redis

from faults import FAULTY, wait_log
from gateways import GatewayProcess, request
from producer.keys import Keys
from worker.redis_server import RedisServer

SLOW = {"entry": FAULTY, "env": {"DQ_FAULT_SLOW_S": "4"}}  # every pack sleeps 4 s first: time to kill the worker


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
    server = RedisServer().start()
    gateway = GatewayProcess(server.url, tmp_path / "gateway.log").wait_up()
    try:
        with httpx.Client(base_url=gateway.url, timeout=30) as http:
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
    finally:
        gateway.stop()
        server.__exit__()
