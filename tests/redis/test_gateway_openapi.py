"""The gateway's OpenAPI document against what its routes return: every route declares each status it answers, with
a schema for its body, and every status declared is one the route was seen to return. The gateway's app runs in
this process in front of a real server and a worker (the real daemon, one poison word making its packs fail);
each route is called into each of its statuses, and every body is checked against the schema its status declares.
/docs and /redoc serve pages that load the document, and every asset they name from the gateway itself."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import defaultdict

import httpx
import jsonschema
import pytest
import redis

from inprocess import InProcessWorker
from producer.gateway.config import ApiKey, GatewayConfig
from producer.gateway.routes import create_app
from producer.local.binaries import servers_under_test
from producer.local.ports import free_port
from producer.plumbing.connection import Deployment
from producer.wire.keys import GROUP, Keys

pytestmark = pytest.mark.redis
TOKENS = {name: f"openapi-token-{name}-0123456789" for name in ("acme", "normal", "idle", "full", "one", "high",
                                                                 "dq-one")}
KEYS = (ApiKey(name="acme", token=TOKENS["acme"]),
        ApiKey(name="high", token=TOKENS["high"], lanes=("high",)),  # a System One call goes to the normal lane
        ApiKey(name="dq-one", token=TOKENS["dq-one"], max_inflight=1),  # the worker's namespace, one call at a time
        ApiKey(name="normal", token=TOKENS["normal"], lanes=("normal",)),
        ApiKey(name="idle", token=TOKENS["idle"], namespace="idle"),  # no worker: results never come
        ApiKey(name="full", token=TOKENS["full"], namespace="full"),  # no worker, filled to --max-unfinished
        ApiKey(name="one", token=TOKENS["one"], namespace="idle", max_inflight=1))
LIMITS = dict(max_body_bytes=4096, max_batch=4, max_unfinished=2, wait_s=20, max_wait_s=30, body_timeout_s=0.5)
POISON = "POISONED-PACK"


def request(request_id: str | None = None, state: str = "Refund me, please.", **fields) -> dict:
    return {**({"id": request_id} if request_id else {}), "state": state,
            "questions": {"refund": {"type": "noul"}}, **fields}


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


class Seen:
    """Each call's route (method and path template), status and body."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], list[tuple[int, httpx.Response]]] = defaultdict(list)

    async def call(self, http: httpx.AsyncClient, method: str, template: str, path: str | None = None,
                   **kwargs) -> httpx.Response:
        reply = await http.request(method.upper(), path or template, **kwargs)
        self.calls[(method, template)].append((reply.status_code, reply))
        return reply


def client(app, host: str = "gw") -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=f"http://{host}", timeout=60)


async def stalled():
    """A body that stops half way, longer than the gateway's body timeout."""
    yield b'{"state": "x", '
    await asyncio.sleep(1.5)
    yield b'"questions": {"q": {"type": "noul"}}}'


async def system_one(http, down, hasty, foreign, c, worker) -> None:
    """POST /v1/systemone and GET /v1/models into each of their statuses (the worker serves its checkpoint under
    the checkpoint's own name, repo). ``hasty``: a gateway that waits a millisecond for a result."""
    so, models = ("post", "/v1/systemone"), ("get", "/v1/models")
    call = {"model": "repo", "state": "Refund me, please.", "questions": {"refund": {"type": "noul"}}}
    raw = {**auth("acme"), "content-type": "application/json"}
    assert (await c(http, *so, json=call, headers=auth("acme"))).status_code == 200
    await c(http, *so, json=call)  # 401
    await c(down, *so, json=call, headers=auth("acme"))  # 503
    await c(http, *so, json=call, headers=auth("high"))  # 403
    await c(http, *so, json={**call, "model": "nobody"}, headers=auth("acme"))  # 404
    await c(http, *so, json={**call, "state": "x" * 5000}, headers=auth("acme"))  # 413
    await c(http, *so, content=json.dumps(call).encode(), headers={**raw, "content-encoding": "br"})  # 415
    await c(http, *so, content=b"\x28\xb5\x2f\xfd not zstd", headers={**raw, "content-encoding": "zstd"})  # 400
    await c(http, *so, json={**call, "questions": {"where": {"type": "box"}}}, headers=auth("acme"))  # 422
    await c(http, *so, json={**call, "state": POISON}, headers=auth("acme"))  # dead-lettered: 500
    worker.faults.gate = threading.Event()  # its pack held: no answer within the hasty gateway's millisecond
    await c(hasty, *so, json={**call, "state": "Too late."}, headers=auth("acme"))  # 504
    worker.faults.gate.set()
    worker.faults.gate = None
    await c(http, *so, content=stalled(), headers=auth("acme"))  # the body stalls: 408
    await c(foreign, *so, json=call)  # no keys, a Host not loopback: 400
    await c(foreign, *models)  # 400
    polling = asyncio.ensure_future(c(http, "get", "/v1/results/{request_id}", "/v1/results/so-poll",
                                      params={"wait": 3}, headers=auth("dq-one")))
    await asyncio.sleep(0.5)
    await c(http, *so, json=call, headers=auth("dq-one"))  # its one slot is taken: 429
    await polling
    for gateway, key in ((http, "acme"), (http, None), (down, "acme")):  # 200, 401, 503
        await c(gateway, *models, headers=auth(key) if key else {})


async def exercise(app, broken, solo, opened, hasty, seen: Seen, url: str, worker) -> dict:
    """Every route into each of its statuses; the OpenAPI document as served. ``broken``: a gateway whose Redis
    does not answer; ``solo``: one whose only key's namespace has a worker (ready); ``opened``: one without keys."""
    async with app.app.router.lifespan_context(app.app), broken.app.router.lifespan_context(broken.app), \
            solo.app.router.lifespan_context(solo.app), opened.app.router.lifespan_context(opened.app), \
            hasty.app.router.lifespan_context(hasty.app):
        async with client(app) as http, client(broken) as down, client(solo) as one, client(opened) as foreign, \
                client(opened, "127.0.0.1") as local, client(hasty) as late:
            await system_one(http, down, late, foreign, seen.call, worker)
            decide, batch, enqueue = ("post", "/v1/decide"), ("post", "/v1/decide/batch"), ("post", "/v1/requests")
            results = ("get", "/v1/results/{request_id}")
            cancel_one, status_one = ("delete", "/v1/requests/{request_id}"), ("get", "/v1/requests/{request_id}")
            cancel_many, status_many = ("delete", "/v1/requests"), ("get", "/v1/requests")
            c = seen.call
            for method, template in (decide, batch, enqueue):
                body = request() if template != "/v1/decide/batch" else {"requests": [request()]}
                await c(http, method, template, json=body)  # no key: 401
                await c(down, method, template, json=body, headers=auth("acme"))  # Redis unreachable: 503
                high = request(priority="high") if template != "/v1/decide/batch" else {
                    "requests": [request(priority="high")]}
                await c(http, method, template, json=high, headers=auth("normal"))  # lane forbidden: 403
                await c(http, method, template, json={"state": "no questions"} if template != "/v1/decide/batch"
                        else {"requests": [{"state": "x"}]}, headers=auth("acme"))  # 422
                await c(http, method, template, content=b"{" + b" " * 5000 + b"}",
                        headers={**auth("acme"), "content-type": "application/json"})  # over the body limit: 413
                await c(http, method, template, content=stalled(), headers=auth("acme"))  # the body stalls: 408
                await c(foreign, method, template, json=body)  # no keys, a Host not loopback: 400
                await c(local, method, template, content=json.dumps(body), headers={"content-type": "text/plain"})
            for i in range(LIMITS["max_unfinished"]):
                assert (await c(http, *enqueue, json=request(f"fill-{i}"), headers=auth("full"))).status_code == 202
            for method, template in (decide, batch, enqueue):
                body = request() if template != "/v1/decide/batch" else {"requests": [request()]}
                await c(http, method, template, json=body, headers=auth("full"))  # queue full: 429
            assert (await c(http, *decide, json=request("oa-1"), headers=auth("acme"))).status_code == 200
            await c(http, *decide, json=request("oa-1", state="Another request."), headers=auth("acme"))  # 409
            await c(http, *decide, json=request(state=POISON), headers=auth("acme"))  # dead-lettered: 500
            await c(http, *decide, params={"timeout": 0.3}, json=request("oa-late"), headers=auth("idle"))  # 504
            await c(http, *cancel_one, "/v1/requests/oa-late", headers=auth("idle"))  # queued: 200 cancelled
            assert (await c(http, *enqueue, json=request("oa-held"), headers=auth("idle"))).status_code == 202
            idle, holder = Keys("idle"), redis.Redis.from_url(url)
            holder.xgroup_create(idle.requests, GROUP, id="0", mkstream=True)  # a worker of its own that holds it
            holder.xreadgroup(GROUP, "a-worker", {idle.requests: ">"}, count=10)
            holder.close()
            await c(http, *cancel_one, "/v1/requests/oa-held", headers=auth("idle"))  # held: 202 cancelling
            await c(http, *cancel_one, "/v1/requests/oa-1", headers=auth("acme"))  # answered: 409 too_late
            await c(http, *cancel_one, "/v1/requests/oa-never", headers=auth("acme"))  # 404 unknown
            await c(http, *status_one, "/v1/requests/oa-1", headers=auth("acme"))  # 200
            await c(http, *status_one, "/v1/requests/oa-never", headers=auth("acme"))  # 404
            for route in (cancel_one, status_one):
                await c(http, *route, "/v1/requests/not%20an%20id", headers=auth("acme"))  # 422
                await c(http, *route, "/v1/requests/oa-1")  # 401
                await c(down, *route, "/v1/requests/oa-1", headers=auth("acme"))  # 503
                await c(foreign, *route, "/v1/requests/oa-1")  # 400
            for route in (cancel_many, status_many):
                await c(http, *route, params=[("id", "oa-1"), ("id", "oa-never")], headers=auth("acme"))  # 200
                await c(http, *route, params=[("id", f"oa-{i}") for i in range(5)], headers=auth("acme"))  # 413
                await c(http, *route, params={"id": "not an id"}, headers=auth("acme"))  # 422
                await c(http, *route, params={"id": "oa-1"})  # 401
                await c(down, *route, params={"id": "oa-1"}, headers=auth("acme"))  # 503
                await c(foreign, *route, params={"id": "oa-1"})  # 400
            await c(http, *batch, json={"requests": [request("oa-b1"), request("oa-b2")]}, headers=auth("acme"))
            await c(http, *batch, json={"requests": [request() for _ in range(5)]}, headers=auth("acme"))  # 413
            await c(http, *enqueue, json={"requests": [request("oa-e1")]}, headers=auth("acme"))  # 202
            await c(http, *results, "/v1/results/oa-1", headers=auth("acme"))  # 200
            await c(http, *results, "/v1/results/oa-1", params={"digest": "0" * 32}, headers=auth("acme"))  # 409
            await c(foreign, *results, "/v1/results/oa-1")  # 400
            await c(http, *results, "/v1/results/oa-never", headers=auth("acme"))  # 404
            await c(http, *results, "/v1/results/not%20an%20id", headers=auth("acme"))  # 422
            await c(http, *results, "/v1/results/oa-1")  # 401
            await c(down, *results, "/v1/results/oa-1", headers=auth("acme"))  # 503
            polling = asyncio.ensure_future(c(http, *results, "/v1/results/oa-poll", params={"wait": 3},
                                              headers=auth("one")))
            await asyncio.sleep(0.5)
            await c(http, *results, "/v1/results/oa-poll", headers=auth("one"))  # its one slot is taken: 429
            for route in (cancel_one, status_one):
                await c(http, *route, "/v1/requests/oa-poll", headers=auth("one"))  # 429
            for route in (cancel_many, status_many):
                await c(http, *route, params={"id": "oa-poll"}, headers=auth("one"))  # 429
            await polling
            for path in ("/health", "/info", "/metrics"):
                await c(http, "get", path)
            for path in ("/health", "/info", "/metrics", "/ready"):
                await c(foreign, "get", path)  # no keys, a Host not loopback: 400
            await c(one, "get", "/ready")
            await c(down, "get", "/ready")  # Redis unreachable: 503
            pages = {path: await http.get(path) for path in ("/docs", "/redoc")}
            named = {link for page in pages.values() for link in re.findall(r'(?:src|href)="([^"]*)"', page.text)}
            assets = {link: await http.get(link) for link in named if link.startswith("/")}
            return {"document": (await http.get("/openapi.json")).json(), "pages": pages, "named": named,
                    "assets": assets}


def test_every_route_declares_the_statuses_it_returns_with_their_bodies(redis_server, loaded, server_binary):
    if server_binary.label != servers_under_test()[0].label:
        pytest.skip("what the gateway declares does not depend on the server: one run")
    worker = InProcessWorker(loaded("repo"), redis_server.url, raise_on=POISON, max_deliveries=1).start()
    seen = Seen()
    try:
        app = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url), keys=KEYS, **LIMITS))
        broken = create_app(GatewayConfig(deployment=Deployment(url=f"redis://127.0.0.1:{free_port()}/0"),
                                          keys=KEYS, **LIMITS))
        solo = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url), keys=KEYS[:1], **LIMITS))
        opened = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url), **LIMITS))
        hasty = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url), keys=KEYS,
                                         **{**LIMITS, "wait_s": 0.001}))
        served = asyncio.run(exercise(app, broken, solo, opened, hasty, seen, redis_server.url, worker))
    finally:
        worker.stop()
    document = served["document"]
    declared = {(method, path): op["responses"] for path, ops in document["paths"].items()
                for method, op in ops.items()}
    routes = {(method.lower(), route.path) for route in app.app.routes for method in getattr(route, "methods", ())
              if method != "HEAD" and route.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect",
                                                          "/redoc", "/v1/v1/{rest:path}")}  # a hint, no API
    assert routes == set(declared), "a route the document does not describe, or the other way round"
    resolver = jsonschema.RefResolver.from_schema(document)
    for route, responses in declared.items():
        returned = {status for status, _ in seen.calls[route]}
        assert {int(status) for status in responses} == returned, (route, sorted(responses), sorted(returned))
        for status, reply in seen.calls[route]:
            content = responses[str(status)]["content"]
            media = reply.headers["content-type"].split(";")[0]
            assert media in content, (route, status, media)
            if media in ("application/json", "application/x-ndjson"):
                for line in reply.text.splitlines():
                    jsonschema.validate(json.loads(line), content[media]["schema"], resolver=resolver)
    for path, page in served["pages"].items():
        assert page.status_code == 200 and "/openapi.json" in page.text, path
    # Every script, style and icon the pages load comes from the gateway itself (they were a CDN's: blank pages on a
    # host without the internet): named by path, and served.
    assert served["named"] == set(served["assets"]) and len(served["assets"]) == 4, served["named"]
    for link, asset in served["assets"].items():
        kind = {"js": "javascript", "css": "text/css", "png": "image/png"}[link.rsplit(".", 1)[1]]
        assert asset.status_code == 200 and kind in asset.headers["content-type"] and len(asset.content) > 1000, link
