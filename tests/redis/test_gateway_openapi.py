"""The gateway's OpenAPI document against what its routes return: every route declares each status it answers, with
a schema for its body, and every status declared is one the route was seen to return. The gateway's app runs in
this process in front of a real server and a worker (the real daemon, one poison word making its packs fail);
each route is called into each of its statuses, and every body is checked against the schema its status declares.
/docs and /redoc serve pages that load the document."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import jsonschema
import pytest

from inprocess import InProcessWorker
from producer.gateway.config import ApiKey, GatewayConfig
from producer.gateway.routes import create_app
from producer.local.binaries import servers_under_test
from producer.local.ports import free_port
from producer.wire.connection import Deployment

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
LIMITS = dict(max_body_bytes=4096, max_batch=4, max_unfinished=2, wait_s=20, max_wait_s=30)
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


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw", timeout=60)


async def system_one(http, down, hasty, c) -> None:
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
    await c(hasty, *so, json={**call, "state": "Too late."}, headers=auth("acme"))  # 504
    polling = asyncio.ensure_future(c(http, "get", "/v1/results/{request_id}", "/v1/results/so-poll",
                                      params={"wait": 3}, headers=auth("dq-one")))
    await asyncio.sleep(0.5)
    await c(http, *so, json=call, headers=auth("dq-one"))  # its one slot is taken: 429
    await polling
    for gateway, key in ((http, "acme"), (http, None), (down, "acme")):  # 200, 401, 503
        await c(gateway, *models, headers=auth(key) if key else {})


async def exercise(app, broken, solo, hasty, seen: Seen) -> dict:
    """Every route into each of its statuses; the OpenAPI document as served. ``broken``: a gateway whose Redis
    does not answer; ``solo``: one whose only key's namespace has a worker (ready)."""
    async with app.app.router.lifespan_context(app.app), broken.app.router.lifespan_context(broken.app), \
            solo.app.router.lifespan_context(solo.app), hasty.app.router.lifespan_context(hasty.app):
        async with client(app) as http, client(broken) as down, client(solo) as one, client(hasty) as late:
            await system_one(http, down, late, seen.call)
            decide, batch, enqueue = ("post", "/v1/decide"), ("post", "/v1/decide/batch"), ("post", "/v1/requests")
            results = ("get", "/v1/results/{request_id}")
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
            for i in range(LIMITS["max_unfinished"]):
                assert (await c(http, *enqueue, json=request(f"fill-{i}"), headers=auth("full"))).status_code == 202
            for method, template in (decide, batch, enqueue):
                body = request() if template != "/v1/decide/batch" else {"requests": [request()]}
                await c(http, method, template, json=body, headers=auth("full"))  # queue full: 429
            assert (await c(http, *decide, json=request("oa-1"), headers=auth("acme"))).status_code == 200
            await c(http, *decide, json=request("oa-1", state="Another request."), headers=auth("acme"))  # 409
            await c(http, *decide, json=request(state=POISON), headers=auth("acme"))  # dead-lettered: 500
            await c(http, *decide, params={"timeout": 0.3}, json=request("oa-late"), headers=auth("idle"))  # 504
            await c(http, *batch, json={"requests": [request("oa-b1"), request("oa-b2")]}, headers=auth("acme"))
            await c(http, *batch, json={"requests": [request() for _ in range(5)]}, headers=auth("acme"))  # 413
            await c(http, *enqueue, json={"requests": [request("oa-e1")]}, headers=auth("acme"))  # 202
            await c(http, *results, "/v1/results/oa-1", headers=auth("acme"))  # 200
            await c(http, *results, "/v1/results/oa-never", headers=auth("acme"))  # 404
            await c(http, *results, "/v1/results/not%20an%20id", headers=auth("acme"))  # 422
            await c(http, *results, "/v1/results/oa-1")  # 401
            await c(down, *results, "/v1/results/oa-1", headers=auth("acme"))  # 503
            polling = asyncio.ensure_future(c(http, *results, "/v1/results/oa-poll", params={"wait": 3},
                                              headers=auth("one")))
            await asyncio.sleep(0.5)
            await c(http, *results, "/v1/results/oa-poll", headers=auth("one"))  # its one slot is taken: 429
            await polling
            for path in ("/health", "/info", "/metrics"):
                await c(http, "get", path)
            await c(one, "get", "/ready")
            await c(down, "get", "/ready")  # Redis unreachable: 503
            pages = {path: await http.get(path) for path in ("/docs", "/redoc")}
            return {"document": (await http.get("/openapi.json")).json(), "pages": pages}


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
        hasty = create_app(GatewayConfig(deployment=Deployment(url=redis_server.url), keys=KEYS,
                                         **{**LIMITS, "wait_s": 0.001}))
        served = asyncio.run(exercise(app, broken, solo, hasty, seen))
    finally:
        worker.stop()
    document = served["document"]
    declared = {(method, path): op["responses"] for path, ops in document["paths"].items()
                for method, op in ops.items()}
    routes = {(method.lower(), route.path) for route in app.app.routes for method in getattr(route, "methods", ())
              if method != "HEAD" and route.path not in ("/openapi.json", "/docs", "/docs/oauth2-redirect",
                                                          "/redoc")}
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
