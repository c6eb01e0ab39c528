"""The gateway's routes (FastAPI): the queue's request JSON in, its result JSON out, each through the service
(service.py). Routes raise; replies.py turns each exception into its status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Annotated, Any

import redis
from fastapi import FastAPI, Query
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .. import __version__
from ..plans import ResultTimeout, WrongResult
from ..wire.keys import ID_PATTERN, PROTOCOL
from ..wire.result import Result
from ..wire.schema import ErrorCode, Request
from . import replies, systemone
from .access import Access
from .bodies import EITHER, MANY, ONE, Batch, describe, parse, seconds
from .config import GatewayConfig
from .front import Front
from .openapi import complete
from .replies import READ, WAIT, Refused, Unsettled
from .service import Gateway

NDJSON = "application/x-ndjson"
CLIENT_GONE = 499  # a decide whose caller went away: nobody reads it, but the metrics count it (nginx's status)


async def watched(http: HttpRequest, work: Awaitable[dict[str, Result]], ids: list[str],
                  phase: str) -> dict[str, Result] | None:
    """``work``'s outcome (a wait for the results of ``ids``), or None once the caller has gone away (``work``
    cancelled): its in-flight slots and its Redis connection come back then, not when its wait would have ended.
    A Redis error is Unsettled, naming the ids (``phase``: where the call was). The body is read by now, so the
    next ASGI message is the disconnect."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return None
    try:
        return task.result()
    except (redis.RedisError, WrongResult) as error:
        raise Unsettled(error, ids, phase) from error


async def _disconnect(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def create_app(config: GatewayConfig, connection: Any = None) -> Front:
    """The ASGI application: the routes behind the front layer (keys, body size, metrics)."""
    gateway = Gateway(config, connection)
    app = FastAPI(title="dq-gateway", version=__version__, lifespan=gateway.lifespan, redoc_url="/redoc",
                  description="The decision queue over HTTP: the queue's request and result JSON (docs/PROTOCOL.md).")
    replies.install(app)
    app.state.gateway = gateway

    # The POST routes: plain Starlette routes, described in the OpenAPI document by bodies.describe.
    async def decide(http: HttpRequest) -> Response:
        body: Request = await parse(http, ONE)
        asked = seconds(http)  # checked before anything is sent
        access, prepared = gateway.admit(http, [body], batch=False)
        client = gateway.clients[access.namespace]
        await gateway.submit(access.namespace, prepared)
        request_id = prepared[0].id
        landed = await watched(http, client.wait_any([request_id], gateway.wait_for(asked, [body.deadline_ms])),
                               [request_id], WAIT)
        if landed is None:
            return Response(status_code=CLIENT_GONE)
        if request_id not in landed:  # with why, when no worker of the namespace is alive to answer it
            raise ResultTimeout("no result in time", missing=[request_id],
                                no_worker=access.namespace if await gateway.no_worker(client) else None)
        # The result under this id may be another request's (a reused id): then id_conflict, never its answer.
        return replies.result_response(prepared[0].answered_by(landed[request_id]))

    async def decide_batch(http: HttpRequest) -> Response:
        body: Batch = await parse(http, MANY)
        asked = seconds(http)
        access, prepared = gateway.admit(http, body.requests, batch=True)
        client = gateway.clients[access.namespace]
        refused = await gateway.submit(access.namespace, prepared, partial=True)
        wait = gateway.wait_for(asked, [r.deadline_ms for r in body.requests])
        digests = {p.id: p.asked() for p in prepared}
        return StreamingResponse(gateway.lines(client, digests, refused, wait), media_type=NDJSON)

    async def enqueue(http: HttpRequest) -> Response:
        body: Request | Batch = await parse(http, EITHER)
        batch = isinstance(body, Batch)
        access, prepared = gateway.admit(http, body.requests if batch else [body], batch)
        await gateway.submit(access.namespace, prepared)
        return JSONResponse({"ids": [p.id for p in prepared]}, 202)

    posts = [("/v1/decide", "Decide one request and wait for its result", "200", ("Request",), True, decide),
             ("/v1/decide/batch", "Decide many; results as they land (NDJSON)", "200", ("Batch",), True,
              decide_batch),
             ("/v1/requests", "Enqueue; answers the ids at once", "202", ("Request", "Batch"), False, enqueue)]
    for path, *_, endpoint in posts:
        app.add_route(path, endpoint, methods=["POST"], include_in_schema=False)

    @app.get("/v1/results/{request_id}", summary="A result, waiting up to ?wait= seconds")
    async def result(request_id: str, http: HttpRequest,
                     wait: Annotated[float, Query(ge=0, description="seconds to wait for it")] = 0) -> Response:
        access: Access = http.state.access
        if not ID_PATTERN.match(request_id):
            raise Refused(422, ErrorCode.INVALID_REQUEST.value, "an id is 1-128 characters of A-Z a-z 0-9 . _ : -",
                          "id")
        client = gateway.clients[access.namespace]
        gateway.hold(http, 1)  # a long-poll holds a Redis connection as a decide does: it counts against the key
        landed = await watched(http, client.wait_any([request_id], min(wait, config.max_wait_s)), [request_id], READ)
        if landed is None:
            return Response(status_code=CLIENT_GONE)
        found = landed.get(request_id)
        if found is None:
            raise Refused(404, "not_found", "no result for this id: not answered yet, expired, or never sent "
                          "with this key's namespace")
        return Response(found.model_dump_json(exclude_none=True), media_type=replies.JSON)

    @app.get("/health", summary="The process answers")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", summary="Redis reachable and workers alive")
    async def ready() -> JSONResponse:
        ok, detail = await gateway.ready()
        return JSONResponse({"ready": ok, **detail}, 200 if ok else 503)

    @app.get("/info", summary="What runs: the gateway's version and wire protocol")
    async def info() -> dict[str, str]:
        return {"version": __version__, "protocol": PROTOCOL}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI's description, the plain routes', every route's responses
            describe(FastAPI.openapi(app), [post[:5] for post in posts])
            complete(app.openapi_schema)
        return app.openapi_schema

    systemone.install(app, gateway, config, watched)
    app.openapi = openapi  # type: ignore[method-assign]
    return Front(app, gateway.keyring, gateway.inflight, gateway.metrics, config.max_body_bytes, gateway.tracer)
